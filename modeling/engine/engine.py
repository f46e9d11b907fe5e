"""The continuous-batching engine: requests join and leave at every step.

```python
engine = Engine(model)                                  # the pool sized from free memory
seq = engine.add(prompt_ids, SamplingParams(temperature=0.7, seed=1), max_tokens=64, stop_token_ids=eos)
while engine.has_work():
    for seq in engine.step():                           # the sequences that got a token this step
        ...                                             # seq.output_ids, seq.finish_reason
```

A step: the scheduler picks the work (``modeling.engine.scheduler``), the runner packs it into one
flat-token batch padded to a graph shape (``step.pack``, ``runner.StepRunner.prepare``), the model
runs it over the cache pool (``QwenForCausalLM.forward`` with the step's context, in the CUDA
graph of that shape), the sequences whose tokens are all computed sample their next token
(``sampler.sample_sequences``, each with its own settings), sequences that ask for prompt logprobs
get those of the prompt tokens the step computed (``prefill_logprobs``), finished ones free their
blocks. ``add`` and ``abort`` may be called from any thread; ``step`` from one thread at a time.
"""

import random
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence as Seq

import numpy as np
import torch

from ..common import is_int
from .block_manager import BlockManager
from .cache_pool import CachePool, size_for
from .prefill_logprobs import PromptScores, prompt_rows
from .prompts import check_engine_args, check_model_len, check_room, checked_token_ids
from .runner import StepRunner
from .sampler import SampledTokens, sample_sequences
from .sampling_params import SamplingParams
from .scheduler import Scheduler, StateSlots
from .sequence import Sequence, Status
from .step import to_device
from .structured_outputs import Grammars
from .token_masks import TokenControls, bad_word_ids
from .workers import WorkerDied, Workers, broadcast_tokens, least_free_memory

BLOCK_SIZE = 16
"""Positions per KV block: the fastest of `python -m bench.throughput --block-sizes 16 32 64 128`
(docs/performance.md, offline throughput); also the finest
prefix-cache granularity (a hit reuses whole blocks only)."""


@dataclass
class EngineStats:
    """Counters since the engine started. Host seconds, without a device sync: ``schedule_s``
    (scheduling, packing the batch, committing its blocks; sampling a deferred step, its token
    masks included), ``capture_s`` (capturing the CUDA graph of a step shape at its first step),
    ``launch_s`` (launching the step or replaying its graph), ``sample_s`` (sampling up to the
    tokens on the host: this absorbs the wait for the device, so a device-bound engine shows it
    largest)."""

    steps: int = 0
    decode_steps: int = 0  # steps where every sequence computed one token
    prompt_tokens: int = 0  # tokens computed in prefill chunks (prefix-cache hits not counted)
    output_tokens: int = 0
    schedule_s: float = 0.0
    capture_s: float = 0.0
    launch_s: float = 0.0
    sample_s: float = 0.0

    def describe(self) -> str:
        busy = self.schedule_s + self.capture_s + self.launch_s + self.sample_s
        return (f"{self.steps} steps ({self.decode_steps} decode-only), {self.prompt_tokens} prompt and "
                f"{self.output_tokens} output tokens; host {busy:.2f} s: schedule {self.schedule_s:.2f}, "
                f"graph capture {self.capture_s:.2f}, launch {self.launch_s:.2f}, sample and wait "
                f"{self.sample_s:.2f}")


@dataclass
class _Launched:
    """A step on the device: the sequences that sample in it (in logits order), their rows of
    ``sampled.tokens`` by request id, the tokens on their way to the host, and whether the next
    step may be launched before they arrive (a decode-only step); ``prompt``: the prompt logprobs
    it computed, if any. A deferred step (``Engine.step``) keeps its ``logits`` and ``positions``
    until ``Engine._sample``."""

    seqs: List[Sequence]
    rows: Dict[int, int]
    sampled: Optional[SampledTokens]
    lookahead: bool
    prompt: Optional[PromptScores] = None
    logits: Optional[torch.Tensor] = None
    positions: Optional[List[int]] = None


def needs_history(seq: Sequence) -> bool:
    """Whether sampling ``seq`` reads its tokens on the host: penalties count them, grammars and
    bad words of several tokens follow them (``TokenControls.needs_history``)."""
    return seq.params.has_penalty or (seq.controls is not None and seq.controls.needs_history)


