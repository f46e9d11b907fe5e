"""The engine loop and the server's side of it. ``EngineCore`` takes requests as messages, steps the
engine while it has work and reports what each step did as messages; ``EngineClient`` hands
requests to it and its reports to the request handlers.

Handlers run on the server's asyncio event loop; the engine loop runs in a process of its own
(``engine_process.ProcessTransport``, what ``python -m modeling.serve`` runs) or in a thread
(``ThreadTransport``: an ``Engine`` of this process, as tests and embedders give ``create_app``).
Either way the client gets the loop's messages on the event loop, one per step, and hands each
request's tokens of that step to its ``Sink`` at once: a handler awaits its tokens without polling
and the engine never waits for a handler.

A failed step fails the requests in the engine at that moment (their sinks get an
``EngineFailure``: a 500 or an error event) and the loop goes on with new requests; when the engine
is dead (``MAX_CONSECUTIVE_FAILURES`` failed steps in a row, or its process exited)
``dead`` is set, ``on_dead`` is called (the server then answers 503 and shuts down, exit status 1)
and every request still in it fails.

Messages are plain tuples (they cross a pipe); ``rid`` is the request id the server gave a sequence.

In:  ("add", rid, prompt_ids, params, max_tokens, stop_ids) | ("abort", rid) | ("stop",)
Out: ("step", t0, events, changes, kv_usage): after each step, t0 its start (perf_counter, one
       clock for every process of the machine), events [(rid, token, logprob entry or None,
       finish reason or None, prompt logprobs or None)] of the sequences that got a token (the
       prompt's logprob entries come with its first token, when its params ask for them),
       changes [(rid, waiting)] of the sequences whose waiting state changed since the last
       report (admitted, or preempted);
     ("status", changes, kv_usage): when adds or aborts changed the engine, or a step failed, and no
       step followed;
     ("failed", rids, message): a step raised, these requests were failed (their blocks freed), or
       one request's grammar reached a dead end (``Sequence.error``);
     ("dead", message): ``MAX_CONSECUTIVE_FAILURES`` steps failed in a row, or one raised
       ``WorkerDied`` (a tensor-parallel worker gone or out of step): the loop has stopped.
"""

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence as Seq, Tuple

from ..engine import Engine, Sequence, Status
from ..engine.prompts import check_room
from ..engine.sampling_params import SamplingParams

log = logging.getLogger("modeling.serve")

MAX_CONSECUTIVE_FAILURES = 3


@dataclass
class TokenEvent:
    """One sampled token of choice ``index``, with its fields of the "step" report (see the module
    doc); ``admitted``: the perf_counter time of the first step that ran the sequence."""

    index: int
    token: int
    logprobs: Optional[tuple]
    finish_reason: Optional[str]
    admitted: float
    prompt_logprobs: Optional[list] = None


@dataclass
class EngineFailure:
    """Put in a sink when a step failed (``message`` says why) while the request was in the engine."""

    message: str


class Sink:
    """Where one HTTP request's sequences deliver, on the event loop: ``put`` a step's list of
    ``TokenEvent`` (or an ``EngineFailure``); ``take`` waits until something came and returns all
    that did, so a step costs one append and at most one wakeup."""

    def __init__(self):
        self.items: list = []
        self._waiter: Optional[asyncio.Future] = None

    def put(self, item) -> None:
        self.items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list:
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self.items = self.items, []
        return items


@dataclass
class _Entry:
    sink: Sink
    index: int
    submitted: float
    waiting: bool = True
    admitted: Optional[float] = None  # perf_counter at the start of the first step that ran it


