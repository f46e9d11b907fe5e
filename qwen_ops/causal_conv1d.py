"""qwen::causal_conv1d: Qwen3.5 Gated DeltaNet's short convolution, over fixed-length or packed sequences.

A depthwise causal conv1d over channels (kernel size K = 4 in Qwen3.5, no bias) followed by
SiLU, on channels-last activations x [B, T, C] (C = 2 * key_dim + value_dim, the fused
in_proj_qkv output). With xs = [state[b, :, 0:K-1], x[b, 0:T, :]^T] along time:

    y[b, t, c] = silu(sum_{j<K} weight[c, j] * xs[b, c, t + j])
    new_state[b, c, i] = xs[b, c, T + i]            (the last K-1 inputs, i < K-1)

causal_conv1d(x, weight, conv_states=None, cu_seqlens=None, state_slots=None, continues=None) -> y,
conv_states updated in place:

- fixed length (cu_seqlens None): x [B, T, C], weight [C, K], conv_states [B, C, K-1] or None
  -> y [B, T, C]. Row b of conv_states is sequence b's initial state, replaced by its final
  state; without it the inputs before t = 0 are zeros and no state is kept (with T < K-1 a final
  state is zero-padded on the left). state_slots and continues are for packed sequences only.
- packed: x [N, C], conv_states [P, C, K-1] (a pool), cu_seqlens [S + 1] int32, state_slots [S]
  int64, continues [S] bool -> y [N, C]: sequence i the rows cu_seqlens[i]:cu_seqlens[i + 1]
  (cu_seqlens[0] = 0, nondecreasing, cu_seqlens[S] = N). Sequence i starts from
  conv_states[state_slots[i]] where continues[i] (a later prompt chunk, a decode token: one
  token is a sequence of length 1), else from zeros, and writes its new state back to that row;
  a length-0 sequence reads and writes nothing (graph padding). Sequences sharing a slot leave
  it undefined (the engine's padding slot). Grid from shapes only: CUDA-graph safe. One call
  serves a mixed engine step.

This is transformers' `causal_conv1d_fn` / `causal_conv1d_update` (activation "silu"; the packed
form covers both) on [B, T, C] instead of [B, C, T], with the state of length K-1. fp32 math (float64 for float64);
y and the state in x's dtype (the state holds inputs). The weight may have any float dtype.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from csrc_free_ops import causal_conv1d as kernels

from .checks import check_float, check_index, check_same, fail
from .registry import acc_dtype, define

MAX_KERNEL_SIZE = 16


def _conv(x: Tensor, weight: Tensor, state: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(y, new_state) in acc dtype; x [B, T, C], state [B, C, K-1] or None."""
    dt = acc_dtype(x)
    bsz, t, c = x.shape
    k = weight.shape[1]
    if state is None:
        state = torch.zeros(bsz, c, k - 1, dtype=dt, device=x.device)
    xs = torch.cat([state.to(dt), x.transpose(1, 2).to(dt)], dim=-1)  # [B, C, K-1+T]
    w = weight.to(dt)
    y = sum(w[:, j, None] * xs[..., j:j + t] for j in range(k))  # [B, C, T]
    return F.silu(y).transpose(1, 2), xs[..., xs.shape[-1] - (k - 1):]


def packed_sequences(cu_seqlens: Tensor, state_slots: Tensor, continues: Tensor):
    """(rows, state slot, continues) of each non-empty sequence of a packed batch, read on the host:
    the varlen references run the fixed-length ones sequence by sequence."""
    cu, slots, cont = cu_seqlens.tolist(), state_slots.tolist(), continues.tolist()
    for i, slot in enumerate(slots):
        if cu[i + 1] > cu[i]:
            yield slice(cu[i], cu[i + 1]), slot, cont[i]


def causal_conv1d_reference(x: Tensor, weight: Tensor, conv_states: Optional[Tensor] = None,
                            cu_seqlens: Optional[Tensor] = None, state_slots: Optional[Tensor] = None,
                            continues: Optional[Tensor] = None) -> Tensor:
    if cu_seqlens is None:
        y, state = _conv(x, weight, conv_states)
        if conv_states is not None:
            conv_states.copy_(state)
        return y.to(x.dtype).contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for rows, slot, cont in packed_sequences(cu_seqlens, state_slots, continues):
        yi, state = _conv(x[None, rows], weight, conv_states[slot:slot + 1] if cont else None)
        y[rows] = yi[0]
        conv_states[slot] = state[0]
    return y


