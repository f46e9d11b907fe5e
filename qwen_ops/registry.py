"""The one way an op enters torch.ops.qwen: `define(reference, kernel, check, fake)`.

Every op is four plain functions with the op's own signature:

- `reference`: the plain-PyTorch math (the test oracle and the CPU path). Its type hints
  are the op's schema (`torch.library.infer_schema`), and its name minus `_reference` is
  the op's name: `rms_norm_reference` defines `torch.ops.qwen.rms_norm`.
- `kernel`: the Triton launcher (csrc_free_ops), called with the same arguments.
- `check`: metadata validation (shapes, dtypes, devices; never tensor values on CUDA),
  run before the kernel or the reference and inside the fake kernel.
- `fake`: allocates outputs of the right shapes and strides without reading data.
- `check_values` (optional): checks that read tensor values; it runs on CPU tensors only
  (free there, a host sync on CUDA, where the kernels clamp instead) and never on fake tensors.

Where an op runs (the real kernel registered for the CPU and CUDA dispatch keys):
CUDA tensors run Triton (on the tensors' device, which need not be the current one); CPU
tensors run Triton under TRITON_INTERPRET=1 (how CI
exercises the kernels) and the reference otherwise; float64 always runs the reference
(the kernels compute in fp32). The op is defined with `torch.library.Library.define` and
plain `impl` registrations: the thinnest Python path the dispatcher offers.

`kernel_calls` counts the Triton launches per op, so tests can assert which path ran.
"""
import inspect
from collections import Counter
from typing import Callable, Iterable, Optional

import torch

from csrc_free_ops.common import INTERPRET

from .checks import KERNEL_DTYPES

_lib = torch.library.Library("qwen", "FRAGMENT")

kernel_calls: Counter = Counter()
"""op name -> number of calls that took the Triton kernel (not the reference), this process."""


def use_triton(t: torch.Tensor) -> bool:
    return t.dtype in KERNEL_DTYPES and (t.is_cuda or (INTERPRET and t.device.type == "cpu"))


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype references compute in: fp32, or float64 for float64 inputs."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def define(reference: Callable, kernel: Callable, check: Callable, fake: Callable,
           mutates_args: Iterable[str] = (), dispatch_arg: int = 0, check_values: Optional[Callable] = None):
    """Register torch.ops.qwen.<name> (see the module doc) and return its OpOverload.

    `dispatch_arg`: the position of the tensor whose device and dtype pick the path.
    """
    name = reference.__name__.removesuffix("_reference")
    schema = torch.library.infer_schema(reference, mutates_args=tuple(mutates_args))
    _lib.define(name + schema)
    # The dispatcher leaves out trailing arguments equal to their defaults: put them back.
    defaults = tuple(p.default for p in inspect.signature(reference).parameters.values())

    def real(*args):
        args += defaults[len(args):]
        check(*args)
        if check_values is not None and args[dispatch_arg].device.type == "cpu":
            check_values(*args)
        t = args[dispatch_arg]
        if use_triton(t):
            kernel_calls[name] += 1
            if t.is_cuda and t.device.index != torch.cuda.current_device():
                with torch.cuda.device(t.device):  # Triton launches on the current device
                    return kernel(*args)
            return kernel(*args)
        return reference(*args)

    def fake_impl(*args):
        args += defaults[len(args):]
        check(*args)
        return fake(*args)

    _lib.impl(name, real, "CPU")
    _lib.impl(name, real, "CUDA")
    torch.library.register_fake(f"qwen::{name}", fake_impl, lib=_lib)
    return getattr(torch.ops.qwen, name).default


def last_dim_contiguous(t):
    """Kernels read rows with unit stride: gradients can arrive expanded (stride 0) or transposed."""
    return t if t is None or t.dim() == 0 or t.stride(-1) == 1 else t.contiguous()


def no_grad_placeholder(ref: torch.Tensor) -> torch.Tensor:
    """The output a backward op gives for a gradient nobody asked for: an empty tensor."""
    return ref.new_empty((0,))
