"""Input validation shared by the real and the fake kernels: metadata only, never data."""
import torch

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Dtypes the Triton kernels take; float64 runs the PyTorch reference (for float64 checks)."""
FLOAT_DTYPES = KERNEL_DTYPES + (torch.float64,)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256
HEAD_DIMS = tuple(range(16, MAX_HEAD_DIM + 1, 16))
"""Head dims the attention, decode attention, fused QKV and Gated DeltaNet kernels take (and
modeling.config accepts): every multiple of 16 up to 256. A power of two is the kernels' block
exactly; any other is masked inside the next power of two (csrc_free_ops.common.head_block)."""
HEAD_DIMS_TEXT = f"multiples of 16 up to {MAX_HEAD_DIM}"
"""HEAD_DIMS in words, for error messages."""


class QwenOpError(ValueError):
    """Bad input to a torch.ops.qwen op; the message names the op and the argument."""


def fail(op: str, msg: str):
    raise QwenOpError(f"qwen.{op}: {msg}")


def check_float(op: str, name: str, t: torch.Tensor, ndim: int | None = None, min_ndim: int = 1):
    if t.dtype not in FLOAT_DTYPES:
        fail(op, f"{name} must be bfloat16, float16, float32 or float64, got {t.dtype}")
    dim = t.dim()
    if ndim is not None and dim != ndim:
        fail(op, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dim < min_ndim:
        fail(op, f"{name} must have at least {min_ndim} dims, got shape {tuple(t.shape)}")
    if dim and t.stride(-1) != 1 and t.shape[-1] > 1:
        fail(op, f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def check_index(op: str, name: str, t: torch.Tensor, shape: tuple):
    if t.dtype not in INDEX_DTYPES:
        fail(op, f"{name} must be int32 or int64, got {t.dtype}")
    if t.shape != tuple(shape):  # torch.Size is a tuple
        fail(op, f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_same(op: str, ref_name: str, ref: torch.Tensor, **others):
    """Every tensor in `others` (None skipped) sits on ref's device and, if floating, has ref's dtype."""
    for name, t in others.items():
        if t is None:
            continue
        if t.device != ref.device:
            fail(op, f"{name} is on {t.device} but {ref_name} is on {ref.device}")
        if t.is_floating_point() and t.dtype != ref.dtype:
            fail(op, f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}")


def check_head_dim(op: str, d: int, name: str = "head_dim"):
    """d is in HEAD_DIMS; `name` is what the error calls it."""
    if d not in HEAD_DIMS:
        fail(op, f"{name} {d} is not supported (supported: {HEAD_DIMS_TEXT})")


def check_like(op: str, ref_name: str, ref: torch.Tensor, **others):
    """Every tensor in `others` is a float tensor (last dim contiguous) with ref's shape, device and dtype."""
    for name, t in others.items():
        check_float(op, name, t)
        check_same(op, ref_name, ref, **{name: t})
        if t.shape != ref.shape:
            fail(op, f"{name} has shape {tuple(t.shape)} but {ref_name} has {tuple(ref.shape)}")
