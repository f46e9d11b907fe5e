"""Where a model runs: the device and dtype a user names (``resolve_device``, ``resolve_dtype``),
the path its ops take there (``backend_name``), the memory the device has free
(``available_memory``) and whether a checkpoint's weights fit it (``check_weights_fit``)."""

import os
from pathlib import Path
from typing import Optional, Union

import torch

from qwen_ops.registry import INTERPRET, runs_kernels

from .config import QwenConfig
from .files import format_size
from .tensor_parallel import SINGLE, TensorParallel

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


class DoesNotFit(MemoryError):
    """The weights, or the cache of one full-length sequence, exceed the device's free memory; the
    message says what was asked for and what is free."""


def resolve_device(spec: Union[str, torch.device, None] = None) -> torch.device:
    """``cuda``, ``cuda:N``, ``cpu`` (or a ``torch.device``); None: CUDA if available. ``ValueError``
    for anything else, a CUDA index that does not exist, or CUDA without a CUDA device."""
    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    text = str(spec)
    kind, _, index = text.partition(":")
    if kind not in ("cuda", "cpu") or (index and not index.isdigit()) or (":" in text and not index):
        raise ValueError(f"device must be cuda, cuda:N or cpu, got {text!r}")
    if kind == "cpu":
        if index and int(index) != 0:
            raise ValueError(f"device {text}: the CPU has no index (use cpu)")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device {text}: no CUDA device is available")
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise ValueError(f"device {text}: there {'is' if count == 1 else 'are'} {count} CUDA device"
                         f"{'' if count == 1 else 's'} (cuda:0{'' if count == 1 else f' to cuda:{count - 1}'})")
    return torch.device("cuda", int(index)) if index else torch.device("cuda", torch.cuda.current_device())


def resolve_dtype(dtype: Union[str, torch.dtype, None], device: torch.device) -> torch.dtype:
    """None: bf16 on CUDA, fp32 on the CPU; a ``torch.dtype`` or bf16 / fp16 / fp32 (or their long names).
    ``torch.float64`` is accepted too: it always runs the PyTorch reference ops (exact, for tests)."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values() and dtype != torch.float64:  # float64: the reference ops, for tests
            raise ValueError(f"dtype must be bfloat16, float16, float32 (or float64), got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def backend_name(device: torch.device, dtype: torch.dtype) -> str:
    """Where the ops run: "Triton kernels (CUDA)", "Triton interpreter (CPU)" (TRITON_INTERPRET=1)
    or "PyTorch reference ops (CPU)" (see qwen_ops.registry)."""
    where = device.type.upper()
    if not runs_kernels(device.type, dtype):
        return f"PyTorch reference ops ({where})"
    return f"Triton interpreter ({where})" if INTERPRET else f"Triton kernels ({where})"


def available_memory(device: torch.device) -> Optional[int]:
    """Bytes free on the device (CUDA: ``mem_get_info``; CPU: MemAvailable, capped by the cgroup's
    limit), or None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            free = None
    try:  # cgroup v2: a container's limit
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            room = max(0, int(limit) - used)
            free = room if free is None else min(free, room)
    except (OSError, ValueError):
        pass
    return free


def weight_bytes(config: QwenConfig, dtype: torch.dtype, fp8: bool = False, parallel: TensorParallel = SINGLE) -> int:
    """Bytes of the model's parameters in ``dtype`` (a tensor-parallel rank's: its shards); with
    ``fp8``, the layers' linear weights and experts at one byte each (``modeling.model.fp8``: the
    scales add 1/16384 of that)."""
    from .causal_lm import QwenForCausalLM
    from .loader import fp8_targets

    with torch.device("meta"):
        model = QwenForCausalLM(config, parallel)
    narrow = fp8_targets(config) if fp8 else set()
    return sum(p.numel() * (1 if name in narrow else dtype.itemsize) for name, p in model.named_parameters())


def check_weights_fit(config: QwenConfig, device: torch.device, dtype: torch.dtype, fp8: bool = False,
                      parallel: TensorParallel = SINGLE) -> None:
    """``DoesNotFit`` when the weights alone (``parallel``: the rank's shards) exceed the device's
    free memory (checked before reading them); ``fp8``: the linear weights and experts are FP8
    (``weight_bytes``)."""
    need, free = weight_bytes(config, dtype, fp8, parallel), available_memory(device)
    if free is not None and need > free:
        kind = str(dtype).replace("torch.", "") + (", linear weights and experts in FP8" if fp8 else "")
        raise DoesNotFit(f"the weights need {format_size(need)} ({kind}) but {device} "
                         f"has {format_size(free)} free")
