"""What the command line writes: ``say`` (one line on stderr, never failing), stdout that survives a
closed reader, ``Writer`` (stdout piece by piece, JSON lines), the stats line (``Totals``,
``path_that_ran``)."""

from __future__ import annotations

import os
import sys
from typing import Any, Dict


def say(msg: str) -> None:
    """One line on stderr; never fails (stderr may be closed, a broken pipe, or ASCII-only)."""
    err = sys.stderr
    if err is None:
        return
    try:
        err.write(msg + "\n")
        err.flush()
    except (OSError, ValueError):
        pass


def escape_line(text: str) -> str:
    """A completion on one line: backslash, newline and carriage return written as \\\\, \\n and \\r."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def _tolerant_stdout() -> None:
    """Characters the output encoding cannot hold (PYTHONIOENCODING=ascii) print as '?' instead of
    raising UnicodeEncodeError (stderr already backslash-escapes them)."""
    out = sys.stdout
    if out is not None and getattr(out, "errors", None) == "strict" and hasattr(out, "reconfigure"):
        try:
            out.reconfigure(errors="replace")
        except (ValueError, OSError, AttributeError):
            pass


def _silence_stdout() -> None:
    """After a broken pipe: point fd 1 at /dev/null, so the interpreter's final flush is quiet."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(fd, sys.stdout.fileno())
        finally:
            os.close(fd)
    except (OSError, ValueError, AttributeError):
        pass


class Totals:
    """The stats of every generate call of a run, for the stats line."""

    def __init__(self):
        self.prompt_tokens = self.new_tokens = self.steps = 0
        self.warmup_ms = self.prefill_ms = self.decode_ms = 0.0
        self.cuda_graph = False

    def add(self, result, outputs) -> None:
        self.prompt_tokens += result.prompt_tokens
        self.new_tokens += sum(o.generated_tokens for o in outputs)
        self.prefill_ms += result.prefill_ms
        self.decode_ms += result.decode_ms
        self.steps += result.decode_steps
        self.warmup_ms += result.setup_ms
        self.cuda_graph |= result.cuda_graph

    def line(self, path: str, dtype) -> str:
        seconds = (self.prefill_ms + self.decode_ms) / 1e3
        rate = f"{self.new_tokens / seconds:.1f}" if seconds else "nan"
        per_step = self.decode_ms / self.steps if self.steps else 0.0
        return (f"prompt tokens {self.prompt_tokens} | warm-up {self.warmup_ms:.1f} ms | "
                f"prefill {self.prefill_ms:.1f} ms | decode {per_step:.2f} ms/token ({self.steps} steps) | "
                f"{self.new_tokens} new tokens, {rate} tokens/s | "
                f"cuda graph: {'yes' if self.cuda_graph else 'no'} | {path}, {str(dtype).replace('torch.', '')}")


def _kernel_launches() -> int:
    from qwen_ops import kernel_calls

    return sum(kernel_calls.values())


def path_that_ran(device, dtype, launches_before: int) -> str:
    """The ops' path, from what ran: Triton launches counted since ``launches_before``."""
    from ..generation.runtime import backend_name

    expected = backend_name(device, dtype)
    ran_triton = _kernel_launches() > launches_before
    if ran_triton == expected.startswith("Triton"):
        return expected
    if ran_triton:
        return "Triton interpreter (CPU)" if device.type == "cpu" else "Triton kernels (CUDA)"
    return f"PyTorch reference ops ({device.type.upper()})"


class Writer:
    """stdout: written and flushed piece by piece; JSON non-ASCII escaped when the encoding is not UTF."""

    def __init__(self, stream):
        self.stream = stream
        encoding = (getattr(stream, "encoding", None) or "utf-8").lower().replace("-", "").replace("_", "")
        self.utf = encoding.startswith("utf")

    def write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def json(self, obj: Dict[str, Any]) -> None:
        import json

        self.write(json.dumps(obj, ensure_ascii=not self.utf) + "\n")


def _json_output(o, batch_index: int, warmup_ms: float) -> Dict[str, Any]:
    m = o.metrics
    return {"index": o.index, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
            "stop_reason": o.stop_reason, "prompt_tokens": len(o.prompt_token_ids),
            "timings": {"batch": batch_index, "warmup_ms": round(warmup_ms, 3), "prefill_ms": round(m["prefill_ms"], 3),
                        "decode_ms": round(m["decode_ms"], 3), "decode_steps": m["decode_steps"],
                        "cuda_graph": m["cuda_graph"]}}
