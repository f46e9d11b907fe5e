"""FP8 ops: the per-token-group activation quantisation (bit-exact against its reference), the
block-scaled linear's two kinds of math (weight-only at M <= 16, quantised activations above),
each against the reference that takes the same rule, the checkpoint-format helpers, opcheck and
errors. The `cuda` cases run Qwen3-8B's projections (hidden 4096, intermediate 12288, 32 q / 8 kv
heads of 128: qkv 6144 x 4096, o_proj 4096 x 4096, gate_up 24576 x 4096, down 4096 x 12288)."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import qwen_ops
from csrc_free_ops import fp8 as fp8_kernels
from csrc_free_ops.common import widen_e4m3
from csrc_free_ops.linear import DecodeConfig
from qwen_ops import (dequantize_weight_fp8_block, fp8_block_linear_reference, fp8_quantize_per_token_group_reference,
                      quantize_weight_fp8_block)
from qwen_ops.fp8 import BLOCK, DECODE_MAX_M, FP8_MAX
from tests.helpers import (DEVICES, DTYPES, ROOT, assert_close, opcheck_without_schema_test, padded, poison_allocator,
                           randn, rel_err)

QWEN3_8B = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}

# (M, K, N): the weight-only rows (M <= 16) first, then the quantised-activation GEMM; K and N
# not multiples of 128 (partial blocks) on purpose.
CASES = {
    "cpu": [(1, 200, 136), (3, 72, 100), (16, 256, 130), (17, 200, 136), (130, 96, 260)],
    "cuda": [(1, 4096, 6144), (4, 12288, 4096), (16, 1000, 300), (17, 4096, 4096), (300, 1000, 700),
             (2048, 4096, 24576)],
}
W8A8_FP32_TOL = 5e-4
"""The quantised-activation GEMM's fp32 outputs against the exact reference on Hopper: its FP8 dots
keep fewer mantissa bits than fp32 while they sum a block (1.3e-4 measured on an H100 at M 17,
K 4096, N 4096), where the fp32 tolerance of the other ops is 2e-5."""
QUANT_SHAPES = {"cpu": [(1, 128), (3, 200), (17, 72), (130, 256), (2, 3, 40)],
                "cuda": [(1, 4096), (4096, 4096), (17, 1000), (4096, 12288)]}


def fp8_weight(n, k, device, scale_dtype=torch.float32):
    """A random [N, K] weight (std K^-0.5) in the checkpoint format: (weight fp8, weight_scale_inv)."""
    w, s = quantize_weight_fp8_block(randn(n, k, dtype=torch.float32, device=device, scale=k ** -0.5))
    return w, s.to(scale_dtype)


def assert_same_fp8(q, ref, what):
    assert q.dtype == ref.dtype == torch.float8_e4m3fn and q.shape == ref.shape, what
    diff = (q.view(torch.uint8) != ref.view(torch.uint8)).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} fp8 values differ, first at {tuple(diff[0].tolist())}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_matches_reference_exactly(device, dtype):
    """Scales and fp8 bytes equal the reference's, groups spanning six decades of magnitude,
    partial last groups, leading dims, rows apart (a column slice), and a group of 64."""
    for shape in QUANT_SHAPES[device]:
        k = shape[-1]
        x = (randn(*shape, dtype=torch.float32, device=device) * torch.logspace(-4, 2, k, device=device)).to(dtype)
        if shape[0] == 17:  # rows apart: a column slice of a wider tensor
            x = torch.cat([x, x[:, :24]], dim=1)[:, :k]
        for group in (128, 64) if len(shape) == 2 and shape[0] == 3 else (128,):
            poison_allocator(device)
            q, s = torch.ops.qwen.fp8_quantize_per_token_group(x, group)
            q_ref, s_ref = fp8_quantize_per_token_group_reference(x, group)
            assert s.shape == (*shape[:-1], -(-k // group)) and s.dtype == torch.float32
            torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
            assert_same_fp8(q, q_ref, f"q {shape} group {group}")


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_rounds_to_nearest_even(device):
    """A group whose amax is 448 (scale 1) keeps the other values as they are rounded: a carry into
    the exponent (124.35 -> 128, 15.5 -> 16), ties to even (8.5 -> 8, 9.5 -> 10), subnormals
    (multiples of 2^-9, 1.5 x 2^-9 a tie), signed zeros (-0.0, and -1e-5 rounded to zero); an
    all-zero group takes scale EPS / 448 and zeros."""
    row = [448.0, 124.35, 15.5, 8.5, 9.5, 232.0, -0.0029, 0.0029296875, -1e-5, 0.0146, 0.0157, 240.0, 447.0,
           -448.0, 0.0, -0.0]
    x = torch.tensor([row, [0.0] * 16], device=device)
    q, s = torch.ops.qwen.fp8_quantize_per_token_group(x, 16)
    q_ref, s_ref = fp8_quantize_per_token_group_reference(x, 16)
    assert_same_fp8(q, q_ref, "rounding")
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    assert s[0, 0] == 1.0 and s[1, 0] == torch.tensor(fp8_kernels.EPS) / FP8_MAX
    assert q[0, :6].float().tolist() == [448.0, 128.0, 16.0, 8.0, 10.0, 224.0]
    assert q[0, 6:8].float().tolist() == [-0.001953125, 0.00390625]
    assert torch.signbit(q[0, [8, 15]].float()).all() and not torch.signbit(q[0, 14].float())
    assert not q[1].float().any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_block_linear_matches_reference(device, dtype, bias):
    """Above 16 rows on the GPU, fp32 outputs get W8A8_FP32_TOL: FP8 tensor cores do not accumulate a
    block's 128 products in full fp32."""
    for m, k, n in CASES[device]:
        x = randn(m, k, dtype=dtype, device=device)
        w, s = fp8_weight(n, k, device)
        b = randn(n, dtype=dtype, device=device) if bias else None
        poison_allocator(device)
        tol = W8A8_FP32_TOL if device == "cuda" and dtype == torch.float32 and m > DECODE_MAX_M else None
        assert_close(torch.ops.qwen.fp8_block_linear(x, w, s, b), fp8_block_linear_reference(x, w, s, b), tol,
                     what=f"fp8_block_linear M{m} K{k} N{n}")


