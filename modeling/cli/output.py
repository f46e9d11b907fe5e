"""What the command line writes: ``Writer`` (stdout piece by piece, JSON lines), the stats line
(``Totals``, ``path_that_ran``). One line on stderr is ``modeling.api.commands.say``."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional


def escape_line(text: str) -> str:
    """A completion on one line: backslash, newline and carriage return written as \\\\, \\n and \\r."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


class Totals:
    """The stats of a run's completions, for the stats line; ``cuda_graph``: whether the engine's
    steps replay CUDA graphs."""

    def __init__(self, device, dtype, cuda_graph: bool):
        self.device, self.dtype, self.cuda_graph = device, dtype, cuda_graph
        self.launches = _kernel_launches()
        self.requests = self.prompt_tokens = self.new_tokens = self.decode_tokens = 0
        self.first_token_ms = self.decode_ms = 0.0
        self.start, self.end = math.inf, -math.inf  # the first arrival, the last finish

    def add(self, output) -> None:
        """A finished ``RequestOutput``."""
        m = output.metrics
        self.requests += 1
        self.prompt_tokens += len(output.prompt_token_ids)
        new = sum(generated_tokens(c) for c in output.outputs)
        self.new_tokens += new
        self.start, self.end = min(self.start, m.arrival_time), max(self.end, m.finished_time)
        if m.first_token_time is not None:
            self.first_token_ms += (m.first_token_time - m.arrival_time) * 1e3
            if new > len(output.outputs):  # decode steps after the first token
                self.decode_ms += (m.finished_time - m.first_token_time) * 1e3
                self.decode_tokens += new / len(output.outputs) - 1

    def line(self) -> str:
        seconds = (self.end - self.start) if self.requests else 0.0
        rate = f"{self.new_tokens / seconds:.1f}" if seconds else "nan"
        first = self.first_token_ms / self.requests if self.requests else 0.0
        per_token = self.decode_ms / self.decode_tokens if self.decode_tokens else 0.0
        path = path_that_ran(self.device, self.dtype, self.launches)
        return (f"prompt tokens {self.prompt_tokens} | first token {first:.1f} ms | decode {per_token:.2f} ms/token | "
                f"{self.new_tokens} new tokens, {rate} tokens/s | cuda graph: {'yes' if self.cuda_graph else 'no'} | "
                f"{path}, {str(self.dtype).replace('torch.', '')}")


def generated_tokens(completion) -> int:
    """Tokens the model produced for a ``CompletionOutput``, a stop token (EOS, a stop token id) included."""
    return len(completion.token_ids) + (completion.finish_reason == "stop" and not isinstance(completion.stop_reason,
                                                                                          str))


def _kernel_launches() -> int:
    from qwen_ops import kernel_calls

    return sum(kernel_calls.values())


def path_that_ran(device, dtype, launches_before: int) -> str:
    """The ops' path, from what ran: Triton launches counted since ``launches_before``."""
    from ..model.device import backend_name

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


def json_output(o, index: int, logprobs: Optional[int], completion: int = 0) -> Dict[str, Any]:
    """Completion ``completion`` of a finished prompt (``RequestOutput`` ``o``, prompt ``index``) as a
    JSON object (``"completion"``: its number among the prompt's ``n``, given when there are several;
    with ``logprobs`` k, each token's log-probability and the k most likely tokens')."""
    c, m = o.outputs[completion], o.metrics
    obj = {"index": index, **({"completion": completion} if len(o.outputs) > 1 else {}), "text": c.text,
           "token_ids": c.token_ids, "finish_reason": c.finish_reason,
           "stop_reason": c.stop_reason, "prompt_tokens": len(o.prompt_token_ids),
           "timings": {"first_token_ms": round((m.first_token_time - m.arrival_time) * 1e3, 3)
                       if m.first_token_time is not None else None,
                       "total_ms": round((m.finished_time - m.arrival_time) * 1e3, 3)}}
    if c.logprobs is not None:
        obj["logprobs"] = [{"token_id": token, "logprob": entry[token].logprob,
                            "top_logprobs": [{"token_id": t, "logprob": lp.logprob}
                                             for t, lp in list(entry.items())[:logprobs]]}
                           for token, entry in zip(c.token_ids, c.logprobs)]
    return obj
