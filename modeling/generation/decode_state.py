"""DecodeState: every device buffer a generation step reads or writes, and the step bodies.

The buffers are allocated once, before any capture, and never move: a CUDA graph replays on
fixed addresses. ``decode_step`` and ``prefill_bucket`` are plain functions of these buffers (no
host sync, no Python branch on tensor values, no allocation that must outlive the step), so
``modeling.generation.graph_cache.GraphCache`` can capture them; run eagerly they launch the same kernels on
the same shapes.
"""

from typing import Dict, List, Sequence, Tuple

import torch
from torch import Tensor

from ..model.causal_lm import Cache, QwenForCausalLM
from .sampling import MAX_STOP_IDS, SamplingParams, sample

MIN_TEMPERATURE = 1e-5  # sampling modes divide by the temperature


class DecodeState:
    """Buffers for ``max_batch_size`` rows (B) of ``max_seq_len`` positions (L):

    ============  =============  ===============================================================
    cache         model.new_cache(B, L)
    tokens        [B, 1] int64   the next step's input token per row
    pos_len       [2, B] int32   [0] positions, [1] cache_seqlens (one add advances both)
    finished      [B] bool       a finished row repeats its token and stops advancing
    step          [1] int64      the history row the next step writes
    history       [L, B] int64   every token of the batch; row 0 holds the first (prefill) tokens
    stop_ids      [16] int64     padded with -1
    first         [B] int64      each row's first token, sampled after its prefill
    temperature   [B] fp32       sampling values, one per row: one graph serves every setting
    top_k, top_p  [B] int64, fp32
    noise         [B, V] fp32    sampling scratch
    ============  =============  ===============================================================

    With ``prefill_len`` > 0, for prefill in padded length buckets: the prompt ``pf_ids``
    [1, prefill_len] int64 (right-padded), its positions ``pf_pos``, the index of its last real
    token ``pf_last`` [1], the token sampled after it ``pf_token`` [1] and a batch-1 ``staging`` cache.
    Only where the cache allows it (``cache.supports_padded_prefill``: not with recurrent layers,
    whose state would absorb the padding); otherwise ``prefill_len`` is 0 and every prompt is
    prefilled at its exact length.
    """

    def __init__(self, model: QwenForCausalLM, max_batch_size: int, max_seq_len: int, prefill_len: int = 0):
        self.model = model
        B, L, dev = max_batch_size, max_seq_len, model.device
        i64 = dict(dtype=torch.int64, device=dev)
        with torch.no_grad():
            self.cache = model.new_cache(B, L)
            if not self.cache.supports_padded_prefill:
                prefill_len = 0
            self.tokens = torch.zeros(B, 1, **i64)
            self.pos_len = torch.zeros(2, B, dtype=torch.int32, device=dev)
            self.finished = torch.zeros(B, dtype=torch.bool, device=dev)
            self.step = torch.zeros(1, **i64)
            self.history = torch.zeros(L, B, **i64)
            self.stop_ids = torch.full((MAX_STOP_IDS,), -1, **i64)
            self.first = torch.zeros(B, **i64)
            self.temperature = torch.ones(B, dtype=torch.float32, device=dev)
            self.top_k = torch.zeros(B, **i64)
            self.top_p = torch.ones(B, dtype=torch.float32, device=dev)
            self.noise = torch.empty(B, model.config.vocab_size, dtype=torch.float32, device=dev)
            self.prefill_len = prefill_len
            if prefill_len:
                self.pf_ids = torch.zeros(1, prefill_len, **i64)
                self.pf_pos = torch.arange(prefill_len, dtype=torch.int32, device=dev)[None]
                self.pf_last = torch.zeros(1, **i64)
                self.pf_token = torch.zeros(1, **i64)
                self.staging = model.new_cache(1, prefill_len)
        if dev.type == "cuda":  # graph-safe: capture registers the default generator
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            self.rng = torch.cuda.default_generators[index]
        else:
            self.rng = torch.Generator(device="cpu")
            self.rng.seed()
        self._views: Dict[Tuple[int, int], Cache] = {}

    def rows(self, start: int, stop: int) -> Cache:
        """Cache rows [start, stop), as views made once."""
        if (start, stop) not in self._views:
            self._views[start, stop] = self.cache.rows(start, stop)
        return self._views[start, stop]

    def sample(self, logits: Tensor, rows: slice, mode: str) -> Tensor:
        return sample(logits, self.temperature[rows], self.top_k[rows], self.top_p[rows], mode, self.rng,
                      self.noise[rows])

    # ------------------------------------------------------------------ captured bodies
    def decode_step(self, bs: int, mode: str) -> None:
        """One decode step of rows [0, bs): the graph feeds itself, a replay needs no host input."""
        tokens, pos_len, finished = self.tokens[:bs], self.pos_len[:, :bs], self.finished[:bs]
        logits = self.model(tokens, pos_len[0].view(bs, 1), self.rows(0, bs), pos_len[1])  # [bs, V]
        nxt = torch.where(finished, tokens[:, 0], self.sample(logits, slice(0, bs), mode))
        self.history[:, :bs].index_copy_(0, self.step, nxt[None])
        finished.logical_or_((nxt[:, None] == self.stop_ids[None]).any(dim=-1))
        pos_len.add_((~finished).to(torch.int32))  # frozen once finished
        tokens.copy_(nxt[:, None])
        self.step.add_(1)

    def prefill_bucket(self, bucket: int, mode: str) -> None:
        """Prefill ``pf_ids[:, :bucket]`` into the staging cache and sample the token after position
        ``pf_last`` into ``pf_token``."""
        last = self.model(self.pf_ids[:, :bucket], self.pf_pos[:, :bucket], self.staging, logits_at=self.pf_last)
        self.pf_token.copy_(self.sample(last, slice(0, 1), mode))

    # ------------------------------------------------------------------ host-side updates
    def reset(self) -> None:
        """Valid, in-range values (positions 0, gather index 0) before a graph's warm-up runs: the
        buffers may hold an earlier call's values (e.g. a prompt longer than the captured bucket)."""
        self.tokens.zero_()
        self.pos_len[0].zero_()
        self.pos_len[1].fill_(1)
        self.finished.zero_()
        self.step.zero_()
        if self.prefill_len:
            self.pf_last.zero_()

    def set_sampling(self, sampling: SamplingParams, stop_ids: Sequence[int], seed_offset: int = 0) -> None:
        """Sampling values and stop ids for every row; reseed the generator if ``sampling.seed`` is set."""
        if sampling.seed is not None:
            self.rng.manual_seed(sampling.seed + seed_offset)
        self.temperature.fill_(max(float(sampling.temperature), MIN_TEMPERATURE))
        self.top_k.fill_(int(sampling.top_k))
        self.top_p.fill_(float(sampling.top_p))
        self.stop_ids.copy_(torch.tensor(list(stop_ids) + [-1] * (MAX_STOP_IDS - len(stop_ids))))

    def prefill(self, row: int, ids: List[int], mode: str) -> None:
        """Prefill one prompt (exact length, eagerly) into cache row ``row``; its first token to ``first[row]``."""
        dev = self.model.device
        positions = torch.arange(len(ids), dtype=torch.int32, device=dev)[None]
        logits = self.model(torch.tensor([ids], dtype=torch.int64).to(dev), positions, self.rows(row, row + 1))
        self.first[row : row + 1].copy_(self.sample(logits, slice(row, row + 1), mode))

    def stage(self, ids: List[int]) -> None:
        """Write a prompt into the padded prefill input (the padding keeps older values: it comes
        after the prompt and causal attention never lets it change the prompt's positions)."""
        self.pf_ids[0, : len(ids)].copy_(torch.tensor(ids, dtype=torch.int64))
        self.pf_last.fill_(len(ids) - 1)

    def unstage(self, row: int, length: int) -> None:
        """After ``prefill_bucket``: the prompt's state (its first ``length`` positions) into cache row
        ``row``, its first token into ``first[row]``."""
        self.cache.copy_prompt_(row, self.staging, 0, length)
        self.first[row : row + 1].copy_(self.pf_token)

    def start(self, lengths: Sequence[int]) -> None:
        """Decode state after prefill: row b's first token sits at position ``lengths[b]``; rows
        past ``len(lengths)`` are idle (finished from the start, position 0)."""
        n, B = len(lengths), self.tokens.shape[0]
        lengths = list(lengths) + [0] * (B - n)
        self.pos_len.copy_(torch.tensor([lengths, [x + 1 for x in lengths]], dtype=torch.int32))
        self.finished.copy_(torch.arange(B) >= n)
        self.finished.logical_or_((self.first[:, None] == self.stop_ids[None]).any(dim=-1))
        self.tokens[:, 0].copy_(self.first)
        self.history[0].copy_(self.first)
        self.step.fill_(1)
