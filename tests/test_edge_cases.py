"""Degenerate inputs and numerical guard rails, on the kernel path.

1. Every op of `qwen_ops` (forward and backward) with each zero-size dimension (no rows, a last
   dim of 0, no heads, no tokens, an empty batch) runs the Triton launcher and gives what the
   reference gives (empty outputs of the right shape, states passed through, zero gradients), or
   both refuse it with a `QwenOpError` naming the op: never `cannot reshape tensor of 0 elements`,
   a Triton compile error or a division by zero. The fake kernel (torch.compile's view of the op)
   agrees on every output's shape and dtype, and raises the same error.
2. Inputs near the top of the bf16 range keep attention, paged_attention (decode rows over several
   KV splits) and the fused lm_head + cross-entropy loss finite wherever the fp32 reference is
   finite (rms_norm's case is tests/test_ops_norm.py::test_large_activations_stay_finite).

CPU cases run under the Triton interpreter (tests/conftest.py); `cuda` cases on a GPU.
"""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

import qwen_ops
from tests.helpers import DEVICES, REL_TOL, assert_close

BF16, F32 = torch.bfloat16, torch.float32


def _r(*shape, dt=F32, dev="cpu", scale=1.0):
    return (torch.randn(*shape, device=dev) * scale).to(dt)


def _pos(*shape, dev="cpu"):
    return torch.zeros(*shape, dtype=torch.long, device=dev)


def _gdr(b, t, hk, hv, dt, dev, state=False, d=16):
    """Arguments of chunk_gated_delta_rule on fixed lengths."""
    q, k, v = _r(b, t, hk, d, dt=dt, dev=dev), _r(b, t, hk, d, dt=dt, dev=dev), _r(b, t, hv, d, dt=dt, dev=dev)
    g = -torch.rand(b, t, hv, device=dev)
    beta = torch.rand(b, t, hv, device=dev).to(dt)
    return (q, k, v, g, beta, 0.25, _r(b, hv, d, d, dev=dev) if state else None, None, None, None, True)


def _fp8_weight(n, k, dev):
    """A random [n, k] weight in Qwen's FP8 block format: (weight, weight_scale_inv)."""
    return qwen_ops.quantize_weight_fp8_block(torch.randn(n, k, device=dev))


