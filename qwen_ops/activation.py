"""qwen::silu_mul: gate_up [..., 2I] -> silu(gate_up[..., :I]) * gate_up[..., I:]  [..., I]."""
import torch
import torch.nn.functional as F
from torch import Tensor

from csrc_free_ops import activation as kernels

from .checks import check_float, fail
from .dispatch import acc_dtype, use_triton


def silu_mul_reference(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.to(acc_dtype(gate_up)).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def _check(gate_up: Tensor):
    check_float("silu_mul", "gate_up", gate_up)
    if gate_up.shape[-1] % 2:
        fail("silu_mul", f"gate_up's last dim must be even (gate and up halves), got {gate_up.shape[-1]}")


@torch.library.custom_op("qwen::silu_mul", mutates_args=())
def silu_mul(gate_up: Tensor) -> Tensor:
    _check(gate_up)
    if use_triton(gate_up):
        return kernels.silu_mul(gate_up)
    return silu_mul_reference(gate_up)


@silu_mul.register_fake
def _(gate_up):
    _check(gate_up)
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))