def _check_weight(op: str, x: Tensor, weight: Tensor, layout: str):
    check_float(op, "weight", weight, ndim=2)
    if weight.device != x.device:
        fail(op, f"weight is on {weight.device} but x is on {x.device}")
    c, k = weight.shape
    if c != x.shape[-1]:
        fail(op, f"weight has {c} channels (weight [C, K]) but x {layout} has {x.shape[-1]}")
    if not 2 <= k <= MAX_KERNEL_SIZE:
        fail(op, f"kernel size (weight.shape[1]) must be between 2 and {MAX_KERNEL_SIZE}, got {k}")
    return c, k


def _check(x, weight, conv_states=None, cu_seqlens=None, state_slots=None, continues=None):
    op = "causal_conv1d"
    if cu_seqlens is None:
        check_unpacked(op, state_slots, continues)
        check_float(op, "x", x, ndim=3)
        c, k = _check_weight(op, x, weight, "[B, T, C]")
        if conv_states is not None:
            check_float(op, "conv_states", conv_states, ndim=3)
            check_same(op, "x", x, conv_states=conv_states)
            want = (x.shape[0], c, k - 1)
            if tuple(conv_states.shape) != want:
                fail(op, f"conv_states must have shape [B, C, K-1] = {want} without cu_seqlens, "
                         f"got {tuple(conv_states.shape)}")
        return
    check_float(op, "x", x, ndim=2)
    c, k = _check_weight(op, x, weight, "[N, C]")
    if conv_states is None:
        fail(op, "packed sequences (cu_seqlens) need conv_states [P, C, K-1], the pool their states live in")
    check_float(op, "conv_states", conv_states, ndim=3)
    check_same(op, "x", x, conv_states=conv_states)
    if tuple(conv_states.shape[1:]) != (c, k - 1):
        fail(op, f"conv_states must have shape [P, C, K-1] = [P, {c}, {k - 1}], got {tuple(conv_states.shape)}")
    check_packed(op, x.shape[0], conv_states.shape[0], cu_seqlens, state_slots, continues, x.device)


def check_unpacked(op: str, state_slots: Optional[Tensor], continues: Optional[Tensor]):
    """Fixed-length sequences: the packed-only arguments must be absent."""
    for name, t in (("state_slots", state_slots), ("continues", continues)):
        if t is not None:
            fail(op, f"{name} is for packed sequences: pass cu_seqlens with it, or leave it out")


def check_packed(op: str, n: int, pool_rows: int, cu_seqlens: Tensor, state_slots: Tensor, continues: Tensor,
                 device: torch.device):
    """The packed-sequence arguments: cu_seqlens [S + 1] int32, state_slots [S] int64, continues [S] bool."""
    for name, t in (("state_slots", state_slots), ("continues", continues)):
        if t is None:
            fail(op, f"packed sequences (cu_seqlens) need {name}")
    s = state_slots.shape[0] if state_slots.dim() == 1 else -1
    if state_slots.dim() != 1 or state_slots.dtype != torch.int64:
        fail(op, f"state_slots must be a 1-d int64 tensor [S], got {state_slots.dtype} {tuple(state_slots.shape)}")
    if cu_seqlens.dtype != torch.int32:
        fail(op, f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    check_index(op, "cu_seqlens", cu_seqlens, (s + 1,))
    if continues.dtype != torch.bool or tuple(continues.shape) != (s,):
        fail(op, f"continues must be a bool tensor of shape ({s},), got {continues.dtype} {tuple(continues.shape)}")
    for name, t in (("cu_seqlens", cu_seqlens), ("state_slots", state_slots), ("continues", continues)):
        if t.device != device:
            fail(op, f"{name} is on {t.device} but x is on {device}")
        if t.stride(0) != 1 and t.shape[0] > 1:
            fail(op, f"{name} must be contiguous")


def check_packed_values(op: str, n: int, pool_rows: int, cu_seqlens: Tensor, state_slots: Tensor):
    """CPU only (a host sync on CUDA): cu_seqlens starts at 0, never decreases and ends at N; slots in the pool."""
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != n or any(b < a for a, b in zip(cu, cu[1:])):
        fail(op, f"cu_seqlens must rise from 0 to the {n} rows, got {cu}")
    if state_slots.numel() and not bool(((state_slots >= 0) & (state_slots < pool_rows)).all()):
        fail(op, f"state_slots must lie in [0, {pool_rows}) (the pool's rows), got {state_slots.tolist()}")


def _check_values(x, weight, conv_states=None, cu_seqlens=None, state_slots=None, continues=None):
    if cu_seqlens is not None:
        check_packed_values("causal_conv1d", x.shape[0], conv_states.shape[0], cu_seqlens, state_slots)


def _fake(x, weight, conv_states=None, cu_seqlens=None, state_slots=None, continues=None):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


causal_conv1d = define(causal_conv1d_reference, kernels.causal_conv1d, _check, _fake, mutates_args=("conv_states",),
                       check_values=_check_values)
