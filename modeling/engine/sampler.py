"""Per-request sampling for a batch of sequences with different settings, on the device
(docs/generate.md, "Sampling": the controls, their order, the draws).

``sample_sequences`` builds the per-row tensors from the sequences; ``sample_rows``,
``apply_penalties`` and ``token_logprobs`` are pure tensor functions. The uniform of row i's
vocabulary entry v is a hash of (seed_i, position_i, v), position_i the position of the token
being sampled; the draw is the Gumbel-max race argmax(logits / T - log E), E = -log U: token t
wins with probability softmax(logits / T)_t, with no host sync (``torch.multinomial`` has one).
"""

from typing import List, NamedTuple, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

import qwen_ops  # noqa: F401 (torch.ops.qwen.apply_token_bitmask)

from .sequence import LogprobEntry, Sequence
from .step import to_device
from .token_masks import token_bitmask

M32 = 0xFFFFFFFF
MIN_TEMPERATURE = 1e-5
"""Temperatures below this sample as this (the scores are divided by it)."""


def _fmix32(h: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def uniforms(seeds: Tensor, positions: Tensor, vocab: int) -> Tensor:
    """U [S, vocab] fp32 in (0, 1), a function of (seed, position, column) only: seeds, positions
    [S] int64 (seeds in [0, 2^63))."""
    key = _fmix32(_fmix32(_fmix32(seeds & M32) ^ (seeds >> 32)) ^ (positions & M32))
    cols = _fmix32(torch.arange(vocab, dtype=torch.int64, device=seeds.device) * 0x9E3779B9 & M32)
    bits = _fmix32(key[:, None] ^ cols[None, :]) >> 8  # 24 bits: exact in fp32
    return (bits.float() + 0.5) * 2.0**-24


class Penalties(NamedTuple):
    """The penalised rows of a batch (P of its S rows): ``rows`` [P] int64, their indices in the
    batch; ``ids`` [P, L] int64, each row's prompt then output token ids, padded with -1;
    ``num_prompt`` [P] int64, how many of its ids are the prompt's; ``presence``, ``frequency``,
    ``repetition`` [P] fp32, the penalties (0, 0 and 1 are off)."""

    rows: Tensor
    ids: Tensor
    num_prompt: Tensor
    presence: Tensor
    frequency: Tensor
    repetition: Tensor


def apply_penalties(logits: Tensor, p: Penalties) -> Tensor:
    """logits [S, V] with the penalised rows changed, in fp32 or wider (the other rows keep their
    values exactly). For each penalised row, with c_t the count of token t among its output ids and
    "seen" meaning t occurs among its prompt or output ids: l_t -> (l_t > 0 ? l_t / r : l_t * r)
    where seen, then l_t -= frequency * c_t + presence * (c_t > 0)."""
    out = logits.to(torch.promote_types(logits.dtype, torch.float32))
    rows = out.index_select(0, p.rows)
    vocab = rows.shape[-1]
    index = torch.where(p.ids >= 0, p.ids, vocab)  # padding counts into an extra column, dropped
    is_output = torch.arange(p.ids.shape[1], device=p.ids.device)[None, :] >= p.num_prompt[:, None]
    counts = torch.zeros(rows.shape[0], vocab + 1, dtype=rows.dtype, device=rows.device)
    counts = counts.scatter_add_(1, index, is_output.to(rows.dtype))[:, :vocab]
    seen = torch.zeros(rows.shape[0], vocab + 1, dtype=torch.bool, device=rows.device)
    seen = seen.scatter_(1, index, True)[:, :vocab]
    r = p.repetition[:, None].to(rows.dtype)
    rows = torch.where(seen, torch.where(rows > 0, rows / r, rows * r), rows)
    rows = rows - p.frequency[:, None].to(rows.dtype) * counts - p.presence[:, None].to(rows.dtype) * (counts > 0)
    return out.index_copy(0, p.rows, rows)


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


def sample_rows(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seeds: Tensor,
                positions: Tensor, any_random: bool, any_top: bool, min_p: Optional[Tensor] = None,
                penalties: Optional[Penalties] = None) -> Tensor:
    """One token per row of logits [S, V]: temperature, top_p [S] fp32; top_k, seeds, positions [S]
    int64; ``min_p`` [S] fp32 or None (no row uses it); ``penalties`` or None (no row has one).

    The logits are penalised first (``apply_penalties``). A row of temperature 0 or top_k 1 then
    takes the argmax; the others draw from softmax(logits / T) cut to the tokens of probability
    >= min_p times the largest, then to the top-k ranks, then to the smallest prefix of mass >=
    top_p of what is left (renormalized). ``any_random`` (some row draws) and ``any_top`` (some row
    cuts by top-k or top-p) are host flags: the batch pays only for what it uses."""
    if penalties is not None:
        logits = apply_penalties(logits, penalties)
    greedy = logits.argmax(dim=-1)
    if not any_random:
        return greedy
    scores = logits.float() / temperature.clamp_min(MIN_TEMPERATURE)[:, None]
    if min_p is not None:  # p_t < min_p * p_max  <=>  s_t - s_max < log(min_p) (log 0 = -inf: no cut)
        scores = scores.masked_fill(scores - scores.amax(dim=-1, keepdim=True) < min_p.log()[:, None],
                                    float("-inf"))
    gumbel = uniforms(seeds, positions, scores.shape[-1]).log_().neg_().log_().neg_()
    if any_top:  # the noise follows the token, not its rank: a row draws the same with or without the sort
        sorted_scores, order = filtered_sorted_scores(scores, top_k, top_p)
        drawn = order.gather(-1, (sorted_scores + gumbel.gather(-1, order)).argmax(dim=-1, keepdim=True))[:, 0]
    else:
        drawn = (scores + gumbel).argmax(dim=-1)
    return torch.where((temperature == 0) | (top_k == 1), greedy, drawn)


def token_logprobs(logits: Tensor, tokens: Tensor, k: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Of the raw distribution log_softmax(logits), logits [R, V], tokens [R] int64, 0 <= k <= V:
    (each token's log-probability [R], the k largest log-probabilities [R, k] best first, their
    token ids [R, k] int64, each token's rank [R] int64: 1 + the number of entries of its row with a
    larger log-probability), in fp32 or wider."""
    logprobs = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(dim=-1)
    top = logprobs.topk(k, dim=-1)
    chosen = logprobs.gather(-1, tokens[:, None])
    return chosen[:, 0], top.values, top.indices, (logprobs > chosen).sum(dim=-1) + 1


def controlled_logits(logits: Tensor, seqs: List[Sequence], positions: List[int]) -> Tensor:
    """logits [S, V] with each row's logit bias added (in fp32 or wider) and the tokens its
    ``TokenControls`` exclude set to -inf (``positions``: the index of each row's token being
    sampled; the rows' ``token_bitmask`` built here); ``logits`` itself when no row has either."""
    bias = [(i, t, b) for i, s in enumerate(seqs) for t, b in s.params.logit_bias or ()]
    if bias:
        rows, ids, values = (to_device(np.array(column, dtype), logits.device)
                             for column, dtype in zip(zip(*bias), (np.int64, np.int64, np.float32)))
        wide = torch.promote_types(logits.dtype, torch.float32)
        logits = logits.to(wide).index_put((rows, ids), values.to(wide), accumulate=True)
    bitmask = token_bitmask(seqs, logits.shape[-1], [p - s.num_prompt for p, s in zip(positions, seqs)],
                            pin=logits.is_cuda)
    if bitmask is not None:  # pinned: the copy does not block the host
        logits = torch.ops.qwen.apply_token_bitmask(logits, bitmask.to(logits.device, non_blocking=True))
    return logits


def penalties_of(seqs: List[Sequence], device) -> Optional[Penalties]:
    """The ``Penalties`` of the sequences that have one (``SamplingParams.has_penalty``), None if none."""
    rows = [i for i, s in enumerate(seqs) if s.params.has_penalty]
    if not rows:
        return None
    width = max(len(seqs[i].tokens) for i in rows)
    f32, i64 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int64, device=device)
    params = [seqs[i].params for i in rows]
    return Penalties(
        rows=torch.tensor(rows, **i64),
        ids=torch.tensor([seqs[i].tokens + [-1] * (width - len(seqs[i].tokens)) for i in rows], **i64),
        num_prompt=torch.tensor([seqs[i].num_prompt for i in rows], **i64),
        presence=torch.tensor([p.presence_penalty for p in params], **f32),
        frequency=torch.tensor([p.frequency_penalty for p in params], **f32),
        repetition=torch.tensor([p.repetition_penalty for p in params], **f32))


class SampledTokens:
    """One step's sampled tokens (and logprobs) on their way to the host. ``tokens`` [S] int64 stays
    on the device (the engine feeds it to the next step without waiting); the host copies are
    issued without blocking, and ``collect`` waits for them only."""

    def __init__(self, tokens: Tensor, logprobs: Optional[Tuple[Tensor, Tensor, Tensor, Tensor]], asking: List[int],
                 counts: List[int]):
        self.tokens, self.asking, self.counts = tokens, asking, counts
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) if t.is_cuda
                      else t for t in (tokens, *(logprobs or ()))]  # on the host, or on their way there
        self._event = None
        if tokens.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def ready(self) -> bool:
        """Whether the host copies have arrived (``collect`` would not wait)."""
        return self._event is None or self._event.query()

    def collect(self) -> List[Tuple[int, Optional[LogprobEntry]]]:
        """(token, ``LogprobEntry`` or None) of each row: the sampled token's log-probability, the
        row's ``params.logprobs`` most likely tokens' and the sampled token's rank."""
        if self._event is not None:
            self._event.synchronize()
        tokens, *logprobs = (t.tolist() for t in self._host)
        entries: List[Optional[LogprobEntry]] = [None] * len(tokens)
        if self.asking:
            chosen, top_values, top_ids, ranks = logprobs
            for j, (i, n) in enumerate(zip(self.asking, self.counts)):
                entries[i] = (chosen[j], list(zip(top_ids[j][:n], top_values[j][:n])), ranks[j])
        return list(zip(tokens, entries))


