"""The flat-token batch of one engine step: what every layer reads.

S sequences, N = the sum of their new tokens. Sequence i computes ``query_lens[i]`` tokens, rows
``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` of the batch, at positions ``seq_lens[i] - query_lens[i]``
up to ``seq_lens[i] - 1`` (``seq_lens`` counts its cached positions including these).

==============  ==============  =================================================================
input_ids       [N] int64       the tokens
positions       [N] int64       their positions
slot_mapping    [N] int64       each token's KV slot (``block * block_size + offset``; -1: none)
cu_seqlens_q    [S + 1] int32   row offsets of the sequences
seq_lens        [S] int32       cached positions after this step
block_table     [S, W] int32    each sequence's KV blocks (W: the widest table of the step)
state_slots     [S] int64       each sequence's recurrent-state slot (hybrid models)
logits_rows     [Ss] int64      the last row of each sequence that samples (all its tokens computed)
==============  ==============  =================================================================

``sampling``: the indices (into the step's work) of the sequences that sample, in logits order;
``pending``: those whose input token (its id -1 here) is the previous step's sample, still on the
device: the engine writes it into ``input_ids`` there.
Host copies of the per-sequence sizes (``query_lens``, ``starts``: positions of the first new
token) and ``max_query_len`` travel with it: the launchers size grids from them without a sync.
"""

from dataclasses import dataclass, field
from typing import List

import numpy as np
import torch
from torch import Tensor

from .scheduler import ScheduledStep


@dataclass
class StepBatch:
    input_ids: Tensor
    positions: Tensor
    slot_mapping: Tensor
    cu_seqlens_q: Tensor
    seq_lens: Tensor
    block_table: Tensor
    state_slots: Tensor
    logits_rows: Tensor
    sampling: List[int]
    query_lens: List[int]
    starts: List[int]
    max_query_len: int
    pending: List[int] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def continues(self) -> Tensor:
        """[S] bool: the sequence has cached positions (its first new token's position > 0), so a
        recurrent layer continues the state in its slot instead of starting from zeros. Computed on the
        device from ``seq_lens`` and ``cu_seqlens_q`` on first use, once per batch: a padded step
        graph's padding sequences (length 0 cached) come out False, and the capture records it."""
        c = self.__dict__.get("_continues")
        if c is None:
            cu = self.cu_seqlens_q
            c = self.__dict__["_continues"] = self.seq_lens > (cu[1:] - cu[:-1])
        return c


def to_device(array: np.ndarray, device) -> Tensor:
    """``array`` on ``device``; to a GPU through pinned memory without blocking the host (a pageable
    copy would wait for the device's queue: ~150 us a tensor on the H200 host)."""
    host = torch.from_numpy(array)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def build(step: ScheduledStep, block_size: int, device) -> StepBatch:
    """The batch of a scheduled step, packed on the host with numpy and copied to ``device`` in two
    transfers (the int64 and the int32 fields are views of two tensors)."""
    work = step.work
    S = len(work)
    qlens = np.fromiter((n for _, n in work), np.int64, S)
    starts = np.fromiter((seq.num_computed for seq, _ in work), np.int64, S)
    cu = np.zeros(S + 1, np.int64)
    np.cumsum(qlens, out=cu[1:])
    N = int(cu[-1])
    width = max((len(seq.block_table) for seq, _ in work), default=1)
    ints = np.zeros(2 * S + 1 + S * width, np.int32)  # cu_seqlens | seq_lens | block_table
    ints[:S + 1], ints[S + 1:2 * S + 1] = cu, starts + qlens
    table = ints[2 * S + 1:].reshape(S, width)
    ids = np.empty(N, np.int64)
    sampling, pending = [], []
    for i, (seq, n) in enumerate(work):
        start, row = int(starts[i]), int(cu[i])
        table[i, :len(seq.block_table)] = seq.block_table
        if start < len(seq.tokens):
            ids[row:row + n] = seq.tokens[start:start + n]
        else:  # its input is the token the step before sampled, not on the host yet
            ids[row] = -1
            pending.append(i)
        if start + n == seq.num_tokens:
            sampling.append(i)
    owner = np.repeat(np.arange(S), qlens)  # each token's sequence
    positions = np.arange(N) - cu[owner] + starts[owner]
    slots = table[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    state = np.fromiter((-1 if seq.state_slot is None else seq.state_slot for seq, _ in work), np.int64, S)
    longs = np.concatenate([ids, positions, slots, state, cu[np.array(sampling, np.int64) + 1] - 1])
    ints_dev, longs_dev = to_device(ints, device), to_device(longs, device)
    sizes = (N, N, N, S, len(sampling))
    views = torch.split(longs_dev, sizes)
    return StepBatch(
        input_ids=views[0], positions=views[1], slot_mapping=views[2], cu_seqlens_q=ints_dev[:S + 1],
        seq_lens=ints_dev[S + 1:2 * S + 1], block_table=ints_dev[2 * S + 1:].view(S, width), state_slots=views[3],
        logits_rows=views[4], sampling=sampling,
        query_lens=qlens.tolist(), starts=starts.tolist(), max_query_len=int(qlens.max(initial=0)), pending=pending,
    )
