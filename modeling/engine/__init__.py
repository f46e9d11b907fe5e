"""The engine: continuous batching of flat-token steps over a paged cache pool, the one runtime.

``Engine`` (engine.py) runs requests; ``Scheduler`` (scheduler.py) picks each step's work under a
token budget; ``BlockManager`` (block_manager.py) owns the paged KV blocks and prefix caching;
``CachePool`` (cache_pool.py) holds every layer's state; ``StepBatch`` (step.py) is what one step's
layers read; ``StepRunner`` (runner.py) runs a step in the CUDA graph of its shape with the decode
kernels it picks; ``sample_sequences`` (sampler.py) draws each sequence's token with its own
``SamplingParams`` (sampling_params.py); ``prompts`` holds the prompt checks every way in shares.

The names below are imported on first use, so the torch-free modules (``prompts``) load without
torch: the command line names ``MAX_MODEL_LEN`` from its first instant.
"""

from typing import TYPE_CHECKING

from ..common import lazy_exports

_EXPORTS = {"BLOCK_SIZE": ".engine", "Engine": ".engine", "Sequence": ".sequence", "Status": ".sequence"}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:
    from .engine import BLOCK_SIZE, Engine  # noqa: F401
    from .sequence import Sequence, Status  # noqa: F401
