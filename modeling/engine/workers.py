"""Tensor parallelism's processes: rank 0 is the engine's own process, ranks 1 .. W-1 are worker
processes it starts, one per device (``Workers``; ``LLM(..., tensor_parallel_size=W)`` and
``python -m modeling.serve --tensor-parallel-size W``). docs/modeling.md ("Tensor parallelism")
describes the protocol: rank 0 schedules, sends each step's staged batch (``step.StagedStep``)
before it runs the step itself, samples from the gathered logits and broadcasts the tokens, which a
worker keeps for the inputs the lookahead leaves on the device (``StepBatch.pending``); every
rank's pool is sized from the least memory any rank has free.

Messages (a pipe per worker): ("free",): drop the pool and step runner, then meet rank 0 in
``least_free_memory`` (every rank's pool is sized from the fullest device's free memory);
("engine", size, runner arguments): build the pool and the step runner (again, larger, when
``LLM`` resizes its engine); ("step", staged, pending, prompt_rows):
run a step, then receive its sampled tokens; ("capture",): capture every graph shape; ("stop",).

A worker that dies ends the engine with ``WorkerDied`` naming its rank: rank 0 checks the workers
before each step, while it waits for a step's tokens (``Workers.wait``: a collective replayed in a
CUDA graph has no timeout of its own), and when a collective fails (``Engine.step``); every rank's
process group has a timeout of ``TIMEOUT_S``. Every process sets ``NCCL_ENV`` (no NVLink
multicast: NCCL's NVLS, symmetric memory's and NVSHMEM's).
"""

import contextlib
import ctypes
import gc
import os
import signal
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..model.device import available_memory
from .cache_pool import CachePool
from .runner import StepRunner
from .step import to_device

TIMEOUT_S = 60
"""Seconds a collective may wait for a peer, and the longest a dead worker goes unnoticed."""
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
PR_SET_PDEATHSIG = 1
"""Linux's prctl option: the signal a process gets when its parent exits."""
POLL_S = 0.5
"""How often rank 0 checks the workers while it waits for a step's tokens."""


class WorkerDied(RuntimeError):
    """A tensor-parallel worker process exited while the engine ran."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker loads: the checkpoint ``path`` in ``dtype`` (``quantization`` as ``LLM``
    takes it) on device kind ``device_type`` (its rank's GPU, or the CPU), in a group of
    ``world_size`` ranks that meet at ``init_method``."""

    path: str
    dtype: torch.dtype
    quantization: Optional[str]
    device_type: str
    world_size: int
    init_method: str

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"

    def device(self, rank: int) -> torch.device:
        return torch.device("cuda", rank) if self.device_type == "cuda" else torch.device("cpu")


def init_group(spec: WorkerSpec, rank: int) -> torch.device:
    """Join the tensor-parallel group as ``rank``; this rank's device."""
    os.environ.update(NCCL_ENV)
    device = spec.device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(spec.backend, init_method=spec.init_method, rank=rank, world_size=spec.world_size,
                            timeout=timedelta(seconds=TIMEOUT_S))
    return device


class Workers:
    """Rank 0's handle on ranks 1 .. W-1: ``start`` them, then ``send`` each message to all of them."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(1, spec.world_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(rank, spec, theirs), name=f"qwen-tp-rank-{rank}", daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)

    def check(self) -> None:
        """``WorkerDied`` naming the first worker that has exited."""
        for rank, proc in enumerate(self.procs, 1):
            if not proc.is_alive():
                raise WorkerDied(f"tensor-parallel worker rank {rank} exited (exit code {proc.exitcode})")

    def wait_ready(self, timeout: float) -> None:
        """Wait until every worker has loaded its shard (``WorkerDied`` if one exits first)."""
        deadline = time.monotonic() + timeout
        for rank, conn in enumerate(self.conns, 1):
            while not conn.poll(POLL_S):
                self.check()
                if time.monotonic() > deadline:
                    raise WorkerDied(f"tensor-parallel worker rank {rank} did not load its shard in {timeout:g} s")
            conn.recv()

    def send(self, message: tuple) -> None:
        self.check()
        try:
            for conn in self.conns:
                conn.send(message)
        except OSError:  # a pipe closed by a worker that exited since the check
            time.sleep(0.5)
            self.check()
            raise

    def wait(self, ready: Callable[[], bool]) -> None:
        """Wait until ``ready()``, checking the workers every ``POLL_S`` (``WorkerDied``)."""
        last = time.monotonic()
        while not ready():
            time.sleep(1e-5)
            if time.monotonic() - last > POLL_S:
                self.check()
                last = time.monotonic()

    def close(self, wait: float = TIMEOUT_S) -> None:
        """Stop the workers (killed if they do not exit within ``wait`` seconds: a worker out of step
        waits in a collective until its timeout)."""
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(wait)
            if proc.is_alive():
                proc.kill()
                proc.join()


def least_free_memory(device: torch.device) -> Optional[int]:
    """The least memory free over the ranks (each its own device's ``available_memory``; None when a
    rank cannot tell), which sizes every rank's pool: the fullest device decides."""
    free = available_memory(device)
    least = torch.tensor([-1 if free is None else free], dtype=torch.int64, device=device)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    return None if least.item() < 0 else int(least.item())


