"""Where a model runs and whether a request fits: the device and dtype a user names
(``resolve_device``, ``resolve_dtype``), the path that will run (``backend_name``), and the memory
check made before a cache is allocated (``memory_estimate``, ``check_fits``; ``DoesNotFit`` says
what would fit)."""

import os
from pathlib import Path
from typing import Dict, List, Optional, Union

import torch

from ..model.causal_lm import QwenForCausalLM
from ..model.config import QwenConfig

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


class DoesNotFit(ValueError):
    """The weights, KV cache and buffers a request needs exceed the device's memory. ``max_seq_len``:
    the longest cache (positions per sequence) that would fit the same batch, 0 if none;
    ``max_prompt``: on the PyTorch reference path, the longest prompt whose prefill fits (else None)."""

    def __init__(self, message: str, max_seq_len: int = 0, max_prompt: Optional[int] = None):
        super().__init__(message)
        self.max_seq_len, self.max_prompt = max_seq_len, max_prompt


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
    from csrc_free_ops.common import INTERPRET
    from qwen_ops.registry import runs_kernels

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


def _tensors(obj) -> List[torch.Tensor]:
    """The tensors a layer's cache object holds (attributes, and lists/tuples of them)."""
    out = []
    for v in vars(obj).values() if hasattr(obj, "__dict__") else ():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += [t for t in v if isinstance(t, torch.Tensor)]
    return out


def memory_estimate(config: QwenConfig, dtype: torch.dtype, batch: int, seq_len: int, prompt_len: int,
                    backend: str) -> Dict[str, int]:
    """Bytes a generator of ``batch`` x ``seq_len`` needs, by part: ``weights``, ``cache`` (built on
    the meta device from the model's own ``new_cache``, so any layer kind counts right), ``buffers``
    (token history, sampling scratch), ``prefill`` (activations of the longest prompt) and, on the
    PyTorch reference path, ``scores``: its attention builds the full fp32 score matrix, ~4 copies of
    heads x T x T. ``per_position``: cache + history bytes per position of ``seq_len``."""
    with torch.device("meta"):
        model = QwenForCausalLM(config)

    def cache_bytes(length: int) -> int:
        cache = model.new_cache(batch, length, dtype, "meta")
        return sum(t.numel() * t.element_size() for c in cache.layers for t in _tensors(c))

    itemsize = torch.empty(0, dtype=dtype).element_size()
    one, two = cache_bytes(1), cache_bytes(2)
    per_position = (two - one) + batch * 8  # + the int64 token history
    c = config
    parts = {
        "weights": sum(p.numel() for p in model.parameters()) * itemsize,
        "cache": (one - (two - one)) + (two - one) * seq_len,
        "buffers": batch * seq_len * 8 + batch * c.vocab_size * 4 * 3,
        "prefill": prompt_len * (c.qkv_size + 2 * c.intermediate_size + 4 * c.hidden_size) * 4 + c.vocab_size * 8,
        "scores": 0,
        "per_position": per_position,
    }
    if backend.startswith("PyTorch reference") and "full_attention" in c.layer_types:
        parts["scores"] = 4 * c.num_attention_heads * prompt_len * prompt_len * 4
    return parts


def check_fits(config: QwenConfig, device: torch.device, dtype: torch.dtype, batch: int, seq_len: int,
               prompt_len: int, weights_loaded: bool = False) -> None:
    """Raise ``DoesNotFit`` (a one-line message with the sizes and what would fit) when the weights
    (unless ``weights_loaded``), the cache of ``batch`` x ``seq_len`` positions, the buffers and the
    prefill of a ``prompt_len``-token prompt exceed ``available_memory(device)``. On CUDA the pinned
    host copy of the token history is checked against the host's memory too."""
    backend = backend_name(device, dtype)
    parts = memory_estimate(config, dtype, batch, seq_len, prompt_len, backend)
    where = str(device)
    checks = [(available_memory(device), where)]
    if device.type == "cuda":
        checks.append((available_memory(torch.device("cpu")), "the host (pinned token history)"))
    weights = 0 if weights_loaded else parts["weights"]
    need = weights + parts["cache"] + parts["buffers"] + parts["prefill"] + parts["scores"]
    free = checks[0][0]
    if free is not None and need > free:
        fixed = need - parts["per_position"] * seq_len
        fits_len = max(0, (free - fixed) // parts["per_position"]) if parts["per_position"] else 0
        max_prompt = None
        what = [f"a KV cache of {batch} x {seq_len:,} positions ({str(dtype).replace('torch.', '')}): "
                f"{_size(parts['cache'])}"]
        if weights:
            what.append(f"weights {_size(weights)}")
        if parts["scores"] > need / 100:
            what.append(f"the reference prefill's fp32 attention scores for {prompt_len:,} tokens: "
                        f"{_size(parts['scores'])}")
            room = free - (need - parts["scores"])
            heads = config.num_attention_heads
            max_prompt = max(0, int((max(room, 0) / (16 * heads)) ** 0.5)) if room > 0 else 0
        msg = f"needs {_size(need)} ({'; '.join(what)}) but {where} has {_size(free)} free"
        if parts["scores"] and parts["scores"] > free / 2:
            msg += (f": prompts of at most ~{max_prompt:,} tokens fit on the PyTorch reference path (it builds "
                    "the full score matrix; the Triton paths do not: CUDA, or TRITON_INTERPRET=1 on the CPU)")
        else:
            msg += f": at most {fits_len:,} positions per sequence fit for a batch of {batch}"
        raise DoesNotFit(msg, fits_len, max_prompt)
    host = checks[1][0] if len(checks) > 1 else None
    if host is not None and batch * seq_len * 8 > host:
        raise DoesNotFit(f"the pinned host copy of the token history ({batch} x {seq_len:,} int64) needs "
                         f"{_size(batch * seq_len * 8)} but the host has {_size(host)} free",
                         host // (8 * batch))


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
