"""The engine's steps in CUDA graphs on static buffers, one graph per padded shape.

A decode-only step (every sequence computes one token) of S sequences runs in the graph of the
smallest sequence bucket b >= S (1, 2, 4, ..., ``max_num_seqs``): rows [S, b) are padding
sequences of one token that touch nothing (KV slot -1: not written; length 0: no keys read; the
pool's padding state slot for recurrent layers).

A prefill or mixed step of N tokens in S sequences (a hybrid model's recurrent layers too: they
take the step's sequences in one packed call per op) runs in the graph of the smallest token
bucket t >= N and sequence bucket s >= S + 1 (powers of two, and the limits):
sequence S is a padding sequence holding the t - N padding tokens (length 0: zeros out, slot -1),
the rest of the s sequences are empty, and the logits of rows that do not sample are computed and
dropped. The attention grid is sized for t queries a sequence, fixed per graph.

The block table is ``max_blocks`` wide in every graph, so the attention kernels' split count,
which depends on shapes only, is fixed too. Graphs are captured the first time their shape
occurs, or all at once (``capture_all``: a server does it before its first client, since a
capture stalls every running sequence for tens of milliseconds), and share one memory pool.
A decode graph keeps its own logits; the prefill and mixed graphs (about 80 shapes) write theirs
into one shared [``max_num_seqs`` + 1, V] buffer, so that capturing every shape does not pin a
logits tensor per shape (~1.8 GB at 256 sequences and Qwen3's vocabulary).
Without CUDA graphs (the CPU, or ``enabled=False``) the same padded bodies run eagerly, so the
CPU tests cover the padding.
"""

from typing import Dict, Hashable, Optional

import torch
from torch import Tensor

from ..generation.graph_cache import GraphCache
from .step import StepBatch


def buckets(limit: int) -> tuple:
    """1, 2, 4, ... below ``limit``, then ``limit``."""
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return tuple(out) + (limit,)


