"""The engine's steps in CUDA graphs on static buffers, one graph per padded shape (docs/generate.md,
"CUDA graphs").

A decode-only step of S sequences runs in the graph of the smallest sequence bucket b >= S (1, 2,
4, ..., ``max_num_seqs``); a prefill or mixed step of N tokens in S sequences in the graph of the
smallest token bucket t >= N and sequence bucket s >= S + 1. Padding rows touch nothing (KV slot
-1, length 0, the pool's padding state slot); a mixed step's sequence S holds its t - N padding
tokens, and the logits of rows that do not sample are computed and dropped.

The block table is ``max_blocks`` wide in every graph, so the attention kernels' split count is
fixed per shape. Graphs share one memory pool; a decode graph keeps its own logits, the prefill and
mixed graphs write theirs into one shared [``max_num_seqs`` + 1, V] buffer (a logits tensor per
shape would pin ~1.8 GB at 256 sequences and Qwen3's vocabulary). Without CUDA graphs (the CPU, or
``enabled=False``) the same padded bodies run eagerly; so does a step that scores prompt tokens.

A step's inputs reach the device in two copies: the batch ``step.pack`` writes into a pinned host
buffer, and its block table rows into the static table, unless the step's tables are those already
there (the same list objects, none grown; a released table is replaced by a new list, never
refilled: ``scheduler``). Two host buffers take turns, each reused only once its last transfer has
run (an event), since the engine packs the next step while the device still runs this one.
"""

import time
from dataclasses import replace
from typing import Callable, Dict, Hashable, Optional, Tuple

import torch
from torch import Tensor

import qwen_ops

from ..model.context import KERNELS, StepContext
from .graphs import GraphCache
from .step import Fields, Packed, StagedStep, StepBatch, fields, pack, table_offset

PERSISTENT_MAX_LEN = 4096
"""The longest ``max_model_len`` whose decode steps take the persistent kernels by default."""
PERSISTENT_MAX_HIDDEN = 2048
"""The widest ``hidden_size`` whose decode steps take the persistent kernels by default."""
FUSED_MAX_SEQS = 8
"""The most rows a decode step takes the fused decode ops (or the dense persistent kernel, whose
16-bit GEMV tasks take up to this many rows on tensor cores) with on CUDA by default."""


def decode_kernels(model, num_seqs: int, max_model_len: int) -> str:
    """The kernels (``modeling.model.context.KERNELS``) of a decode-only step of ``num_seqs`` rows,
    the fastest measured per case (docs/generate.md, "Decode kernels"; docs/performance.md)."""
    if not model.supports_fused_decode:
        return "ops"
    cuda = model.device.type == "cuda"
    if num_seqs > 1 and not (cuda and num_seqs <= FUSED_MAX_SEQS):
        return "ops"
    if num_seqs > 1:  # the hybrid kernel and FP8 tiles take their rows one by one: slower than the fused ops
        persistent = model.supports_persistent_decode and not model.holds_fp8
    else:
        persistent = model.supports_persistent_decode or model.supports_hybrid_persistent_decode
    if persistent and cuda and max_model_len <= PERSISTENT_MAX_LEN and \
            model.config.hidden_size <= PERSISTENT_MAX_HIDDEN:
        return "persistent"
    return "fused"


def buckets(limit: int) -> tuple:
    """1, 2, 4, ... below ``limit``, then ``limit``."""
    return tuple(1 << i for i in range((limit - 1).bit_length())) + (limit,)


