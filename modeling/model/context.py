"""What an engine step hands the model: ``StepContext`` (the step's packed batch, the cache pool and
the kernels the step runner chose for it), and ``LayerContext``, one layer's share of it.

The model reads these fields only (the engine's ``StepBatch`` and ``CachePool`` hold them):

- ``batch``: ``positions``, ``slot_mapping`` [N] (the tokens' positions and KV slots),
  ``cu_seqlens_q`` [S + 1], ``seq_lens`` [S], ``block_table`` [S, W], ``state_slots`` [S],
  ``continues`` [S], ``logits_rows`` [Ss], ``max_query_len`` (``modeling.engine.step``);
- ``pool``: ``layers`` (layer i's entry: its ``DecoderLayer.cache_spec`` tensors), ``kv`` and
  ``states`` (those stacked over the layers, as the persistent decode kernels read them;
  ``modeling.engine.cache_pool``).

``kernels`` (``KERNELS``) is how the layers compute: ``"ops"`` op by op (every step shape),
``"fused"`` the fused decode ops, ``"persistent"`` every layer in one persistent kernel
(``modeling.model.layers`` and ``QwenForCausalLM.forward``). The step runner chooses
(``modeling.engine.runner.decode_kernels``); the model never does.
"""

from typing import Any, NamedTuple, Tuple

from torch import Tensor

KERNELS = ("ops", "fused", "persistent")


class LayerContext(NamedTuple):
    batch: Any
    entry: Tuple[Tensor, ...]
    fused: bool


class StepContext(NamedTuple):
    batch: Any
    pool: Any
    kernels: str = "ops"

    def layer(self, i: int) -> LayerContext:
        return LayerContext(self.batch, self.pool.layers[i], self.kernels == "fused")
