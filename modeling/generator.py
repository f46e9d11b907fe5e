"""Generator: prefill with the model, then decode with the whole step captured in a CUDA graph.

One decode step (all layers, final norm, lm_head, sampling, and the bookkeeping that feeds the
sampled token back, advances positions and cache lengths, records the token and updates the
``finished`` mask) runs on static device buffers. On CUDA it is captured once per
(batch-size bucket, sampling mode) in a ``torch.cuda.CUDAGraph``; all graphs share one memory
pool, and a replay needs no input from the host. Without CUDA (or with
``use_cuda_graph=False``) the very same step function runs eagerly, so both paths launch the
same kernels on the same shapes and produce the same tokens.

Host/device traffic while decoding: the graph writes each step's tokens into a device history
``[max_seq_len, max_batch]``; every ``readback_every`` steps the host enqueues an asynchronous
copy of the new history rows into pinned memory and an event, and it reads a chunk only once
the *next* chunk has been enqueued, so the GPU always has queued work while the host
detokenizes and checks for stop tokens. A sequence that has emitted a stop token is frozen on
the device (its position stops advancing, it repeats its last token); the host stops
launching steps once it has seen every sequence finish, at most ~2 chunks later.

Prefill runs each prompt separately into its batch row of the KV cache (a [1, T] forward on
views of that row), eagerly by default. With ``prefill_graph=True`` prompts up to the largest
length bucket are right-padded to a bucket and run through a graph captured per (bucket, mode)
that writes a batch-1 staging cache; its first T entries are then copied into the row (without
CUDA graphs the same padded bucket runs eagerly, which is how CPU tests check it). Right
padding is harmless under causal attention (the padded positions come last and their logits are
ignored: the graph gathers the logits of position T - 1), but the padded GEMM shapes can round
differently from the exact-length prefill, so tokens may differ from the eager prefill in the
last bits of bf16 (never in the decode graph, which is bit-identical to its eager run).
"""

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .model import KVCache, QwenForCausalLM
from .sampling import SamplingParams, sample

MAX_STOP_IDS = 16
WARMUP_STEPS = 2
DEFAULT_PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)
MIN_TEMPERATURE = 1e-5  # sampling modes divide by the temperature

TokenCallback = Callable[[int, int], None]  # (prompt index, token id)
FinishCallback = Callable[[int, List[int], str], None]  # (prompt index, new token ids, reason)


class CacheView:
    """Duck-types ``KVCache`` for ``QwenForCausalLM.forward``: ``k``, ``v`` are
    [num_layers, B, L, Hk, D] views (some batch rows of a larger cache)."""

    def __init__(self, k: Tensor, v: Tensor):
        self.k, self.v = k, v


@dataclass
class GenerationResult:
    """``tokens[i]``: the new tokens of prompt i, without the stop token; ``finish_reasons[i]``:
    ``"stop"`` (it emitted a stop token) or ``"length"`` (max_new_tokens reached)."""

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
        """Tokens produced, stop tokens included."""
        return sum(len(t) for t in self.tokens) + self.finish_reasons.count("stop")

    @property
    def decode_ms_per_step(self) -> float:
        return self.decode_ms / self.decode_steps if self.decode_steps else 0.0


def _buckets(limit: int) -> Tuple[int, ...]:
    """1, 2, 4, ... below ``limit``, then ``limit``."""
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return tuple(out) + (limit,)


