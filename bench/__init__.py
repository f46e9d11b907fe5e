"""Benchmarks, one module each: ``python -m bench.<name>`` (see each module's doc).

Most measure on a CUDA GPU: their ``main`` calls ``require_cuda`` once the arguments are parsed
(``--help`` works anywhere), so that without a GPU they say so in one line instead of a traceback.
``bench.cpu``, ``bench.decode --render``, ``bench.train --device cpu`` and ``bench.cuda_suite --gpus N``
run without one.
"""

import sys

NO_CUDA_EXIT = 2
"""The exit status of a benchmark started without the CUDA GPU it needs (as for bad input)."""


def require_cuda(module: str, hint: str = "") -> None:
    """Exit (status 2, one ``error:`` line on stderr, no traceback) when torch sees no CUDA device.
    ``module``: the benchmark's name as run (``bench.decode``); ``hint``: what runs without one."""
    import torch

    if not torch.cuda.is_available():
        print(f"error: python -m {module} needs a CUDA GPU and torch sees none here"
              + (f" ({hint})" if hint else ""), file=sys.stderr)
        sys.exit(NO_CUDA_EXIT)


def gpu_slug(gpu: str) -> str:
    """A GPU's name as result files spell it: "NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3"."""
    return gpu.replace("NVIDIA ", "").replace(" ", "-").lower()
