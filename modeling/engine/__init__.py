"""The serving engine: continuous batching of flat-token steps over a paged cache pool.

``Engine`` (engine.py) runs requests; ``Scheduler`` (scheduler.py) picks each step's work under a
token budget; ``BlockManager`` (block_manager.py) owns the paged KV blocks and prefix caching;
``CachePool`` (cache_pool.py) holds every layer's cache; ``StepBatch`` (step.py) is what one step's
layers read; ``sample_rows`` (sampler.py) draws each sequence's token with its own settings.
"""

from .engine import BLOCK_SIZE, Engine
from .sequence import Sequence, Status

__all__ = ["BLOCK_SIZE", "Engine", "Sequence", "Status"]
