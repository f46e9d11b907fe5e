"""``SamplingParams``: how a request picks its tokens and when it stops, vLLM's fields and names;
every value checked when the params are made (a ``ValueError`` naming each bad one).

The engine applies them per sequence (``modeling.engine.sampler``); ``LLM`` and the server read
the text-level ones (``stop``, ``skip_special_tokens``) as they build a completion's text.
"""

import hashlib
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Tuple

from ..common import is_int
from .structured_outputs import StructuredOutputs

FLOAT32_MAX = 3.4028234663852886e38
"""The largest temperature the device's fp32 sampling values can hold."""
INT64_LIMIT = 2**63
"""top_k and seeds live in int64 device tensors and generators: values must stay below this."""
MAX_LOGPROBS = 20
"""``SamplingParams.logprobs`` at most (OpenAI's limit)."""
MAX_STOP_IDS = 16
"""Stop token ids (EOS and ``stop_token_ids``) a request may name, at most."""
MAX_N = 128
"""``SamplingParams.n`` at most (OpenAI's limit)."""
BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
"""The fields that are True or False (a bool, nothing else: "no" is refused, not read as True)."""
ITERABLE_FIELDS = ("stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words")
"""The fields that take a collection: any iterable is read into a tuple once, before the checks (a
str and a mapping stay as they are)."""
NONE_IS_EMPTY = ("stop", "stop_token_ids", "bad_words")
"""The collections whose None means none (vLLM's default for them): stored as ``()``."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (vLLM's ``SamplingParams``; each field's default, range
    and effect: docs/generate.md, "Sampling").

    Tokens, in vLLM's order: the logit bias, then the token mask (``allowed_token_ids``,
    ``bad_words``, ``min_tokens``, ``structured_outputs``: excluded tokens' logits set to -inf),
    then the penalties, the temperature, min-p, top-k and top-p; each request draws from its own
    counter-based stream (``modeling.engine.sampler``). With c_t the count of token t in the output
    so far, a token seen in the prompt or output has its logit l replaced by l / r if l > 0, else
    l * r (``repetition_penalty``), then ``l_t -= presence * (c_t > 0) + frequency * c_t``.
    ``logprobs`` are of the raw model distribution, ``log_softmax(logits)``, whatever the sampling
    settings. Completion i of ``n`` draws with ``choice_seed(seed, i)``.

    Stopping: ``max_tokens`` new tokens at most (None: the caller's default; ``LLM`` takes the
    checkpoint's ``max_new_tokens``, else ``modeling.api.llm.DEFAULT_MAX_TOKENS``); ``stop``:
    strings that end a completion (a str or a sequence of them; the text returned stops before the
    first match, or after it with ``include_stop_str_in_output``); ``stop_token_ids``: token ids
    that end it besides the tokenizer's EOS ids; ``ignore_eos``: do not stop at EOS;
    ``skip_special_tokens``: leave special tokens out of the text.
    Lists (any iterable, a generator too, read once) are stored as tuples and dicts as sorted pairs
    (the params are hashable); ``stop``, ``stop_token_ids`` and ``bad_words`` take None for none, as
    vLLM's do.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = None
    stop: Tuple[str, ...] = ()
    stop_token_ids: Tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: Optional[int] = None
    n: int = 1
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    logit_bias: Optional[Tuple[Tuple[int, float], ...]] = None
    allowed_token_ids: Optional[Tuple[int, ...]] = None
    bad_words: Tuple[str, ...] = ()
    truncate_prompt_tokens: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    structured_outputs: Optional[StructuredOutputs] = None

    def __post_init__(self):
        for name in NONE_IS_EMPTY:
            if getattr(self, name) is None:
                object.__setattr__(self, name, ())
        for name in ITERABLE_FIELDS:  # read once: a generator is checked and stored whole
            value = getattr(self, name)
            if isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping)):
                object.__setattr__(self, name, tuple(value))
        values = {name: getattr(self, name) for name, *_ in VALUE_CHECKS}
        problems = [f"{name} {text}, got {values[name]!r}" for name, *check, text in VALUE_CHECKS
                    if not ((name in OPTIONAL and values[name] is None) or in_range(values[name], *check))]
        problems += [f"{name} must be True or False, got {getattr(self, name)!r}" for name in BOOL_FIELDS
                     if not isinstance(getattr(self, name), bool)]
        problems += self._control_errors()
        if isinstance(self.structured_outputs, Mapping):
            try:
                object.__setattr__(self, "structured_outputs", StructuredOutputs(**self.structured_outputs))
            except (TypeError, ValueError) as e:
                problems.append(str(e) if isinstance(e, ValueError) else f"structured_outputs: {e}")
        elif not (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs)):
            problems.append(f"structured_outputs must be a StructuredOutputs or a dict of its fields, "
                            f"got {self.structured_outputs!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        try:
            stop = tuple(stop)
        except TypeError:
            problems.append(f"stop must be a string or a sequence of strings, got {self.stop!r}")
            stop = ()
        for s in stop:
            if not isinstance(s, str) or not s:
                problems.append(f"stop strings must be non-empty strings, got {s!r}")
            elif not _is_unicode(s):
                problems.append(f"stop string {s!r} is not valid Unicode (a lone surrogate)")
        try:
            stop_ids = tuple(self.stop_token_ids)
        except TypeError:
            problems.append(f"stop_token_ids must be a sequence of integers, got {self.stop_token_ids!r}")
            stop_ids = ()
        for t in stop_ids:
            if not (is_int(t) and 0 <= t < INT64_LIMIT):
                problems.append(f"stop_token_ids must be integers >= 0, got {t!r}")
        if problems:
            raise ValueError("; ".join(problems))
        # plain Python values (numpy / torch scalars in, ints and floats out) and tuples
        for name, kind, *_ in VALUE_CHECKS:
            if values[name] is not None:
                object.__setattr__(self, name, kind(values[name]))
        if self.top_k == -1:  # vLLM's "every token": off, stored as 0
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop_ids))
        if self.logit_bias is not None:
            pairs = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
            object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in pairs)))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in self.allowed_token_ids))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))

    def _control_errors(self) -> list:
        """Messages naming each invalid value of the logit controls."""
        errors = []
        if self.max_tokens is not None and is_int(self.min_tokens) and is_int(self.max_tokens) \
                and self.min_tokens > self.max_tokens:
            errors.append(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logit_bias is not None:
            try:
                pairs = list(self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias)
            except TypeError:
                pairs = [(None, None)]
            for pair in pairs:
                t, b = pair if isinstance(pair, tuple) and len(pair) == 2 else (None, None)
                if not (is_int(t) and 0 <= t < INT64_LIMIT and _is_real(b) and -100 <= b <= 100):
                    errors.append(f"logit_bias maps token ids (integers >= 0) to numbers in [-100, 100], got {pair!r}")
                    break
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__") or not list(ids) \
                    or not all(is_int(t) and 0 <= t < INT64_LIMIT for t in ids):
                errors.append(f"allowed_token_ids must be a non-empty sequence of token ids (integers >= 0), got {ids!r}")
        words = (self.bad_words,) if isinstance(self.bad_words, str) else self.bad_words
        if isinstance(self.bad_words, str) or not hasattr(words, "__iter__") \
                or not all(isinstance(w, str) and w and _is_unicode(w) for w in words):
            errors.append(f"bad_words must be a sequence of non-empty strings, got {self.bad_words!r}")
        return errors

    @property
    def has_token_mask(self) -> bool:
        """Some tokens may be excluded (``allowed_token_ids``, ``bad_words``, ``min_tokens``,
        ``structured_outputs``)."""
        return (self.allowed_token_ids is not None or bool(self.bad_words) or self.min_tokens > 0
                or self.structured_outputs is not None)

    @property
    def has_penalty(self) -> bool:
        """Some penalty is on (the engine then counts the sequence's tokens)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def mode(self) -> str:
        """What the sampler must compute: ``greedy`` (temperature 0 or top-k 1: the argmax),
        ``sample`` (the temperature alone) or ``top`` (a top-k or top-p cut: a sort)."""
        if self.temperature == 0 or self.top_k == 1:
            return "greedy"
        return "sample" if self.top_k == 0 and self.top_p >= 1 else "top"


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


VALUE_CHECKS = (
    ("temperature", float, 0, FLOAT32_MAX, False, "must be a finite number >= 0 (at most 3.4e38, float32's largest)"),
    ("top_k", int, -1, INT64_LIMIT - 1, False, "must be an integer in [0, 2**63) or -1 (0 and -1 disable it)"),
    ("top_p", float, 0, 1, True, "must lie in (0, 1] (1 disables it)"),
    ("seed", int, 0, INT64_LIMIT - 1, False, "must be an integer in [0, 2**63)"),
    ("min_p", float, 0, 1, False, "must lie in [0, 1] (0 disables it)"),
    ("presence_penalty", float, -2, 2, False, "must lie in [-2, 2] (0 disables it)"),
    ("frequency_penalty", float, -2, 2, False, "must lie in [-2, 2] (0 disables it)"),
    ("repetition_penalty", float, 0, FLOAT32_MAX, True, "must be a finite number > 0 (1 disables it)"),
    ("logprobs", int, 0, MAX_LOGPROBS, False, f"must be an integer in [0, {MAX_LOGPROBS}] (or None)"),
    ("n", int, 1, MAX_N, False, f"must be an integer in [1, {MAX_N}]"),
    ("max_tokens", int, 1, math.inf, False, "must be an integer >= 1 (or None)"),
    ("min_tokens", int, 0, math.inf, False, "must be an integer >= 0"),
    ("truncate_prompt_tokens", int, 1, math.inf, False, "must be an integer >= 1 (or None)"),
    ("prompt_logprobs", int, 0, MAX_LOGPROBS, False, f"must be an integer in [0, {MAX_LOGPROBS}] (or None)"),
)
"""The numeric fields of ``SamplingParams``: (name, type, low, high, whether low is excluded, what
the value must be). Each is an integer (``is_int``) or a real number (not a bool) in [low, high]
(or (low, high]), stored as a plain int or float; ``OPTIONAL`` ones may be None."""
OPTIONAL = ("seed", "logprobs", "max_tokens", "truncate_prompt_tokens", "prompt_logprobs")


def in_range(value, kind: type, low, high, open_low: bool) -> bool:
    return ((is_int(value) if kind is int else _is_real(value)) and (low < value if open_low else low <= value)
            and value <= high)


def choice_seed(seed: Optional[int], i: int) -> Optional[int]:
    """The seed of completion ``i`` of a request seeded with ``seed``: the seed itself for the first
    (so it samples as ``n=1`` does), a hash of (seed, i) for the others (None stays None)."""
    if seed is None or i == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % INT64_LIMIT


def choice_params(params: SamplingParams, i: int, every: bool = False) -> SamplingParams:
    """The params of completion ``i`` of a request: its own seed (``choice_seed``); the prompt
    logprobs computed by the first completion only (the others' prefills may then hit the prefix
    cache), or by each when ``every``."""
    if i == 0:
        return params
    return replace(params, seed=choice_seed(params.seed, i), prompt_logprobs=params.prompt_logprobs if every else None)
