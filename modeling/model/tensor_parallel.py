"""Tensor parallelism: one model split over the ``world_size`` ranks of a torch.distributed group
(NCCL on GPUs, gloo on the CPU), each rank holding a slice of every layer.

``TensorParallel`` is a rank's place in the group and the collectives the layers need.
``SINGLE`` (world size 1) is the model as it runs on one device: every collective returns its
input, no extra op runs. docs/modeling.md ("Tensor parallelism") says which projections are
column-parallel (each rank's heads' output rows), row-parallel (each rank's heads' input columns,
summed by ``all_reduce``) and vocabulary-parallel (``embedding``, ``gather_logits``).

Heads of a kind split evenly (``heads``): n >= W heads, n a multiple of W, rank r takes
[r n/W, (r+1) n/W); n < W heads (key/value heads where there are fewer than ranks), W a multiple
of n, rank r takes head r n // W, the one its query heads read (GQA: query head h reads key head
h // (Hq / Hk)), replicated on W / n ranks. Intermediate rows and the vocabulary split as heads of
one row. ``Split`` says how a checkpoint tensor splits: along one dim, in sections (e.g. q, k, v
rows of the fused QKV), each divided by heads; ``local_config`` is the per-rank ``QwenConfig``
(its head counts and intermediate size) the layers are built from.
"""

import dataclasses
from typing import Any, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from .config import QwenConfig


class Split(NamedTuple):
    """How a checkpoint tensor is divided among the ranks: along ``dim``, as consecutive
    ``sections``, each (heads, elements per head); a rank takes its heads of each section
    (``TensorParallel.heads``), concatenated in section order."""

    dim: int
    sections: Tuple[Tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """A rank's place in a tensor-parallel group: ``rank`` of ``world_size``, ``group`` the
    torch.distributed process group (None: the default group)."""

    rank: int = 0
    world_size: int = 1
    group: Optional[Any] = None

    @classmethod
    def from_group(cls, group: Optional[Any] = None) -> "TensorParallel":
        """This process's place in ``group`` (default: the initialised default group)."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def heads(self, n: int) -> range:
        """This rank's heads of a kind with ``n`` heads (the module doc's rule)."""
        w, r = self.world_size, self.rank
        if n >= w:
            if n % w:
                raise ValueError(f"{n} heads do not split over {w} ranks")
            return range(r * n // w, (r + 1) * n // w)
        if w % n:
            raise ValueError(f"{n} heads do not replicate over {w} ranks ({w} is not a multiple of {n})")
        return range(r * n // w, r * n // w + 1)

    def ranges(self, split: Split) -> List[Tuple[int, int]]:
        """The [start, stop) element ranges along ``split.dim`` this rank takes, in order."""
        out, offset = [], 0
        for n, size in split.sections:
            mine = self.heads(n)
            out.append((offset + mine.start * size, offset + mine.stop * size))
            offset += n * size
        return out

    def local_config(self, config: QwenConfig) -> QwenConfig:
        """``config`` with this rank's head counts and intermediate size: what its layers hold.
        Raises ``ValueError`` for a model that does not split over ``world_size`` ranks (query
        heads, Gated DeltaNet value heads, intermediate size or vocabulary not a multiple of it; key
        heads neither a multiple nor a divisor of it), or one this package does not split yet
        (mixture of experts, FP8)."""
        if self.world_size == 1:
            return config
        c, w = config, self.world_size
        if c.moe_layers or c.quantization:
            raise ValueError("tensor parallelism takes dense models in bf16, fp16 or fp32: mixture-of-experts and "
                             "FP8 models run on one device")
        for name in ("num_attention_heads", "intermediate_size", "vocab_size", "linear_num_value_heads"):
            if getattr(c, name) % w:
                raise ValueError(f"{name} {getattr(c, name)} does not split over tensor_parallel_size {w}")
        linear_key_heads = self._local_heads(c, "linear_num_key_heads") if c.linear_num_key_heads else 0
        return dataclasses.replace(c, num_attention_heads=c.num_attention_heads // w,
                                   num_key_value_heads=self._local_heads(c, "num_key_value_heads"),
                                   intermediate_size=c.intermediate_size // w,
                                   linear_num_key_heads=linear_key_heads,
                                   linear_num_value_heads=c.linear_num_value_heads // w)

    def _local_heads(self, config: QwenConfig, name: str) -> int:
        """How many of the heads counted by config field ``name`` this rank holds."""
        try:
            return len(self.heads(getattr(config, name)))
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum of ``x`` over the ranks (in place): a row-parallel projection's output."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def embedding(self, input_ids: Tensor, weight: Tensor) -> Tensor:
        """The vocabulary-parallel lookup: ``weight`` [V/W, hidden] holds this rank's vocabulary
        slice; each rank embeds its tokens (zeros for the others) and the all-reduce sums them."""
        if self.world_size == 1:
            return F.embedding(input_ids, weight)
        start = self.rank * weight.shape[0]
        local = input_ids - start
        outside = (local < 0) | (local >= weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0)
        return self.all_reduce(x)

    def gather_logits(self, logits: Tensor) -> Tensor:
        """The full logits [..., V] from each rank's vocabulary slice [..., V/W] (all-gather)."""
        if self.world_size == 1:
            return logits
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.world_size)]
        dist.all_gather(parts, logits, group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()
"""One device: no split, no collective."""
