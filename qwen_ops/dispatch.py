"""Where an op runs: the Triton kernel or the PyTorch reference.

CUDA tensors run Triton. CPU tensors run Triton under TRITON_INTERPRET=1 (how CI
exercises the kernels) and the reference otherwise. float64 always runs the
reference: the kernels compute in fp32.
"""
import torch

from csrc_free_ops.triton_helpers import INTERPRET

from .checks import KERNEL_DTYPES


def use_triton(t: torch.Tensor) -> bool:
    return t.dtype in KERNEL_DTYPES and (t.is_cuda or (INTERPRET and t.device.type == "cpu"))


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype references compute in: fp32, or float64 for float64 inputs."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32
