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
decode_rows     [Sd] int64      hybrid models: the rows of the sequences that decode (one token
decode_slots    [Sd] int64      after cached ones) and their state slots, run together
==============  ==============  =================================================================

``chunks``: hybrid models' other sequences (prefill chunks), (first row, tokens, state slot,
first position) each, run one by one by the recurrent layers.

``sampling``: the indices (into the step's work) of the sequences that sample, in logits order.
Host copies of the per-sequence sizes (``query_lens``, ``starts``: positions of the first new
token) and ``max_query_len`` travel with it: the launchers size grids from them without a sync.
"""

from dataclasses import dataclass
from typing import List, Tuple

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
    decode_rows: Tensor
    decode_slots: Tensor
    chunks: List[Tuple[int, int, int, int]]
    sampling: List[int]
    query_lens: List[int]
    starts: List[int]
    max_query_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


def build(step: ScheduledStep, block_size: int, device) -> StepBatch:
    """The batch of a scheduled step (built on the host, copied to ``device`` in one transfer per
    tensor)."""
    ids, pos, slots, cu, lens, starts, qlens, tables, state = [], [], [], [0], [], [], [], [], []
    decode_rows, decode_slots, chunks, sampling = [], [], [], []
    for i, (seq, n) in enumerate(step.work):
        start = seq.num_computed
        if start + n == len(seq.tokens):
            sampling.append(i)
        if seq.state_slot is not None:
            if n == 1 and start > 0:
                decode_rows.append(cu[-1])
                decode_slots.append(seq.state_slot)
            else:
                chunks.append((cu[-1], n, seq.state_slot, start))
        ids += seq.tokens[start:start + n]
        for p in range(start, start + n):
            slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
        pos += range(start, start + n)
        cu.append(cu[-1] + n)
        lens.append(start + n)
        starts.append(start)
        qlens.append(n)
        tables.append(seq.block_table)
        state.append(-1 if seq.state_slot is None else seq.state_slot)
    width = max((len(t) for t in tables), default=1)
    table = [t + [0] * (width - len(t)) for t in tables]
    i64 = dict(dtype=torch.int64, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    return StepBatch(
        input_ids=torch.tensor(ids, **i64), positions=torch.tensor(pos, **i64),
        slot_mapping=torch.tensor(slots, **i64), cu_seqlens_q=torch.tensor(cu, **i32),
        seq_lens=torch.tensor(lens, **i32), block_table=torch.tensor(table, **i32).reshape(len(tables), width),
        state_slots=torch.tensor(state, **i64), logits_rows=torch.tensor([cu[i + 1] - 1 for i in sampling], **i64),
        decode_rows=torch.tensor(decode_rows, **i64), decode_slots=torch.tensor(decode_slots, **i64),
        chunks=chunks, sampling=sampling,
        query_lens=qlens, starts=starts, max_query_len=max(qlens, default=0),
    )
