"""The mixture-of-experts ops against their references: the router's top-k (ties, renormalisation,
a strided view of logits), the sort per expert (exactly: an expert with no pair, one pair, every
pair, no tokens), and fused_moe on both paths (per-pair GEMV for decode-sized steps, the sorted
grouped GEMMs) with and without the shared expert, with FP8 experts (weight-only, blocks of 128
partial on every axis); opcheck and the errors.
"""
import pytest
import torch

import qwen_ops
from csrc_free_ops import moe as kernels
from qwen_ops import (dequantize_weight_fp8_block, fused_moe_reference, moe_align_block_size_reference,
                      moe_topk_softmax_reference, quantize_weight_fp8_block)
from tests.helpers import DEVICES, DTYPES, assert_close, poison_allocator, randn

ops = torch.ops.qwen


def distinct_ids(m: int, k: int, e: int, device, experts=None, seed=0) -> torch.Tensor:
    """[m, k] int32 top-k ids: k distinct experts a row, drawn from ``experts`` (default all e)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.arange(e) if experts is None else torch.tensor(experts)
    rows = [pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(m)]
    return torch.stack(rows).to(torch.int32).to(device) if m else torch.empty((0, k), dtype=torch.int32, device=device)


# ------------------------------------------------------------------------------------------ router


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_softmax_matches_reference(device, dtype):
    cases = {"cpu": [(1, 8, 2), (37, 60, 8), (5, 128, 1)], "cuda": [(1, 128, 8), (4096, 128, 8), (300, 256, 8),
                                                                     (77, 60, 4)]}[device]
    for m, e, k in cases:
        logits = randn(m, e, dtype=dtype, device=device, scale=2.0)
        for renormalize in (False, True):
            w, ids = ops.moe_topk_softmax(logits, k, renormalize)
            w_ref, ids_ref = moe_topk_softmax_reference(logits, k, renormalize)
            assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.is_contiguous()
            assert torch.equal(ids, ids_ref), f"ids {m}x{e} top {k}"
            assert_close(w, w_ref, rel_tol=1e-6, what=f"weights {m}x{e} top {k} renormalize={renormalize}")
            if renormalize:
                assert torch.allclose(w.sum(-1), torch.ones(m, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_topk_softmax_ties_and_strided_logits(device):
    """Ties go to the lower expert id (exact values, so the ties are exact); the logits are the
    first E columns of a wider router output (the shared expert's gate beside them)."""
    wide = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 9.0],
                         [1.0, 3.0, 3.0, 2.0, 3.0, 9.0],
                         [-1.0, 2.0, -1.0, 2.0, 0.5, 9.0]], device=device)
    logits = wide[:, :5]
    w, ids = ops.moe_topk_softmax(logits, 3, True)
    assert ids.tolist() == [[0, 1, 2], [1, 2, 4], [1, 3, 4]]
    assert torch.allclose(w[0], torch.full((3,), 1 / 3, device=device))
    assert torch.allclose(w[1], torch.full((3,), 1 / 3, device=device))
    p = torch.softmax(logits[2], -1)[[1, 3, 4]]
    assert torch.allclose(w[2], p / p.sum())
    w, ids = ops.moe_topk_softmax(logits, 2, False)
    assert ids.tolist() == [[0, 1], [1, 2], [1, 3]]
    assert torch.allclose(w[0], torch.full((2,), 0.2, device=device))


# -------------------------------------------------------------------------------------------- sort


@pytest.mark.parametrize("device", DEVICES)
def test_align_block_size_by_hand(device):
    """Pairs 0 and 1 to expert 1, pair 2 to expert 3; experts 0 and 2 get none."""
    ids = torch.tensor([[1], [1], [3]], dtype=torch.int32, device=device)
    sorted_ids, expert_ids, post = ops.moe_align_block_size(ids, 4, 16)
    assert sorted_ids.shape == (3 + 4 * 15,) and expert_ids.shape == (4,)
    assert sorted_ids[:16].tolist() == [0, 1] + [3] * 14 and sorted_ids[16:32].tolist() == [2] + [3] * 15
    assert (sorted_ids[32:] == 3).all()
    assert expert_ids.tolist() == [1, 3, -1, -1] and post.tolist() == [32]