def _packed(lens, dev):
    """cu_seqlens, state_slots (the last of 3 pool rows: padding) and continues of packed sequences."""
    cu = torch.tensor([0] + torch.tensor(lens, dtype=torch.long).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    return cu, torch.full((len(lens),), 2, dtype=torch.long, device=dev), torch.ones(len(lens), dtype=torch.bool,
                                                                                   device=dev)


def _conv_varlen(lens, c, dt, dev):
    """causal_conv1d arguments of packed sequences: sum(lens) rows of c channels, a pool of 3 states."""
    return (_r(sum(lens), c, dt=dt, dev=dev), _r(c, 4, dt=dt, dev=dev), _r(3, c, 3, dt=dt, dev=dev),
            *_packed(lens, dev))


def _gdr_varlen(lens, hk, hv, dt, dev, recurrent=False, d=16):
    """chunk_gated_delta_rule (or with `recurrent`, recurrent_gated_delta_rule_varlen) arguments of packed
    sequences."""
    n = sum(lens)
    q, k, v = _r(n, hk, d, dt=dt, dev=dev), _r(n, hk, d, dt=dt, dev=dev), _r(n, hv, d, dt=dt, dev=dev)
    gates = ((_r(n, hv, dt=dt, dev=dev), _r(n, hv, dt=dt, dev=dev), _r(hv, dev=dev), _r(hv, dev=dev)) if recurrent
             else (-torch.rand(n, hv, device=dev), torch.rand(n, hv, device=dev).to(dt)))
    pool = _r(3, hv, d, d, dev=dev)
    if recurrent:
        return (q, k, v, *gates, pool, *_packed(lens, dev), 0.25, True)
    return (q, k, v, *gates, 0.25, pool, *_packed(lens, dev), True)


def _ids(m, k, dev):
    """[m, k] int32 expert ids (expert i % 8 for pair i), or an all-zero token bitmask of k words a row."""
    return (torch.arange(m * k, device=dev) % 8).to(torch.int32).view(m, k)


def _moe(m, dt, dev, inter=4, h=8, e=8):
    """fused_moe arguments: m tokens of hidden h routed top-2 over e experts of intermediate inter."""
    return (_r(m, h, dt=dt, dev=dev), _r(e, 2 * inter, h, dt=dt, dev=dev), _r(e, h, inter, dt=dt, dev=dev),
            torch.rand(m, 2, device=dev), _ids(m, 2, dev))


def _qkv(n, dt, dev, num_blocks=2):
    """norm_qkv_rope_store arguments: n rows of hidden 8, 2 q heads and 1 kv head of 16, paged caches
    of num_blocks blocks of 16, the rows at positions 3, 4, ... and slots 0, 2, ..."""
    cache = lambda: _r(num_blocks, 16, 1, 16, dt=dt, dev=dev)  # noqa: E731
    return (_r(n, 8, dt=dt, dev=dev), _r(8, dt=dt, dev=dev), _r(64, 8, dt=dt, dev=dev), None, _r(16, dt=dt, dev=dev),
            _r(16, dt=dt, dev=dev), cache(), cache(), torch.arange(3, 3 + n, device=dev),
            torch.arange(0, 2 * n, 2, device=dev), 1e-6, 0.0, 1e4, 16, 2, False)


def _layers(m, dt, dev):
    """decode_layers arguments: m sequences, 2 layers of hidden 8 (2 q heads, 1 kv head of 16, I 8),
    a cache of 2 blocks of 16."""
    i32 = dict(dtype=torch.int32, device=dev)
    return (_r(m, 8, dt=dt, dev=dev), torch.zeros(m, dtype=torch.long, device=dev), torch.ones(m, **i32),
            torch.zeros(m, 1, **i32), _r(2, 8, dt=dt, dev=dev), _r(2, 64, 8, dt=dt, dev=dev), None,
            _r(2, 16, dt=dt, dev=dev), _r(2, 16, dt=dt, dev=dev), _r(2, 8, 32, dt=dt, dev=dev), _r(2, 8, dt=dt, dev=dev),
            _r(2, 16, 8, dt=dt, dev=dev), _r(2, 8, 8, dt=dt, dev=dev), _r(2, 2, 16, 1, 16, dt=dt, dev=dev),
            _r(2, 2, 16, 1, 16, dt=dt, dev=dev), 1e-6, 0.0, 1e4, 16, 2, 1)


def _hybrid_layers(m, dt, dev):
    """decode_hybrid_layers arguments: m sequences, a Gated DeltaNet and an attention layer of hidden
    32 (tests/test_decode_hybrid_layers.py's small case)."""
    from tests.test_decode_hybrid_layers import A, G, _args

    return tuple(_args(m, 32, 24, (G, A), (2, 1, 16, 8), (1, 2, 16, 16, 4), 16, 2, dt, dev, splits=2))


def _slots(n, hk, d, dt, dev, num_blocks=2):
    """kv_cache_store_slots arguments: n <= 3 tokens into a cache of num_blocks blocks of 16, at
    slots 0, 17, -1."""
    slots = torch.tensor([0, 17, -1][:n], dtype=torch.int32, device=dev)
    return (_r(n, hk, d, dt=dt, dev=dev), _r(n, hk, d, dt=dt, dev=dev), _r(num_blocks, 16, hk, d, dt=dt, dev=dev),
            _r(num_blocks, 16, hk, d, dt=dt, dev=dev), slots)


def _paged(n, hq, qlens, seq_lens, max_blocks, dt, dev):
    """paged_attention arguments: n tokens of hq heads of 16 (one kv head), qlens / seq_lens per
    sequence, block tables of max_blocks entries into a cache of 2 blocks of 16."""
    cu = torch.tensor([0] + torch.tensor(qlens, dtype=torch.long).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    i32 = dict(dtype=torch.int32, device=dev)
    return (_r(n, hq, 16, dt=dt, dev=dev), _r(2, 16, 1, 16, dt=dt, dev=dev), _r(2, 16, 1, 16, dt=dt, dev=dev), cu,
            torch.tensor(seq_lens, **i32), torch.zeros(len(seq_lens), max_blocks, **i32), 0.25, max(qlens, default=0))


def _lce_bwd(n, h, v, dt, dev):
    hidden, w = _r(n, h, dt=dt, dev=dev), _r(v, h, dt=dt, dev=dev)
    targets = torch.randint(0, v, (n,), device=dev)
    lse = torch.logsumexp(hidden.float() @ w.float().t(), -1) if n else torch.zeros(0, device=dev)
    return (torch.tensor(1.0, device=dev), None, hidden, w, targets, lse, -100, True, True)


# (op, case id, args(dtype, device)); the kernel counter an op bumps is its own name except for
# the composite linear_cross_entropy. Every op of qwen_ops appears (test_every_op_has_edge_cases).
CASES = [
    ("rms_norm", "N=0", lambda dt, dev: (_r(3, 0, dt=dt, dev=dev), _r(0, dt=dt, dev=dev), 1e-6, 0.0)),
    ("rms_norm", "N=0 1-d", lambda dt, dev: (_r(0, dt=dt, dev=dev), _r(0, dt=dt, dev=dev), 1e-6, 1.0)),
    ("rms_norm", "rows=0", lambda dt, dev: (_r(0, 8, dt=dt, dev=dev), _r(8, dt=dt, dev=dev), 1e-6, 0.0)),
    ("rms_norm", "rows=0 3-d", lambda dt, dev: (_r(2, 0, 8, dt=dt, dev=dev), _r(8, dt=dt, dev=dev), 1e-6, 0.0)),
    ("add_rms_norm", "N=0", lambda dt, dev: (_r(3, 0, dt=dt, dev=dev), _r(3, 0, dt=dt, dev=dev), _r(0, dt=dt, dev=dev),
                                             1e-6, 0.0)),
    ("add_rms_norm", "rows=0", lambda dt, dev: (_r(0, 8, dt=dt, dev=dev), _r(0, 8, dt=dt, dev=dev),
                                                _r(8, dt=dt, dev=dev), 1e-6, 0.0)),
    ("rms_norm_backward", "N=0", lambda dt, dev: (_r(3, 0, dt=dt, dev=dev), _r(3, 0, dt=dt, dev=dev),
                                                  _r(0, dt=dt, dev=dev), 1e-6, 0.0, _r(3, 0, dt=dt, dev=dev))),
    ("rms_norm_backward", "rows=0", lambda dt, dev: (_r(0, 8, dt=dt, dev=dev), _r(0, 8, dt=dt, dev=dev),
                                                     _r(8, dt=dt, dev=dev), 1e-6, 0.0, None)),
    ("silu_mul", "I=0", lambda dt, dev: (_r(3, 0, dt=dt, dev=dev),)),
    ("silu_mul", "rows=0", lambda dt, dev: (_r(0, 8, dt=dt, dev=dev),)),
    ("silu_mul_split", "I=0", lambda dt, dev: (_r(3, 0, dt=dt, dev=dev), _r(3, 0, dt=dt, dev=dev))),
    ("silu_mul_split", "rows=0", lambda dt, dev: (_r(0, 4, dt=dt, dev=dev), _r(0, 4, dt=dt, dev=dev))),
    ("silu_mul_backward", "I=0", lambda dt, dev: (_r(3, 0, dt=dt, dev=dev), _r(3, 0, dt=dt, dev=dev))),
    ("silu_mul_backward", "rows=0", lambda dt, dev: (_r(0, 4, dt=dt, dev=dev), _r(0, 8, dt=dt, dev=dev))),
    ("silu_mul_split_backward", "I=0", lambda dt, dev: tuple(_r(3, 0, dt=dt, dev=dev) for _ in range(3))),
    ("silu_mul_split_backward", "rows=0", lambda dt, dev: tuple(_r(0, 4, dt=dt, dev=dev) for _ in range(3))),
    ("sigmoid_mul", "N=0", lambda dt, dev: (_r(3, 2, 0, dt=dt, dev=dev), _r(3, 2, 0, dt=dt, dev=dev))),
    ("sigmoid_mul", "rows=0", lambda dt, dev: (_r(0, 2, 8, dt=dt, dev=dev), _r(0, 2, 8, dt=dt, dev=dev))),
    ("gated_delta_gates", "H=0", lambda dt, dev: (_r(3, 0, dt=dt, dev=dev), _r(3, 0, dt=dt, dev=dev), _r(0, dev=dev),
                                                  _r(0, dev=dev))),
    ("gated_delta_gates", "rows=0", lambda dt, dev: (_r(0, 4, dt=dt, dev=dev), _r(0, 4, dt=dt, dev=dev),
                                                     _r(4, dev=dev), _r(4, dev=dev))),
    ("rope", "Hq=0", lambda dt, dev: (_r(2, 3, 0, 16, dt=dt, dev=dev), _r(2, 3, 2, 16, dt=dt, dev=dev),
                                      _pos(2, 3, dev=dev), 1e4, 16, None, None, 1e-6, 0.0)),
    ("rope", "Hk=0 norm", lambda dt, dev: (_r(2, 3, 4, 16, dt=dt, dev=dev), _r(2, 3, 0, 16, dt=dt, dev=dev),
                                           torch.arange(6, device=dev).view(2, 3), 1e4, 8, _r(16, dt=dt, dev=dev),
                                           _r(16, dt=dt, dev=dev), 1e-6, 0.0)),
    ("rope", "Hq=Hk=0", lambda dt, dev: (_r(2, 3, 0, 16, dt=dt, dev=dev), _r(2, 3, 0, 16, dt=dt, dev=dev),
                                         _pos(2, 3, dev=dev), 1e4, 16, None, None, 1e-6, 0.0)),
    ("rope", "T=0", lambda dt, dev: (_r(2, 0, 4, 16, dt=dt, dev=dev), _r(2, 0, 2, 16, dt=dt, dev=dev),
                                     _pos(2, 0, dev=dev), 1e4, 16, _r(16, dt=dt, dev=dev), _r(16, dt=dt, dev=dev),
                                     1e-6, 0.0)),
    ("rope", "B=0 1-d positions", lambda dt, dev: (_r(0, 4, 16, dt=dt, dev=dev), _r(0, 2, 16, dt=dt, dev=dev),
                                                   _pos(0, dev=dev), 1e4, 16, None, None, 1e-6, 0.0)),
    ("rope_backward", "Hq=0", lambda dt, dev: (_r(2, 3, 0, 16, dt=dt, dev=dev), _r(2, 3, 2, 16, dt=dt, dev=dev),
                                               _r(2, 3, 0, 16, dt=dt, dev=dev), _r(2, 3, 2, 16, dt=dt, dev=dev),
                                               torch.arange(6, device=dev).view(2, 3), 1e4, 16, None, None, 1e-6, 0.0)),
    ("rope_backward", "Hk=0 norm", lambda dt, dev: (_r(2, 3, 4, 16, dt=dt, dev=dev), _r(2, 3, 0, 16, dt=dt, dev=dev),
                                                    _r(2, 3, 4, 16, dt=dt, dev=dev), _r(2, 3, 0, 16, dt=dt, dev=dev),
                                                    _pos(2, 3, dev=dev), 1e4, 16, _r(16, dt=dt, dev=dev),
                                                    _r(16, dt=dt, dev=dev), 1e-6, 0.0)),
    ("rope_backward", "T=0 norm", lambda dt, dev: (_r(2, 0, 4, 16, dt=dt, dev=dev), _r(2, 0, 2, 16, dt=dt, dev=dev),
                                                   _r(2, 0, 4, 16, dt=dt, dev=dev), _r(2, 0, 2, 16, dt=dt, dev=dev),
                                                   _pos(2, 0, dev=dev), 1e4, 16, _r(16, dt=dt, dev=dev),
                                                   _r(16, dt=dt, dev=dev), 1e-6, 0.0)),
    ("linear", "M=0", lambda dt, dev: (_r(0, 8, dt=dt, dev=dev), _r(4, 8, dt=dt, dev=dev), None)),
    ("linear", "M=0 bias 3-d", lambda dt, dev: (_r(2, 0, 8, dt=dt, dev=dev), _r(4, 8, dt=dt, dev=dev),
                                                _r(4, dt=dt, dev=dev))),
    ("linear", "N=0", lambda dt, dev: (_r(3, 8, dt=dt, dev=dev), _r(0, 8, dt=dt, dev=dev), _r(0, dt=dt, dev=dev))),
    ("linear_silu_mul", "M=0", lambda dt, dev: (_r(2, 0, 8, dt=dt, dev=dev), _r(6, 8, dt=dt, dev=dev))),
    ("linear_silu_mul", "I=0", lambda dt, dev: (_r(40, 8, dt=dt, dev=dev), _r(0, 8, dt=dt, dev=dev))),
    ("linear_backward", "M=0", lambda dt, dev: (_r(0, 4, dt=dt, dev=dev), _r(0, 8, dt=dt, dev=dev),
                                                _r(4, 8, dt=dt, dev=dev), True, True, True)),
    ("linear_backward", "N=0", lambda dt, dev: (_r(3, 0, dt=dt, dev=dev), _r(3, 8, dt=dt, dev=dev),
                                                _r(0, 8, dt=dt, dev=dev), True, True, True)),
    ("linear_backward", "K=0", lambda dt, dev: (_r(3, 4, dt=dt, dev=dev), _r(3, 0, dt=dt, dev=dev),
                                                _r(4, 0, dt=dt, dev=dev), True, True, True)),
    ("attention", "B=0", lambda dt, dev: (_r(0, 4, 2, 16, dt=dt, dev=dev), _r(0, 4, 2, 16, dt=dt, dev=dev),
                                          _r(0, 4, 2, 16, dt=dt, dev=dev), 0.25, True)),
    ("attention", "Sq=0", lambda dt, dev: (_r(1, 0, 2, 16, dt=dt, dev=dev), _r(1, 4, 2, 16, dt=dt, dev=dev),
                                           _r(1, 4, 2, 16, dt=dt, dev=dev), 0.25, True)),
    ("attention", "Hq=0", lambda dt, dev: (_r(1, 4, 0, 16, dt=dt, dev=dev), _r(1, 4, 2, 16, dt=dt, dev=dev),
                                           _r(1, 4, 2, 16, dt=dt, dev=dev), 0.25, False)),
    ("attention_with_lse", "B=0", lambda dt, dev: (_r(0, 4, 2, 16, dt=dt, dev=dev), _r(0, 4, 2, 16, dt=dt, dev=dev),
                                                   _r(0, 4, 2, 16, dt=dt, dev=dev), 0.25, True)),
    ("attention_with_lse", "Sq=0", lambda dt, dev: (_r(1, 0, 2, 16, dt=dt, dev=dev), _r(1, 4, 2, 16, dt=dt, dev=dev),
                                                    _r(1, 4, 2, 16, dt=dt, dev=dev), 0.25, False)),
    ("attention_backward", "B=0", lambda dt, dev: (*(_r(0, 4, 2, 16, dt=dt, dev=dev) for _ in range(5)), None, 0.25,
                                                   True, None)),
    ("attention_backward", "Sq=0", lambda dt, dev: (_r(1, 0, 2, 16, dt=dt, dev=dev), _r(1, 0, 2, 16, dt=dt, dev=dev),
                                                    _r(1, 4, 2, 16, dt=dt, dev=dev), _r(1, 4, 2, 16, dt=dt, dev=dev),
                                                    _r(1, 0, 2, 16, dt=dt, dev=dev), None, 0.25, True, None)),
    ("attention_backward", "Hq=0", lambda dt, dev: (_r(1, 4, 0, 16, dt=dt, dev=dev), _r(1, 4, 0, 16, dt=dt, dev=dev),
                                                    _r(1, 4, 2, 16, dt=dt, dev=dev), _r(1, 4, 2, 16, dt=dt, dev=dev),
                                                    _r(1, 4, 0, 16, dt=dt, dev=dev), None, 0.25, True, None)),
    ("linear_cross_entropy", "N=0", lambda dt, dev: (_r(0, 8, dt=dt, dev=dev), _r(5, 8, dt=dt, dev=dev),
                                                     _pos(0, dev=dev))),
    ("linear_cross_entropy", "H=0", lambda dt, dev: (_r(3, 0, dt=dt, dev=dev), _r(5, 0, dt=dt, dev=dev),
                                                     torch.tensor([1, 4, -100], device=dev))),
    ("linear_cross_entropy", "all ignored", lambda dt, dev: (_r(3, 8, dt=dt, dev=dev), _r(5, 8, dt=dt, dev=dev),
                                                             torch.full((3,), -100, device=dev))),
    ("linear_cross_entropy_with_lse", "N=0", lambda dt, dev: (_r(0, 8, dt=dt, dev=dev), _r(5, 8, dt=dt, dev=dev),
                                                              _pos(0, dev=dev), -100)),
    ("linear_cross_entropy_backward", "N=0", lambda dt, dev: _lce_bwd(0, 8, 5, dt, dev)),
    ("linear_cross_entropy_backward", "H=0", lambda dt, dev: _lce_bwd(3, 0, 5, dt, dev)),
    ("norm_linear", "M=0", lambda dt, dev: (_r(0, 8, dt=dt, dev=dev), _r(8, dt=dt, dev=dev), _r(4, 8, dt=dt, dev=dev),
                                            None, 1e-6, 0.0)),
    ("norm_linear", "N=0", lambda dt, dev: (_r(3, 8, dt=dt, dev=dev), _r(8, dt=dt, dev=dev), _r(0, 8, dt=dt, dev=dev),
                                            _r(0, dt=dt, dev=dev), 1e-6, 1.0)),
    ("linear_residual", "M=0", lambda dt, dev: (_r(2, 0, 8, dt=dt, dev=dev), _r(4, 8, dt=dt, dev=dev),
                                                _r(2, 0, 4, dt=dt, dev=dev))),
    ("linear_residual", "N=0", lambda dt, dev: (_r(3, 8, dt=dt, dev=dev), _r(0, 8, dt=dt, dev=dev),
                                                _r(3, 0, dt=dt, dev=dev))),
    ("norm_gate_up_silu", "M=0", lambda dt, dev: (_r(0, 8, dt=dt, dev=dev), _r(8, dt=dt, dev=dev),
                                                  _r(6, 8, dt=dt, dev=dev), 1e-6, 0.0)),
    ("norm_gate_up_silu", "I=0", lambda dt, dev: (_r(3, 8, dt=dt, dev=dev), _r(8, dt=dt, dev=dev),
                                                  _r(0, 8, dt=dt, dev=dev), 1e-6, 0.0)),
    ("norm_qkv_rope_store", "N=0", lambda dt, dev: _qkv(0, dt, dev)),
    ("norm_qkv_rope_store", "num_blocks=0", lambda dt, dev: _qkv(2, dt, dev, num_blocks=0)),
    ("decode_layers", "M=0", lambda dt, dev: _layers(0, dt, dev)),
    ("decode_hybrid_layers", "M=0", lambda dt, dev: _hybrid_layers(0, dt, dev)),
    ("causal_conv1d", "B=0", lambda dt, dev: (_r(0, 3, 8, dt=dt, dev=dev), _r(8, 4, dt=dt, dev=dev), None)),
    ("causal_conv1d", "T=0", lambda dt, dev: (_r(2, 0, 8, dt=dt, dev=dev), _r(8, 4, dt=dt, dev=dev), None)),
    ("causal_conv1d", "T=0 state", lambda dt, dev: (_r(2, 0, 8, dt=dt, dev=dev), _r(8, 4, dt=dt, dev=dev),
                                                    _r(2, 8, 3, dt=dt, dev=dev))),
    ("causal_conv1d", "C=0", lambda dt, dev: (_r(2, 3, 0, dt=dt, dev=dev), _r(0, 4, dt=dt, dev=dev), None)),
    ("causal_conv1d", "packed S=0", lambda dt, dev: _conv_varlen([], 8, dt, dev)),
    ("causal_conv1d", "packed N=0", lambda dt, dev: _conv_varlen([0, 0], 8, dt, dev)),
    ("causal_conv1d", "packed C=0", lambda dt, dev: _conv_varlen([2, 1], 0, dt, dev)),
    ("chunk_gated_delta_rule", "B=0", lambda dt, dev: _gdr(0, 3, 1, 1, dt, dev)),
    ("chunk_gated_delta_rule", "T=0", lambda dt, dev: _gdr(1, 0, 1, 2, dt, dev)),
    ("chunk_gated_delta_rule", "T=0 state", lambda dt, dev: _gdr(2, 0, 1, 1, dt, dev, state=True)),
    ("chunk_gated_delta_rule", "Hv=0", lambda dt, dev: _gdr(1, 3, 1, 0, dt, dev)),
    ("chunk_gated_delta_rule", "packed S=0", lambda dt, dev: _gdr_varlen([], 1, 2, dt, dev)),
    ("chunk_gated_delta_rule", "packed N=0", lambda dt, dev: _gdr_varlen([0, 0], 1, 2, dt, dev)),
    ("chunk_gated_delta_rule", "packed Hv=0", lambda dt, dev: _gdr_varlen([2, 1], 1, 0, dt, dev)),
    ("recurrent_gated_delta_rule_varlen", "S=0", lambda dt, dev: _gdr_varlen([], 1, 2, dt, dev, True)),
    ("recurrent_gated_delta_rule_varlen", "N=0", lambda dt, dev: _gdr_varlen([0, 0], 1, 2, dt, dev, True)),
    ("recurrent_gated_delta_rule_varlen", "Hv=0", lambda dt, dev: _gdr_varlen([1, 1], 1, 0, dt, dev, True)),
    ("gated_rms_norm", "N=0", lambda dt, dev: (_r(3, 0, dt=dt, dev=dev), _r(3, 0, dt=dt, dev=dev),
                                               _r(0, dt=dt, dev=dev), 1e-6)),
    ("gated_rms_norm", "rows=0", lambda dt, dev: (_r(0, 8, dt=dt, dev=dev), _r(0, 8, dt=dt, dev=dev),
                                                  _r(8, dt=dt, dev=dev), 1e-6)),
    ("kv_cache_store_slots", "N=0", lambda dt, dev: _slots(0, 2, 16, dt, dev)),
    ("kv_cache_store_slots", "Hk=0", lambda dt, dev: _slots(3, 0, 16, dt, dev)),
    ("kv_cache_store_slots", "D=0", lambda dt, dev: _slots(3, 2, 0, dt, dev)),
    ("kv_cache_store_slots", "num_blocks=0", lambda dt, dev: _slots(3, 2, 16, dt, dev, num_blocks=0)),
    ("paged_attention", "N=0", lambda dt, dev: _paged(0, 2, [0, 0], [5, 0], 1, dt, dev)),
    ("paged_attention", "seqs=0", lambda dt, dev: _paged(0, 2, [], [], 1, dt, dev)),
    ("paged_attention", "Hq=0", lambda dt, dev: _paged(2, 0, [1, 1], [1, 2], 1, dt, dev)),
    ("paged_attention", "max_blocks=0", lambda dt, dev: _paged(2, 2, [1, 1], [0, 0], 0, dt, dev)),
    ("fp8_quantize_per_token_group", "rows=0", lambda dt, dev: (_r(0, 200, dt=dt, dev=dev), 128)),
    ("fp8_block_linear", "rows=0", lambda dt, dev: (_r(0, 200, dt=dt, dev=dev), *_fp8_weight(40, 200, dev), None)),
    ("fp8_block_linear", "N=0", lambda dt, dev: (_r(3, 200, dt=dt, dev=dev), *_fp8_weight(0, 200, dev), None)),
    ("fp8_block_linear", "N=0 prefill", lambda dt, dev: (_r(20, 200, dt=dt, dev=dev), *_fp8_weight(0, 200, dev),
                                                         None)),
    ("moe_topk_softmax", "M=0", lambda dt, dev: (_r(0, 8, dt=dt, dev=dev), 2, True)),
    ("moe_align_block_size", "M=0", lambda dt, dev: (_ids(0, 2, dev), 8, 16)),
    ("fused_moe", "M=0", lambda dt, dev: _moe(0, dt, dev)),
    ("apply_token_bitmask", "rows=0", lambda dt, dev: (_r(0, 64, dt=dt, dev=dev), _ids(0, 2, dev))),
    ("apply_token_bitmask", "vocab=0", lambda dt, dev: (_r(2, 0, dt=dt, dev=dev), _ids(2, 0, dev))),
]

# Degenerate inputs the ops refuse (the same error from the real and the fake kernel).
REFUSED = [
    ("attention", "scale=0", r"scale must be a positive finite number",
     lambda dt, dev: (_r(1, 2, 2, 16, dt=dt, dev=dev), _r(1, 2, 1, 16, dt=dt, dev=dev), _r(1, 2, 1, 16, dt=dt, dev=dev),
                      0.0, True)),
    ("attention", "scale<0", r"scale must be a positive finite number",
     lambda dt, dev: (_r(1, 2, 2, 16, dt=dt, dev=dev), _r(1, 2, 1, 16, dt=dt, dev=dev), _r(1, 2, 1, 16, dt=dt, dev=dev),
                      -0.25, True)),
    ("rope", "theta=0", r"theta \(the RoPE base\) must be positive and finite",
     lambda dt, dev: (_r(1, 2, 2, 16, dt=dt, dev=dev), _r(1, 2, 1, 16, dt=dt, dev=dev), _pos(1, 2, dev=dev), 0.0, 16)),
    ("rope", "theta<0", r"theta \(the RoPE base\) must be positive and finite",
     lambda dt, dev: (_r(1, 2, 2, 16, dt=dt, dev=dev), _r(1, 2, 1, 16, dt=dt, dev=dev), _pos(1, 2, dev=dev), -1e4, 16)),
    ("rope", "theta=nan", r"theta \(the RoPE base\) must be positive and finite",
     lambda dt, dev: (_r(1, 2, 2, 16, dt=dt, dev=dev), _r(1, 2, 1, 16, dt=dt, dev=dev), _pos(1, 2, dev=dev),
                      float("nan"), 16)),
    ("rope", "theta=inf", r"theta \(the RoPE base\) must be positive and finite",
     lambda dt, dev: (_r(1, 2, 2, 16, dt=dt, dev=dev), _r(1, 2, 1, 16, dt=dt, dev=dev), _pos(1, 2, dev=dev),
                      float("inf"), 16)),
    ("rope_backward", "theta=0", r"theta \(the RoPE base\) must be positive and finite",
     lambda dt, dev: (_r(1, 2, 2, 16, dt=dt, dev=dev), _r(1, 2, 1, 16, dt=dt, dev=dev), _r(1, 2, 2, 16, dt=dt, dev=dev),
                      _r(1, 2, 1, 16, dt=dt, dev=dev), _pos(1, 2, dev=dev), 0.0, 16)),
    ("rope", "D=0", r"rotary_dim must be even and in \(0, head_dim=0\]",
     lambda dt, dev: (_r(1, 2, 2, 0, dt=dt, dev=dev), _r(1, 2, 1, 0, dt=dt, dev=dev), _pos(1, 2, dev=dev), 1e4, 0)),
    ("linear", "K=0", r"x's last dim \(K\) must be positive",
     lambda dt, dev: (_r(3, 0, dt=dt, dev=dev), _r(4, 0, dt=dt, dev=dev))),
    ("fp8_quantize_per_token_group", "K=0", r"x's last dim \(K\) must be positive",
     lambda dt, dev: (_r(3, 0, dt=dt, dev=dev), 128)),
    ("fp8_block_linear", "K=0", r"x's last dim \(K\) must be positive",
     lambda dt, dev: (_r(3, 0, dt=dt, dev=dev), *_fp8_weight(4, 0, dev), None)),
    ("attention", "Sk=0", "k and v must hold at least one position",
     lambda dt, dev: (_r(1, 0, 2, 16, dt=dt, dev=dev), _r(1, 0, 2, 16, dt=dt, dev=dev), _r(1, 0, 2, 16, dt=dt, dev=dev),
                      0.25, False)),
    ("attention", "Hk=0", r"must be a multiple of kv heads \(0\)",
     lambda dt, dev: (_r(1, 2, 2, 16, dt=dt, dev=dev), _r(1, 2, 0, 16, dt=dt, dev=dev), _r(1, 2, 0, 16, dt=dt, dev=dev),
                      0.25, True)),
    ("attention", "D=0", "head_dim 0 is not supported",
     lambda dt, dev: (_r(1, 2, 2, 0, dt=dt, dev=dev), _r(1, 2, 2, 0, dt=dt, dev=dev), _r(1, 2, 2, 0, dt=dt, dev=dev),
                      0.25, True)),
    ("linear_cross_entropy", "V=0", r"vocab size V > 0",
     lambda dt, dev: (_r(3, 8, dt=dt, dev=dev), _r(0, 8, dt=dt, dev=dev), _pos(3, dev=dev))),
    ("chunk_gated_delta_rule", "Hk=0", "v's head count 0 must be a multiple of k's 0",
     lambda dt, dev: _gdr(1, 3, 0, 0, dt, dev)),
    ("paged_attention", "Hk=0", r"must be a multiple of kv heads \(0\)",
     lambda dt, dev: (_r(1, 2, 16, dt=dt, dev=dev), _r(2, 16, 0, 16, dt=dt, dev=dev), _r(2, 16, 0, 16, dt=dt, dev=dev),
                      torch.tensor([0, 1], dtype=torch.int32, device=dev), torch.ones(1, dtype=torch.int32, device=dev),
                      torch.zeros(1, 1, dtype=torch.int32, device=dev), 0.25, 1)),
    ("causal_conv1d", "K=1", "kernel size",
     lambda dt, dev: (_r(1, 3, 8, dt=dt, dev=dev), _r(8, 1, dt=dt, dev=dev), None)),
]

MUTATED = {"kv_cache_store_slots": (2, 3), "norm_qkv_rope_store": (6, 7), "decode_layers": (13, 14),
           "decode_hybrid_layers": (14, 15, 22, 23),
           "causal_conv1d": (2,), "chunk_gated_delta_rule": (6,),
           "recurrent_gated_delta_rule_varlen": (7,)}
"""Arguments an op writes in place: compared with the reference's after the call."""

KERNEL_NAME = {"linear_cross_entropy": "linear_cross_entropy_with_lse"}


def _op(name):
    return getattr(torch.ops.qwen, name)


def _reference(name):
    return getattr(qwen_ops, f"{name}_reference")


def _clone(args):
    return tree_map(lambda a: a.clone() if isinstance(a, torch.Tensor) else a, args)


def _leaves(x):
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _check_same(out, ref, what):
    """Same structure, shapes and dtypes; equal values (NaN where the reference has NaN)."""
    outs, refs = _leaves(out), _leaves(ref)
    assert len(outs) == len(refs), f"{what}: {len(outs)} outputs, the reference has {len(refs)}"
    for i, (o, r) in enumerate(zip(outs, refs)):
        where = f"{what} [output {i}]"
        assert o.shape == r.shape and o.dtype == r.dtype, \
            f"{where}: {tuple(o.shape)} {o.dtype} != reference {tuple(r.shape)} {r.dtype}"
        if not r.numel():
            continue
        o, r = o.cpu(), r.cpu()
        if not r.is_floating_point():  # indices and counts: exact
            assert torch.equal(o, r), f"{where}: differs from the reference"
            continue
        nan = torch.isnan(r)
        assert torch.equal(torch.isnan(o), nan), f"{where}: NaN where the reference has none (or the reverse)"
        if nan.all():
            continue
        o, r = o[~nan], r[~nan]
        if not r.any():
            assert not o.any(), f"{where}: the reference is all zeros, the kernel's output is not"
        else:
            assert_close(o, r, max(REL_TOL[r.dtype], 1e-5) * 2, where)


def _fake_outputs(op, args):
    with FakeTensorMode() as mode:
        fake = tree_map(lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a, args)
        return op(*fake)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name,case,make", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_zero_size_inputs_match_the_reference(name, case, make, dtype, device, nan_empty):
    torch.manual_seed(0)
    args = make(dtype, device)
    ref_args = _clone(args)
    counter = KERNEL_NAME.get(name, name)
    before = qwen_ops.kernel_calls[counter]
    out = _op(name)(*args)
    assert qwen_ops.kernel_calls[counter] == before + 1, "the op did not take its Triton launcher"
    ref = _reference(name)(*ref_args)
    what = f"{name} {case} {dtype}"
    _check_same(out, ref, what)
    for i in MUTATED.get(name, ()):
        _check_same(args[i], ref_args[i], f"{what} (argument {i}, written in place)")
    fake = _fake_outputs(_op(name), _clone(args))
    assert [(tuple(t.shape), t.dtype) for t in _leaves(fake)] == [(tuple(t.shape), t.dtype) for t in _leaves(out)], \
        f"{what}: the fake kernel's outputs differ from the real ones"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,case,message,make", REFUSED, ids=[f"{c[0]}-{c[1]}" for c in REFUSED])
def test_degenerate_inputs_refused_with_a_clear_error(name, case, message, make, device):
    args = make(F32, device)
    pattern = rf"qwen\.{name.removesuffix('_backward')}: .*{message}"  # rope_backward runs rope's check
    with pytest.raises(qwen_ops.QwenOpError, match=pattern):
        _op(name)(*args)
    with pytest.raises(qwen_ops.QwenOpError, match=pattern):
        _fake_outputs(_op(name), args)


def test_every_op_has_edge_cases():
    """Each op with a reference in qwen_ops has zero-size cases here (a new op needs its rows)."""
    ops = {n.removesuffix("_reference") for n in qwen_ops.__all__ if n.endswith("_reference")}
    missing = sorted(ops - {c[0] for c in CASES})
    assert not missing, f"ops without zero-size cases in tests/test_edge_cases.py: {missing}"


# ------------------------------------------------------------------------------------------ large values

BF16_MAX = torch.finfo(torch.bfloat16).max  # 3.39e38, as fp32's


def _uniform(*shape, bound, device, dtype, positive=False):
    u = torch.rand(*shape, device=device)
    return ((u if positive else 2 * u - 1) * bound).to(dtype)


def _finite_and_close(out, ref, what):
    assert torch.isfinite(ref).all(), f"{what}: the fp32 reference itself overflows (a bad test case)"
    assert torch.isfinite(out).all(), f"{what}: the kernel overflows where the fp32 reference is finite"
    assert_close(out, ref, REL_TOL[out.dtype] * 2, what)


LARGE = [  # (q and k bound, v bound, v positive): score magnitudes up to ~1e37, values up to the bf16 maximum
    pytest.param(1e18, 1.0, False, id="scores~1e37"),
    pytest.param(1.0, 0.99 * BF16_MAX, False, id="v~bf16max"),
    pytest.param(1.0, 0.99 * BF16_MAX, True, id="v~bf16max-positive"),
    pytest.param(1e18, 1e37, True, id="both"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("qk,vb,positive", LARGE)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_large_values_stay_finite(qk, vb, positive, causal, dtype, device):
    """The online softmax sums p * v before normalising: with |v| near the bf16 maximum and more
    than a few keys the unnormalised sum would overflow fp32 (common.SOFTMAX_HEADROOM keeps it
    below max |v|); scores of 1e37 must not turn into inf - inf."""
    torch.manual_seed(1)
    b, sq, sk, hq, hk, d = 2, 37, 70, 4, 2, 64
    q = _uniform(b, sq, hq, d, bound=qk, device=device, dtype=dtype)
    k = _uniform(b, sk, hk, d, bound=qk, device=device, dtype=dtype)
    v = _uniform(b, sk, hk, d, bound=vb, device=device, dtype=dtype, positive=positive)
    out, lse = torch.ops.qwen.attention_with_lse(q, k, v, d**-0.5, causal)
    ref, ref_lse = qwen_ops.attention_with_lse_reference(q, k, v, d**-0.5, causal)
    _finite_and_close(out, ref, "attention")
    _finite_and_close(lse, ref_lse, "attention lse")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("qk,vb,positive", LARGE)
def test_paged_attention_large_values_stay_finite(qk, vb, positive, dtype, device):
    """Decode rows (2 per sequence) over several KV splits (tables of 19 blocks of 16, lengths 300
    and 77: the combine step sums split outputs near the bf16 maximum)."""
    torch.manual_seed(2)
    seqs, tq, hq, hk, d, blocks = 2, 2, 4, 2, 64, 19
    q = _uniform(seqs * tq, hq, d, bound=qk, device=device, dtype=dtype)
    kc = _uniform(seqs * blocks, 16, hk, d, bound=qk, device=device, dtype=dtype)
    vc = _uniform(seqs * blocks, 16, hk, d, bound=vb, device=device, dtype=dtype, positive=positive)
    i32 = dict(dtype=torch.int32, device=device)
    args = (q, kc, vc, torch.tensor([0, tq, 2 * tq], **i32), torch.tensor([300, 77], **i32),
            torch.arange(seqs * blocks, **i32).view(seqs, blocks), d**-0.5, tq)
    _finite_and_close(torch.ops.qwen.paged_attention(*args), qwen_ops.paged_attention_reference(*args),
                      "paged_attention")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("hidden_bound,weight_bound", [(1e18, 1.0), (1e36, 1e-1), (1.0, 1e35)],
                         ids=["hidden~1e18", "hidden~1e36", "weight~1e35"])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy, on masked-off lanes
def test_fused_loss_large_values_stay_finite(hidden_bound, weight_bound, dtype, device):
    """Logits up to ~1e36 (the mean of the row losses stays below the fp32 maximum): the loss, the
    log-sum-exp and both gradients stay finite and match the reference."""
    torch.manual_seed(3)
    n, h, v = 24, 32, 300
    hidden = _uniform(n, h, bound=hidden_bound, device=device, dtype=dtype).requires_grad_(True)
    weight = _uniform(v, h, bound=weight_bound, device=device, dtype=dtype).requires_grad_(True)
    targets = torch.randint(0, v, (n,), device=device)
    targets[3] = -100
    loss, lse = torch.ops.qwen.linear_cross_entropy_with_lse(hidden, weight, targets, -100)
    ref_loss, ref_lse = qwen_ops.linear_cross_entropy_with_lse_reference(hidden, weight, targets, -100)
    _finite_and_close(loss, ref_loss, "loss")
    _finite_and_close(lse, ref_lse, "lse")
    dh, dw = torch.autograd.grad(loss, (hidden, weight))
    ref_dh, ref_dw = torch.autograd.grad(ref_loss, (hidden, weight))
    assert torch.isfinite(ref_dh).all() and torch.isfinite(ref_dw).all()
    assert torch.isfinite(dh).all() and torch.isfinite(dw).all(), "loss gradients overflow"
    assert_close(dh, ref_dh.to(dh.dtype), REL_TOL[dtype] * 2, "dhidden")
    assert_close(dw, ref_dw.to(dw.dtype), REL_TOL[dtype] * 2, "dweight")
