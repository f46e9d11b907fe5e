"""The one thread that drives the engine, and how its tokens reach the request handlers.

Handlers run on the server's asyncio event loop; the engine runs in ``EngineLoop``'s thread,
which steps while the engine has work and sleeps on a condition variable when it has none
(``submit`` wakes it). After each step the tokens sampled for each request are handed to that
request's ``Sink`` (an ``asyncio.Queue``) in one ``loop.call_soon_threadsafe`` per step, so a
handler awaits its tokens without polling and the engine never waits for a handler; a handler
that finds several steps queued takes them together (``Generation.next``).

A failing step fails every request in the engine at that moment (its sink gets the exception:
a 500 or an error event), aborts their sequences (their blocks are freed) and the thread goes on
with new requests. ``MAX_CONSECUTIVE_FAILURES`` failed steps in a row mean the engine is broken:
``dead`` is set, ``on_dead`` is called (the server then answers 503 and shuts down, exit
status 1), and the thread stops.
"""

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence as Seq

from ..engine import Engine, Sequence, Status
from ..generation.sampling import SamplingParams

log = logging.getLogger("modeling.serve")

MAX_CONSECUTIVE_FAILURES = 3


@dataclass
class TokenEvent:
    """One sampled token of choice ``index``; ``logprobs`` its ``LogprobEntry`` when the request
    asked for them; ``finish_reason`` the engine's ("stop", "length") when it was the last;
    ``admitted`` the perf_counter time of the first step that ran the sequence."""

    index: int
    token: int
    logprobs: Optional[tuple]
    finish_reason: Optional[str]
    admitted: float


class EngineFailure:
    """Put in a sink when a step failed with ``error`` while the request was in the engine."""

    def __init__(self, error: BaseException):
        self.error = error


class Sink:
    """Where one HTTP request's sequences deliver: a queue of lists of ``TokenEvent`` (one list per
    step), or an ``EngineFailure``. Lives on the event loop; filled through ``EngineLoop``."""

    def __init__(self):
        self.queue: "asyncio.Queue" = asyncio.Queue()


@dataclass
class _Entry:
    seq: Sequence
    sink: Sink
    index: int
    logprobs: bool
    submitted: float
    admitted: Optional[float] = None  # perf_counter at the start of the first step that ran it


class EngineLoop:
    """``submit`` and ``abort`` from the event loop, ``start``/``stop`` the thread."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop,
                 on_dead: Optional[Callable[[BaseException], None]] = None):
        self.engine, self.loop, self.on_dead = engine, loop, on_dead
        self._cond = threading.Condition()
        self._entries: Dict[int, _Entry] = {}  # request_id -> entry, while the sequence runs
        self._stopping = False
        self.dead: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="qwen-serve-engine", daemon=True)

    # ------------------------------------------------------------------ event-loop side
    def submit(self, sink: Sink, index: int, prompt_ids: Seq[int], params: SamplingParams, max_tokens: int,
               stop_ids: Seq[int]) -> Sequence:
        """Add one sequence (``Engine.add``'s ValueError when it cannot run); its tokens go to ``sink``."""
        with self._cond:  # registered before the thread can look for it after a step
            seq = self.engine.add(prompt_ids, params, max_tokens, stop_ids)
            self._entries[seq.request_id] = _Entry(seq, sink, index, params.logprobs is not None,
                                                   time.perf_counter())
            self._cond.notify()
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop ``seq`` (its blocks are freed); tokens it still gets are dropped."""
        self.engine.abort(seq)
        with self._cond:
            self._entries.pop(seq.request_id, None)

    def counts(self) -> Dict[str, int]:
        """Sequences in the engine: ``running`` (admitted) and ``waiting`` (queued or preempted)."""
        with self._cond:
            statuses = [e.seq.status for e in self._entries.values()]
        waiting = sum(s is Status.WAITING for s in statuses)
        return {"running": len(statuses) - waiting, "waiting": waiting}

    def kv_cache_usage(self) -> float:
        """The fraction of KV blocks some sequence holds (freed prefix-cache blocks count as free)."""
        blocks = self.engine.blocks
        return 1.0 - blocks.num_free / blocks.num_blocks

    # ------------------------------------------------------------------ the thread
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        failures = 0
        while True:
            with self._cond:
                while not self._stopping and not self.engine.has_work():
                    self._cond.wait()
                if self._stopping:
                    return
            t0 = time.perf_counter()
            try:
                sampled = self.engine.step()
            except Exception as e:  # every request in the engine fails; the server stays up
                failures += 1
                log.exception("engine step failed (%d in a row); failing the requests in the engine", failures)
                self._fail_all(e)
                if failures >= MAX_CONSECUTIVE_FAILURES:
                    self.dead = e
                    log.error("the engine failed %d steps in a row: it is unusable", failures)
                    if self.on_dead is not None:
                        self.loop.call_soon_threadsafe(self.on_dead, e)
                    return
                continue
            failures = 0
            self._deliver(sampled, t0)

    def _deliver(self, sampled: List[Sequence], t0: float) -> None:
        batches: Dict[Sink, List[TokenEvent]] = {}
        with self._cond:
            for entry in self._entries.values():
                if entry.admitted is None and entry.seq.status is not Status.WAITING:
                    # a sequence submitted while the step ran was scheduled by its lookahead launch
                    entry.admitted = max(t0, entry.submitted)
            for seq in sampled:
                entry = self._entries.get(seq.request_id)
                if entry is None:  # aborted by its handler meanwhile
                    continue
                lp = seq.logprobs[-1] if entry.logprobs else None
                batches.setdefault(entry.sink, []).append(
                    TokenEvent(entry.index, seq.tokens[-1], lp, seq.finish_reason, entry.admitted))
                if seq.finish_reason is not None:
                    del self._entries[seq.request_id]
        if batches:
            self.loop.call_soon_threadsafe(_put_all, list(batches.items()))

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            self.engine.abort(entry.seq)
        sinks = list({id(e.sink): e.sink for e in entries}.values())
        self.loop.call_soon_threadsafe(_put_all, [(sink, EngineFailure(error)) for sink in sinks])


def _put_all(items) -> None:
    for sink, item in items:
        sink.queue.put_nowait(item)