class EngineClient:
    """``submit``, ``abort`` and ``counts`` from the event loop; ``start(loop)`` and ``stop`` around the
    server's life. ``max_model_len``: the engine's, for ``submit``'s check; ``kv_usage``: the fraction
    of KV blocks some sequence holds, as of the engine's last report."""

    def __init__(self, transport, max_model_len: int, on_dead: Optional[Callable[[BaseException], None]] = None):
        self.transport, self.max_model_len, self.on_dead = transport, max_model_len, on_dead
        self._entries: Dict[int, _Entry] = {}  # rid -> entry, while the sequence runs
        self._next_rid = 0
        self.kv_usage = 0.0
        self.dead: Optional[BaseException] = None
        self.stopped = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.transport.start(self.on_message, loop)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine loop; later aborts (handlers cancelled after the app's shutdown) do nothing."""
        self.stopped = True
        self.transport.stop(timeout)

    def submit(self, sink: Sink, index: int, prompt_ids: Seq[int], params: SamplingParams, max_tokens: int,
               stop_ids: Seq[int]) -> int:
        """Add one sequence (the ValueError of ``Engine.add`` when it cannot run); its tokens go to
        ``sink`` (an ``EngineFailure`` at once if the engine is dead: nothing would answer). Returns
        its request id, for ``abort``."""
        if not prompt_ids:
            raise ValueError("a prompt needs at least one token")
        check_room(len(prompt_ids), max_tokens, self.max_model_len)
        rid, self._next_rid = self._next_rid, self._next_rid + 1
        if self.dead is not None:  # it died while the handler read the body
            sink.put(EngineFailure(str(self.dead)))
            return rid
        self._entries[rid] = _Entry(sink, index, time.perf_counter())
        self.transport.put(("add", rid, list(prompt_ids), params, max_tokens, tuple(stop_ids)))
        return rid

    def abort(self, rid: int) -> None:
        """Stop the sequence (its blocks are freed); tokens it still gets are dropped."""
        if self._entries.pop(rid, None) is not None and not self.stopped:
            self.transport.put(("abort", rid))

    def counts(self) -> Dict[str, int]:
        """Sequences in the engine: ``running`` (admitted) and ``waiting`` (queued or preempted)."""
        waiting = sum(e.waiting for e in self._entries.values())
        return {"running": len(self._entries) - waiting, "waiting": waiting}

    def on_message(self, msg: tuple) -> None:
        """An ``EngineCore`` report, on the event loop."""
        kind = msg[0]
        if kind in ("step", "status"):
            t0 = msg[1] if kind == "step" else time.perf_counter()
            changes, self.kv_usage = msg[-2], msg[-1]
            for rid, waiting in changes:
                e = self._entries.get(rid)
                if e is not None:
                    e.waiting = waiting
                    if not waiting and e.admitted is None:
                        # a sequence submitted while a step ran was scheduled by its lookahead launch
                        e.admitted = max(t0, e.submitted)
            if kind == "step":
                self._deliver(msg[2], t0)
        elif kind == "failed":
            self._fail([rid for rid in msg[1] if rid in self._entries], msg[2])
        elif kind == "dead" and self.dead is None:
            self.dead = RuntimeError(msg[1])
            self._fail(list(self._entries), msg[1])
            if self.on_dead is not None:
                self.on_dead(self.dead)

    def _deliver(self, events, t0: float) -> None:
        batches: Dict[Sink, List[TokenEvent]] = {}
        for rid, token, logprobs, finish_reason, prompt_logprobs in events:
            e = self._entries.get(rid)
            if e is None:  # aborted by its handler meanwhile
                continue
            batches.setdefault(e.sink, []).append(
                TokenEvent(e.index, token, logprobs, finish_reason, e.admitted if e.admitted is not None else t0,
                           prompt_logprobs))
            if finish_reason is not None:
                del self._entries[rid]
        for sink, batch in batches.items():
            sink.put(batch)

    def _fail(self, rids: List[int], message: str) -> None:
        for sink in dict.fromkeys(self._entries.pop(rid).sink for rid in rids):  # each once, in order
            sink.put(EngineFailure(message))


class EngineCore:
    """``run(get)``: ``get(block)`` returns the next message (None when ``block`` is False and there
    is none); ``send(msg)`` reports."""

    def __init__(self, engine: Engine, send: Callable[[tuple], None]):
        self.engine, self.send = engine, send
        self.seqs: Dict[int, Sequence] = {}  # rid -> its sequence, while it runs
        self.rids: Dict[int, int] = {}  # Sequence.request_id -> rid
        self.waiting: Dict[int, bool] = {}  # rid -> the waiting state last reported
        self.failures = 0
        self.dirty = False  # adds or aborts not reported yet

    def run(self, get: Callable[[bool], Optional[tuple]]) -> None:
        while True:
            if self.dirty and not self.engine.has_work():  # before blocking: the server's view is current
                self.dirty = False
                self.send(("status", self.changes(), self.kv_usage()))
            msg = get(not self.engine.has_work())
            while msg is not None:
                if msg[0] == "stop":  # abort what is left: an Engine of the server's process outlives the loop
                    for seq in self.seqs.values():
                        self.engine.abort(seq)
                    return
                self.handle(msg)
                msg = get(False)
            if self.engine.has_work() and not self.step():
                return

    def handle(self, msg: tuple) -> None:
        self.dirty = True
        if msg[0] == "add":
            _, rid, prompt_ids, params, max_tokens, stop_ids = msg
            try:
                seq = self.engine.add(prompt_ids, params, max_tokens, stop_ids)
            except ValueError as e:  # the server checks what add checks: not expected
                self.send(("failed", [rid], str(e)))
                return
            self.seqs[rid], self.rids[seq.request_id] = seq, rid
        elif msg[0] == "abort" and msg[1] in self.seqs:
            self.engine.abort(self.forget(msg[1]))

    def step(self) -> bool:
        """One engine step and its report; False once the engine is dead."""
        t0 = time.perf_counter()
        try:
            sampled = self.engine.step()
        except Exception as e:  # every request in the engine fails; the loop goes on
            from ..engine.workers import WorkerDied  # here: the server's process never imports torch for it

            self.failures += 1
            log.exception("engine step failed (%d in a row); failing the requests in the engine", self.failures)
            rids = list(self.seqs)
            for rid in rids:
                self.engine.abort(self.forget(rid))
            message = f"{type(e).__name__}: {e}"
            self.send(("failed", rids, message))
            self.dirty = True  # their blocks were freed: the KV usage the server last got is stale
            dead = isinstance(e, WorkerDied)  # a tensor-parallel worker is gone or out of step: no step can run
            if not dead and self.failures >= MAX_CONSECUTIVE_FAILURES:
                log.error("the engine failed %d steps in a row: it is unusable", self.failures)
                dead = True
            if dead:
                self.send(("dead", message))
            return not dead
        self.failures = 0
        events: List[tuple] = []
        for seq in sampled:
            rid = self.rids.get(seq.request_id)
            if rid is None:  # aborted meanwhile
                continue
            if seq.error is not None:  # this request alone fails
                self.forget(rid)
                self.send(("failed", [rid], seq.error))
                continue
            events.append((rid, seq.tokens[-1], seq.logprobs[-1] if seq.logprobs is not None else None,
                           seq.finish_reason, seq.prompt_logprobs if seq.num_output == 1 else None))
            if seq.finish_reason is not None:
                self.forget(rid)
        self.dirty = False
        self.send(("step", t0, events, self.changes(), self.kv_usage()))
        return True

    def forget(self, rid: int) -> Sequence:
        seq = self.seqs.pop(rid)
        del self.rids[seq.request_id]
        self.waiting.pop(rid, None)
        return seq

    def changes(self) -> List[Tuple[int, bool]]:
        out = []
        for rid, seq in self.seqs.items():
            waiting = seq.status is Status.WAITING
            if self.waiting.get(rid, True) != waiting:
                out.append((rid, waiting))
                self.waiting[rid] = waiting
        return out

    def kv_usage(self) -> float:
        """The fraction of KV blocks some sequence holds (freed prefix-cache blocks count as free)."""
        blocks = self.engine.blocks
        return 1.0 - blocks.num_free / blocks.num_blocks


class ThreadTransport:
    """The engine loop in a thread of this process, over ``engine``."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._inbox: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def start(self, callback: Callable[[tuple], None], loop: asyncio.AbstractEventLoop) -> None:
        core = EngineCore(self.engine, lambda msg: loop.call_soon_threadsafe(callback, msg))
        self._thread = threading.Thread(target=core.run, args=(self._get,), name="qwen-serve-engine", daemon=True)
        self._thread.start()

    def _get(self, block: bool) -> Optional[tuple]:
        try:
            return self._inbox.get(block)
        except queue.Empty:
            return None

    def put(self, msg: tuple) -> None:
        self._inbox.put(msg)

    def stop(self, timeout: float) -> None:
        self._inbox.put(("stop",))
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
