"""Per-request sampling for a batch of sequences with different settings, on the device.

Every row has its own temperature, top-k, top-p and seed; one code path serves a batch that
mixes them (greedy rows take the argmax). The randomness of row i is a counter-based stream: the
uniform for vocabulary rank v is a hash of (seed_i, position_i, v), where position_i is the
position of the token being sampled. So a request's tokens depend only on its own seed and
logits, never on which other requests share its steps, and a seeded request is reproducible.
The draw is the Gumbel-max race of ``modeling.sampling``: argmax(logits / T - log E), E = -log U.
"""

import torch
from torch import Tensor

from ..sampling import filtered_sorted_scores

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


def sample_rows(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seeds: Tensor,
                positions: Tensor, any_random: bool, any_top: bool) -> Tensor:
    """One token per row of logits [S, V]: temperature, top_p [S] fp32; top_k, seeds, positions [S]
    int64. A row of temperature 0 or top_k 1 takes the argmax; the others draw from softmax(logits /
    T) cut to the top-k ranks, then to the smallest prefix of mass >= top_p. ``any_random`` (some
    row draws) and ``any_top`` (some row cuts) are host flags: the batch pays only for what it uses."""
    greedy = logits.argmax(dim=-1)
    if not any_random:
        return greedy
    scores = logits.float() / temperature.clamp_min(MIN_TEMPERATURE)[:, None]
    gumbel = uniforms(seeds, positions, scores.shape[-1]).log_().neg_().log_().neg_()
    if any_top:
        sorted_scores, order = filtered_sorted_scores(scores, top_k, top_p)
        drawn = order.gather(-1, (sorted_scores + gumbel).argmax(dim=-1, keepdim=True))[:, 0]
    else:
        drawn = (scores + gumbel).argmax(dim=-1)
    return torch.where((temperature == 0) | (top_k == 1), greedy, drawn)
