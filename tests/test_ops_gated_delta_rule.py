"""qwen::chunk_gated_delta_rule on fixed-length sequences and qwen::gated_rms_norm (Qwen3.5 Gated
DeltaNet): the chunked kernel against a float64 token-by-token recurrence, chunk boundaries (T = 63, 64, 65, 130), grouped
value heads, initial states, a prefill continued by qwen::recurrent_gated_delta_rule_varlen's decode
tokens, transformers as the oracle for the references, opcheck, CUDA graph capture of the decode
step and error messages. Packed sequences (cu_seqlens): tests/test_ops_gated_delta_rule_varlen.py."""
import inspect

import pytest
import torch
import torch.nn.functional as F

import qwen_ops  # noqa: F401
from csrc_free_ops import gated_delta_rule as gdr_kernels
from qwen_ops import QwenOpError
from qwen_ops.gated_delta_rule import (chunked_delta_rule, gated_delta_gates_reference, gated_delta_recurrence,
                                       gated_rms_norm_reference, recurrent_gated_delta_rule_varlen_reference)
from qwen_ops.registry import kernel_calls
from tests.helpers import DEVICES, DTYPES, REL_TOL, SANITIZING, assert_close, poison_allocator, randn

# ||out - fp64|| / ||fp64|| for the chunked kernel. bf16 and fp16 products and intermediates
# (W, U, V', per-chunk states) follow flash-linear-attention; on CPU the interpreter truncates
# to bf16 instead of rounding, which about triples the bf16 error.
CHUNK_TOL = {"cpu": {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 2e-5},
             "cuda": {torch.bfloat16: 1.2e-2, torch.float16: 4e-3, torch.float32: 2e-5}}


def _gdn_inputs(b, t, hk, hv, dk, dv, dtype, device, normalized_keys=True):
    """q, k, v, and the raw gate projections a, b with A_log, dt_bias (Qwen3.5-like ranges)."""
    q = randn(b, t, hk, dk, dtype=dtype, device=device)
    k = randn(b, t, hk, dk, dtype=dtype, device=device, scale=1.0 if normalized_keys else dk ** -0.5)
    v = randn(b, t, hv, dv, dtype=dtype, device=device)
    a = randn(b, t, hv, dtype=dtype, device=device)
    braw = randn(b, t, hv, dtype=dtype, device=device)
    a_log = torch.empty(hv, device=device).uniform_(0.02, 0.5).log()
    dt_bias = randn(hv, dtype=torch.float32, device=device, scale=0.5)
    return q, k, v, a, braw, a_log, dt_bias