def sample_sequences(logits: Tensor, seqs: List[Sequence], positions: Optional[List[int]] = None) -> SampledTokens:
    """The next token of each sequence, logits [len(seqs), V] (row i is seqs[i]'s), each with its own
    ``params``, ``seed`` and position (``positions``, default ``len(tokens)``), its logit bias and
    token mask (``controlled_logits``), and the logprobs its ``params.logprobs`` asks for, of the raw
    logits (``token_logprobs``)."""
    dev = logits.device
    params = [s.params for s in seqs]
    modes = {p.mode for p in params}
    penalties = penalties_of(seqs, dev)
    positions = positions if positions is not None else [len(s.tokens) for s in seqs]
    scores = controlled_logits(logits, seqs, positions)
    if modes == {"greedy"} and penalties is None:
        tokens = scores.argmax(dim=-1)
    else:
        floats = to_device(np.array([[p.temperature, p.top_p, p.min_p] for p in params], np.float32).T.copy(), dev)
        longs = to_device(np.array([[p.top_k for p in params], [s.seed for s in seqs], positions], np.int64), dev)
        any_min_p = any(p.min_p > 0 and p.mode != "greedy" for p in params)
        tokens = sample_rows(scores, floats[0], longs[0], floats[1], longs[1], longs[2],
                             any_random=bool(modes - {"greedy"}), any_top="top" in modes,
                             min_p=floats[2] if any_min_p else None, penalties=penalties)
    asking = [i for i, p in enumerate(params) if p.logprobs is not None]
    logprobs = None
    if asking:
        rows = to_device(np.array(asking, np.int64), dev)
        k = min(max(params[i].logprobs for i in asking), logits.shape[-1])
        logprobs = token_logprobs(logits[rows], tokens[rows], k)
    return SampledTokens(tokens, logprobs, asking, [params[i].logprobs for i in asking])
