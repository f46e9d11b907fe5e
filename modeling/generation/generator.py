"""Generator: prefill with the model, then decode with the whole step captured in a CUDA graph.

It composes three pieces:

- ``DecodeState`` (modeling/generation/decode_state.py): the static device buffers (the model's cache,
  tokens, positions, the finished mask, the token history, sampling values) and the step bodies
  that read and write them. One decode step runs all layers, the final norm, the lm_head,
  sampling, and the bookkeeping that feeds the sampled token back: a replay needs no host input.
- ``GraphCache`` (modeling/generation/graph_cache.py): one CUDA graph per (decode, batch bucket, sampling
  mode) or (prefill, length bucket, mode), captured on first use or by ``capture()``, in one
  shared memory pool. Without CUDA (or with ``use_cuda_graph=False``) the very same bodies run
  eagerly, so both paths launch the same kernels on the same shapes and give the same tokens.
- ``Readback`` (modeling/generation/readback.py): the decode loop, reading the tokens back in chunks one
  chunk behind the GPU; ``TokenSink`` applies the stop / length rule and calls the callbacks.

Prefill runs each prompt separately into its batch row of the cache. With the prefill graphs (on
by default wherever the decode step is captured; ``prefill_graph=False`` turns them off) prompts up
to the largest length bucket are right-padded to a bucket and run through a graph captured per
(bucket, mode) that writes a batch-1 staging cache; the prompt's state is then copied into its
row. Longer prompts, and every prompt without them, are prefilled eagerly at their exact length.
The padded GEMM shapes can round differently from the exact-length prefill, so tokens may differ
from the eager prefill in the last bits of bf16 (never in the decode graph, which is
bit-identical to its eager run). Padded prefill needs every layer's cache to allow
it (``Cache.supports_padded_prefill``): a model with recurrent layers (Qwen3.5's Gated DeltaNet)
falls back to the exact-length prefill and ``gen.prefill_graph`` reads False. See docs/generate.md.
"""

import contextlib
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from ..engine.runner import buckets
from ..model.causal_lm import QwenForCausalLM
from .decode_state import DecodeState
from .graph_cache import GraphCache
from .prompts import check_ids
from .readback import FinishCallback, Readback, TokenCallback, TokenSink
from .sampling import MAX_STOP_IDS, SamplingParams

DEFAULT_PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)


@dataclass
class GenerationResult:
    """``tokens[i]``: the new tokens of prompt i, without the stop token; ``finish_reasons[i]``:
    ``"stop"`` (it emitted a stop token), ``"length"`` (max_new_tokens reached) or ``"callback"``
    (``on_token`` returned ``readback.STOP``)."""

    tokens: List[List[int]]
    finish_reasons: List[str]
    prompt_tokens: int
    prefill_ms: float  # prefill of every prompt until the first tokens are on the host
    decode_ms: float  # the decode loop, until the last tokens are on the host
    decode_steps: int  # decode steps run (one step decodes every sequence of a batch)
    setup_ms: float  # graph warm-up and capture (first use of a bucket only)
    cuda_graph: bool

    @property
    def generated_tokens(self) -> int:
        """Tokens produced, stop tokens included (a row ended by its callback emitted none)."""
        return sum(len(t) for t in self.tokens) + self.finish_reasons.count("stop")

    @property
    def decode_ms_per_step(self) -> float:
        return self.decode_ms / self.decode_steps if self.decode_steps else 0.0