class StepRunner:
    def __init__(self, model, pool, max_num_seqs: int, max_num_batched_tokens: int, max_blocks: int,
                 enabled: bool):
        dev = model.device
        self.model, self.pool = model, pool
        self.seq_buckets = buckets(max_num_seqs + 1)  # room for the padding sequence
        self.token_buckets = buckets(max(max_num_batched_tokens, max_num_seqs))
        T, S = self.token_buckets[-1], self.seq_buckets[-1]
        i64, i32 = dict(dtype=torch.int64, device=dev), dict(dtype=torch.int32, device=dev)
        self.input_ids = torch.zeros(T, **i64)
        self.positions = torch.zeros(T, **i64)
        self.slot_mapping = torch.full((T,), -1, **i64)
        self.cu_seqlens = torch.zeros(S + 1, **i32)
        self.seq_lens = torch.zeros(S, **i32)
        self.block_table = torch.zeros(S, max_blocks, **i32)
        self.state_slots = torch.full((S,), pool.padding_slot, **i64)
        self.logits_rows = torch.zeros(S, **i64)
        self.arange = torch.arange(S + 1, **i64)
        self.arange32 = self.arange.int()
        self.logits: Dict[Hashable, Tensor] = {}
        self.mixed_logits = torch.empty(S, model.config.vocab_size, dtype=model.dtype, device=dev)
        self.shape: Optional[tuple] = None  # the key of the step being set up
        self.graphs = GraphCache(dev, enabled and dev.type == "cuda", self._reset)

    def _reset(self) -> None:
        """Every row padding and every index in range for the step's shape (``self.shape``): a
        step on these buffers (a capture's warm-up) writes no KV and no state but the padding
        slot's, and reads nothing out of bounds (a previous step's logits rows could lie past a
        smaller step's tokens). A mixed shape's tokens all belong to padding sequence 0."""
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        self.state_slots.fill_(self.pool.padding_slot)
        self.logits_rows.zero_()
        self.input_ids.zero_()
        self.positions.zero_()
        self.cu_seqlens.zero_()
        if self.shape is not None and self.shape[0] == "mixed":
            self.cu_seqlens[1:] = self.shape[1]

    def _batch(self, key) -> StepBatch:
        kind, t, s = key
        decode = kind == "decode"
        rows = self.arange[:s]
        return StepBatch(
            input_ids=self.input_ids[:t], positions=self.positions[:t], slot_mapping=self.slot_mapping[:t],
            cu_seqlens_q=self.arange32[:s + 1] if decode else self.cu_seqlens[:s + 1],
            seq_lens=self.seq_lens[:s], block_table=self.block_table[:s], state_slots=self.state_slots[:s],
            logits_rows=rows if decode else self.logits_rows[:s], sampling=list(range(s)),
            query_lens=[], starts=[], max_query_len=1 if decode else t)

    def _body(self, key):
        def body():
            logits = self.model.forward_step(self._batch(key), self.pool)
            if key[0] == "mixed":
                logits = self.mixed_logits[:key[2]].copy_(logits)
            self.logits[key] = logits
        return body

    def all_keys(self) -> list:
        """Every key ``key`` can return: each sequence bucket that 1 to ``max_num_seqs`` decoding
        sequences map to (the smallest bucket >= S), and each token bucket t with each sequence
        bucket that S <= t sequences of a mixed step map to (the smallest bucket > S)."""
        seq, most = self.seq_buckets, self.seq_buckets[-1] - 1
        keys = [("decode", s, s) for lower, s in zip((0,) + seq, seq) if lower < most]
        for t in self.token_buckets:
            keys += [("mixed", t, s) for lower, s in zip(seq, seq[1:]) if lower <= t]
        return keys

    def capture_all(self) -> int:
        """Capture the graph of every shape (``all_keys``) not captured yet; how many were."""
        todo = [key for key in self.all_keys() if key not in self.graphs.keys()] if self.graphs.enabled else []
        for key in todo:
            self.shape = key
            self.graphs.get(key, self._body(key))
        return len(todo)

    def key(self, batch: StepBatch, decode_only: bool) -> Optional[tuple]:
        """The graph a step runs in, or None: it runs eagerly on its own tensors."""
        n, s = int(batch.input_ids.numel()), batch.num_seqs
        if decode_only:
            return "decode", next(b for b in self.seq_buckets if b >= s), next(b for b in self.seq_buckets if b >= s)
        if n > self.token_buckets[-1] or s + 1 > self.seq_buckets[-1]:
            return None
        return "mixed", next(b for b in self.token_buckets if b >= n), next(b for b in self.seq_buckets if b > s)

    def run(self, batch: StepBatch, decode_only: bool) -> Tensor:
        """The logits [Ss, V] of the step's sampling sequences (``batch.logits_rows``)."""
        key = self.key(batch, decode_only)
        if key is None:
            return self.model.forward_step(batch, self.pool)
        kind, t, s = key
        n, m = int(batch.input_ids.numel()), batch.num_seqs
        width = batch.block_table.shape[1]
        if width > self.block_table.shape[1]:
            raise ValueError(f"a sequence holds {width} KV blocks; the step graphs take {self.block_table.shape[1]}")
        self.shape = key
        replay = self.graphs.get(key, self._body(key))  # captured first: the capture resets the buffers
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.seq_lens[:m].copy_(batch.seq_lens)
        self.block_table[:m, :width].copy_(batch.block_table)
        # rows past the step's are padding (see _reset): only these tails change between steps
        self.input_ids[n:t].zero_()
        self.positions[n:t].zero_()
        self.slot_mapping[n:t].fill_(-1)
        self.seq_lens[m:s].zero_()
        if self.pool.recurrent:  # hybrid models: every sequence's state slot, in order (decodes and prefill chunks)
            self.state_slots[:m].copy_(batch.state_slots)
            self.state_slots[m:s].fill_(self.pool.padding_slot)
        sampled = batch.logits_rows.numel()
        if kind == "mixed":
            self.cu_seqlens[:m + 1].copy_(batch.cu_seqlens_q)
            self.cu_seqlens[m + 1:s + 1] = t  # the padding sequence m holds tokens [n, t); the rest are empty
            self.logits_rows[:sampled].copy_(batch.logits_rows)
            self.logits_rows[sampled:s] = 0
        replay()
        logits = self.logits[key]
        return logits[:sampled] if kind == "mixed" else logits[:m]
