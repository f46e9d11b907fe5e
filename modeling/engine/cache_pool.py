"""The engine's cache pool: every layer's cache for every running sequence, allocated once.

Layout (the kernels and the persistent decode kernel address it this way):

- an attention layer: ``k``, ``v`` [num_blocks, block_size, Hk, D] (the model dtype). A token's KV
  slot is ``block * block_size + offset``: its row in the [num_blocks * block_size, Hk, D] view.
  Block ids come from the sequence's block table (``modeling.engine.block_manager``), shared by
  all layers: block b of layer 0 and block b of layer 27 hold the same positions. The attention
  layers' entries are views of one k and one v tensor [NA, num_blocks, block_size, Hk, D], layer
  by layer: what the persistent decode kernel reads for every layer at once;
- a Gated DeltaNet layer: ``conv`` [num_slots + 1, C, K-1] (the model dtype) and ``state``
  [num_slots + 1, Hv, Dk, Dv] (fp32; float64 for float64 models), one slot per running sequence
  (``Sequence.state_slot``), the same slot in every layer, and the padding slot (the last) that
  the padding rows of a captured decode step read and write.

The pool is sized from the memory the device has free (``size_for``) and never moves, as CUDA
graph replay needs.
"""

from dataclasses import dataclass
from typing import List, Tuple

import torch

from ..model.layers import AttentionLayer, GatedDeltaNetLayer


@dataclass
class PoolSize:
    num_blocks: int
    block_size: int
    num_state_slots: int

    def describe(self, model) -> str:
        bytes_ = bytes_per_block(model) * self.num_blocks + bytes_per_state_slot(model) * self.num_state_slots
        text = (f"{self.num_blocks} KV blocks of {self.block_size} positions "
                f"({self.num_blocks * self.block_size} positions)")
        if self.num_state_slots:
            text += f", {self.num_state_slots} recurrent-state slots"
        return f"{text}, {bytes_ / 2**30:.2f} GiB"


def _attention_layers(model) -> List[AttentionLayer]:
    return [layer for layer in model.layers if isinstance(layer, AttentionLayer)]


def _recurrent_layers(model) -> List[GatedDeltaNetLayer]:
    return [layer for layer in model.layers if isinstance(layer, GatedDeltaNetLayer)]


def bytes_per_block(model, block_size: int = 1) -> int:
    """KV bytes of ``block_size`` positions in every attention layer."""
    c = model.config
    return 2 * len(_attention_layers(model)) * block_size * c.num_key_value_heads * c.head_dim * model.dtype.itemsize


def bytes_per_state_slot(model) -> int:
    c, layers = model.config, _recurrent_layers(model)
    if not layers:
        return 0
    state_bytes = 8 if model.dtype == torch.float64 else 4
    conv = c.linear_conv_dim * (c.linear_conv_kernel_dim - 1) * model.dtype.itemsize
    state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * state_bytes
    return len(layers) * (conv + state)


def size_for(model, block_size: int, max_num_seqs: int, max_model_len: int, memory_fraction: float,
             reserve_bytes: int = 0) -> PoolSize:
    """The pool for ``model``: one state slot per sequence (hybrid models), and as many KV blocks as
    ``memory_fraction`` of the device's free memory holds after the slots and ``reserve_bytes`` (the
    step's activations), but never fewer than one full-length sequence needs nor more than
    ``max_num_seqs`` full-length sequences need. On the CPU: that upper bound."""
    if not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    slots = max_num_seqs if _recurrent_layers(model) else 0
    per_seq = -(-max_model_len // block_size)
    most = per_seq * max_num_seqs
    per_block = bytes_per_block(model, block_size)
    if model.device.type != "cuda" or per_block == 0:
        return PoolSize(most if per_block else 1, block_size, slots)
    free, _ = torch.cuda.mem_get_info(model.device)
    budget = free * memory_fraction - reserve_bytes - slots * bytes_per_state_slot(model)
    blocks = min(most, int(budget // per_block))
    if blocks < per_seq:
        raise MemoryError(f"the KV cache of one {max_model_len}-token sequence needs "
                          f"{per_seq * per_block / 2**30:.2f} GiB; {memory_fraction:.0%} of the "
                          f"{free / 2**30:.2f} GiB free leaves {max(budget, 0) / 2**30:.2f} GiB (lower "
                          f"max_model_len or "
                          f"raise memory_fraction)")
    return PoolSize(blocks, block_size, slots)


class CachePool:
    """``layers[i]``: layer i's pool entry, (k, v) for attention or (conv, state) for Gated DeltaNet.
    ``kv``: the attention layers' k and v stacked [NA, num_blocks, block_size, Hk, D] (their entries
    are views of them): the layout the persistent decode kernel reads (``ops.decode_layers``)."""

    def __init__(self, model, size: PoolSize):
        c, dev, dtype = model.config, model.device, model.dtype
        self.size = size
        self.padding_slot = size.num_state_slots
        model.prepare_for_graphs(dev)  # before any CUDA graph capture of a step
        layers: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.recurrent = tuple(i for i, layer in enumerate(model.layers) if not isinstance(layer, AttentionLayer))
        shape = (len(_attention_layers(model)), max(size.num_blocks, 1), size.block_size, c.num_key_value_heads,
                 c.head_dim)
        self.kv = tuple(torch.zeros(shape, dtype=dtype, device=dev) for _ in "kv")
        attention = iter(zip(*self.kv))
        for layer in model.layers:
            if isinstance(layer, AttentionLayer):
                layers.append(next(attention))
            else:
                state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
                n = size.num_state_slots + 1  # and the padding slot
                conv = torch.zeros(n, c.linear_conv_dim, c.linear_conv_kernel_dim - 1, dtype=dtype, device=dev)
                state = torch.zeros(n, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                                    dtype=state_dtype, device=dev)
                layers.append((conv, state))
        self.layers = tuple(layers)
