"""What a completion gives back: ``RequestOutput``, and its text as the tokens arrive (``TextRow``:
incremental detokenization, then ``StopStrings``)."""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from ..generation.sampling import SamplingParams
from .tokenizer import IncrementalDetokenizer, QwenTokenizer


@dataclass
class RequestOutput:
    """One completion. ``prompt``: the prompt's text (None for a prompt given as token ids);
    ``text``: the new text (without the stop string that ended it); ``token_ids``: the new token
    ids (without a stop token; with the token that completed a stop string); ``finish_reason``:
    ``"stop"`` (EOS, a stop token id or a stop string), ``"length"`` (``max_tokens``, or the cache
    full) or ``"abort"`` (the stream was closed, or ``cancel`` set, before the end);
    ``stop_reason``: the stop string that ended it, else None. ``metrics``: the timings of the
    ``Generator.generate`` call it ran in (``prefill_ms``, ``decode_ms``, ``decode_steps``,
    ``setup_ms``: graph warm-up and capture, ``cuda_graph``). ``outputs`` is ``[self]``, so code
    written for vLLM's ``RequestOutput.outputs[0].text`` works."""

    index: int
    prompt: Optional[str]
    prompt_token_ids: List[int]
    text: str
    token_ids: List[int]
    finish_reason: str
    stop_reason: Optional[str] = None
    metrics: Dict[str, Any] = field(default_factory=dict)

    @property
    def outputs(self) -> List["RequestOutput"]:
        return [self]

    @property
    def generated_tokens(self) -> int:
        """Tokens the model produced for it, a stop token included."""
        return len(self.token_ids) + (self.finish_reason == "stop" and self.stop_reason is None)

    def to_dict(self) -> Dict[str, Any]:
        return {"index": self.index, "text": self.text, "token_ids": list(self.token_ids),
                "finish_reason": self.finish_reason, "stop_reason": self.stop_reason,
                "prompt_tokens": len(self.prompt_token_ids), "metrics": dict(self.metrics)}


class StopStrings:
    """Text pieces in, the text to emit out, up to the first stop string. What could still be the
    start of a stop string is held back until the next piece shows it is not."""

    def __init__(self, stop: Sequence[str]):
        self.stop = tuple(stop)
        self.pending = ""
        self.matched: Optional[str] = None

    def push(self, piece: str) -> str:
        if self.matched is not None:
            return ""
        self.pending += piece
        if not self.stop:
            out, self.pending = self.pending, ""
            return out
        hits = [(i, s) for s in self.stop for i in [self.pending.find(s)] if i >= 0]
        if hits:
            i, self.matched = min(hits, key=lambda h: (h[0], -len(h[1])))
            out, self.pending = self.pending[:i], ""
            return out
        keep = max((k for s in self.stop for k in range(min(len(s) - 1, len(self.pending)), 0, -1)
                    if self.pending.endswith(s[:k])), default=0)
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.matched is not None else self.pending), ""
        return out


class TextRow:
    """One completion's text as its tokens arrive: incremental detokenization, then ``StopStrings``
    (public for ``modeling.serve``, which builds a completion's text the same way)."""

    def __init__(self, tokenizer: QwenTokenizer, params: SamplingParams):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.stops = StopStrings(params.stop)
        self.pieces: List[str] = []

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def push(self, token: int) -> str:
        out = self.stops.push(self.detok.push(token))
        self.pieces.append(out)
        return out

    def finish(self) -> str:
        out = self.stops.push(self.detok.flush())
        out += self.stops.flush()
        self.pieces.append(out)
        return out