class Generator:
    """Batched generation with a CUDA-graph decode step. See the module doc and docs/generate.md.

    ``max_batch_size`` rows of KV cache of ``max_seq_len`` positions are allocated up front,
    with every other buffer the step reads or writes. ``generate`` takes any number of prompts
    (more than ``max_batch_size`` run in consecutive batches).
    """

    def __init__(
        self,
        model: QwenForCausalLM,
        max_batch_size: int = 1,
        max_seq_len: Optional[int] = None,
        use_cuda_graph: bool = True,
        prefill_graph: bool = False,
        prefill_buckets: Sequence[int] = DEFAULT_PREFILL_BUCKETS,
        readback_every: int = 4,
    ):
        param = model.embed_tokens
        self.model = model
        self.config = c = model.config
        self.device, self.dtype = param.device, param.dtype
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len or min(4096, c.max_position_embeddings)
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        on_cuda = self.device.type == "cuda"
        self.use_cuda_graph = bool(use_cuda_graph and on_cuda)
        self.prefill_graph = bool(prefill_graph)  # without CUDA graphs: the padded buckets, eagerly
        self.prefill_buckets = tuple(sorted(b for b in set(prefill_buckets) if 0 < b <= self.max_seq_len))
        self.batch_buckets = _buckets(max_batch_size)
        self.readback_every = max(1, readback_every) if on_cuda else 1

        B, L, dev = max_batch_size, self.max_seq_len, self.device
        with torch.no_grad():
            self.cache = KVCache(c, B, L, self.dtype, dev)
            i64 = dict(dtype=torch.int64, device=dev)
            # --- decode state: everything a captured step reads or writes ---
            self._tokens = torch.zeros(B, 1, **i64)  # the next step's input token per row
            self._pos_len = torch.zeros(2, B, dtype=torch.int32, device=dev)  # [0] positions, [1] cache_seqlens
            self._finished = torch.zeros(B, dtype=torch.bool, device=dev)
            self._step = torch.zeros(1, **i64)  # history row the next step writes
            self._history = torch.zeros(L, B, **i64)  # [step, row] sampled tokens
            self._stop_ids = torch.full((MAX_STOP_IDS,), -1, **i64)
            self._first = torch.zeros(B, **i64)  # first token of each row, from prefill
            # --- sampling values (device tensors: one graph serves every setting) ---
            self._temperature = torch.ones(B, dtype=torch.float32, device=dev)
            self._top_k = torch.zeros(B, **i64)
            self._top_p = torch.ones(B, dtype=torch.float32, device=dev)
            self._noise = torch.empty(B, c.vocab_size, dtype=torch.float32, device=dev)  # sampling scratch
            self._host_history = torch.zeros(L, B, dtype=torch.int64, pin_memory=on_cuda)
            # --- prefill graphs: static padded prompt, positions, gather index, staging cache ---
            if self.prefill_graph and self.prefill_buckets:
                top = self.prefill_buckets[-1]
                self._pf_ids = torch.zeros(1, top, **i64)
                self._pf_pos = torch.arange(top, dtype=torch.int32, device=dev)[None]
                self._pf_last = torch.zeros(1, **i64)
                self._pf_token = torch.zeros(1, **i64)
                self._staging = KVCache(c, 1, top, self.dtype, dev)

        if on_cuda:
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self._rng = torch.cuda.default_generators[index]  # graph-safe: capture registers it
        else:
            self._rng = torch.Generator(device="cpu")
            self._rng.seed()
        self._graphs: Dict[tuple, "torch.cuda.CUDAGraph"] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_cuda_graph else None
        self._stream = torch.cuda.Stream(device=self.device) if self.use_cuda_graph else None

    # ------------------------------------------------------------------ step bodies
    def _rows(self, bs: int) -> CacheView:
        return CacheView(self.cache.k[:, :bs], self.cache.v[:, :bs])

    def _row(self, b: int) -> CacheView:
        return CacheView(self.cache.k[:, b : b + 1], self.cache.v[:, b : b + 1])

    def _sample(self, logits: Tensor, rows: slice, mode: str) -> Tensor:
        return sample(logits, self._temperature[rows], self._top_k[rows], self._top_p[rows], mode,
                      self._rng, self._noise[rows])

    def _decode_body(self, bs: int, mode: str) -> None:
        """One decode step of rows [0, bs) on the static buffers: the captured region."""
        tokens = self._tokens[:bs]
        pos_len = self._pos_len[:, :bs]
        logits = self.model(tokens, pos_len[0].view(bs, 1), self._rows(bs), pos_len[1])  # [bs, V]
        finished = self._finished[:bs]
        nxt = torch.where(finished, tokens[:, 0], self._sample(logits, slice(0, bs), mode))
        self._history[:, :bs].index_copy_(0, self._step, nxt[None])
        finished.logical_or_((nxt[:, None] == self._stop_ids[None]).any(dim=-1))
        pos_len.add_((~finished).to(torch.int32))  # frozen once finished
        tokens.copy_(nxt[:, None])
        self._step.add_(1)

    def _prefill_bucket_body(self, bucket: int, mode: str) -> None:
        """Prefill the padded prompt in ``_pf_ids[:, :bucket]`` into the staging cache; sample the
        token after position ``_pf_last`` into ``_pf_token``: the captured prefill region."""
        logits = self.model(self._pf_ids[:, :bucket], self._pf_pos[:, :bucket], self._staging, all_logits=True)
        last = logits.index_select(1, self._pf_last)[:, 0]  # [1, V]
        self._pf_token.copy_(self._sample(last, slice(0, 1), mode))

    # ------------------------------------------------------------------ graphs
    def _reset_state(self) -> None:
        """Valid, in-range state (positions 0, gather index 0) before warm-up steps: the buffers may
        hold the values of an earlier call (e.g. a prompt longer than the bucket being captured)."""
        self._tokens.zero_()
        self._pos_len[0].zero_()
        self._pos_len[1].fill_(1)
        self._finished.zero_()
        self._step.zero_()
        if self.prefill_graph and self.prefill_buckets:
            self._pf_last.zero_()

    def _capture(self, key: tuple, body: Callable[[], None]):
        graph = self._graphs.get(key)
        if graph is not None:
            return graph
        self._reset_state()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up: compile and load every kernel outside the capture
            for _ in range(WARMUP_STEPS):
                body()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            body()
        self._graphs[key] = graph
        return graph

    def _decode_graph(self, bs: int, mode: str):
        return self._capture(("decode", bs, mode), lambda: self._decode_body(bs, mode))

    def _prefill_bucket(self, length: int) -> Optional[int]:
        if not self.prefill_graph:
            return None
        return next((b for b in self.prefill_buckets if b >= length), None)

    def _prefill_graph_for(self, bucket: int, mode: str):
        return self._capture(("prefill", bucket, mode), lambda: self._prefill_bucket_body(bucket, mode))

    def capture(self, batch_sizes: Sequence[int] = (), modes: Sequence[str] = ("greedy",),
                prefill_lengths: Sequence[int] = ()) -> None:
        """Capture graphs ahead of time (otherwise each is captured on first use)."""
        if not self.use_cuda_graph:
            return
        with torch.no_grad():
            for mode in modes:
                for bs in batch_sizes:
                    self._decode_graph(self._batch_bucket(bs), mode)
                for length in prefill_lengths:
                    bucket = self._prefill_bucket(length)
                    if bucket is not None:
                        self._prefill_graph_for(bucket, mode)

    # ------------------------------------------------------------------ generate
    def _batch_bucket(self, n: int) -> int:
        return next(b for b in self.batch_buckets if b >= n)

    def _check(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Sequence[int]) -> None:
        if not prompts:
            raise ValueError("no prompts given")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids, got {len(stop_ids)}")
        vocab = self.config.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
            if len(p) + max_new_tokens > self.max_seq_len:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                    f"{len(p) + max_new_tokens} cache positions, but max_seq_len is {self.max_seq_len}")

    @torch.no_grad()
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
            part = self._generate_batch(chunk, start, max_new_tokens, sampling, stop_ids, on_token, on_finish)
            total.tokens += part.tokens
            total.finish_reasons += part.finish_reasons
            total.prefill_ms += part.prefill_ms
            total.decode_ms += part.decode_ms
            total.decode_steps += part.decode_steps
            total.setup_ms += part.setup_ms
            total.cuda_graph |= part.cuda_graph
        return total

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _generate_batch(self, prompts, offset, max_new, sampling, stop_ids, on_token, on_finish):
        n, mode = len(prompts), sampling.mode
        bs = self._batch_bucket(n)
        t0 = time.perf_counter()
        # Graphs first (their warm-up consumes random numbers), then seed.
        graph = self._decode_graph(bs, mode) if self.use_cuda_graph and max_new > 1 else None
        buckets = [self._prefill_bucket(len(p)) for p in prompts]
        if self.use_cuda_graph:
            for bucket in sorted(set(buckets) - {None}):
                self._prefill_graph_for(bucket, mode)
        self._sync()
        t1 = time.perf_counter()

        if sampling.seed is not None:  # each chunk of prompts gets its own stream
            self._rng.manual_seed(sampling.seed + offset)
        self._temperature.fill_(max(float(sampling.temperature), MIN_TEMPERATURE))
        self._top_k.fill_(int(sampling.top_k))
        self._top_p.fill_(float(sampling.top_p))
        self._stop_ids.copy_(torch.tensor(stop_ids + [-1] * (MAX_STOP_IDS - len(stop_ids))))

        # Prefill each prompt into its row; collect the first tokens in _first.
        for b, (ids, bucket) in enumerate(zip(prompts, buckets)):
            if bucket is None:
                ids_t = torch.tensor([ids], dtype=torch.int64).to(self.device)
                positions = torch.arange(len(ids), dtype=torch.int32, device=self.device)[None]
                logits = self.model(ids_t, positions, self._row(b))
                self._first[b : b + 1].copy_(self._sample(logits, slice(b, b + 1), mode))
            else:
                T = len(ids)
                self._pf_ids[0, :T].copy_(torch.tensor(ids, dtype=torch.int64))
                self._pf_last.fill_(T - 1)
                if self.use_cuda_graph:
                    self._prefill_graph_for(bucket, mode).replay()
                else:
                    self._prefill_bucket_body(bucket, mode)
                self.cache.k[:, b, :T].copy_(self._staging.k[:, 0, :T])
                self.cache.v[:, b, :T].copy_(self._staging.v[:, 0, :T])
                self._first[b : b + 1].copy_(self._pf_token)
        # Decode state: row b's first token sits at position len(prompt b); rows >= n are idle.
        lengths = [len(p) for p in prompts] + [0] * (self.max_batch_size - n)
        self._pos_len.copy_(torch.tensor([lengths, [x + 1 for x in lengths]], dtype=torch.int32))
        self._finished.copy_(torch.arange(self.max_batch_size) >= n)
        self._finished.logical_or_((self._first[:, None] == self._stop_ids[None]).any(dim=-1))
        self._tokens[:, 0].copy_(self._first)
        self._history[0].copy_(self._first)
        self._step.fill_(1)
        first = self._first[:n].tolist()  # host sync: the first tokens, time to first token
        t2 = time.perf_counter()

        tokens: List[List[int]] = [[] for _ in range(n)]
        reasons: List[Optional[str]] = [None] * n
        stop_set = set(stop_ids)

        def take(row: int, token: int) -> None:
            if reasons[row] is not None:
                return
            if token in stop_set:
                reasons[row] = "stop"
            else:
                tokens[row].append(token)
                if on_token is not None:
                    on_token(offset + row, token)
                if len(tokens[row]) == max_new:
                    reasons[row] = "length"
            if reasons[row] is not None and on_finish is not None:
                on_finish(offset + row, tokens[row], reasons[row])

        for row, token in enumerate(first):
            take(row, token)

        steps = 0
        if any(r is None for r in reasons):
            steps = self._decode_loop(bs, mode, graph, max_new - 1, n, take, reasons)
        t3 = time.perf_counter()
        return GenerationResult(tokens, list(reasons), sum(map(len, prompts)), (t2 - t1) * 1e3, (t3 - t2) * 1e3,
                                steps, (t1 - t0) * 1e3, graph is not None)

    def _decode_loop(self, bs, mode, graph, max_steps, n, take, reasons) -> int:
        """Run up to ``max_steps`` decode steps; read tokens back in chunks, one chunk behind."""
        step = graph.replay if graph is not None else (lambda: self._decode_body(bs, mode))
        on_cuda = self.device.type == "cuda"
        pending: deque = deque()  # (event, first history row, end row)
        launched, copied = 0, 1  # history row 0 (the first tokens) is already on the host

        def read(lo: int, hi: int, event) -> None:
            if event is not None:
                event.synchronize()
            for row_tokens in self._host_history[lo:hi, :n].tolist():
                for row, token in enumerate(row_tokens):
                    take(row, token)

        while launched < max_steps and any(r is None for r in reasons):
            step()
            launched += 1
            if launched + 1 - copied >= self.readback_every or launched == max_steps:
                lo, hi = copied, launched + 1
                self._host_history[lo:hi].copy_(self._history[lo:hi], non_blocking=on_cuda)
                event = None
                if on_cuda:
                    event = torch.cuda.Event()
                    event.record()
                pending.append((lo, hi, event))
                copied = hi
                if len(pending) > 1 or not on_cuda:
                    read(*pending.popleft())
        while pending:
            read(*pending.popleft())
        return launched