class StepRunner:
    """``kernels``: the decode steps' kernels, one of ``KERNELS`` for every decode shape, or None
    for ``decode_kernels``' choice per shape (prefill and mixed steps run op by op)."""

    def __init__(self, model, pool, max_num_seqs: int, max_num_batched_tokens: int, max_blocks: int,
                 block_size: int, enabled: bool, kernels: Optional[str] = None):
        dev = model.device
        if kernels is not None and kernels not in KERNELS:
            raise ValueError(f"decode_kernels must be one of {', '.join(KERNELS)} (or None), got {kernels!r}")
        persistent = model.supports_persistent_decode or model.supports_hybrid_persistent_decode
        if kernels == "persistent" and not persistent:
            raise ValueError("decode_kernels='persistent' needs a model of attention layers without an output gate "
                             "(Qwen3, Qwen2) or of Gated DeltaNet and gated attention layers (Qwen3.5), with dense "
                             "MLPs, on one device (not tensor-parallel; FP8 weights in Qwen3 and Qwen2 only)")
        if kernels == "fused" and not model.supports_fused_decode:
            raise ValueError("decode_kernels='fused' needs dense MLPs, the model on one device and, in FP8 weights, "
                             "unquantised rows only in a Gated DeltaNet in_proj: a mixture-of-experts or "
                             "tensor-parallel model decodes op by op")
        if kernels == "persistent" and max_num_seqs > qwen_ops.DECODE_LAYERS_MAX_ROWS:
            raise ValueError(f"decode_kernels='persistent' takes at most {qwen_ops.DECODE_LAYERS_MAX_ROWS} sequences "
                             f"a step, got max_num_seqs {max_num_seqs}")
        self.model, self.pool, self.block_size = model, pool, block_size
        self.max_model_len = max_blocks * block_size
        self.kernels = kernels
        self.seq_buckets = buckets(max_num_seqs + 1)  # room for the padding sequence
        self.token_buckets = buckets(max(max_num_batched_tokens, max_num_seqs))
        T, S = self.token_buckets[-1], self.seq_buckets[-1]
        size = table_offset(T, S) + 4 * (S - 1) * max_blocks
        self.inputs = torch.zeros(size, dtype=torch.uint8, device=dev)
        self.block_table = torch.zeros(S, max_blocks, dtype=torch.int32, device=dev)
        cuda = dev.type == "cuda"
        self.staging = [torch.zeros(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)] if cuda \
            else [self.inputs]  # the CPU packs in place
        self.staged = [torch.cuda.Event() for _ in self.staging] if cuda else []  # each one's last transfer
        self.turn = 0
        self.views: Dict[Hashable, Fields] = {}  # each shape's fields in ``inputs``
        self.replays: Dict[Hashable, Callable[[], None]] = {}  # each shape's graph replay (or eager body)
        self.logits: Dict[Hashable, Tensor] = {}
        self.mixed_logits = torch.empty(S, model.config.vocab_size, dtype=model.dtype, device=dev)
        self.shape = None  # the key of the graph being captured
        self.capture_s = 0.0  # host seconds spent capturing step graphs (``_capture_new``)
        self._tables: list = []  # the block tables (list objects) and their lengths in ``block_table`` now
        qwen_ops.reserve_decode_buffers(dev)  # before any capture: the decode kernels' per-device buffers
        if any(self.decode_kernels(s) == "persistent" for s in self.seq_buckets):
            model.stack_layer_weights()  # before any capture: the graphs read the weights by address
        self.graphs = GraphCache(dev, enabled and cuda, self._reset)

    def decode_kernels(self, num_seqs: int) -> str:
        """The kernels of a decode-only step of ``num_seqs`` rows (its graph's)."""
        return self.kernels or decode_kernels(self.model, num_seqs, self.max_model_len)

    def _stage(self, work, key) -> Tuple[Packed, Tensor]:
        """Pack ``work`` for graph shape ``key`` into the next host buffer and copy it to the device:
        the packed batch and the bytes it took on the host."""
        i, host = self._next_host()
        packed = pack(work, key, self.block_size, self.pool.padding_slot, host.numpy())
        self._send(i, packed.nbytes)
        return packed, host[:packed.nbytes]

    def _next_host(self) -> Tuple[int, Tensor]:
        """The next host buffer and its index, once its last transfer has run."""
        i = self.turn
        self.turn = (i + 1) % len(self.staging)
        if self.staged:
            self.staged[i].synchronize()
        return i, self.staging[i]

    def _send(self, i: int, nbytes: int) -> None:
        """Copy the first ``nbytes`` of host buffer ``i`` to the device (on the CPU it is the device's)."""
        if self.staged:
            self.inputs[:nbytes].copy_(self.staging[i][:nbytes], non_blocking=True)
            self.staged[i].record(torch.cuda.current_stream(self.inputs.device))

    def _reset(self) -> None:
        """The all-padding batch of the shape being captured (``self.shape``): a step on it (a
        capture's warm-up) writes no KV and no state but the padding slot's, and reads nothing out of
        bounds (a previous step's logits rows could lie past a smaller step's tokens)."""
        self._stage([], self.shape)

    def _batch(self, key) -> StepBatch:
        kind, t, s = key
        f = self.views.get(key)
        if f is None:
            f = self.views[key] = fields(self.inputs, t, s)
        return StepBatch(
            input_ids=f.input_ids, positions=f.positions, slot_mapping=f.slot_mapping, cu_seqlens_q=f.cu_seqlens_q,
            seq_lens=f.seq_lens, block_table=self.block_table[:s], state_slots=f.state_slots,
            logits_rows=f.logits_rows, sampling=list(range(s)), query_lens=[], starts=[],
            max_query_len=1 if kind == "decode" else t, key=key)

    def _body(self, key):
        kernels = self.decode_kernels(key[2]) if key[0] == "decode" else "ops"

        def body():
            batch = self._batch(key)
            logits = self.model(batch.input_ids, StepContext(batch, self.pool, kernels))
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
        todo = [key for key in self.all_keys() if key not in self.replays] if self.graphs.enabled else []
        for key in todo:
            self._capture_new(key, False)
        return len(todo)

    def key(self, num_tokens: int, num_seqs: int, decode_only: bool) -> tuple:
        """The graph shape a step of ``num_tokens`` tokens in ``num_seqs`` sequences runs in."""
        if num_tokens > self.token_buckets[-1] or num_seqs + 1 > self.seq_buckets[-1]:
            raise ValueError(f"a step of {num_tokens} tokens in {num_seqs} sequences exceeds the step graphs' "
                             f"{self.token_buckets[-1]} tokens in {self.seq_buckets[-1] - 1} sequences")
        if decode_only:
            s = next(b for b in self.seq_buckets if b >= num_seqs)
            return "decode", s, s
        return ("mixed", next(b for b in self.token_buckets if b >= num_tokens),
                next(b for b in self.seq_buckets if b > num_seqs))

    def prepare(self, step, eager: bool = False) -> StepBatch:
        """The batch of a scheduled step (``scheduler.ScheduledStep``) in the static buffers of its
        graph shape, on its way to the device: the graph is captured first if the shape is new (the
        capture stages its own all-padding batch; not for an ``eager`` step, one that ``run`` takes
        with prompt-logprob rows), then the step's batch is staged. ``batch.staged`` is what a
        tensor-parallel worker needs to stage the same batch (``load``)."""
        work = step.work
        key = self.key(step.num_tokens, len(work), step.decode_only)
        width = max(len(seq.block_table) for seq, _ in work)
        if width > self.block_table.shape[1]:
            raise ValueError(f"a sequence holds {width} KV blocks; the step graphs take {self.block_table.shape[1]}")
        self._capture_new(key, eager)
        packed, host = self._stage(work, key)
        batch = self._batch(key)
        tables = [(seq.block_table, len(seq.block_table)) for seq, _ in work]
        copied = None
        if len(tables) != len(self._tables) or any(a is not b or m != n for (a, m), (b, n) in zip(tables, self._tables)):
            copied = (len(work), width)  # a table grew, or other sequences: copy the rows
            self._copy_tables(key, packed.nbytes, *copied)
            self._tables = tables
        batch.sampling, batch.query_lens, batch.starts = packed.sampling, packed.query_lens, packed.starts
        batch.pending = packed.pending
        if self.model.parallel.world_size > 1:
            batch.staged = StagedStep(key, eager, host.numpy().copy(), copied, len(packed.sampling),
                                      list(packed.query_lens), list(packed.starts))
        return batch

    def load(self, staged: "StagedStep") -> StepBatch:
        """The batch rank 0 ``prepare``d, from its ``StagedStep``, in this (worker's) buffers: the
        same captures at the same steps, the same bytes staged, the same table rows copied."""
        self._capture_new(staged.key, staged.eager)
        i, host = self._next_host()
        host[:len(staged.data)].copy_(torch.from_numpy(staged.data))
        self._send(i, len(staged.data))
        batch = self._batch(staged.key)
        if staged.tables is not None:
            self._copy_tables(staged.key, len(staged.data), *staged.tables)
            self._tables = []  # rank 0's tables are not this process's: compare nothing
        batch.sampling = list(range(staged.num_sampling))
        batch.query_lens, batch.starts = staged.query_lens, staged.starts
        return batch

    def _capture_new(self, key, eager: bool) -> None:
        if key not in self.replays and not eager:
            t0 = time.perf_counter()
            self.shape = key
            self.replays[key] = self.graphs.get(key, self._body(key))
            self.capture_s += time.perf_counter() - t0

    def _copy_tables(self, key, nbytes: int, num_seqs: int, width: int) -> None:
        """Copy the staged block table rows [num_seqs, width] into the static table."""
        offset = self.views[key].table_offset
        self.block_table[:num_seqs, :width].copy_(self.inputs[offset:nbytes].view(torch.int32).view(num_seqs, width))

    def run(self, batch: StepBatch, prompt_rows: Optional[Tensor] = None) -> Tensor:
        """Run a ``prepare``d step: the logits [Ss, V] of its sampling sequences, in order. With
        ``prompt_rows`` [R] int64 (token rows whose logits the prompt logprobs need,
        ``prefill_logprobs``): the padded step runs eagerly, op by op, outside the CUDA graphs, and
        the logits are [Ss + R, V], the sampling rows first."""
        key = batch.key
        if prompt_rows is not None:
            rows = torch.cat([batch.logits_rows[:len(batch.sampling)], prompt_rows])
            return self.model(batch.input_ids, StepContext(replace(batch, logits_rows=rows), self.pool, "ops"))
        self.replays[key]()
        logits = self.logits[key]
        return logits[:len(batch.sampling)] if key[0] == "mixed" else logits[:batch.num_seqs]
