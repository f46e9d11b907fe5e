"""The flat-token batch of one engine step: what every layer reads, and how the host packs it.

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

A step runs padded to a graph shape (``runner.StepRunner``): t >= N token rows and s > S
sequence rows, the rows past the step's being padding (no KV slot, no cached position, the
padding state slot). ``pack`` writes such a padded batch into one flat byte buffer, laid out per
shape as ``fields`` reads it back: the int64 fields, then the int32 ones, then the step's block
table rows ([S, W], compact). So the whole batch reaches the device in one copy.

``sampling``: the indices (into the step's work) of the sequences that sample, in logits order;
``pending``: those whose input token (its id -1 here) is the previous step's sample, still on the
device: the engine writes it into ``input_ids`` there.
Host copies of the per-sequence sizes (``query_lens``, ``starts``: positions of the first new
token) and ``max_query_len`` travel with it: the launchers size grids without a sync.
"""

from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional, Sequence as Seq, Tuple

import numpy as np
import torch
from torch import Tensor


class StagedStep(NamedTuple):
    """What a tensor-parallel worker needs to stage the batch rank 0 staged (``runner.StepRunner.load``):
    its graph shape ``key``, whether it runs ``eager``ly, the packed bytes ``data`` (uint8), the block
    table rows [S, W] copied from them (None: the table already there is the step's), and the host
    sizes the launchers read."""

    key: tuple
    eager: bool
    data: np.ndarray
    tables: Optional[Tuple[int, int]]
    num_sampling: int
    query_lens: List[int]
    starts: List[int]


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
    key: tuple = ()  # the graph shape it is padded to (``runner.StepRunner.key``)
    staged: Optional[StagedStep] = None  # a tensor-parallel model's: what the workers stage

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def continues(self) -> Tensor:
        """[S] bool: the sequence has cached positions, so a recurrent layer continues the state in
        its slot instead of starting from zeros (padding sequences: False). Computed on the device on
        first use, once per batch."""
        c = self.__dict__.get("_continues")
        if c is None:
            cu = self.cu_seqlens_q
            c = self.__dict__["_continues"] = self.seq_lens > (cu[1:] - cu[:-1])
        return c


def to_device(array: np.ndarray, device) -> Tensor:
    """``array`` on ``device``; to a GPU through pinned memory without blocking the host (a pageable
    copy would wait for the device's queue, holding the host for every tensor)."""
    host = torch.from_numpy(array)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class Fields(NamedTuple):
    """The padded batch of a (t, s) shape as views of a flat byte buffer (numpy array or tensor)."""

    input_ids: object
    positions: object
    slot_mapping: object
    state_slots: object
    logits_rows: object
    cu_seqlens_q: object
    seq_lens: object
    table_offset: int  # byte offset of the block table rows


def table_offset(t: int, s: int) -> int:
    """Byte offset of a (t, s) shape's block table rows: after 3t + 2s int64 and 2s + 1 int32 fields."""
    return 8 * (3 * t + 2 * s) + 4 * (2 * s + 1)


def fields(buffer, t: int, s: int) -> Fields:
    """Views of ``buffer`` (uint8, numpy or torch): int64 [input_ids t | positions t | slot_mapping t
    | state_slots s | logits_rows s], then int32 [cu_seqlens_q s + 1 | seq_lens s], then the block
    table from ``table_offset`` (4-byte aligned)."""
    n64, n32 = 3 * t + 2 * s, 2 * s + 1
    i64, i32 = (np.int64, np.int32) if isinstance(buffer, np.ndarray) else (torch.int64, torch.int32)
    longs = buffer[:8 * n64].view(i64)
    ints = buffer[8 * n64:8 * n64 + 4 * n32].view(i32)
    return Fields(longs[:t], longs[t:2 * t], longs[2 * t:3 * t], longs[3 * t:3 * t + s], longs[3 * t + s:],
                  ints[:s + 1], ints[s + 1:], table_offset(t, s))


class Packed(NamedTuple):
    """What ``pack`` leaves on the host: the step's sizes and its sequences' roles."""

    nbytes: int  # the packed prefix of the buffer to copy
    query_lens: List[int]
    starts: List[int]
    sampling: List[int]
    pending: List[int]


def pack(work: Seq[Tuple["object", int]], shape: tuple, block_size: int, padding_slot: int,
         buffer: np.ndarray) -> Packed:
    """Write the padded batch of ``work`` ((sequence, new tokens) pairs, batch order) for graph shape
    ``shape`` = (kind, t, s) into ``buffer`` (uint8, laid out as ``fields``). Padding rows:
    token 0 at position 0, KV slot -1, no cached position, the padding state slot, logits row 0.
    A decode shape's sequences hold a row each (padding ones too); a mixed shape's padding sequence
    S holds the padding tokens [N, t) and the sequences after it are empty. An empty ``work``
    writes the all-padding batch a graph capture warms up on."""
    kind, t, s = shape
    S = len(work)
    f = fields(buffer, t, s)
    qlens = np.fromiter((n for _, n in work), np.int64, S)
    starts = np.fromiter((seq.num_computed for seq, _ in work), np.int64, S)
    cu = np.zeros(S + 1, np.int64)
    np.cumsum(qlens, out=cu[1:])
    N = int(cu[-1])
    f.cu_seqlens_q[:S + 1] = cu
    f.cu_seqlens_q[S + 1:] = np.arange(S + 1, s + 1) if kind == "decode" else t
    f.seq_lens[:S] = starts + qlens
    f.seq_lens[S:] = 0
    width = max((len(seq.block_table) for seq, _ in work), default=0)
    table = buffer[f.table_offset:f.table_offset + 4 * S * width].view(np.int32).reshape(S, width)
    ids, sampling, pending = f.input_ids, [], []
    for i, (seq, n) in enumerate(work):
        start, row = int(starts[i]), int(cu[i])
        table[i, :len(seq.block_table)] = seq.block_table  # the entries past it are never read
        if start < len(seq.tokens):
            ids[row:row + n] = seq.tokens[start:start + n]
        else:  # its input is the token the step before sampled, not on the host yet
            ids[row] = -1
            pending.append(i)
        if start + n == seq.num_tokens:
            sampling.append(i)
    ids[N:] = 0
    owner = np.repeat(np.arange(S), qlens)  # each token's sequence
    positions = np.arange(N) - cu[owner] + starts[owner]
    f.positions[:N], f.positions[N:] = positions, 0
    f.slot_mapping[:N] = table[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    f.slot_mapping[N:] = -1
    f.state_slots[:S] = np.fromiter((padding_slot if seq.state_slot is None else seq.state_slot for seq, _ in work),
                                    np.int64, S)
    f.state_slots[S:] = padding_slot
    if kind == "decode":
        f.logits_rows[:] = np.arange(s)
    else:
        f.logits_rows[:len(sampling)] = cu[np.array(sampling, np.int64) + 1] - 1
        f.logits_rows[len(sampling):] = 0
    return Packed(f.table_offset + 4 * S * width, qlens.tolist(), starts.tolist(), sampling, pending)

