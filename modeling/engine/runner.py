"""The engine's decode steps in CUDA graphs, one per batch bucket, on static buffers.

A decode-only step (every sequence computes one token) of S sequences runs in the graph of the
smallest bucket b >= S (1, 2, 4, ..., ``max_num_seqs``): its tensors are copied into rows [0, S)
of the static buffers, rows [S, b) are padding that touches nothing (KV slot -1: not written;
length 0: no keys read; the pool's padding state slot for recurrent layers), and the graph's
logits rows [0, S) are the step's. The block table is ``max_blocks`` wide for every bucket, so the
attention kernels' split count, which depends on shapes only, is fixed per graph.

Prefill and mixed steps run eagerly (``QwenForCausalLM.forward_step`` on the step's own tensors).
Without CUDA graphs (the CPU, or ``enabled=False``) a decode step runs the same padded body
eagerly, so the CPU tests cover the padding.
"""

from typing import Dict

import torch
from torch import Tensor

from ..graph_cache import GraphCache
from .step import StepBatch


def buckets(limit: int) -> tuple:
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return tuple(out) + (limit,)


class DecodeRunner:
    def __init__(self, model, pool, max_num_seqs: int, max_blocks: int, enabled: bool):
        dev = model.device
        self.model, self.pool = model, pool
        self.buckets = buckets(max_num_seqs)
        B = self.buckets[-1]
        i64, i32 = dict(dtype=torch.int64, device=dev), dict(dtype=torch.int32, device=dev)
        self.input_ids = torch.zeros(B, **i64)
        self.positions = torch.zeros(B, **i64)
        self.slot_mapping = torch.full((B,), -1, **i64)
        self.seq_lens = torch.zeros(B, **i32)
        self.block_table = torch.zeros(B, max_blocks, **i32)
        self.state_slots = torch.full((B,), pool.padding_slot, **i64)
        self.rows = torch.arange(B, **i64)
        self.cu_seqlens = torch.arange(B + 1, **i32)
        self.logits: Dict[int, Tensor] = {}
        self.graphs = GraphCache(dev, enabled and dev.type == "cuda", self._reset)

    def _reset(self) -> None:
        """Every row padding: a step on these buffers writes no KV and no state but the padding slot's."""
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        self.state_slots.fill_(self.pool.padding_slot)

    def _batch(self, b: int) -> StepBatch:
        return StepBatch(
            input_ids=self.input_ids[:b], positions=self.positions[:b], slot_mapping=self.slot_mapping[:b],
            cu_seqlens_q=self.cu_seqlens[:b + 1], seq_lens=self.seq_lens[:b], block_table=self.block_table[:b],
            state_slots=self.state_slots[:b], logits_rows=self.rows[:b], decode_rows=self.rows[:b],
            decode_slots=self.state_slots[:b], chunks=[], sampling=list(range(b)), query_lens=[1] * b,
            starts=[0] * b, max_query_len=1)

    def _body(self, b: int):
        def body():
            self.logits[b] = self.model.forward_step(self._batch(b), self.pool)
        return body

    def run(self, batch: StepBatch) -> Tensor:
        """The logits [S, V] of a decode-only step."""
        s = batch.num_seqs
        b = next(x for x in self.buckets if x >= s)
        width = batch.block_table.shape[1]
        if width > self.block_table.shape[1]:
            raise ValueError(f"a sequence holds {width} KV blocks; the decode graphs take {self.block_table.shape[1]}")
        replay = self.graphs.get(b, self._body(b))  # captured first: the capture resets the buffers
        self._reset()
        self.input_ids[:s].copy_(batch.input_ids)
        self.positions[:s].copy_(batch.positions)
        self.slot_mapping[:s].copy_(batch.slot_mapping)
        self.seq_lens[:s].copy_(batch.seq_lens)
        self.block_table[:s, :width].copy_(batch.block_table)
        if batch.decode_slots.numel():
            self.state_slots[:s].copy_(batch.decode_slots)
        replay()
        return self.logits[b][:s]
