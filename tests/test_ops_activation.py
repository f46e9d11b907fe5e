import pytest

import qwen_ops  # noqa: F401
import torch
from qwen_ops import gated_delta_gates_reference, sigmoid_mul_reference, silu_mul_reference
from tests.helpers import DEVICES, DTYPES, assert_close, poison_allocator, randn

SHAPES = {"cpu": [(1, 2 * 48), (7, 2 * 1100)], "cuda": [(1, 2 * 3072), (255, 2 * 4864), (1000, 2 * 3584), (2, 256, 2 * 3072)]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(device, dtype):
    for shape in SHAPES[device]:
        gate_up = randn(*shape, dtype=dtype, device=device, scale=3.0)
        poison_allocator(device)
        assert_close(torch.ops.qwen.silu_mul(gate_up), silu_mul_reference(gate_up), what=f"silu_mul {shape}")


def _gated_q(device, dtype, b=2, t=3, h=4, d=32):
    """o [B, T, H, D] and the gate as a strided view of a fused q projection (per head [query | gate])."""
    qg = randn(b, t, h * 2 * d + 8, dtype=dtype, device=device, scale=3.0)[..., : h * 2 * d].view(b, t, h, 2 * d)
    return randn(b, t, h, d, dtype=dtype, device=device, scale=2.0), qg[..., d:]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_mul_matches_reference(device, dtype):
    x, gate = _gated_q(device, dtype)
    assert gate.stride(-2) == 64 and not gate.is_contiguous()  # read in place, no copy
    cases = [(x, gate), (x[:, :, 0], gate[:, :, 0]), (x[0, 0, 0], gate[0, 0, 0]),
             (randn(5, 300, dtype=dtype, device=device), randn(5, 300, dtype=dtype, device=device, scale=4.0))]
    for xs, gs in cases:
        poison_allocator(device)
        out = torch.ops.qwen.sigmoid_mul(xs, gs)
        assert out.is_contiguous() and out.dtype == dtype
        assert_close(out, sigmoid_mul_reference(xs, gs), what=f"sigmoid_mul {tuple(xs.shape)}")
    empty = torch.empty(0, 4, dtype=dtype, device=device)
    assert torch.ops.qwen.sigmoid_mul(empty, empty).shape == (0, 4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_delta_gates_match_reference(device, dtype):
    """a, b: strided views of a fused projection, as the Gated DeltaNet layer passes them; a spans
    softplus's threshold (a + dt_bias > 20)."""
    h = 6
    proj = randn(2, 5, 40 + 2 * h, dtype=dtype, device=device, scale=8.0)
    b, a = proj[..., 40 : 40 + h], proj[..., 40 + h :]
    a[0, 0] = 25.0
    A_log, dt_bias = randn(h, dtype=dtype, device=device), randn(h, dtype=dtype, device=device)
    g, beta = torch.ops.qwen.gated_delta_gates(a, b, A_log, dt_bias)
    g_ref, beta_ref = gated_delta_gates_reference(a, b, A_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype and g.shape == beta.shape == a.shape
    assert_close(g, g_ref, rel_tol=1e-6, what="g")
    assert_close(beta, beta_ref, rel_tol={torch.float32: 1e-6}.get(dtype), what="beta")


@pytest.mark.parametrize("device", DEVICES)
def test_gate_ops_opcheck(device):
    x, gate = _gated_q(device, torch.float32)
    torch.library.opcheck(torch.ops.qwen.sigmoid_mul.default, (x, gate))
    proj = randn(2, 3, 16, dtype=torch.float32, device=device)
    args = (proj[..., 8:12], proj[..., 12:], randn(4, dtype=torch.float32, device=device),
            randn(4, dtype=torch.float32, device=device))
    torch.library.opcheck(torch.ops.qwen.gated_delta_gates.default, args)


def test_gate_ops_errors():
    x = torch.randn(2, 8)
    with pytest.raises(qwen_ops.QwenOpError, match="qwen.sigmoid_mul: gate has shape"):
        torch.ops.qwen.sigmoid_mul(x, x[:, :4])
    with pytest.raises(qwen_ops.QwenOpError, match="qwen.sigmoid_mul: gate has dtype"):
        torch.ops.qwen.sigmoid_mul(x, x.double())
    with pytest.raises(qwen_ops.QwenOpError, match="qwen.gated_delta_gates: dt_bias has 3 elements"):
        torch.ops.qwen.gated_delta_gates(x, x, torch.randn(8), torch.randn(3))