@pytest.mark.parametrize("device", DEVICES)
def test_align_block_size_matches_reference(device):
    e = 8
    cases = [distinct_ids(23, 2, e, device),  # a few pairs each
             distinct_ids(9, 3, e, device, experts=[0, 2, 5]),  # every token in experts 0, 2 and 5; others none
             torch.full((40, 1), 6, dtype=torch.int32, device=device),  # every pair to one expert: 3 blocks
             torch.tensor([[7, 0]], dtype=torch.int64, device=device),  # one pair each for the last and first
             torch.empty((0, 2), dtype=torch.int32, device=device),  # no tokens
             distinct_ids(70, 8, e, device)]  # more pairs than one sort chunk
    for ids in cases:
        for block in (16, 32):
            out = ops.moe_align_block_size(ids, e, block)
            ref = moe_align_block_size_reference(ids, e, block)
            for name, a, b in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), out, ref):
                assert torch.equal(a, b), f"{name} of {tuple(ids.shape)} ids, block {block}"


# --------------------------------------------------------------------------------------- fused_moe


def _moe_inputs(m, h, inter, e, k, dtype, device, ids=None, shared=False, seed=0):
    torch.manual_seed(seed)
    x = randn(m, h, dtype=dtype, device=device)
    w13 = randn(e, 2 * inter, h, dtype=dtype, device=device, scale=h**-0.5)
    w2 = randn(e, h, inter, dtype=dtype, device=device, scale=inter**-0.5)
    ids = distinct_ids(m, k, e, device, seed=seed) if ids is None else ids
    weights = torch.rand(m, k, device=device)
    extra = (randn(m, h, dtype=dtype, device=device), randn(m, 1, dtype=dtype, device=device)) if shared else ()
    return (x, w13, w2, weights, ids, *extra)


SIZES = {"cpu": dict(h=48, inter=40, e=6), "cuda": dict(h=2048, inter=768, e=128)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 5, 19])
def test_fused_moe_matches_reference(device, dtype, m, nan_empty):
    """M <= GEMV_MAX_TOKENS takes the per-pair GEMV, more the sorted grouped GEMMs; top 2 of 6
    experts (every expert, most with several pairs), H = 48 and I = 40 (not multiples of the
    tiles); with the shared expert at M = 5 and 19."""
    s = SIZES[device]
    k = 2 if device == "cpu" else 8
    args = _moe_inputs(m, s["h"], s["inter"], s["e"], k, dtype, device, shared=m >= 5)
    poison_allocator(device)
    out = ops.fused_moe(*args)
    assert out.shape == (m, s["h"]) and out.dtype == dtype
    # bf16 under the interpreter: three conversions that truncate (act, each pair's output, the sum)
    tol = 2e-2 if device == "cpu" and dtype == torch.bfloat16 else None
    assert_close(out, fused_moe_reference(*args), rel_tol=tol, what=f"fused_moe M={m}")


@pytest.mark.launcher
@pytest.mark.parametrize("path", ["gemv", "sorted"])
def test_fused_moe_paths_on_awkward_routing(path, nan_empty):
    """Both paths on every routing corner: an expert that gets no pair (1, 4), one that gets one
    (5: the last row only), one that gets every token (2), top-3, and the shared expert."""
    m, e, k = 6, 6, 3
    ids = torch.tensor([[2, 0, 3]] * (m - 1) + [[5, 2, 0]], dtype=torch.int32)
    args = _moe_inputs(m, 48, 40, e, k, torch.float32, "cpu", ids=ids, shared=True)
    assert_close(kernels.fused_moe(*args, path=path), fused_moe_reference(*args), what=path)


@pytest.mark.launcher
def test_fused_moe_skips_ids_out_of_range(nan_empty):
    """On CUDA the ids are not checked (that would sync): a pair outside [0, E) adds nothing on
    either path, and nothing is read or written out of bounds."""
    ids = torch.tensor([[1, 6], [-1, 0], [3, 2], [4, 5], [0, 1]], dtype=torch.int32)
    args = _moe_inputs(5, 48, 40, 6, 2, torch.float32, "cpu", ids=ids)
    keep = (ids >= 0) & (ids < 6)
    expected = fused_moe_reference(*args[:3], args[3] * keep, ids.clamp(0, 5))
    for path in ("gemv", "sorted"):
        assert_close(kernels.fused_moe(*args, path=path), expected, what=path)


# ---------------------------------------------------------------------------------- FP8 experts