def test_reference_math_on_each_side_of_16_rows():
    """M <= 16: x @ dequant(weight).T, x as it is; M > 16: x quantised per token and group of 128
    first. The same rows give different results on either side."""
    x = randn(DECODE_MAX_M + 1, 200, dtype=torch.float32, device="cpu")
    w, s = fp8_weight(136, 200, "cpu")
    wf = dequantize_weight_fp8_block(w, s)
    q, sx = fp8_quantize_per_token_group_reference(x)
    xq = q.float() * sx.repeat_interleave(BLOCK, 1)[:, :200]
    decode, prefill = fp8_block_linear_reference(x[:DECODE_MAX_M], w, s), fp8_block_linear_reference(x, w, s)
    torch.testing.assert_close(decode, x[:DECODE_MAX_M] @ wf.t())
    torch.testing.assert_close(prefill, xq @ wf.t())
    assert not torch.allclose(decode, prefill[:DECODE_MAX_M], rtol=1e-4, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_block_linear_leading_dims_bf16_scales_and_strided_operands(device):
    """x [2, 3, K] and [2, 10, K] (both paths) and column slices of a wider x (rows 232 apart), a
    bf16 weight_scale_inv, and a weight that is a column slice of a wider tensor (its row stride
    is not K)."""
    wide, s = fp8_weight(100, 200, device, scale_dtype=torch.bfloat16)
    w = torch.cat([wide, wide[:, :16]], dim=1)[:, :200]
    assert w.stride(0) == 216
    xs = [randn(2, t, 200, dtype=torch.bfloat16, device=device) for t in (3, 10)]
    xs += [randn(m, 232, dtype=torch.bfloat16, device=device)[:, :200] for m in (5, 20)]
    for x in xs:
        out = torch.ops.qwen.fp8_block_linear(x, w, s)
        assert out.shape == (*x.shape[:-1], 100) and out.dtype == torch.bfloat16
        assert_close(out, fp8_block_linear_reference(x, w, s), what=f"x {tuple(x.shape)} strides {x.stride()}")


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_weight_only_every_split(device, split_k):
    """K = 600 (five blocks, the last partial) in 1, 2 or 3 slices of whole blocks (5; 3 + 2;
    2 + 2 + 1), with bias, sums to the reference."""
    x = randn(5, 600, dtype=torch.float32, device=device)
    w, s = fp8_weight(40, 600, device)
    b = randn(40, dtype=torch.float32, device=device)
    y = padded(5, 40, device=device)
    fp8_kernels.weight_only_matmul(x, w, s, b, y, DecodeConfig(16, BLOCK, split_k))
    assert_close(y, fp8_block_linear_reference(x, w, s, b), what=f"split_k={split_k}")


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
def test_w8a8_tiles_and_wrong_configs(device):
    """GEMM tiles narrower than a weight block (16 x 16) and wider (256 columns: two blocks' scales
    in one tile) give the reference; a config of the wrong kind for M is an error."""
    x = randn(40, 300, dtype=torch.bfloat16, device=device)
    w, s = fp8_weight(300, 300, device)
    ref = fp8_block_linear_reference(x, w, s)
    stages = 1 if device == "cpu" else 2
    for tiles in (fp8_kernels.PrefillTiles(16, 16, 4, stages), fp8_kernels.PrefillTiles(32, 256, 4, stages)):
        assert_close(fp8_kernels.block_linear(x, w, s, None, tiles), ref, what=str(tiles))
    with pytest.raises(ValueError, match="PrefillTiles for M = 3"):
        fp8_kernels.block_linear(x[:3], w, s, None, fp8_kernels.PrefillTiles(16, 16))
    with pytest.raises(ValueError, match="DecodeConfig for M = 40"):
        fp8_kernels.block_linear(x, w, s, None, DecodeConfig(16, BLOCK, 1))


@triton.jit
def _widen_kernel(w_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, widen_e4m3(tl.load(w_ptr + offs), out_ptr.dtype.element_ty))


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_widen_e4m3_is_exact(device, dtype):
    """`widen_e4m3` (how the FP8 GEMVs widen weight tiles; bit moves to bf16 on the GPU) on every
    finite e4m3 value, signed zeros and subnormals included: PyTorch's conversion, bit for bit."""
    codes = torch.arange(256, dtype=torch.uint8, device=device)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # the two NaN codes: 1.0 instead
    w = codes.view(torch.float8_e4m3fn)
    out = torch.empty(256, dtype=dtype, device=device)
    _widen_kernel[(1,)](w, out, N=256)
    bits = torch.int16 if dtype.itemsize == 2 else torch.int32
    wrong = (out.view(bits) != w.to(dtype).view(bits)).nonzero().flatten()
    assert wrong.numel() == 0, f"{wrong.numel()} codes widen wrongly, first {int(codes[wrong[0]]):#04x}"


def test_weight_format_round_trip():
    """quantize_weight_fp8_block: Qwen's checkpoint format (fp8 weight, fp32 weight_scale_inv of one
    value per 128 x 128 block, partial blocks at the edges), each block's largest magnitude 448;
    dequantised, within e4m3's rounding of the original."""
    w = randn(300, 200, dtype=torch.bfloat16, device="cpu")
    w[:128, 128:] *= 1e-3  # blocks of other magnitudes keep their own relative error
    q, s = quantize_weight_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (300, 200)
    assert s.dtype == torch.float32 and s.shape == (3, 2)
    amax = F.pad(q.float().abs(), (0, 56, 0, 84)).view(3, 128, 2, 128).amax(dim=(1, 3))
    assert (amax == FP8_MAX).all()
    back = dequantize_weight_fp8_block(q, s, torch.bfloat16)
    assert back.dtype == torch.bfloat16
    assert rel_err(back, w) < 3e-2 and rel_err(back[:128, 128:], w[:128, 128:]) < 3e-2
    torch.testing.assert_close(dequantize_weight_fp8_block(q, s), q.float() * s.repeat_interleave(128, 0)[:300]
                               .repeat_interleave(128, 1)[:, :200])


def _samples(device):
    w, s = fp8_weight(40, 200, device)
    return {
        "fp8_quantize_per_token_group": [(randn(3, 200, dtype=torch.float32, device=device), 128),
                                         (randn(2, 2, 40, dtype=torch.bfloat16, device=device), 32)],
        "fp8_block_linear": [(randn(3, 200, dtype=torch.float32, device=device), w, s, None),
                             (randn(20, 200, dtype=torch.bfloat16, device=device), w, s.bfloat16(),
                              randn(40, dtype=torch.bfloat16, device=device))],
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["fp8_quantize_per_token_group", "fp8_block_linear"])
def test_opcheck(device, name):
    """opcheck; for fp8_block_linear without its schema test, which cannot compare float8 inputs
    (`opcheck_without_schema_test`)."""
    op = getattr(torch.ops.qwen, name).default
    for args in _samples(device)[name]:
        if name == "fp8_quantize_per_token_group":
            torch.library.opcheck(op, args)
        else:
            opcheck_without_schema_test(op, args)


def _linear_args(n=4, k=8, weight=None, scale=None, bias=None, x=None):
    w, s = quantize_weight_fp8_block(torch.randn(n, k))
    return (torch.randn(2, k) if x is None else x, w if weight is None else weight, s if scale is None else scale,
            bias)


ERRORS = [
    ("fp8_quantize_per_token_group", lambda: (torch.randn(2, 8), 100), "group_size must be a power of two"),
    ("fp8_quantize_per_token_group", lambda: (torch.randn(2, 0), 128), "x's last dim"),
    ("fp8_quantize_per_token_group", lambda: (torch.randint(0, 3, (2, 8)), 128), "x must be bfloat16"),
    ("fp8_block_linear", lambda: _linear_args(weight=torch.randn(4, 8)), "weight must be float8_e4m3fn"),
    ("fp8_block_linear", lambda: _linear_args(scale=torch.ones(1, 1, dtype=torch.float16)),
     "weight_scale_inv must be float32 or bfloat16"),
    ("fp8_block_linear", lambda: _linear_args(n=130, scale=torch.ones(1, 1)),
     "weight_scale_inv must have shape (2, 1)"),
    ("fp8_block_linear", lambda: _linear_args(x=torch.randn(2, 9)), "x's last dim is 9"),
    ("fp8_block_linear", lambda: _linear_args(bias=torch.randn(5)), "bias has 5 elements"),
    ("fp8_block_linear", lambda: _linear_args(bias=torch.randn(4).half()), "bias has dtype torch.float16"),
    ("fp8_block_linear", lambda: _linear_args(weight=torch.zeros(4, 8, 1, dtype=torch.float8_e4m3fn)),
     "weight must be [N, K]"),
]


@pytest.mark.parametrize("name,make_args,message", ERRORS, ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_bad_input_raises_clear_error(name, make_args, message):
    escaped = message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    with pytest.raises(qwen_ops.QwenOpError, match=f"qwen.{name}: .*" + escaped):
        getattr(torch.ops.qwen, name)(*make_args())


@pytest.mark.cuda
def test_device_mismatch_names_the_argument():
    x, w, s, _ = _linear_args()
    with pytest.raises(qwen_ops.QwenOpError, match="weight is on cpu but x is on cuda"):
        torch.ops.qwen.fp8_block_linear(x.cuda(), w, s.cuda())
    with pytest.raises(qwen_ops.QwenOpError, match="weight_scale_inv is on cpu but x is on cuda"):
        torch.ops.qwen.fp8_block_linear(x.cuda(), w.cuda(), s)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 4096])