def broadcast_tokens(tokens: torch.Tensor) -> None:
    """Rank 0's sampled tokens [S] int64 to every rank (the workers' ``StepMirror.step``)."""
    dist.broadcast(tokens.contiguous(), src=0)


class StepMirror:
    """A worker's half of the engine: the pool and step runner of rank 0's sizes, running each step
    rank 0 staged (``StepRunner.load``) and keeping its sampled tokens."""

    def __init__(self, model, size, runner_args: dict):
        self.model = model
        self.pool = CachePool(model, size)
        self.runner = StepRunner(model, self.pool, **runner_args)
        self.tokens = torch.zeros(0, dtype=torch.int64, device=model.device)  # the last step's samples

    @torch.inference_mode()
    def step(self, staged, pending: Optional[np.ndarray], prompt_rows: Optional[np.ndarray]) -> None:
        """Run rank 0's step: ``pending`` [2, P] (batch rows, rows of the last step's tokens) are the
        inputs to take from the tokens on the device; ``prompt_rows`` the extra logits rows."""
        dev = self.model.device
        batch = self.runner.load(staged)
        if pending is not None:
            dst, src = to_device(pending, dev)
            batch.input_ids.index_copy_(0, dst, self.tokens.index_select(0, src))
        self.runner.run(batch, None if prompt_rows is None else to_device(prompt_rows, dev))
        if staged.num_sampling:
            self.tokens = torch.empty(staged.num_sampling, dtype=torch.int64, device=dev)
            dist.broadcast(self.tokens, src=0)


def worker_main(rank: int, spec: WorkerSpec, conn) -> None:
    """A worker process: join the group, load this rank's shard, then follow rank 0's messages. It
    dies with rank 0 (Linux: the parent-death signal), ignores Ctrl-C (rank 0 handles it and stops
    the workers) and ends on SIGTERM, whatever handlers the process that started rank 0 had."""
    from ..model.causal_lm import QwenForCausalLM
    from ..model.tensor_parallel import TensorParallel

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    device = init_group(spec, rank)
    try:
        model = QwenForCausalLM.from_pretrained(spec.path, device=device, dtype=spec.dtype,
                                                quantization=spec.quantization, parallel=TensorParallel.from_group())
        conn.send(("ready",))
        mirror: Optional[StepMirror] = None
        while True:
            message = conn.recv()
            kind = message[0]
            if kind == "stop":
                return
            if kind == "free":
                mirror = None  # the old pool's memory first (the step graphs hold the runner in a cycle)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                least_free_memory(device)
            elif kind == "engine":
                mirror = StepMirror(model, *message[1:])
            elif kind == "step":
                mirror.step(*message[1:])
            elif kind == "capture":
                with torch.inference_mode():
                    mirror.runner.capture_all()
    except (EOFError, BrokenPipeError):  # rank 0 has gone
        return
    finally:
        dist.destroy_process_group()


def start(path, dtype: torch.dtype, quantization: Optional[str], device: torch.device, world_size: int) -> Workers:
    """Start ranks 1 .. ``world_size`` - 1 on ``path`` and join the group as rank 0 (a
    ``RuntimeError`` if torch.distributed already has a group in this process, a ``ValueError`` if
    CUDA has fewer devices than ranks). Rank 0 then loads its own shard and calls ``wait_ready``."""
    if dist.is_initialized():
        raise RuntimeError("tensor_parallel_size > 1 starts its own process group, but torch.distributed is "
                           "already initialised in this process")
    if device.type == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"tensor_parallel_size {world_size} needs {world_size} GPUs, "
                           f"{torch.cuda.device_count()} are visible")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = WorkerSpec(str(path), dtype, quantization, device.type, world_size, f"tcp://127.0.0.1:{port}")
    workers = Workers(spec)
    try:
        init_group(spec, 0)
    except BaseException:
        workers.close()
        raise
    return workers