def fp8_experts(e: int, n: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random experts [E, N, K] (std K^-0.5, each 128 x 128 block times its own factor from 1 to 10,
    so that a scale read from another block shows) in the block format of Qwen's FP8 checkpoints,
    expert by expert: (weight float8_e4m3fn, scale_inv fp32 [E, cdiv(N, 128), cdiv(K, 128)])."""
    factors = 1 + 9 * torch.rand(e, -(-n // 128), -(-k // 128), device=device)
    w = randn(e, n, k, dtype=torch.float32, device=device, scale=k**-0.5)
    w = w * factors.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :n, :k]
    parts = [quantize_weight_fp8_block(we) for we in w]
    return torch.stack([w for w, _ in parts]), torch.stack([s for _, s in parts])


FP8_SIZES = {"cpu": dict(h=136, inter=72, e=5, k=3), "cuda": dict(h=2048, inter=768, e=128, k=8)}
"""CPU: H = 136 and 2I = 144, past one block and not multiples of 128: w13 [E, 144, 136] ends in a
partial block on both axes (its up half starts inside the first block row and ends in the
second), w2 [E, 136, 72] has two block rows and one partial block column; 5 experts, top 3.
CUDA: Qwen3-30B-A3B's layer."""


def _fp8_moe_inputs(m: int, dtype, device, ids=None, seed=0, sizes=None):
    """fused_moe's arguments with FP8 experts (no shared expert): (x, w13, w2, weights, ids, None,
    None, w13_scale_inv, w2_scale_inv); ``sizes`` as FP8_SIZES' entries (default: the device's)."""
    s = sizes or FP8_SIZES[device]
    torch.manual_seed(seed)
    x = randn(m, s["h"], dtype=dtype, device=device)
    w13, s13 = fp8_experts(s["e"], 2 * s["inter"], s["h"], device)
    w2, s2 = fp8_experts(s["e"], s["h"], s["inter"], device)
    ids = distinct_ids(m, s["k"], s["e"], device, seed=seed) if ids is None else ids
    return (x, w13, w2, torch.rand(m, s["k"], device=device), ids, None, None, s13, s2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [2, 9])
def test_fused_moe_fp8_matches_reference(device, dtype, m, nan_empty):
    """FP8 experts, weight-only: M = 2 takes the per-pair GEMV, 9 the sorted grouped GEMMs; on the
    CPU top 3 of 5 experts (each gets several pairs) and, in the first row, one expert twice."""
    ids = None
    if device == "cpu":
        ids = distinct_ids(m, 3, 5, device)
        ids[0] = torch.tensor([4, 1, 4], dtype=torch.int32)
    args = _fp8_moe_inputs(m, dtype, device, ids)
    poison_allocator(device)
    out = ops.fused_moe(*args)
    assert out.shape == (m, args[0].shape[1]) and out.dtype == dtype
    tol = 2e-2 if device == "cpu" and dtype == torch.bfloat16 else None  # as test_fused_moe_matches_reference
    assert_close(out, fused_moe_reference(*args), rel_tol=tol, what=f"fp8 fused_moe M={m}")


@pytest.mark.launcher
@pytest.mark.parametrize("path", ["gemv", "sorted"])
def test_fused_moe_fp8_paths_on_awkward_routing(path, nan_empty):
    """Both paths on the routing corners of test_fused_moe_paths_on_awkward_routing (experts with no
    pair (1), one pair (4: the last row only), every token (2); one expert twice in a row), with
    the shared expert; then w13 FP8 and w2 not (the loader keeps each weight FP8 on its own), and
    no tokens."""
    ids = torch.tensor([[2, 0, 3]] * 2 + [[4, 2, 2]], dtype=torch.int32)
    x, w13, w2, weights, _, _, _, s13, s2 = _fp8_moe_inputs(3, torch.float32, "cpu", ids)
    shared = (randn(3, 136, dtype=torch.float32, device="cpu"), randn(3, 1, dtype=torch.float32, device="cpu"))
    args = (x, w13, w2, weights, ids, *shared, s13, s2)
    assert_close(kernels.fused_moe(*args, path=path), fused_moe_reference(*args), what=path)
    w2_dense = torch.stack([dequantize_weight_fp8_block(w, s) for w, s in zip(w2, s2)])
    args = (x[2:], w13, w2_dense, weights[2:], ids[2:], None, None, s13, None)
    assert_close(kernels.fused_moe(*args, path=path), fused_moe_reference(*args), what=f"{path}, w2 not FP8")
    assert kernels.fused_moe(x[:0], w13, w2, weights[:0], ids[:0], None, None, s13, s2, path=path).shape == (0, 136)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 256])