@pytest.mark.parametrize("name", list(QWEN3_8B))
def test_qwen3_8b_projections(name, m):
    """Qwen3-8B's projections in bf16 at decode (M = 1, weight-only) and at 4096 tokens: the kernel
    within bf16's 1e-2 of its reference, and the FP8 result within 5e-2 of the bf16 weight's."""
    n, k = QWEN3_8B[name]
    x = randn(m, k, dtype=torch.bfloat16, device="cuda")
    w_bf16 = randn(n, k, dtype=torch.bfloat16, device="cuda", scale=k ** -0.5)
    w, s = quantize_weight_fp8_block(w_bf16)
    out = torch.ops.qwen.fp8_block_linear(x, w, s)
    assert_close(out, fp8_block_linear_reference(x, w, s), rel_tol=1e-2, what=f"{name} M{m}")
    assert rel_err(out, F.linear(x.float(), w_bf16.float())) < 5e-2, name


HOPPER_PTX = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from csrc_free_ops import fp8, moe

def ptx(kernel, pointers, constexprs, arch, **options):
    names = kernel.fn.arg_names
    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
    src = ASTSource(kernel.fn, sig, {(names.index(n),): v for n, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options).asm["ptx"]

quantize = ptx(fp8._quantize_kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32"),
               dict(GROUP=128, BLOCK_M=16), 90, num_warps=4)
gemm = dict(q_ptr="*fp8e4nv", sx_ptr="*fp32", w_ptr="*fp8e4nv", sw_ptr="*fp32", b_ptr="*bf16", y_ptr="*bf16")
tiles = dict(HAS_BIAS=True, EVEN_K=True, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8)
hopper = ptx(fp8._w8a8_kernel, gemm, tiles, 90, num_warps=4, num_stages=3)
ada = ptx(fp8._w8a8_kernel, gemm, tiles, 89, num_warps=4, num_stages=3)
gemv = ptx(fp8._weight_only_kernel, dict(x_ptr="*bf16", w_ptr="*fp8e4nv", sw_ptr="*fp32", b_ptr="*bf16",
                                          out_ptr="*fp32"),
           dict(SPLIT_K=2, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128), 90, num_warps=4, num_stages=4)
print("quantize rounds to nearest even:", "cvt.rn.satfinite.e4m3x2.f32" in quantize)
print("quantize divides exactly:", "div.rn.f32" in quantize and "div.full" not in quantize)
print("w8a8 takes FP8 wgmma on sm_90:", ".f32.e4m3.e4m3" in hopper and "wgmma.mma_async" in hopper)
print("w8a8 takes FP8 mma on sm_89:", ".f32.e4m3.e4m3.f32" in ada and "mma.sync" in ada)
print("the GEMV widens FP8 to bf16 tensor-core operands:", ".f32.bf16.bf16.f32" in gemv and "mma.sync" in gemv)
print("the GEMV widens FP8 by bit moves, not through fp16 and fp32:", "mul.rn.bf16x2" in gemv and "e4m3x2" not in gemv
      and "cvt.rn.bf16" not in gemv)
experts = ptx(moe._grouped_gemm_kernel, dict(a_ptr="*bf16", w_ptr="*fp8e4nv", ws_ptr="*fp32", c_ptr="*bf16",
                                             topk_w_ptr="*fp32", sorted_ptr="*i32", expert_ids_ptr="*i32",
                                             post_ptr="*i32"),
              dict(SILU_MUL=True, MUL_WEIGHT=False, FP8_W=True, EVEN_K=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64,
                   GROUP_M=8), 90, num_warps=4, num_stages=3)
print("the FP8 experts' GEMM widens FP8 to bf16 wgmma operands:", ".f32.bf16.bf16" in experts
      and "wgmma.mma_async" in experts)
"""


def test_kernels_compile_for_hopper_and_ada():
    """No GPU needed: the kernels compiled for sm_90 (and the GEMM for sm_89, the first arch with FP8
    tensor cores) take the instructions the interpreter cannot show: the quantisation's IEEE
    division and round-to-nearest-even e4m3 conversion (what makes it bit-exact against PyTorch),
    the GEMM's FP8 tensor-core dot, the GEMV's bf16 one (its e4m3 tiles widened by `widen_e4m3`'s bit
    moves, none of the conversion unit's instructions), and the FP8 experts' grouped GEMM (64-deep
    steps within a weight block) Hopper's bf16 wgmma."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = subprocess.run([sys.executable, "-c", HOPPER_PTX], env=env, capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == 7 and all(line.endswith(" True") for line in lines), \
        out.stdout + out.stderr
