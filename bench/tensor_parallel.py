"""Tensor parallelism's rows of ``python -m bench.decode --tp N`` and ``python -m bench.throughput
--tp N``: a random bf16 checkpoint of Qwen3-8B's shape (written once under ``--checkpoints``),
loaded by ``LLM(..., tensor_parallel_size=size)`` for size 1 (the single-GPU default path, the
persistent kernel included) and N (N GPUs, N - 1 worker processes), measured in the same run:

- batch-1 decode at context 256 (``bench.decode.ours_ms``): ``qwen3_8b_b1_ms_tp{size}`` and
  ``qwen3_8b_b1_tp{N}_over_tp1``;
- offline throughput in nano-vllm's shape (``bench.throughput``'s workload and engine settings):
  ``qwen3_8b_throughput_tokens_per_s_tp{size}`` and ``qwen3_8b_throughput_tp{N}_over_tp1``.
"""
import os
from pathlib import Path
from typing import Callable, Dict, Sequence

import torch

from bench.fp8 import MODELS
from modeling.model.random_checkpoint import build_random_checkpoint, is_complete

DEFAULT_ROOT = Path(os.environ.get("TMPDIR", "/tmp")) / "qwen-tp-bench"
"""Where the random checkpoint is written (``--checkpoints``)."""


def checkpoint(root: Path, fields: Dict = MODELS["qwen3-8b"]) -> Path:
    """The random bf16 checkpoint of ``fields`` (config.json fields) under ``root``, built once."""
    path = Path(root) / "qwen3-8b"
    if not is_complete(path):
        build_random_checkpoint(path, vocab_size=fields["vocab_size"], tokenizer="words", dtype=torch.bfloat16,
                                std=0.02, **{k: v for k, v in fields.items() if k != "vocab_size"})
    return path


def _per_size(path: Path, sizes: Sequence[int], measure: Callable, device: str, dtype) -> Dict[int, float]:
    """``measure(llm)`` with the checkpoint loaded at each tensor-parallel size (one at a time)."""
    from bench.throughput import free_device_memory
    from modeling import LLM

    out = {}
    for size in sizes:
        llm = LLM(path, device=device, dtype=dtype, tensor_parallel_size=size, progress=False)
        try:
            out[size] = measure(llm)
        finally:
            llm.close()
            del llm
            if device == "cuda":
                free_device_memory()
    return out


def _keys(value: str, ratio: str, values: Dict[int, float]) -> Dict[str, float]:
    """``{value}_tp{size}`` for each size, and ``{ratio}_tp{size}_over_tp1`` beside size 1's."""
    out = {f"{value}_tp{size}": v for size, v in values.items()}
    out.update({f"{ratio}_tp{size}_over_tp1": v / values[1] for size, v in values.items() if size != 1 and 1 in values})
    return out


def decode_rows(path: Path, sizes: Sequence[int], steps: int, context: int = 256, device: str = "cuda",
                dtype=torch.bfloat16) -> Dict[str, float]:
    """Batch-1 decode ms per token at each size (see the module doc)."""
    from bench.decode import ours_ms

    return _keys("qwen3_8b_b1_ms", "qwen3_8b_b1", _per_size(
        path, sizes, lambda llm: ours_ms(llm.model, 1, context, steps, workers=llm.workers), device, dtype))


def throughput_rows(path: Path, sizes: Sequence[int], requests: int, device: str = "cuda", dtype=torch.bfloat16,
                    engine_args: Dict = None) -> Dict[str, float]:
    """Offline output tokens/s at each size, after a warm-up run of the same workload."""
    from bench.throughput import ENGINE, run_all, workload
    from modeling import Engine, SamplingParams

    def measure(llm) -> float:
        engine = Engine(llm.model, workers=llm.workers, **(engine_args or ENGINE))
        work = workload(requests, llm.model.config.vocab_size)
        run_all(engine, work, SamplingParams())
        return run_all(engine, work, SamplingParams())

    return _keys("qwen3_8b_throughput_tokens_per_s", "qwen3_8b_throughput",
                 _per_size(path, sizes, measure, device, dtype))
