"""The private Triton and PyTorch APIs the fast paths use, the versions they were tested on, and the
switch to the public paths.

Triton (``TRITON``):
- a compiled kernel's C launcher (``run`` with ``function`` and ``packed_metadata``), which
  `launch.Kernel` calls for a specialization it has seen (public path: ``JITFunction.run``, Triton's
  own launch, every call);
- ``triton.runtime._allocation``'s current allocator, which the TMA GEMM reads to set its scratch
  allocator only where none is set (public path: `set_allocator_unless_set` always sets it).

PyTorch (``TORCH``, read by ``qwen_ops.registry`` and ``qwen_ops.plans``):
- the dispatch key sets and the below-autograd guard of the registry's lean autograd kernel
  (public path: ``torch.library.register_autograd``);
- ``torch.utils._python_dispatch.TorchDispatchMode`` and the current device and raw stream getters
  of launch plans (public path: no plans, each op call runs its checks and launcher).

Each is used where the installed version lies in the range it was tested on; another version takes
the public paths, with one warning. ``QWEN_PRIVATE_APIS=0`` in the environment forces the public
paths, ``QWEN_PRIVATE_APIS=1`` the private ones (read at import).
"""
import os
import re
import warnings

import torch
import triton

TRITON_TESTED = ((3, 5), (3, 9))
"""The Triton versions (major, minor), first and last, the private Triton paths were tested on."""
TORCH_TESTED = ((2, 9), (2, 13))
"""The PyTorch versions (major, minor), first and last, the private PyTorch paths were tested on."""


def major_minor(version: str) -> tuple:
    """(major, minor) of a version string such as '3.9.0' or '2.13.0+cpu'."""
    parts = re.findall(r"\d+", version)[:2]
    return tuple(int(p) for p in parts) + (0,) * (2 - len(parts))


def usable(version: str, tested: tuple, forced=None) -> bool:
    """Whether a private path is taken: ``forced`` ('0' or '1', as QWEN_PRIVATE_APIS) decides,
    else whether version lies in the tested range."""
    if forced in ("0", "1"):
        return forced == "1"
    return tested[0] <= major_minor(version) <= tested[1]


_forced = os.environ.get("QWEN_PRIVATE_APIS")
TRITON = usable(triton.__version__, TRITON_TESTED, _forced)
TORCH = usable(torch.__version__, TORCH_TESTED, _forced)
for _name, _version, _tested, _usable in (("Triton", triton.__version__, TRITON_TESTED, TRITON),
                                          ("PyTorch", torch.__version__, TORCH_TESTED, TORCH)):
    if _forced is None and not _usable:
        warnings.warn(f"{_name} {_version} is outside the versions {'.'.join(map(str, _tested[0]))} to "
                      f"{'.'.join(map(str, _tested[1]))} the fast paths were tested on: kernels launch through "
                      f"{_name}'s public APIs (more host time per op call); QWEN_PRIVATE_APIS=1 forces the fast paths",
                      stacklevel=2)


def compiled_launcher(compiled):
    """(run, function, packed_metadata) of a compiled Triton kernel, or None where the private
    path is off or the kernel lacks them (then every launch goes through Triton)."""
    if not TRITON:
        return None
    try:
        return compiled.run, compiled.function, compiled.packed_metadata
    except AttributeError:
        return None


def set_allocator_unless_set(allocator) -> None:
    """Make ``allocator`` Triton's allocator for kernel scratch (TMA descriptors built on the device)
    unless one is set already (Inductor sets its own); where the private check is off, always."""
    if TRITON:
        from triton.runtime import _allocation
        if _allocation._allocator.get() is not _allocation._NULL_ALLOCATOR:
            return
    triton.set_allocator(allocator)
