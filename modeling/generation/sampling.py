"""Token sampling on the device, safe inside a CUDA graph: greedy, temperature, top-k, top-p.

Everything here is plain tensor code: no ``.item()``, no host sync, no Python branch on tensor
values, fixed shapes. The sampling *values* (temperature, top-k, top-p) are device tensors
with one entry per batch row, so one captured graph serves every setting; only the *mode*
(which code runs) is a Python choice, made once per generate call (``sampling_mode``):

- ``greedy``: ``argmax(logits)`` (temperature 0, or top-k 1).
- ``sample``: temperature only. The exponential race ``argmax(p_i / E_i)`` with
  ``E_i ~ Exponential(1)``, computed in log space as ``argmax(logits_i / T - log E_i)``
  (the Gumbel-max trick), draws token i with probability ``softmax(logits / T)_i`` without
  ``torch.multinomial`` (which syncs with the host).
- ``top``: top-k and/or top-p. Sort the scaled logits once (descending), mask ranks >= k, take
  the softmax of what is left, mask ranks whose preceding mass is already >= p (so the kept set
  is the smallest prefix with mass >= p, never empty), then the same exponential race over the
  kept ranks. Order as in transformers: temperature, then top-k, then top-p on the renormalized
  top-k distribution.

Randomness comes from ``Tensor.exponential_(generator=...)``. On CUDA pass the device's default
generator (``torch.cuda.default_generators[i]``): CUDA graphs register it and advance its
Philox offset on every replay, so a replayed graph draws fresh numbers, and reseeding it
(``manual_seed``) before a run makes the run reproducible.
"""

import numbers
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..common import is_int

MODES = ("greedy", "sample", "top")