def test_fused_moe_fp8_qwen3_30b_a3b_layer(m):
    """Qwen3-30B-A3B's experts in FP8 at one token (GEMV) and 256 (grouped GEMMs), bf16 activations:
    the kernel within bf16's 1e-2 of its reference and of the bf16 kernel on the dequantised experts."""
    x, w13, w2, weights, ids, _, _, s13, s2 = _fp8_moe_inputs(m, torch.bfloat16, "cuda")
    out = ops.fused_moe(x, w13, w2, weights, ids, None, None, s13, s2)
    assert_close(out, fused_moe_reference(x, w13, w2, weights, ids, None, None, s13, s2), rel_tol=1e-2,
                 what=f"M={m}")
    dense = [torch.stack([dequantize_weight_fp8_block(w, s, torch.bfloat16) for w, s in zip(t, st)])
             for t, st in ((w13, s13), (w2, s2))]
    assert_close(out, ops.fused_moe(x, *dense, weights, ids), rel_tol=1e-2, what=f"M={m} vs bf16 experts")


@pytest.mark.parametrize("device", DEVICES)
def test_fused_moe_no_tokens(device):
    args = _moe_inputs(0, 48, 40, 6, 2, torch.float32, device)
    assert ops.fused_moe(*args).shape == (0, 48)
    w, ids = ops.moe_topk_softmax(torch.empty(0, 6, device=device), 2, True)
    assert w.shape == ids.shape == (0, 2)


@pytest.mark.parametrize("device", DEVICES)
def test_moe_ops_opcheck(device):
    logits = randn(5, 9, dtype=torch.float32, device=device)
    torch.library.opcheck(ops.moe_topk_softmax.default, (logits, 3, True))
    torch.library.opcheck(ops.moe_align_block_size.default, (distinct_ids(7, 2, 6, device), 6, 16))
    torch.library.opcheck(ops.fused_moe.default, _moe_inputs(3, 32, 16, 4, 2, torch.float32, device, shared=True))


