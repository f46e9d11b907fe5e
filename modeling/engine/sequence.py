"""One request's life in the engine: its tokens, how many of them are in the cache, its blocks."""

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional, Tuple

from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .token_masks import TokenControls


LogprobEntry = Tuple[float, List[Tuple[int, float]], int]
"""A token's log-probability, the top-k tokens' (id, log-probability) best first, and the token's
rank (1 + the number of vocabulary entries of a larger log-probability)."""


class Status(enum.Enum):
    WAITING = "waiting"    # not admitted, or preempted (its cache dropped: recomputed when readmitted)
    RUNNING = "running"    # admitted: holds blocks (and a state slot), computes tokens every step
    FINISHED = "finished"


_ids = itertools.count()

DEAD_END = "its grammar allows no token of the model's vocabulary after the output so far"
"""``Sequence.error`` of a sequence whose grammar reached a dead end (``token_masks``)."""


@dataclass
class Sequence:
    """``tokens``: the prompt, then every sampled token; ``num_computed``: the leading tokens whose
    KV (and recurrent state) is in the pool, so the next step computes ``tokens[num_computed:]``
    (all of the prompt's rest while prefilling, one token while decoding). ``block_table`` and
    ``state_slot`` are the pool entries it holds while running. ``num_pending``: tokens sampled on
    the device that the host has not read yet (the engine's lookahead step feeds them to the next
    step on the device); ``num_tokens`` counts them with ``tokens``.

    ``max_tokens``: new tokens at most; ``stop_token_ids``: tokens that finish it (EOS included
    unless the caller left it out); ``finish_reason``: "stop", "length" or "abort".

    ``logprobs``: None unless ``params.logprobs`` is set, then one ``LogprobEntry`` per output
    token (of the raw model distribution, ``params.logprobs`` top tokens; see ``SamplingParams``).
    ``prompt_logprobs``: None unless ``params.prompt_logprobs`` is set, then None for the first
    prompt token and one ``LogprobEntry`` per prompt token after it, filled by the prefill steps
    (``prefill_logprobs``).
    ``controls``: the tokens it may not sample (``token_masks.TokenControls``; None: any).
    ``error``: why it ended without its token ("abort"), else None."""

    tokens: List[int]
    params: SamplingParams
    max_tokens: int
    stop_token_ids: Tuple[int, ...] = ()
    request_id: int = field(default_factory=lambda: next(_ids))
    num_prompt: int = 0
    num_computed: int = 0
    num_cached: int = 0  # prompt tokens found in the prefix cache at admission
    block_table: List[int] = field(default_factory=list)
    block_hashes: List[bytes] = field(default_factory=list)  # of its blocks registered for prefix caching
    prefix_hashes: List[bytes] = field(default_factory=list)  # the hash chain of its full blocks, as far as
    # computed (tokens only grow, so it stays valid through preemption: each block is hashed once)
    state_slot: Optional[int] = None
    seed: int = 0  # the sampling stream's seed (the request's, or drawn when it was added)
    status: Status = Status.WAITING
    finish_reason: Optional[str] = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: Optional[float] = None
    logprobs: Optional[List[LogprobEntry]] = None
    prompt_logprobs: Optional[List[Optional[LogprobEntry]]] = None
    num_pending: int = 0
    controls: Optional["TokenControls"] = None  # what excludes tokens (``token_masks``), None if nothing
    error: Optional[str] = None

    def __post_init__(self):
        self.tokens = list(self.tokens)
        self.num_prompt = self.num_prompt or len(self.tokens)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether some of its prompt logprobs are still to be computed."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) + self.num_pending

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def output_ids(self) -> List[int]:
        return self.tokens[self.num_prompt:]

    def append(self, token: int, logprobs: Optional[LogprobEntry] = None) -> None:
        """Record a sampled token (with its ``LogprobEntry`` exactly when ``params.logprobs`` is set)
        and finish the sequence if it is a stop token, completes its grammar or is the last allowed;
        a sequence whose grammar reached a dead end (``TokenControls.dead_end``) ends ("abort",
        ``error`` DEAD_END) without it."""
        if (logprobs is None) != (self.logprobs is None):
            raise ValueError(f"request {self.request_id}: a logprobs entry is needed exactly when its params ask "
                             f"for logprobs (logprobs={self.params.logprobs!r}), got {logprobs!r}")
        if self.controls is not None and self.controls.dead_end:  # this token was drawn from nothing
            self.finish_reason, self.error = "abort", DEAD_END
            return
        self.tokens.append(token)
        if self.controls is not None:
            self.controls.accept(token)
        if self.logprobs is not None:
            self.logprobs.append(logprobs)
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        if token in self.stop_token_ids or (self.controls is not None and self.controls.terminated):
            self.finish_reason = "stop"
        elif self.num_output >= self.max_tokens:
            self.finish_reason = "length"
