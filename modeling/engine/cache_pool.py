"""The engine's cache pool: every layer's state for every running sequence, allocated once.

Each layer kind declares what it keeps (``DecoderLayer.cache_spec``): per-position tensors,
addressed in blocks of ``block_size`` positions through a sequence's block table, and
per-sequence tensors, one state slot a sequence. Layout (the kernels and the persistent decode
kernel address it this way):

- an attention layer: ``k``, ``v`` [num_blocks, block_size, Hk, D] (the model dtype). A token's KV
  slot is ``block * block_size + offset``: its row in the [num_blocks * block_size, Hk, D] view.
  Block ids come from the sequence's block table (``modeling.engine.block_manager``), shared by
  all layers: block b of layer 0 and block b of layer 27 hold the same positions. The layers'
  per-position tensors are views of one tensor per kind stacked [NA, num_blocks, block_size, Hk,
  D] (``kv``): what the persistent decode kernel reads for every layer at once;
- a Gated DeltaNet layer: ``conv`` [num_slots + 1, C, K-1] (the model dtype) and ``state``
  [num_slots + 1, Hv, Dk, Dv] (fp32; float64 for float64 models), one slot per running sequence
  (``Sequence.state_slot``), the same slot in every layer, and the padding slot (the last) that
  the padding rows of a captured step read and write. The layers' per-sequence tensors are views
  of one tensor per kind stacked [NG, num_slots + 1, ...] (``states``): what the hybrid persistent
  decode kernel reads for every layer at once.

The pool is sized from the memory the device has free (``size_for``) and never moves, as CUDA
graph replay needs.
"""

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..model.device import DoesNotFit, available_memory
from ..model.files import format_size
from ..model.layers import CacheSpec


@dataclass
class PoolSize:
    num_blocks: int
    block_size: int
    num_state_slots: int

    def describe(self, model) -> str:
        bytes_ = bytes_per_block(model, self.block_size) * self.num_blocks + \
            bytes_per_state_slot(model) * self.num_state_slots
        text = (f"{self.num_blocks} KV blocks of {self.block_size} positions "
                f"({self.num_blocks * self.block_size} positions)")
        if self.num_state_slots:
            text += f", {self.num_state_slots} recurrent-state slots"
        return f"{text}, {bytes_ / 2**30:.2f} GiB"


def cache_specs(model) -> List[CacheSpec]:
    return [layer.cache_spec(layer.config, model.dtype) for layer in model.layers]


def _nbytes(shapes) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes)


def bytes_per_block(model, block_size: int = 1) -> int:
    """Bytes of ``block_size`` positions in every layer."""
    return block_size * sum(_nbytes(s.per_position) for s in cache_specs(model))


def bytes_per_state_slot(model) -> int:
    """Bytes of one sequence's state slot in every layer."""
    return sum(_nbytes(s.per_sequence) for s in cache_specs(model))


def size_for(model, block_size: int, max_num_seqs: int, max_model_len: int, gpu_memory_utilization: float,
             reserve_bytes: int = 0, free_bytes: Optional[int] = None) -> PoolSize:
    """The pool for ``model``: one state slot per sequence (hybrid models), and as many KV blocks as
    ``gpu_memory_utilization`` of the device's free memory (the host's, on the CPU; ``free_bytes``
    when given) holds after the slots and ``reserve_bytes`` (the step's activations), but never
    fewer than one full-length sequence needs nor more than ``max_num_seqs`` full-length sequences
    need. ``DoesNotFit`` (a ``MemoryError``) when one full-length sequence does not fit."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    slot_bytes = bytes_per_state_slot(model)
    slots = max_num_seqs if slot_bytes else 0
    per_seq = -(-max_model_len // block_size)
    most = per_seq * max_num_seqs
    per_block = bytes_per_block(model, block_size)
    free = available_memory(model.device) if free_bytes is None else free_bytes
    if free is None or per_block == 0:  # (no attention layer: the blocks hold nothing)
        return PoolSize(most, block_size, slots)
    budget = free * gpu_memory_utilization - reserve_bytes - slots * slot_bytes
    blocks = min(most, int(budget // per_block))
    if blocks < per_seq:
        raise DoesNotFit(
            f"the cache of one {max_model_len}-token sequence needs {format_size(per_seq * per_block + slot_bytes)}"
            f"; {gpu_memory_utilization:.0%} of the {format_size(free)} free on {model.device} leaves "
            f"{format_size(max(budget, 0) + slots * slot_bytes)} (lower max_model_len or max_num_seqs)")
    return PoolSize(blocks, block_size, slots)


class CachePool:
    """``layers[i]``: layer i's pool entry, the tensors of its ``cache_spec``, views of the stacked
    ``kv`` and ``states`` (the module doc's layout)."""

    def __init__(self, model, size: PoolSize):
        dev = model.device
        self.size = size
        self.padding_slot = size.num_state_slots
        specs = cache_specs(model)

        def stack(kind: str, lead: Tuple[int, ...]) -> Tuple[torch.Tensor, ...]:
            """One tensor [n, *lead, *shape] for each of the ``kind`` tensors of the n layers that keep them."""
            kept = [getattr(s, kind) for s in specs if getattr(s, kind)]
            if any(p != kept[0] for p in kept):
                raise ValueError(f"the layers keep {kind.replace('_', '-')} state of different shapes: one stacked "
                                 "pool takes one")
            return tuple(torch.zeros((len(kept), *lead, *shape), dtype=dtype, device=dev)
                         for shape, dtype in (kept[0] if kept else ()))

        self.kv = stack("per_position", (max(size.num_blocks, 1), size.block_size))
        self.states = stack("per_sequence", (size.num_state_slots + 1,))  # and the padding slot
        per_position, per_sequence = iter(zip(*self.kv)), iter(zip(*self.states))
        layers: List[Tuple[torch.Tensor, ...]] = []
        for spec in specs:
            entry = next(per_position) if spec.per_position else ()
            entry += next(per_sequence) if spec.per_sequence else ()
            layers.append(entry)
        self.layers = tuple(layers)
