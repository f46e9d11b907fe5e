"""qwen::decode_hybrid_layers (the persistent decode kernel of Qwen3.5's hybrid decoder) against its
reference, the composition of the per-layer ops; the reference against the model's layers run
through the fused decode ops.

On the CPU interpreter one program runs every task in order (its waits are met as it reaches
them); on CUDA the grid is every co-resident program and the waits are real."""
import pytest
import torch

import qwen_ops
from csrc_free_ops import decode_hybrid_layers as kernels
from csrc_free_ops.decode_layers import error_flag
from tests.helpers import DEVICES, DTYPES, REL_TOL, assert_close, randn

A, G = kernels.ATTENTION, kernels.GATED_DELTANET

# (M, hidden, I, layer kinds, (Hq, Hk, D, rotary dim), (Hk', Hv, Dk, Dv, K), block size, blocks per
# sequence): awkward sizes on the CPU (hidden and I not powers of two, 3 and 6 value heads, a head
# dim of 48, partial rotary, GQA groups of 3 and 1); Qwen3.5-0.8B's layer shapes on CUDA
CASES = {"cpu": [(1, 40, 72, (G, G, A), (6, 2, 32, 16), (2, 6, 16, 32, 4), 16, 2),
                 (3, 48, 40, (G, A, G, A), (2, 2, 48, 24), (1, 3, 32, 16, 3), 16, 3)],
         "cuda": [(1, 1024, 3584, (G, G, G, A) * 2, (8, 2, 256, 64), (16, 16, 128, 128, 4), 16, 24),
                  (5, 1024, 3584, (G, G, G, A) * 2, (8, 2, 256, 64), (16, 16, 128, 128, 4), 16, 150)]}

NAMES = ["x", "positions", "cache_seqlens", "block_table", "state_slots", "layer_kinds", "input_norm", "post_norm",
         "gate_up_weight", "down_weight", "qkv_weight", "q_norm", "k_norm", "o_weight", "k_cache", "v_cache",
         "in_proj_weight", "conv_weight", "A_log", "dt_bias", "norm_weight", "out_weight", "conv_states", "ssm_states",
         "eps", "offset", "theta", "rotary_dim", "num_heads", "num_splits"]
CACHES = [NAMES.index(n) for n in ("k_cache", "v_cache", "conv_states", "ssm_states")]


def _args(m, hidden, inter, kinds, attn, gdn, bs, per_seq, dtype, device, splits=3, padding=False, seed=0):
    """The op's arguments: random weights and caches; row 0 a first token (nothing cached), with
    `padding` the last row a padding row (length 0, the pool's last slot, as an engine step pads)."""
    torch.manual_seed(seed)
    f = dict(dtype=dtype, device=device)
    hq, hk, d, rot = attn
    hkl, hv, dk, dv, taps = gdn
    nl, na = len(kinds), kinds.count(A)
    ng = nl - na
    channels, vd = 2 * hkl * dk + hv * dv, hv * dv
    num_blocks, slots = m * per_seq + 3, m + 2
    table = torch.randperm(num_blocks, device=device)[:m * per_seq].view(m, per_seq).to(torch.int32)
    seqlens = torch.randint(2, per_seq * bs + 1, (m,), device=device, dtype=torch.int32)
    seqlens[0] = 1
    state_slots = torch.randperm(slots - 1, device=device)[:m]
    if padding:
        seqlens[-1] = 0
        state_slots[-1] = slots - 1
    norm = lambda *shape: 0.1 * randn(*shape, **f)  # noqa: E731  (zero-centred: offset 1)
    return [randn(m, hidden, **f), (seqlens - 1).clamp(min=0).long(), seqlens, table, state_slots, list(kinds),
            norm(nl, hidden), norm(nl, hidden), randn(nl, 2 * inter, hidden, **f, scale=hidden ** -0.5),
            randn(nl, hidden, inter, **f, scale=inter ** -0.5),
            randn(na, (2 * hq + 2 * hk) * d, hidden, **f, scale=hidden ** -0.5), norm(na, d), norm(na, d),
            randn(na, hidden, hq * d, **f, scale=(hq * d) ** -0.5),
            randn(na, num_blocks, bs, hk, d, **f), randn(na, num_blocks, bs, hk, d, **f),
            randn(ng, channels + vd + 2 * hv, hidden, **f, scale=hidden ** -0.5),
            randn(ng, channels, taps, **f, scale=taps ** -0.5),
            torch.log(torch.empty(ng, hv, device=device).uniform_(1, 16)).to(dtype),
            randn(ng, hv, **f), 1 + 0.1 * randn(ng, dv, **f), randn(ng, hidden, vd, **f, scale=vd ** -0.5),
            randn(ng, slots, channels, taps - 1, **f),
            randn(ng, slots, hv, dk, dv, dtype=torch.float32, device=device, scale=0.3),
            1e-6, 1.0, 1e4, rot, hq, splits]


def _check(args, dtype, device, what):
    ref_args = list(args)
    for i in CACHES:
        ref_args[i] = args[i].clone()
    ref = qwen_ops.decode_hybrid_layers_reference(*ref_args)
    calls = qwen_ops.kernel_calls["decode_hybrid_layers"]
    out = torch.ops.qwen.decode_hybrid_layers(*args)
    assert qwen_ops.kernel_calls["decode_hybrid_layers"] == calls + 1, "the kernel did not run"
    # Every layer rounds to the model dtype a dozen times; the residual stream carries it on.
    tol = REL_TOL[dtype] * (max(3, len(args[5])) if dtype != torch.float32 else 5)
    assert_close(out, ref, tol, what)
    for i in CACHES:
        assert_close(args[i], ref_args[i], tol, f"{what} {NAMES[i]}")
    if device == "cuda":
        assert error_flag(torch.device(device)).item() == 0, "a wait of the persistent kernel timed out"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_hybrid_layers(device, dtype):
    for i, case in enumerate(CASES[device]):
        splits = 1 + 2 * i
        _check(_args(*case, dtype, device, splits=splits, padding=i == 1), dtype, device, f"{case} S{splits}")