@pytest.mark.parametrize("device", DEVICES)
def test_fused_moe_fp8_opcheck(device):
    """As test_ops_fp8's opcheck of fp8_block_linear: without `test_schema` (it compares inputs with
    torch.allclose, which float8 lacks); the inputs' bytes are compared here instead."""
    args = _fp8_moe_inputs(3, torch.float32, device, sizes=dict(h=48, inter=40, e=4, k=2))
    before = [a.clone() for a in args if a is not None]
    torch.library.opcheck(ops.fused_moe.default, args, test_utils=("test_autograd_registration", "test_faketensor",
                                                                  "test_aot_dispatch_dynamic"))
    for a, b in zip([a for a in args if a is not None], before):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_moe_ops_errors():
    x, w13, w2, weights, ids = _moe_inputs(3, 32, 16, 4, 2, torch.float32, "cpu")
    err = qwen_ops.QwenOpError
    with pytest.raises(err, match="qwen.moe_topk_softmax: top_k must be in"):
        ops.moe_topk_softmax(torch.randn(3, 4), 5, True)
    with pytest.raises(err, match="qwen.moe_topk_softmax: router_logits must have 2 dims"):
        ops.moe_topk_softmax(torch.randn(3, 4, 2), 1, True)
    with pytest.raises(err, match="qwen.moe_align_block_size: block_size must be a power of two"):
        ops.moe_align_block_size(ids, 4, 24)
    with pytest.raises(err, match=r"qwen.moe_align_block_size: topk_ids must be in \[0, 4\)"):
        ops.moe_align_block_size(ids + 3, 4, 16)
    with pytest.raises(err, match="qwen.moe_align_block_size: topk_ids must be int32 or int64"):
        ops.moe_align_block_size(ids.float(), 4, 16)
    with pytest.raises(err, match=r"qwen.fused_moe: topk_ids must be in \[0, 4\)"):
        ops.fused_moe(x, w13, w2, weights, ids - 1)
    with pytest.raises(err, match="qwen.fused_moe: w13 must be"):
        ops.fused_moe(x, w13[:, :, :16], w2, weights, ids)
    with pytest.raises(err, match="qwen.fused_moe: w2 must be"):
        ops.fused_moe(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(err, match="qwen.fused_moe: topk_ids has shape"):
        ops.fused_moe(x, w13, w2, weights, ids[:, :1].contiguous())
    with pytest.raises(err, match="qwen.fused_moe: w2 has dtype"):
        ops.fused_moe(x, w13, w2.double(), weights, ids)
    with pytest.raises(err, match="qwen.fused_moe: shared_output and shared_gate"):
        ops.fused_moe(x, w13, w2, weights, ids, x, None)
    with pytest.raises(err, match="qwen.fused_moe: shared_gate must be"):
        ops.fused_moe(x, w13, w2, weights, ids, x, x)
    with pytest.raises(err, match="qwen.fused_moe: topk_weights must be contiguous"):
        ops.fused_moe(x, w13, w2, torch.rand(2, 3).t(), ids)
    w8, s8 = fp8_experts(4, 32, 32, "cpu")  # w13 [4, 2I = 32, H = 32]
    with pytest.raises(err, match="qwen.fused_moe: w13 is float8_e4m3fn: its w13_scale_inv must be given"):
        ops.fused_moe(x, w8, w2, weights, ids)
    with pytest.raises(err, match="qwen.fused_moe: w13 must be float8_e4m3fn where w13_scale_inv is given"):
        ops.fused_moe(x, w13, w2, weights, ids, None, None, s8)
    with pytest.raises(err, match="qwen.fused_moe: w13_scale_inv must be float32, got torch.bfloat16"):
        ops.fused_moe(x, w8, w2, weights, ids, None, None, s8.bfloat16())
    with pytest.raises(err, match=r"qwen.fused_moe: w13_scale_inv must be \(4, 1, 1\)"):
        ops.fused_moe(x, w8, w2, weights, ids, None, None, s8.expand(4, 2, 1))
    with pytest.raises(err, match=r"qwen.fused_moe: w2 must be \[E, N, K\]"):
        ops.fused_moe(x, w8, w8[0], weights, ids, None, None, s8, s8[0])


@torch.no_grad()
def test_references_match_transformers():
    """The references against transformers' sparse MoE blocks in float64 (the routing weights fp32
    in both): Qwen3-MoE's (top 2 of 6, renormalised) and Qwen2-MoE's (not renormalised, a shared
    expert behind a sigmoid gate)."""
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    sizes = dict(hidden_size=32, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2)
    for block, config, renormalize in [
        (Qwen3MoeSparseMoeBlock, Qwen3MoeConfig(**sizes, norm_topk_prob=True), True),
        (Qwen2MoeSparseMoeBlock, Qwen2MoeConfig(**sizes, shared_expert_intermediate_size=40), False),
    ]:
        torch.manual_seed(0)
        moe = block(config).double()
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
        x = torch.randn(1, 11, 32, dtype=torch.float64)
        h = x[0]
        weights, ids = moe_topk_softmax_reference(h @ moe.gate.weight.T, 2, renormalize)
        assert weights.dtype == torch.float32  # transformers' routing weights are fp32 too (softmax in fp32)
        shared = ()
        if renormalize is False:
            s = moe.shared_expert
            shared = (s.down_proj(torch.nn.functional.silu(s.gate_proj(h)) * s.up_proj(h)), moe.shared_expert_gate(h))
        out = fused_moe_reference(h, moe.experts.gate_up_proj, moe.experts.down_proj, weights, ids, *shared)
        assert_close(out, moe(x)[0], rel_tol=1e-6, what=block.__name__)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    """The router and the experts in one compiled function: no graph break, eager's result."""

    def moe(x, router, w13, w2, shared, gate):
        weights, ids = ops.moe_topk_softmax(x @ router.T, 2, True)
        return ops.fused_moe(x, w13, w2, weights, ids, shared, gate)

    x, w13, w2, _, _, shared, gate = _moe_inputs(7, 32, 16, 4, 2, torch.float32, device, shared=True)
    args = (x, randn(4, 32, dtype=torch.float32, device=device), w13, w2, shared, gate)
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    assert_close(compiled(*args), moe(*args), what="compiled vs eager")


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 64])
def test_router_and_experts_replay_in_cuda_graph(m):
    """Qwen3-30B-A3B's layer shape: the router and the experts captured once (the GEMV path at one
    token, the sort and grouped GEMMs at 64), replayed on new tokens that route elsewhere: the
    graph's result is eager's, bit for bit."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.empty(m, 2048, **bf)
    router = torch.randn(128, 2048, **bf) * 0.05
    w13 = torch.randn(128, 2 * 768, 2048, **bf) * 0.02
    w2 = torch.randn(128, 2048, 768, **bf) * 0.03

    def layer():
        weights, ids = ops.moe_topk_softmax(ops.linear(x, router), 8, True)
        return ops.fused_moe(x, w13, w2, weights, ids)

    x.normal_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer()
    for step in range(3):
        x.normal_()
        graph.replay()
        assert torch.equal(static_out, layer()), f"step {step}: graph replay differs from eager"
