import pytest

import qwen_ops  # noqa: F401
import torch
from qwen_ops import silu_mul_reference
from tests.helpers import DEVICES, DTYPES, assert_close, poison_allocator, randn

SHAPES = {"cpu": [(1, 2 * 48), (7, 2 * 1100)], "cuda": [(1, 2 * 3072), (255, 2 * 4864), (1000, 2 * 3584), (2, 256, 2 * 3072)]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(device, dtype):
    for shape in SHAPES[device]:
        gate_up = randn(*shape, dtype=dtype, device=device, scale=3.0)
        poison_allocator(device)
        assert_close(torch.ops.qwen.silu_mul(gate_up), silu_mul_reference(gate_up), what=f"silu_mul {shape}")