class Generator:
    """Batched generation with a CUDA-graph decode step. See the module doc and docs/generate.md.

    ``max_batch_size`` rows of cache of ``max_seq_len`` positions are allocated up front, with
    every other buffer a step reads or writes. ``generate`` takes any number of prompts (more than
    ``max_batch_size`` run in consecutive batches). A batch of n runs in the graph of the smallest
    batch bucket (1, 2, 4, ..., ``max_batch_size``) >= n, its extra rows idle.

    ``prefill_graph``: None (default) captures prefill per length bucket whenever the decode step
    is captured (CUDA and ``use_cuda_graph``); True also pads eagerly without CUDA graphs (tests);
    False prefills every prompt eagerly at its exact length. The staging cache holds the largest
    bucket that fits ``max_seq_len``.
    """

    def __init__(
        self,
        model: QwenForCausalLM,
        max_batch_size: int = 1,
        max_seq_len: Optional[int] = None,
        use_cuda_graph: bool = True,
        prefill_graph: Optional[bool] = None,
        prefill_buckets: Sequence[int] = DEFAULT_PREFILL_BUCKETS,
        readback_every: int = 4,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model, self.config = model, model.config
        self.device, self.dtype = model.device, model.dtype
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len or min(4096, self.config.max_position_embeddings)
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        self.use_cuda_graph = bool(use_cuda_graph and self.device.type == "cuda")
        # without CUDA graphs (prefill_graph=True): the padded buckets, eagerly
        self.prefill_graph = self.use_cuda_graph if prefill_graph is None else bool(prefill_graph)
        self.prefill_buckets = tuple(sorted(b for b in set(prefill_buckets) if 0 < b <= self.max_seq_len))
        self.batch_buckets = buckets(max_batch_size)
        prefill_len = self.prefill_buckets[-1] if self.prefill_graph and self.prefill_buckets else 0
        self.state = DecodeState(model, max_batch_size, self.max_seq_len, prefill_len)
        if not self.state.cache.supports_padded_prefill:  # recurrent layers: exact-length prefill only
            self.prefill_graph = False
        self.graphs = GraphCache(self.device, self.use_cuda_graph, self.state.reset)
        self.readback = Readback(self.state.history, readback_every)
        self.readback_every = self.readback.every

    @property
    def cache(self):
        """The model's cache for ``max_batch_size`` sequences (``model.new_cache``)."""
        return self.state.cache

    # ------------------------------------------------------------------ steps (graph replays or eager)
    def _decode(self, bs: int, mode: str):
        return self.graphs.get(("decode", bs, mode), lambda: self.state.decode_step(bs, mode))

    def _prefill(self, bucket: int, mode: str):
        return self.graphs.get(("prefill", bucket, mode), lambda: self.state.prefill_bucket(bucket, mode))

    def _batch_bucket(self, n: int) -> int:
        return next(b for b in self.batch_buckets if b >= n)

    def _prefill_bucket(self, length: int) -> Optional[int]:
        """The padded length a prompt is prefilled at, or None for an exact-length eager prefill."""
        if not self.prefill_graph:
            return None
        return next((b for b in self.prefill_buckets if b >= length), None)

    def capture(self, batch_sizes: Sequence[int] = (), modes: Sequence[str] = ("greedy",),
                prefill_lengths: Sequence[int] = ()) -> None:
        """Capture graphs ahead of time (otherwise each is captured on first use); a no-op without
        CUDA graphs."""
        if not self.use_cuda_graph:
            return
        with torch.inference_mode(), self._on_device():
            for mode in modes:
                for bs in batch_sizes:
                    self._decode(self._batch_bucket(bs), mode)
                for length in prefill_lengths:
                    bucket = self._prefill_bucket(length)
                    if bucket is not None:
                        self._prefill(bucket, mode)

    # ------------------------------------------------------------------ generate
    def _check(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Sequence[int]) -> None:
        if not prompts:
            raise ValueError("no prompts given")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids, got {len(stop_ids)}")
        for i, p in enumerate(prompts):
            check_ids(p, f"prompt {i}", self.config.vocab_size)
            if len(p) + max_new_tokens > self.max_seq_len:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                    f"{len(p) + max_new_tokens} cache positions, but max_seq_len is {self.max_seq_len}")

    @torch.inference_mode()  # skips the Autograd key: the ops' Python autograd kernels cost host time
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 64,
        sampling: SamplingParams = SamplingParams(),
        stop_token_ids: Sequence[int] = (),
        on_token: Optional[TokenCallback] = None,
        on_finish: Optional[FinishCallback] = None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after each prompt (lists of token ids).

        Stops a sequence at any of ``stop_token_ids`` (not included in its tokens). ``on_token``
        is called with each new token as the host reads it back (in order per prompt);
        ``on_finish`` once per prompt when it is done. With a ``sampling.seed`` the run is
        reproducible: on CUDA it reseeds the device's default generator (global state).
        """
        prompts = [list(map(int, p)) for p in prompts]
        stop_ids = list(dict.fromkeys(int(t) for t in stop_token_ids))
        self._check(prompts, max_new_tokens, stop_ids)
        total = GenerationResult([], [], sum(map(len, prompts)), 0.0, 0.0, 0, 0.0, False)
        for start in range(0, len(prompts), self.max_batch_size):
            chunk = prompts[start : start + self.max_batch_size]
            with self._on_device():
                part = self._generate_batch(chunk, start, max_new_tokens, sampling, stop_ids, on_token, on_finish)
            total.tokens += part.tokens
            total.finish_reasons += part.finish_reasons
            total.prefill_ms += part.prefill_ms
            total.decode_ms += part.decode_ms
            total.decode_steps += part.decode_steps
            total.setup_ms += part.setup_ms
            total.cuda_graph |= part.cuda_graph
        return total

    def _on_device(self):
        """The model's GPU as the current device (streams, events, graphs and Triton launches follow
        the current device, which need not be the model's)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _generate_batch(self, prompts, offset, max_new, sampling, stop_ids, on_token, on_finish) -> GenerationResult:
        n, mode, state = len(prompts), sampling.mode, self.state
        bs = self._batch_bucket(n)
        t0 = time.perf_counter()
        # Graphs first (their warm-up consumes random numbers), then seed.
        decode = self._decode(bs, mode) if max_new > 1 else None
        buckets = [self._prefill_bucket(len(p)) for p in prompts]
        prefill = {b: self._prefill(b, mode) for b in sorted(set(buckets) - {None})}
        self._sync()
        t1 = time.perf_counter()

        state.set_sampling(sampling, stop_ids, seed_offset=offset)  # each chunk of prompts: its own stream
        for row, (ids, bucket) in enumerate(zip(prompts, buckets)):  # each prompt into its row
            if bucket is None:
                state.prefill(row, ids, mode)
            else:
                state.stage(ids)
                prefill[bucket]()
                state.unstage(row, len(ids))
        state.start([len(p) for p in prompts])
        first = state.first[:n].tolist()  # host sync: the first tokens, time to first token
        t2 = time.perf_counter()

        sink = TokenSink(n, offset, max_new, stop_ids, on_token, on_finish)
        for row, token in enumerate(first):
            sink.take(row, token)
        steps = 0 if sink.done else self.readback.run(decode, max_new - 1, sink)
        t3 = time.perf_counter()
        return GenerationResult(sink.tokens, list(sink.reasons), sum(map(len, prompts)), (t2 - t1) * 1e3,
                                (t3 - t2) * 1e3, steps, (t1 - t0) * 1e3, self.use_cuda_graph and max_new > 1)