def recurrence_fp64(q, k, v, g, beta, scale, state=None, use_qk_l2norm=True):
    """Token-by-token gated delta rule in float64, written independently of qwen_ops
    -> (o [B, T, Hv, Dv], final state [B, Hv, Dk, Dv]), both float64."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    bsz, t, hk, dk = k.shape
    hv, dv = v.shape[2:]
    q, k = (x.repeat_interleave(hv // hk, dim=2) for x in (q, k))
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    s = torch.zeros(bsz, hv, dk, dv, dtype=torch.float64, device=q.device) if state is None else state.double()
    out = []
    for i in range(t):
        s = s * torch.exp(g[:, i])[..., None, None]
        pred = torch.einsum("bhk,bhkv->bhv", k[:, i], s)
        s = s + torch.einsum("bhk,bhv->bhkv", k[:, i], beta[:, i, :, None] * (v[:, i] - pred))
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, i] * scale, s))
    o = torch.stack(out, 1) if out else torch.zeros(bsz, 0, hv, dv, dtype=torch.float64, device=q.device)
    return o, s


def chunk(q, k, v, g, beta, scale, h0=None, use_qk_l2norm=False):
    """(o, final state) of the fixed-length op, its state (a copy of h0, zeros without one) passed in place."""
    bsz, _, _, dk = k.shape
    state = (torch.zeros(bsz, v.shape[2], dk, v.shape[3], dtype=torch.float64 if q.dtype == torch.float64
                         else torch.float32, device=q.device) if h0 is None else h0.clone())
    return torch.ops.qwen.chunk_gated_delta_rule(q, k, v, g, beta, scale, state, use_qk_l2norm=use_qk_l2norm), state


# (B, T, Hk, Hv, Dk, Dv): T across chunk boundaries, grouped value heads, Dk != Dv.
CHUNK_SHAPES = {
    "cpu": [(1, 0, 1, 1, 16, 16), (1, 1, 1, 1, 16, 16), (2, 63, 1, 2, 16, 32), (1, 64, 2, 2, 32, 16),
            (1, 65, 1, 1, 32, 32), (1, 130, 1, 2, 16, 16)],
    "cuda": [(1, 2048, 16, 16, 128, 128), (2, 2048, 16, 16, 128, 128), (1, 1000, 16, 32, 128, 128),
             (3, 65, 2, 4, 64, 128), (2, 300, 2, 4, 32, 32), (1, 200, 1, 2, 64, 32), (1, 130, 1, 2, 16, 16)],
}
"""The last three cuda shapes: value heads of 32 columns or fewer, which take 8 warps where Triton
computed wrong outputs at 4 (gated_delta_rule._chunk)."""


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_fp64_recurrence(device, dtype, with_state, nan_empty):
    torch.manual_seed(0)
    tol = CHUNK_TOL[device][dtype]
    for shape in CHUNK_SHAPES[device]:
        b, t, hk, hv, dk, dv = shape
        q, k, v, a, braw, a_log, dt_bias = _gdn_inputs(*shape, dtype, device)
        g, beta = gated_delta_gates_reference(a, braw, a_log, dt_bias)
        h0 = randn(b, hv, dk, dv, dtype=torch.float32, device=device) if with_state else None
        scale = dk ** -0.5
        poison_allocator(device)
        calls = kernel_calls["chunk_gated_delta_rule"]
        o, final = chunk(q, k, v, g, beta, scale, h0, True)
        assert kernel_calls["chunk_gated_delta_rule"] == calls + 1, "the Triton kernel did not run"
        assert o.dtype == dtype and final.dtype == torch.float32
        if h0 is None:  # no state at all: the same outputs as from a zero state
            assert torch.equal(torch.ops.qwen.chunk_gated_delta_rule(q, k, v, g, beta, scale, use_qk_l2norm=True), o)
        if SANITIZING:
            assert torch.isfinite(o).all() and torch.isfinite(final).all()
            continue
        ref_o, ref_s = recurrence_fp64(q, k, v, g, beta, scale, h0)
        assert_close(o, ref_o, tol, what=f"chunk o {shape}")
        assert_close(final, ref_s, tol, what=f"chunk final state {shape}")
        if device == "cpu":
            op_ref_o, op_ref_s = chunked_delta_rule(q, k, v, g, beta, scale, h0, True)
            assert_close(o, op_ref_o.to(torch.float64), tol, what=f"chunk o vs op reference {shape}")
            assert_close(final, op_ref_s, tol, what=f"chunk state vs op reference {shape}")


@pytest.mark.parametrize("device", DEVICES)
def test_chunk_without_l2norm_and_other_scale(device):
    torch.manual_seed(1)
    shape = (2, 70, 1, 2, 32, 16) if device == "cpu" else (1, 700, 16, 16, 128, 128)
    b, t, hk, hv, dk, dv = shape
    q, k, v, a, braw, a_log, dt_bias = _gdn_inputs(*shape, torch.float32, device, normalized_keys=False)
    g, beta = gated_delta_gates_reference(a, braw, a_log, dt_bias)
    o, final = chunk(q, k, v, g, beta, 0.3)
    ref_o, ref_s = recurrence_fp64(q, k, v, g, beta, 0.3, use_qk_l2norm=False)
    assert_close(o, ref_o, 1e-4, what="chunk o, no l2norm")
    assert_close(final, ref_s, 1e-4, what="chunk state, no l2norm")


@pytest.mark.parametrize("device", DEVICES)
def test_chunk_strided_inputs(device):
    """q, k, v as slices of one fused [B, T, 2 Hk Dk + Hv Dv] activation (the conv output)."""
    torch.manual_seed(2)
    b, t, hk, hv, dk, dv = 1, 70, 1, 2, 16, 32
    qkv = randn(b, t, 2 * hk * dk + hv * dv, dtype=torch.float32, device=device)
    q = qkv[..., :hk * dk].view(b, t, hk, dk)
    k = qkv[..., hk * dk:2 * hk * dk].view(b, t, hk, dk)
    v = qkv[..., 2 * hk * dk:].view(b, t, hv, dv)
    gb = randn(b, t, 2 * hv, dtype=torch.float32, device=device)
    g, beta = F.logsigmoid(gb[..., :hv] + 2), gb[..., hv:].sigmoid()
    o, final = chunk(q, k, v, g, beta, dk ** -0.5, None, True)
    ref_o, ref_s = recurrence_fp64(q, k, v, g, beta, dk ** -0.5)
    assert_close(o, ref_o, 2e-5, what="strided chunk o")
    assert_close(final, ref_s, 2e-5, what="strided chunk state")


def test_chunk_reference_is_the_recurrence_in_float64():
    """The op's reference (chunked) equals the token recurrence; float64 runs the reference."""
    torch.manual_seed(3)
    shape = (2, 130, 1, 2, 16, 16)
    q, k, v, a, braw, a_log, dt_bias = _gdn_inputs(*shape, torch.float64, "cpu")
    g, beta = gated_delta_gates_reference(a, braw, a_log, dt_bias)
    h0 = torch.randn(2, 2, 16, 16, dtype=torch.float64)
    calls = kernel_calls["chunk_gated_delta_rule"]
    o, final = chunk(q, k, v, g, beta, 0.25, h0, True)
    assert kernel_calls["chunk_gated_delta_rule"] == calls
    ref_o, ref_s = recurrence_fp64(q, k, v, g, beta, 0.25, h0)
    assert_close(o, ref_o, 1e-10, what="reference o")
    assert_close(final, ref_s, 1e-10, what="reference state")
    rec_o, rec_s = gated_delta_recurrence(q, k, v, g, beta, 0.25, h0, True)
    assert_close(rec_o, ref_o, 1e-12, what="gated_delta_recurrence o")
    assert_close(rec_s, ref_s, 1e-12, what="gated_delta_recurrence state")