FLOAT32_MAX = 3.4028234663852886e38
"""The largest temperature the device's fp32 sampling values can hold."""
INT64_LIMIT = 2**63
"""top_k and seeds live in int64 device tensors and generators: values must stay below this."""
MAX_LOGPROBS = 20
"""``SamplingParams.logprobs`` at most (OpenAI's limit)."""
MAX_STOP_IDS = 16
"""Stop token ids (EOS and ``stop_token_ids``) a ``Generator`` row checks on the device, at most."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens, and (for the text API, ``modeling.api.llm.LLM``) when to stop.

    Token level (the ``Generator`` and the engine read these): temperature 0 means greedy; top_k 0 means no top-k
    (any k >= the vocabulary is the same); top_p 1.0 means no top-p; seed None draws from the
    generator's current state (not reproducible).

    Text level (``LLM`` reads these; ``Generator`` ignores them): ``max_tokens`` new tokens at
    most (None: the checkpoint's ``max_new_tokens``, else ``modeling.api.llm.DEFAULT_MAX_TOKENS``);
    ``stop``: strings that end a completion (a str or a sequence of them; the text returned stops
    before the first match); ``stop_token_ids``: token ids that end it besides the tokenizer's EOS
    ids; ``ignore_eos``: do not stop at EOS; ``skip_special_tokens``: leave special tokens out of
    the text. Lists are stored as tuples (the params are hashable).

    Engine only (``modeling.engine.Engine``, the server's; ``LLM`` on the ``Generator`` refuses
    them, see ``modeling.api.llm``), in vLLM's order: penalties on the raw logits, then the
    temperature, then min-p, top-k and top-p.

    - ``repetition_penalty`` (> 0, 1.0 off; transformers' and vLLM's): each token that occurs in
      the prompt or the output so far has its logit l replaced by l / r if l > 0, else l * r.
    - ``presence_penalty``, ``frequency_penalty`` (in [-2, 2], 0 off; OpenAI's): with c_t the
      count of token t in the output so far, ``l_t -= presence * (c_t > 0) + frequency * c_t``.
    - ``min_p`` (in [0, 1], 0 off; transformers' ``MinPLogitsWarper``): after the temperature,
      drop the tokens whose probability is below ``min_p`` times the most likely token's.
    - ``logprobs`` (None: none; k in [0, 20]): each output token comes with its log-probability
      and the k most likely tokens' (id, log-probability), best first. These are of the raw
      model distribution, ``log_softmax(logits)`` before penalties and temperature (vLLM's
      default, "raw_logprobs"), whatever the sampling settings.
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

    def __post_init__(self):
        problems = sampling_errors(self.temperature, self.top_k, self.top_p, self.seed)
        problems += penalty_errors(self.min_p, self.presence_penalty, self.frequency_penalty,
                                   self.repetition_penalty, self.logprobs)
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
        if self.max_tokens is not None and not (is_int(self.max_tokens) and self.max_tokens >= 1):
            problems.append(f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens!r}")
        if problems:
            raise ValueError("; ".join(problems))
        # plain Python values (numpy / torch scalars in, ints and floats out) and tuples
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "top_p", float(self.top_p))
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))
        if self.max_tokens is not None:
            object.__setattr__(self, "max_tokens", int(self.max_tokens))
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop_ids))
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))
        object.__setattr__(self, "skip_special_tokens", bool(self.skip_special_tokens))
        for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", int(self.logprobs))

    @property
    def has_penalty(self) -> bool:
        """Some penalty is on (the engine then counts the sequence's tokens)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def mode(self) -> str:
        return sampling_mode(self.temperature, self.top_k, self.top_p)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def sampling_errors(temperature: float, top_k: int, top_p: float, seed: Optional[int] = None) -> list:
    """Messages naming each invalid value (empty when all are valid)."""
    errors = []
    if not (_is_real(temperature) and 0 <= temperature <= FLOAT32_MAX):
        errors.append(f"temperature must be a finite number >= 0 (at most 3.4e38, float32's largest), "
                      f"got {temperature!r}")
    if not (is_int(top_k) and 0 <= top_k < INT64_LIMIT):
        errors.append(f"top_k must be an integer in [0, 2**63) (0 disables it), got {top_k!r}")
    if not (_is_real(top_p) and 0 < top_p <= 1):
        errors.append(f"top_p must lie in (0, 1] (1 disables it), got {top_p!r}")
    if seed is not None and not (is_int(seed) and 0 <= seed < INT64_LIMIT):
        errors.append(f"seed must be an integer in [0, 2**63), got {seed!r}")
    return errors


def penalty_errors(min_p: float, presence_penalty: float, frequency_penalty: float, repetition_penalty: float,
                   logprobs: Optional[int]) -> list:
    """Messages naming each invalid value of the engine's controls (empty when all are valid)."""
    errors = []
    if not (_is_real(min_p) and 0 <= min_p <= 1):
        errors.append(f"min_p must lie in [0, 1] (0 disables it), got {min_p!r}")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not (_is_real(value) and -2 <= value <= 2):
            errors.append(f"{name} must lie in [-2, 2] (0 disables it), got {value!r}")
    if not (_is_real(repetition_penalty) and 0 < repetition_penalty <= FLOAT32_MAX):
        errors.append(f"repetition_penalty must be a finite number > 0 (1 disables it), got {repetition_penalty!r}")
    if logprobs is not None and not (is_int(logprobs) and 0 <= logprobs <= MAX_LOGPROBS):
        errors.append(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (or None), got {logprobs!r}")
    return errors


def sampling_mode(temperature: float, top_k: int, top_p: float) -> str:
    """Which code path the values need: ``greedy``, ``sample`` or ``top`` (see the module doc)."""
    if temperature == 0 or top_k == 1:
        return "greedy"
    if top_k == 0 and top_p >= 1:
        return "sample"
    return "top"


def _exponential_noise(shape, device, generator: Optional[torch.Generator], out: Optional[Tensor]) -> Tensor:
    """E ~ Exponential(1), fp32, strictly positive (so -log E is finite)."""
    noise = torch.empty(shape, dtype=torch.float32, device=device) if out is None else out
    noise.exponential_(generator=generator)
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def filtered_sorted_scores(scores: Tensor, top_k: Tensor, top_p: Tensor):
    """scores [B, V] fp32 (already divided by the temperature); top_k [B] (0 = off), top_p [B].

    Returns (sorted scores with the dropped ranks set to -inf, the vocabulary index of each rank),
    both [B, V]; rank 0 (the most likely token) is always kept.
    """
    vocab = scores.shape[-1]
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=scores.device)
    k = torch.where(top_k > 0, top_k, vocab).clamp_max(vocab)
    sorted_scores = sorted_scores.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    probs = sorted_scores.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_scores = sorted_scores.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return sorted_scores, order


def sample(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    mode: str,
    generator: Optional[torch.Generator] = None,
    noise: Optional[Tensor] = None,
) -> Tensor:
    """Draw one token per row. logits [B, V] (any float dtype); temperature/top_p [B] float,
    top_k [B] int; ``noise`` an optional preallocated fp32 [B, V] scratch. Returns [B] int64.

    In ``sample`` and ``top`` modes the temperature must be > 0 (``greedy`` ignores the values).
    """
    if mode == "greedy":
        return logits.argmax(dim=-1)
    if mode not in MODES:
        raise ValueError(f"unknown sampling mode {mode!r}: expected one of {MODES}")
    scores = logits.float() / temperature[:, None]
    if mode == "top":
        sorted_scores, order = filtered_sorted_scores(scores, top_k, top_p)
        gumbel = _exponential_noise(scores.shape, scores.device, generator, noise).log_().neg_()
        rank = (sorted_scores + gumbel).argmax(dim=-1, keepdim=True)
        return order.gather(-1, rank)[:, 0]
    gumbel = _exponential_noise(scores.shape, scores.device, generator, noise).log_().neg_()
    return (scores + gumbel).argmax(dim=-1)


def sampling_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """The distribution ``sample`` draws from in the ``sample``/``top`` modes, [B, V] fp32
    (for tests and inspection; not used while generating)."""
    scores = logits.float() / temperature[:, None]
    sorted_scores, order = filtered_sorted_scores(scores, top_k, top_p)
    return torch.zeros_like(scores).scatter_(-1, order, sorted_scores.softmax(dim=-1))
