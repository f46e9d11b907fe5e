"""What a completion gives back: ``RequestOutput``, and its text as the tokens arrive (``TextRow``:
incremental detokenization, then ``StopStrings``)."""

from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Dict, List, Optional, Sequence, Tuple

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
    start of a stop string is held back until the next piece shows it is not.

    A push finds, in the held-back text and the new piece, the match that starts first (at one
    place, the longest). The stop strings are one Aho-Corasick automaton (``_automaton``, built
    once per tuple of stop strings), so a push costs the length of its piece plus at most the
    longest stop string, whatever their number; the text held back is never longer than the
    longest stop string minus one."""

    def __init__(self, stop: Sequence[str]):
        self.stop = tuple(stop)
        self.pending = ""
        self.matched: Optional[str] = None
        self._automaton = _automaton(self.stop) if self.stop else None
        self._node = 0  # the automaton's state: the node that spells ``pending``

    def push(self, piece: str) -> str:
        if self.matched is not None:
            return ""
        if self._automaton is None:
            return piece
        goto, fail, depth, out = self._automaton
        text, base, node = self.pending + piece, len(self.pending), self._node
        start, found = len(text), None  # the best match so far: its start, its stop string
        for end, c in enumerate(piece, base + 1):
            while node and c not in goto[node]:
                node = fail[node]
            node = goto[node].get(c, 0)
            s = out[node]  # the longest stop string ending here: the earliest start of those that do
            if s is not None and (end - len(s), -len(s)) < (start, -len(found or "")):
                start, found = end - len(s), s
            if found is not None and end - depth[node] > start:
                break  # every match still in progress starts after the one found
        if found is not None:
            self.matched, self.pending, self._node = found, "", 0
            return text[:start]
        cut = len(text) - depth[node]  # the longest end of the text a stop string starts with
        self.pending, self._node = text[cut:], node
        return text[:cut]

    def flush(self) -> str:
        out, self.pending, self._node = ("" if self.matched is not None else self.pending), "", 0
        return out


@lru_cache(maxsize=64)
def _automaton(stop: Tuple[str, ...]) -> Tuple[List[Dict[str, int]], List[int], List[int], List[Optional[str]]]:
    """The Aho-Corasick automaton of ``stop``: per node (0 the root; node n spells the prefix of a
    stop string of length ``depth[n]``), its children ``goto[n]``, its failure link ``fail[n]``
    (the node of its longest proper suffix that is a prefix of a stop string) and ``out[n]``, the
    longest stop string that ends its text (None if none does)."""
    goto: List[Dict[str, int]] = [{}]
    depth, out = [0], [None]
    for s in stop:
        node = 0
        for c in s:
            if c not in goto[node]:
                goto[node][c] = len(goto)
                goto.append({})
                depth.append(depth[node] + 1)
                out.append(None)
            node = goto[node][c]
        out[node] = s
    fail = [0] * len(goto)
    queue = deque(goto[0].values())
    while queue:  # breadth first: a node's failure link is shallower, so it is complete
        node = queue.popleft()
        out[node] = out[node] if out[node] is not None else out[fail[node]]
        for c, child in goto[node].items():
            f = fail[node]
            while f and c not in goto[f]:
                f = fail[f]
            fail[child] = goto[f].get(c, 0)
            queue.append(child)
    return goto, fail, depth, out


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