class Engine:
    """``max_num_seqs`` sequences at most in a step, ``max_num_batched_tokens`` new tokens at most
    in a step (prefill chunks share it with the decoding sequences), prompts and outputs of up to
    ``max_model_len`` tokens together; the pool takes ``gpu_memory_utilization`` of the device's free
    memory (on the CPU: what ``max_num_seqs`` full-length sequences need; ``num_blocks`` fixes the
    number of KV blocks instead). Steps replay CUDA graphs of padded shapes (``runner.StepRunner``:
    decode-only, prefill and mixed steps of every model; ``enforce_eager=True``: eager), their
    decode steps with the kernels ``runner.decode_kernels`` picks per shape (``decode_kernels``
    forces one of ``modeling.model.context.KERNELS``). Prefix caching is on for models of attention
    layers only (a recurrent state cannot be rebuilt from cached blocks). ``tokenizer`` (a
    ``QwenTokenizer``): what ``bad_words`` are tokenized with and grammars compiled for
    (``structured_outputs.Grammars``: each constraint compiled once, at its first request).

    A tensor-parallel model (``modeling.model.tensor_parallel``) runs with ``workers``
    (``workers.Workers``, which ``LLM(..., tensor_parallel_size=N)`` starts): this process is rank 0,
    schedules and samples, and the workers run each step beside it. Without workers (ranks started
    by ``torchrun``), every rank must make the same engine calls in the same order: each runs the
    same steps and samples the same tokens from the gathered logits."""

    def __init__(self, model, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_model_len: Optional[int] = None, block_size: int = BLOCK_SIZE, gpu_memory_utilization: float = 0.9,
                 prefix_caching: bool = True, num_blocks: Optional[int] = None, enforce_eager: bool = False,
                 decode_kernels: Optional[str] = None, tokenizer=None, workers: Optional[Workers] = None):
        c = model.config
        if workers is not None and model.parallel.world_size != workers.spec.world_size:
            raise ValueError(f"workers of tensor_parallel_size {workers.spec.world_size} take a model split over as "
                             f"many ranks, got one of {model.parallel.world_size}")
        self.workers = workers
        self.model, self.tokenizer = model, tokenizer
        self._grammars: Optional[Grammars] = None  # made at the first structured request
        check_engine_args(max_model_len, max_num_seqs, max_num_batched_tokens)
        check_model_len(max_model_len, c.max_position_embeddings)
        self.max_model_len = max_model_len or c.max_position_embeddings
        hybrid = any(kind != "full_attention" for kind in c.layer_types)
        reserve = max_num_batched_tokens * c.hidden_size * 64 * model.dtype.itemsize  # the step's activations
        free = None
        if workers is not None:  # every rank's pool from the fullest device's free memory
            workers.send(("free",))
            free = least_free_memory(model.device)
        self.size = size_for(model, block_size, max_num_seqs, self.max_model_len, gpu_memory_utilization, reserve, free)
        if num_blocks is not None:
            self.size.num_blocks = num_blocks
        self.pool = CachePool(model, self.size)
        self.blocks = BlockManager(self.size.num_blocks, block_size, prefix_caching and not hybrid)
        slots = StateSlots(self.size.num_state_slots) if hybrid else None
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens, slots)
        runner_args = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           max_blocks=-(-self.max_model_len // block_size), block_size=block_size,
                           enabled=not enforce_eager, kernels=decode_kernels)
        self.runner = StepRunner(model, self.pool, **runner_args)  # its argument checks before the workers build
        if workers is not None:
            workers.send(("engine", self.size, runner_args))
        self._lock = threading.Lock()
        self._rng = random.Random()
        self.stats = EngineStats()
        self._inflight: Optional[_Launched] = None  # a launched step whose tokens the host has not read
        self._failed: Optional[str] = None  # a tensor-parallel step that raised: the workers are out of step

    def add(self, prompt_ids: Seq[int], params: SamplingParams, max_tokens: int,
            stop_token_ids: Seq[int] = ()) -> Sequence:
        """Queue a request; it joins the next step that has room for it. A ``ValueError`` names what
        it cannot run: token ids outside the vocabulary, an empty prompt, more than ``max_model_len``
        positions (``ContextLengthError``)."""
        prompt_ids = checked_token_ids(prompt_ids, "the prompt", self.model.config.vocab_size)
        if not (is_int(max_tokens) and max_tokens >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        check_room(len(prompt_ids), max_tokens, self.max_model_len)
        seq = Sequence(prompt_ids, params, max_tokens, tuple(stop_token_ids))
        seq.controls = self._controls(params, stop_token_ids)
        seq.seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        with self._lock:
            self.scheduler.add(seq)
        return seq

    def _controls(self, params: SamplingParams, stop_token_ids: Seq[int]) -> Optional[TokenControls]:
        """The ``TokenControls`` of a request, None when it excludes no token (a ``ValueError``
        naming a token id outside the vocabulary, or bad words without the engine's tokenizer)."""
        vocab = self.model.config.vocab_size
        ids = [t for t, _ in params.logit_bias or ()] + list(params.allowed_token_ids or ())
        outside = sorted({t for t in ids if t >= vocab})
        if outside:
            raise ValueError(f"logit_bias and allowed_token_ids name token ids {outside[:4]} outside the model's "
                             f"vocabulary [0, {vocab})")
        if not params.has_token_mask:
            return None
        for name in ("bad_words", "structured_outputs"):
            if getattr(params, name) and self.tokenizer is None:
                raise ValueError(f"{name} needs the engine's tokenizer (Engine(tokenizer=...))")
        bad = bad_word_ids(self.tokenizer, params.bad_words) if params.bad_words else []
        matcher = None
        if params.structured_outputs is not None:
            self.prepare_grammars()
            matcher = self._grammars.matcher(params.structured_outputs)
        return TokenControls(params, vocab, bad, stop_token_ids, matcher)

    def prepare_grammars(self) -> None:
        """Build the structured-output compiler (xgrammar's table of the tokenizer's vocabulary, a
        few seconds for Qwen's) now, not at the first constrained request, which would hold every
        running sequence meanwhile; an ``ImportError`` without xgrammar."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.model.config.vocab_size)

    def abort(self, seq: Sequence) -> None:
        """Finish ``seq`` now ("abort"), freeing its blocks; a finished sequence is left as it is."""
        with self._lock:
            if seq.status is not Status.FINISHED:
                self.scheduler.finish(seq, "abort")

    def has_work(self) -> bool:
        with self._lock:
            return self.scheduler.has_work() or self._inflight is not None

    @torch.inference_mode()
    def step(self) -> List[Sequence]:
        """Run one step; returns the sequences that got a token (finished ones included).

        Lookahead (docs/generate.md): after a decode-only step, the next step is scheduled and
        launched before the host reads the tokens of the one before (each sequence's next input is
        that token, written into the batch on the device), so ``step`` returns the tokens of the
        step before the one it launched; a token a finished sequence gets after its last is dropped.
        A step launched ahead whose sampling reads its tokens on the host (``needs_history``:
        penalties, grammars, bad words of several tokens) runs its forward pass only and is sampled
        as soon as they are read (its token masks built then), before the next step is scheduled,
        so its sampling runs on the device while the host packs the next step."""
        if self.workers is None:
            return self._step()
        if self._failed is not None:
            raise WorkerDied(f"a step of this tensor-parallel engine failed ({self._failed}): its workers are out of "
                             "step with it; start it again")
        try:
            return self._step()
        except BaseException as e:  # the workers may wait for a collective this rank will not make
            self._failed = f"{type(e).__name__}: {e}"
            if isinstance(e, RuntimeError) and not isinstance(e, WorkerDied):  # a collective that lost a peer?
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    self.workers.check()
                    time.sleep(0.1)
            raise

    @property
    def failed(self) -> bool:
        """A step of this tensor-parallel engine raised: its workers are out of step, it runs no more."""
        return self._failed is not None

    def drain(self) -> List[Sequence]:
        """Read the step still in flight, if any (sampled first if it was deferred): the sequences
        that got a token. Before an engine is dropped or captures graphs, so that tensor-parallel
        workers do not wait for a token broadcast that never comes."""
        launched, self._inflight = self._inflight, None
        return self._finish(launched) if launched is not None else []

    def _step(self) -> List[Sequence]:
        prev, self._inflight = self._inflight, None
        if prev is None:
            prev = self._launch(None)
            if prev is None:
                return []
        if prev.lookahead:
            self._inflight = self._launch(prev)
        out = self._finish(prev)
        nxt = self._inflight
        if nxt is not None and nxt.sampled is None and nxt.seqs:
            t0 = time.perf_counter()
            self._sample(nxt)
            self.stats.schedule_s += time.perf_counter() - t0
        return out

    def _sample(self, launched: "_Launched") -> None:
        """Sample a deferred step (its logits stay in the step's buffers until then; its token masks
        read the output tokens the host has) and send its tokens to the workers."""
        launched.sampled = sample_sequences(launched.logits, launched.seqs, launched.positions)
        launched.logits = launched.positions = None
        if self.workers is not None:
            broadcast_tokens(launched.sampled.tokens)

    def _launch(self, prev: Optional["_Launched"]) -> Optional["_Launched"]:
        """Schedule, build and launch a step (after ``prev``, sampled, whose tokens may still be on the
        device)."""
        t0 = time.perf_counter()
        captured = self.runner.capture_s
        with self._lock:  # an abort from another thread cannot release a block table while it is packed
            scheduled = self.scheduler.schedule()
            if not scheduled.work:
                return None
            scored = None if scheduled.decode_only else prompt_rows(scheduled.work)  # a decode step scores none
            batch = self.runner.prepare(scheduled, eager=scored is not None)
        captured = self.runner.capture_s - captured
        dev = self.model.device
        pending = None  # [2, P]: the batch rows whose input is a token of the step before, and its rows there
        if batch.pending:
            src = [prev.rows[scheduled.work[i][0].request_id] for i in batch.pending]
            cu = np.cumsum([0] + batch.query_lens)
            pending = np.array([[cu[i] for i in batch.pending], src], np.int64)
            if scheduled.decode_only and src == batch.pending == list(range(len(src))):
                batch.input_ids[:len(src)].copy_(prev.sampled.tokens[:len(src)])  # the same rows, in order
            else:
                dst, src = to_device(pending, dev)
                batch.input_ids.index_copy_(0, dst, prev.sampled.tokens.index_select(0, src))
        if self.workers is not None:  # before this rank's step: the collectives wait for every rank
            self.workers.send(("step", batch.staged, pending, None if scored is None else scored.rows))
        t1 = time.perf_counter()
        seqs = [scheduled.work[i][0] for i in batch.sampling]
        prompt = None
        if scored is None:
            logits = self.runner.run(batch)
        else:
            logits = self.runner.run(batch, to_device(scored.rows, dev))
            prompt, logits = scored.score(logits[len(seqs):]), logits[:len(seqs)]
        t2 = time.perf_counter()
        positions = [s.num_tokens for s in seqs]
        deferred = prev is not None and any(map(needs_history, seqs))  # the tokens before are not read yet
        sampled = sample_sequences(logits, seqs, positions) if seqs and not deferred else None
        if sampled is not None and self.workers is not None:
            broadcast_tokens(sampled.tokens)
        with self._lock:
            for seq, n in scheduled.work:
                if seq.status is Status.FINISHED:  # aborted while the step ran: its blocks are gone
                    continue
                if seq.num_computed < seq.num_prompt:
                    self.stats.prompt_tokens += min(n, seq.num_prompt - seq.num_computed)
                seq.num_computed += n
                self.blocks.commit(seq.block_table, seq.tokens, min(seq.num_computed, len(seq.tokens)),
                                   seq.block_hashes, seq.prefix_hashes)
            for seq in seqs:
                seq.num_pending += 1
        st = self.stats
        st.steps += 1
        st.decode_steps += scheduled.decode_only
        st.schedule_s += (t1 - t0 - captured) + (time.perf_counter() - t2)
        st.capture_s += captured
        st.launch_s += t2 - t1
        lookahead = scheduled.decode_only and bool(seqs)
        return _Launched(seqs, {s.request_id: i for i, s in enumerate(seqs)}, sampled, lookahead, prompt,
                         logits if deferred else None, positions if deferred else None)

    def _finish(self, launched: "_Launched") -> List[Sequence]:
        """Read a launched step's tokens and give them to their sequences."""
        t0 = time.perf_counter()
        if launched.sampled is None and launched.seqs:  # deferred, and no step launched after it
            self._sample(launched)
        if self.workers is not None and launched.sampled is not None:
            self.workers.wait(launched.sampled.ready)  # a dead worker is an error, not a hang
        tokens = launched.sampled.collect() if launched.sampled is not None else []
        t1 = time.perf_counter()
        out = []
        with self._lock:
            if launched.prompt is not None:
                launched.prompt.collect()
            for seq, (token, logprobs) in zip(launched.seqs, tokens):
                seq.num_pending -= 1
                if seq.status is Status.FINISHED:  # aborted, or finished by the token before this one
                    continue
                seq.append(token, logprobs)  # a preempted sequence keeps it: it was computed before
                out.append(seq)
                if seq.finish_reason is not None:
                    self.scheduler.finish(seq)
        self.stats.output_tokens += len(out)
        self.stats.sample_s += t1 - t0
        self.stats.schedule_s += time.perf_counter() - t1
        return out

    @torch.inference_mode()
    def capture_graphs(self) -> int:
        """Capture the CUDA graph of every step shape now (``runner.StepRunner.capture_all``)
        instead of at each shape's first step; how many were captured (0 without CUDA graphs)."""
        self.drain()
        if self.workers is not None:
            self.workers.send(("capture",))
        return self.runner.capture_all()

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams, max_tokens: int,
                 stop_token_ids: Seq[int] = ()) -> List[List[int]]:
        """Run ``prompts`` (token ids) to completion as one continuous batch; the new token ids of each."""
        seqs = [self.add(p, params, max_tokens, stop_token_ids) for p in prompts]
        while any(s.status is not Status.FINISHED for s in seqs):
            self.step()
        return [s.output_ids for s in seqs]