def decode_step(b, n, device, continues=True):
    """(cu_seqlens, state_slots, continues) of B packed sequences of n tokens each, sequence i on
    state slot i: a decode step of the batch rows of a fixed-length op's [B, ...] state."""
    return (torch.arange(0, b * n + 1, n, dtype=torch.int32, device=device), torch.arange(b, device=device),
            torch.full((b,), continues, dtype=torch.bool, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefix", [64, 65])
def test_chunk_prefix_then_recurrent_steps_equals_chunk_on_whole(device, dtype, prefix):
    """Prefill the first `prefix` tokens with the chunked op, decode the rest with the packed
    recurrent op continuing the prefill's final state (the B sequences packed, one token each, then
    two, then one at a time): the outputs and the final state match the chunked op over the whole
    sequence."""
    torch.manual_seed(5)
    shape = (1, 69, 1, 2, 16, 32) if device == "cpu" else (2, 69, 16, 16, 128, 128)
    b, t, hk, hv, dk, dv = shape
    q, k, v, a, braw, a_log, dt_bias = _gdn_inputs(*shape, dtype, device)
    g, beta = gated_delta_gates_reference(a, braw, a_log, dt_bias)
    scale = dk ** -0.5
    h0 = randn(b, hv, dk, dv, dtype=torch.float32, device=device)
    o_all, s_all = chunk(q, k, v, g, beta, scale, h0, True)
    o_pre, state = chunk(q[:, :prefix], k[:, :prefix], v[:, :prefix], g[:, :prefix], beta[:, :prefix], scale, h0, True)
    outs, i = [o_pre], prefix
    while i < t:
        n = 2 if i == prefix + 1 else 1
        rows = [x[:, i:i + n].flatten(0, 1) for x in (q, k, v, a, braw)]
        o = torch.ops.qwen.recurrent_gated_delta_rule_varlen(*rows, a_log, dt_bias, state, *decode_step(b, n, device),
                                                             scale)
        outs.append(o.view(b, n, hv, dv))
        i += n
    tol = CHUNK_TOL[device][dtype]
    ref_o, ref_s = recurrence_fp64(q, k, v, g, beta, scale, h0)
    assert_close(torch.cat(outs, 1), ref_o, tol, what="prefix + recurrent steps vs fp64")
    assert_close(torch.cat(outs, 1), o_all.double(), tol, what="prefix + recurrent steps vs chunk on whole")
    assert_close(state, ref_s, tol, what="state after the steps vs fp64")
    assert_close(state, s_all, tol, what="state after the steps vs chunk on whole")


@pytest.mark.parametrize("device", DEVICES)
def test_several_value_blocks(device, monkeypatch, nan_empty):
    """Value columns split over four programs of 16 (the interpreter otherwise gives one program all
    of Dv): the state, recurrent and output kernels each read and write their own block's columns
    of v, the state and o, prefill (two chunks, an initial state) then a decode step (the packed
    recurrent op continuing the prefill's state)."""
    monkeypatch.setattr(gdr_kernels, "_value_block", lambda dk, dv, programs, target: 16)
    monkeypatch.setattr(gdr_kernels, "_output_value_block", lambda dv: 16)
    torch.manual_seed(7)
    shape = (1, 66, 1, 2, 16, 64)
    b, t, hk, hv, dk, dv = shape
    q, k, v, a, braw, a_log, dt_bias = _gdn_inputs(*shape, torch.float32, device)
    g, beta = gated_delta_gates_reference(a, braw, a_log, dt_bias)
    h0 = randn(b, hv, dk, dv, dtype=torch.float32, device=device)
    pre = slice(0, t - 1)
    o, state = chunk(q[:, pre], k[:, pre], v[:, pre], g[:, pre], beta[:, pre], dk ** -0.5, h0, True)
    o_step = torch.ops.qwen.recurrent_gated_delta_rule_varlen(q[:, -1], k[:, -1], v[:, -1], a[:, -1], braw[:, -1],
                                                              a_log, dt_bias, state, *decode_step(b, 1, device),
                                                              dk ** -0.5)
    ref_o, ref_s = recurrence_fp64(q, k, v, g, beta, dk ** -0.5, h0)
    tol = CHUNK_TOL[device][torch.float32]
    assert_close(torch.cat([o, o_step[:, None]], 1), ref_o, tol, what="o over four value blocks")
    assert_close(state, ref_s, tol, what="state over four value blocks")


@pytest.mark.parametrize("device", DEVICES)
def test_gated_rms_norm_rounds_the_weight_product(device):
    """With a 16-bit weight of x's dtype the weight product is rounded to that dtype before the
    gate, as transformers computes it: fp16 (which the interpreter rounds as torch does) agrees
    with the reference to a few elements of one ulp, far below the one rounding left out."""
    x = randn(64, 128, dtype=torch.float16, device=device, scale=3.0)
    z = randn(64, 128, dtype=torch.float16, device=device, scale=2.0)
    w = randn(128, dtype=torch.float16, device=device)
    assert_close(torch.ops.qwen.gated_rms_norm(x, z, w, 1e-6), gated_rms_norm_reference(x, z, w, 1e-6), 5e-5,
                 what="gated_rms_norm fp16 weight")


NORM_SHAPES = {"cpu": [(3, 2, 16), (5, 32), (1, 1, 2, 128)], "cuda": [(2048, 16, 128), (1, 16, 128), (7, 3, 64)]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp32_weight", [False, True])
def test_gated_rms_norm_matches_reference(device, dtype, fp32_weight, nan_empty):
    """bf16 on the CPU interpreter truncates at each of three roundings (the normalised x, the weight
    product, the output), errors of one sign: ||error|| / ||y|| reaches 1.6e-2 over seeds, hence three
    times the bf16 bound there (test_gated_rms_norm_rounds_the_weight_product pins the roundings)."""
    torch.manual_seed(8)
    tol = REL_TOL[dtype] * (3 if dtype == torch.bfloat16 and device == "cpu" else 1)
    for shape in NORM_SHAPES[device]:
        x = randn(*shape, dtype=dtype, device=device, scale=3.0)
        z = randn(*shape, dtype=dtype, device=device, scale=2.0)
        w = randn(shape[-1], dtype=torch.float32 if fp32_weight else dtype, device=device)
        poison_allocator(device)
        calls = kernel_calls["gated_rms_norm"]
        y = torch.ops.qwen.gated_rms_norm(x, z, w, 1e-6)
        assert kernel_calls["gated_rms_norm"] == calls + 1, "the Triton kernel did not run"
        assert_close(y, gated_rms_norm_reference(x, z, w, 1e-6), tol, what=f"gated_rms_norm {shape}")


@pytest.mark.parametrize("device", DEVICES)
def test_gated_rms_norm_strided_gate(device):
    """z as a head-reshaped slice of a wider projection (read in place: token and head strides),
    x [tokens, heads, D] contiguous; then both strided in 4-d [B, T, H, D] with heads padded."""
    zz = randn(6, 3 * 48, dtype=torch.float32, device=device)
    z = zz[:, 16:].view(6, 4, 32)
    x = randn(6, 4, 32, dtype=torch.float32, device=device)
    w = randn(32, dtype=torch.float32, device=device)
    assert_close(torch.ops.qwen.gated_rms_norm(x, z, w, 1e-6), gated_rms_norm_reference(x, z, w, 1e-6),
                 what="strided gate")
    x4 = randn(2, 3, 5, 40, dtype=torch.float32, device=device)[:, :, 1:, 8:]
    z4 = randn(3, 2, 4, 32, dtype=torch.float32, device=device).transpose(0, 1)
    assert_close(torch.ops.qwen.gated_rms_norm(x4, z4, w, 1e-6), gated_rms_norm_reference(x4, z4, w, 1e-6),
                 what="strided 4-d x and z")


# ----------------------------------------------------------------------------- transformers as the oracle


def _hf():
    return pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
@pytest.mark.parametrize("with_state", [False, True])
def test_references_match_transformers(use_qk_l2norm, with_state):
    """transformers' torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule (which scale q
    by Dk^-0.5) against our references (the recurrent one: the packed op's, the B sequences packed),
    fp32, grouped value heads, T across chunk boundaries."""
    m = _hf()
    hf_chunk = inspect.unwrap(m.torch_chunk_gated_delta_rule)
    hf_recurrent = inspect.unwrap(m.torch_recurrent_gated_delta_rule)
    torch.manual_seed(6)
    for shape in [(2, 1, 1, 2, 16, 8), (1, 70, 2, 4, 16, 32), (1, 128, 1, 1, 8, 8)]:
        b, t, hk, hv, dk, dv = shape
        q, k, v, a, braw, a_log, dt_bias = _gdn_inputs(*shape, torch.float32, "cpu", normalized_keys=use_qk_l2norm)
        g, beta = gated_delta_gates_reference(a, braw, a_log, dt_bias)
        h0 = torch.randn(b, hv, dk, dv) if with_state else None
        scale = dk ** -0.5
        ours = chunked_delta_rule(q, k, v, g, beta, scale, h0, use_qk_l2norm)
        hf = hf_chunk(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                      use_qk_l2norm_in_kernel=use_qk_l2norm)
        assert_close(ours[0], hf[0], 1e-5, what=f"chunk reference o vs transformers {shape}")
        assert_close(ours[1], hf[1], 1e-5, what=f"chunk reference state vs transformers {shape}")
        pool = h0.clone() if with_state else torch.full((b, hv, dk, dv), float("nan"))  # not read: fresh
        o = recurrent_gated_delta_rule_varlen_reference(*(x.flatten(0, 1) for x in (q, k, v, a, braw)), a_log, dt_bias,
                                                        pool, *decode_step(b, t, "cpu", with_state), scale,
                                                        use_qk_l2norm)
        hf = hf_recurrent(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                          use_qk_l2norm_in_kernel=use_qk_l2norm)
        assert_close(o.view(b, t, hv, dv), hf[0], 1e-5, what=f"recurrent reference o vs transformers {shape}")
        assert_close(pool, hf[1], 1e-5, what=f"recurrent reference state vs transformers {shape}")


def test_kernel_matches_transformers_chunk():
    """One direct comparison of the Triton kernel (CPU interpreter) with transformers."""
    m = _hf()
    hf_chunk = inspect.unwrap(m.torch_chunk_gated_delta_rule)
    torch.manual_seed(7)
    shape = (1, 66, 1, 2, 16, 16)
    q, k, v, a, braw, a_log, dt_bias = _gdn_inputs(*shape, torch.float32, "cpu")
    g, beta = gated_delta_gates_reference(a, braw, a_log, dt_bias)
    h0 = torch.randn(1, 2, 16, 16)
    o, s = chunk(q, k, v, g, beta, 16 ** -0.5, h0, True)
    hf = hf_chunk(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_close(o, hf[0], 1e-5, what="kernel o vs transformers")
    assert_close(s, hf[1], 1e-5, what="kernel state vs transformers")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gates_and_gated_norm_match_transformers(dtype):
    """g, beta as Qwen3_5GatedDeltaNet.forward computes them; gated_rms_norm as Qwen3_5RMSNormGated
    with a weight in the model's dtype (a loaded checkpoint) and in fp32."""
    m = _hf()
    torch.manual_seed(8)
    a, braw = randn(2, 3, 4, dtype=dtype, device="cpu"), randn(2, 3, 4, dtype=dtype, device="cpu")
    a_log, dt_bias = torch.rand(4).log().to(dtype), randn(4, dtype=dtype, device="cpu")
    g, beta = gated_delta_gates_reference(a, braw, a_log, dt_bias)
    assert torch.equal(g, -a_log.float().exp() * F.softplus(a.float() + dt_bias))
    assert torch.equal(beta, braw.sigmoid())
    x, z = randn(6, 32, dtype=dtype, device="cpu", scale=3.0), randn(6, 32, dtype=dtype, device="cpu")
    for wdtype in (dtype, torch.float32):
        norm = m.Qwen3_5RMSNormGated(32, eps=1e-6).to(wdtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(32))
        want = norm(x, z)
        got = gated_rms_norm_reference(x, z, norm.weight.detach(), 1e-6)
        assert got.dtype == want.dtype and torch.equal(got, want), f"gated norm, weight {wdtype}"


def test_qwen3_5_config_heads():
    """The default Qwen3_5TextConfig has more value heads than key heads (grouped); the ops take that."""
    cfg = pytest.importorskip("transformers.models.qwen3_5.configuration_qwen3_5").Qwen3_5TextConfig()
    assert cfg.linear_num_value_heads % cfg.linear_num_key_heads == 0
    assert cfg.linear_key_head_dim in (16, 32, 64, 128, 256) and cfg.linear_value_head_dim in (16, 32, 64, 128, 256)


# ------------------------------------------------------------------------------------ contract


def _samples(device):
    torch.manual_seed(9)
    q, k, v, a, braw, a_log, dt_bias = _gdn_inputs(2, 5, 1, 2, 16, 16, torch.float32, device)
    g, beta = gated_delta_gates_reference(a, braw, a_log, dt_bias)
    state = randn(2, 2, 16, 16, dtype=torch.float32, device=device)
    x = randn(2, 5, 2, 16, dtype=torch.float32, device=device)
    return {
        "chunk_gated_delta_rule": [(q, k, v, g, beta, 0.25, state, None, None, None, True), (q, k, v, g, beta, 0.25)],
        "gates": (a, braw, a_log, dt_bias),
        "gated_rms_norm": [(x, randn(2, 5, 2, 16, dtype=torch.float32, device=device),
                            randn(16, dtype=torch.float32, device=device), 1e-6)],
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["chunk_gated_delta_rule", "gated_rms_norm"])
def test_opcheck(device, name):
    for args in _samples(device)[name]:
        torch.library.opcheck(getattr(torch.ops.qwen, name).default, args)


def test_compile_fullgraph_prefill_then_decode():
    """A prefill, then a decode token per sequence (the packed recurrent op) continuing the
    prefill's final state in place, then the gated norm."""
    s = _samples("cpu")
    q, k, v, g, beta = s["chunk_gated_delta_rule"][1][:5]
    a, braw, a_log, dt_bias = s["gates"]
    z, w = s["gated_rms_norm"][0][1:3]
    step = decode_step(2, 1, "cpu")

    def f(q, k, v, g, beta, a, braw):
        st = q.new_zeros(2, 2, 16, 16)
        o = torch.ops.qwen.chunk_gated_delta_rule(q, k, v, g, beta, 0.25, st, use_qk_l2norm=True)
        o1 = torch.ops.qwen.recurrent_gated_delta_rule_varlen(q[:, -1], k[:, -1], v[:, -1], a[:, -1], braw[:, -1],
                                                              a_log, dt_bias, st, *step, 0.25)
        return torch.ops.qwen.gated_rms_norm(o + o1[:, None], z, w, 1e-6), st

    want = f(q, k, v, g, beta, a, braw)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, g, beta, a, braw)
    assert_close(got[0], want[0], what="compiled output")
    assert_close(got[1], want[1], what="compiled state")


def _bad_chunk(**over):
    args = dict(q=torch.randn(1, 4, 2, 16), k=torch.randn(1, 4, 2, 16), v=torch.randn(1, 4, 4, 16),
                g=torch.randn(1, 4, 4), beta=torch.rand(1, 4, 4), scale=0.25, state=None)
    args.update(over)
    return tuple(args.values())


ERRORS = [
    ("chunk_gated_delta_rule", lambda: _bad_chunk(v=torch.randn(1, 4, 3, 16)), "multiple of k's 2"),
    ("chunk_gated_delta_rule", lambda: _bad_chunk(k=torch.randn(1, 4, 2, 12), q=torch.randn(1, 4, 2, 12)),
     "k head dim 12 is not supported"),
    ("chunk_gated_delta_rule", lambda: _bad_chunk(k=torch.randn(1, 5, 2, 16)), "same shape"),
    ("chunk_gated_delta_rule", lambda: _bad_chunk(g=torch.randn(1, 4, 2)), "g must have shape"),
    ("chunk_gated_delta_rule", lambda: _bad_chunk(v=torch.randn(1, 4, 4, 16, dtype=torch.bfloat16)), "v has dtype"),
    ("chunk_gated_delta_rule", lambda: _bad_chunk(state=torch.randn(1, 4, 16, 16, dtype=torch.bfloat16)),
     "state must be torch.float32"),
    ("chunk_gated_delta_rule", lambda: _bad_chunk(state=torch.randn(1, 2, 16, 16)), "state must have shape"),
    ("chunk_gated_delta_rule", lambda: (*_bad_chunk(), None, torch.tensor([0])), "state_slots is for packed sequences"),
    ("gated_rms_norm", lambda: (torch.randn(2, 8), torch.randn(2, 7), torch.randn(8), 1e-6), "z has shape"),
    ("gated_rms_norm", lambda: (torch.randn(2, 8), torch.randn(2, 8), torch.randn(7), 1e-6), "weight has 7"),
]


@pytest.mark.parametrize("name,make,match", ERRORS)
def test_errors_name_the_argument(name, make, match):
    with pytest.raises(QwenOpError, match=f"qwen.{name}: .*{match}"):
        getattr(torch.ops.qwen, name)(*make())


# ------------------------------------------------------------------------------------------ CUDA graph


@pytest.mark.cuda
def test_recurrent_step_replays_in_cuda_graph():
    """The decode step (the packed conv and recurrent rule, one token per sequence continuing its
    state slots, then the gated norm) captured once, replayed with new inputs and states, equals
    eager."""
    torch.manual_seed(10)
    dev, bf = "cuda", torch.bfloat16
    b, hk, hv, d, c = 2, 16, 16, 128, 3 * 16 * 128
    st = {"x": torch.empty(b, c, device=dev, dtype=bf), "a": torch.empty(b, hv, device=dev, dtype=bf),
          "b": torch.empty(b, hv, device=dev, dtype=bf), "z": torch.empty(b, hv, d, device=dev, dtype=bf),
          "conv": torch.empty(b, c, 3, device=dev, dtype=bf), "state": torch.empty(b, hv, d, d, device=dev)}
    conv_w = torch.randn(c, 4, device=dev, dtype=bf) * 0.5
    a_log, dt_bias = torch.rand(hv, device=dev).log(), torch.randn(hv, device=dev)
    norm_w = torch.randn(d, device=dev, dtype=bf)
    packed = decode_step(b, 1, dev)

    def step():
        mixed = torch.ops.qwen.causal_conv1d(st["x"], conv_w, st["conv"], *packed)
        q = mixed[:, :hk * d].view(b, hk, d)
        k = mixed[:, hk * d:2 * hk * d].view(b, hk, d)
        v = mixed[:, 2 * hk * d:].view(b, hv, d)
        o = torch.ops.qwen.recurrent_gated_delta_rule_varlen(q, k, v, st["a"], st["b"], a_log, dt_bias, st["state"],
                                                             *packed, d ** -0.5)
        return torch.ops.qwen.gated_rms_norm(o, st["z"], norm_w, 1e-6)

    def fill(seed):
        gen = torch.Generator(device=dev).manual_seed(seed)
        for name, t in st.items():
            t.copy_(torch.randn(t.shape, generator=gen, device=dev))

    fill(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile every kernel outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (1, 2, 3):
        fill(seed)
        saved = {n: t.clone() for n, t in st.items()}
        graph.replay()
        replayed, states = out.clone(), (st["conv"].clone(), st["state"].clone())
        for n, t in saved.items():
            st[n].copy_(t)
        eager = step()
        assert torch.equal(replayed, eager)
        assert torch.equal(states[0], st["conv"]) and torch.equal(states[1], st["state"])
