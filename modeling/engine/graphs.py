"""GraphCache: CUDA graphs of step functions, captured on first use, one per key, in one memory pool."""

from typing import Callable, Dict, Hashable

import torch

WARMUP_STEPS = 2


class GraphCache:
    """``get(key, body)`` returns a callable that runs ``body`` (a function of static buffers with
    no host sync inside): the replay of a CUDA graph, captured the first time ``key`` is asked for:

    1. ``reset()`` (the caller's: put the buffers in a valid, in-range state), then ``body()``
       ``WARMUP_STEPS`` times on a side stream: every Triton kernel is compiled and its module
       loaded outside the capture (the kernels never autotune);
    2. capture one ``body()`` with ``torch.cuda.graph(g, pool=pool, stream=side_stream)``.

    All graphs share one pool (``torch.cuda.graph_pool_handle()``): only intermediates live there,
    whatever must survive a replay is in the caller's buffers, so graphs may replay in any order.
    Disabled (no CUDA graphs), ``get`` returns ``body`` itself and captures nothing.
    """

    def __init__(self, device: torch.device, enabled: bool, reset: Callable[[], None]):
        self.device, self.enabled, self.reset = device, enabled, reset
        self.graphs: Dict[Hashable, "torch.cuda.CUDAGraph"] = {}
        self.pool = torch.cuda.graph_pool_handle() if enabled else None
        self.stream = torch.cuda.Stream(device=device) if enabled else None

    def get(self, key: Hashable, body: Callable[[], None]) -> Callable[[], None]:
        if not self.enabled:
            return body
        if key not in self.graphs:
            self.reset()
            current = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                for _ in range(WARMUP_STEPS):
                    body()
            current.wait_stream(self.stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                body()
            self.graphs[key] = graph
        return self.graphs[key].replay
