"""What a request gives back, in vLLM's shapes (``RequestOutput``, ``CompletionOutput``, ``Logprob``),
and one completion's output as its tokens arrive (``Completion``), which ``LLM`` and the server share."""

from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from ..engine.sampling_params import SamplingParams
from ..engine.sequence import LogprobEntry
from .tokenizer import IncrementalDetokenizer, QwenTokenizer


@dataclass
class Logprob:
    """A token's log-probability under the raw model distribution; ``rank``: 1 for the most likely
    token (a top token's place among the top ones; another token's 1 + the number of vocabulary
    entries more likely, as vLLM's); its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    """Completion ``index`` of a request. ``text``: the new text, without the stop string that
    ended it (with it when ``include_stop_str_in_output``); ``token_ids``: the new token ids, without
    a stop token (EOS or ``stop_token_ids``), with the token that completed a stop string;
    ``finish_reason``: ``"stop"`` (EOS, a stop token id or a stop string), ``"length"``
    (``max_tokens``, or ``max_model_len`` reached) or ``"abort"``; ``stop_reason``: the stop string
    or stop token id (not EOS) that ended it, else None. With ``SamplingParams.logprobs``:
    ``logprobs``, one dict a token id (the sampled one and the top ``logprobs``) -> ``Logprob``, and
    ``cumulative_logprob``, their sum over the sampled tokens; else both None."""

    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[List[Dict[int, Logprob]]]
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.time()`` seconds, as vLLM's): when the request was added, when
    its first token reached the host, when its last completion finished."""

    arrival_time: float
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None


@dataclass
class RequestOutput:
    """One prompt's completions (``outputs``, ``SamplingParams.n`` of them). ``prompt``: its text
    (None for a prompt given as token ids). ``text``, ``token_ids``, ``finish_reason`` and
    ``stop_reason`` are the first completion's (all there is with ``n=1``). ``prompt_logprobs``
    (with ``SamplingParams.prompt_logprobs``, else None): per prompt token, None for the first,
    then a dict token id -> ``Logprob`` of the prompt's token and the top ones, as ``logprobs``."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool
    metrics: Optional[RequestMetrics] = None
    prompt_logprobs: Optional[List[Optional[Dict[int, Logprob]]]] = None

    text = property(lambda self: self.outputs[0].text)
    token_ids = property(lambda self: self.outputs[0].token_ids)
    finish_reason = property(lambda self: self.outputs[0].finish_reason)
    stop_reason = property(lambda self: self.outputs[0].stop_reason)


class StopStrings:
    """Text pieces in, the text to emit out, up to the first stop string (at one place, the longest).
    What could still be the start of a stop string is held back until the next piece shows it is
    not. One Aho-Corasick automaton (``_automaton``) matches them all: a push costs the length of
    its piece plus at most the longest stop string. ``include``: the text emitted ends with the
    stop string that matched (vLLM's ``include_stop_str_in_output``) instead of before it."""

    def __init__(self, stop: Sequence[str], include: bool = False):
        self.stop, self.include = tuple(stop), include
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
            return text[:start + len(found)] if self.include else text[:start]
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


class TokenStrings:
    """Each token id's own text, special tokens included (``Logprob.decoded_token``, the server's
    logprobs; a piece of a multi-byte character decodes as U+FFFD), cached."""

    def __init__(self, tokenizer: QwenTokenizer):
        self.tokenizer = tokenizer
        self._cache: Dict[int, str] = {}

    def __call__(self, token: int) -> str:
        s = self._cache.get(token)
        if s is None:
            s = self._cache[token] = self.tokenizer.decode([token])
        return s


class Completion:
    """One sequence's output as the engine hands over its tokens (``push``), the fields of
    ``CompletionOutput`` (``output()``) and each token's ``LogprobEntry`` (``entries``) when the
    params ask for logprobs. A stop string ends it (the caller then aborts the sequence); tokens
    pushed after the end are ignored. The token that ends it at the engine (EOS or a stop token id)
    adds no text, and stays in ``token_ids`` and ``entries`` only with ``keep_stop_tokens``."""

    def __init__(self, index: int, strings: TokenStrings, params: SamplingParams, keep_stop_tokens: bool = False):
        self.index, self.strings, self.params, self.keep_stop_tokens = index, strings, params, keep_stop_tokens
        self.detok = IncrementalDetokenizer(strings.tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.stops = StopStrings(params.stop, params.include_stop_str_in_output)
        self.text = ""
        self.token_ids: List[int] = []
        self.entries: List[LogprobEntry] = []
        self.finish_reason: Optional[str] = None
        self.stop_reason: Union[int, str, None] = None  # the stop string, or the stop token id (not EOS), that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int, entry: Optional[LogprobEntry], finish_reason: Optional[str]) -> str:
        """Take the next token (its ``LogprobEntry`` when the params ask for logprobs, the engine's
        finish reason when it was the last); returns the text it adds, and at the end the text
        still held back."""
        if self.finished:
            return ""
        if finish_reason != "stop" or self.keep_stop_tokens:
            self.token_ids.append(token)
            if self.params.logprobs is not None:
                self.entries.append(entry)
        text = self.stops.push(self.detok.push(token)) if finish_reason != "stop" else ""
        if self.stops.matched is not None:
            finish_reason, self.stop_reason = "stop", self.stops.matched
        elif finish_reason == "stop" and token in self.params.stop_token_ids:
            self.stop_reason = token
        if finish_reason is not None:
            text += self.stops.push(self.detok.flush()) + self.stops.flush()
            self.finish_reason = finish_reason
        self.text += text
        return text

    def output(self) -> CompletionOutput:
        logprobs = cumulative = None
        if self.params.logprobs is not None:
            logprobs = [logprob_dict(self.strings, t, e) for t, e in zip(self.token_ids, self.entries)]
            cumulative = sum((e[0] for e in self.entries), 0.0)
        return CompletionOutput(self.index, self.text, list(self.token_ids), cumulative, logprobs,
                                self.finish_reason, self.stop_reason)


def logprob_dict(text: Callable[[int], str], token: int, entry: LogprobEntry) -> Dict[int, Logprob]:
    """A token's ``LogprobEntry`` as vLLM gives it: token id -> ``Logprob`` of the top tokens
    (ranked from 1, best first), then of ``token`` when it is not among them (with its own rank);
    ``text``: a token id's text (``decoded_token``)."""
    chosen, top, rank = entry
    out = {tid: Logprob(lp, place, text(tid)) for place, (tid, lp) in enumerate(top, 1)}
    if token not in out:
        out[token] = Logprob(chosen, rank, text(token))
    return out
