"""The engine's side of the server: a loop that takes requests as messages, steps the engine while it
has work, and reports what each step did as messages. It runs in the engine's own process
(``engine_process``: the default, so the HTTP side's Python never holds the engine's interpreter)
or in a thread of the server's (``engine_loop.ThreadTransport``: tests, embedding). Messages are
plain tuples (they cross a pipe); ``rid`` is the request id the server gave a sequence.

In:  ("add", rid, prompt_ids, params, max_tokens, stop_ids, logprobs) | ("abort", rid) | ("stop",)
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
import logging
import time
from typing import Callable, Dict, List, Optional, Tuple

from ..engine import Engine, Sequence, Status

log = logging.getLogger("modeling.serve")

MAX_CONSECUTIVE_FAILURES = 3


class EngineCore:
    """``run(get)``: ``get(block)`` returns the next message (None when ``block`` is False and there
    is none); ``send(msg)`` reports."""

    def __init__(self, engine: Engine, send: Callable[[tuple], None]):
        self.engine, self.send = engine, send
        self.seqs: Dict[int, Sequence] = {}  # rid -> its sequence, while it runs
        self.rids: Dict[int, int] = {}  # Sequence.request_id -> rid
        self.wants_logprobs: Dict[int, bool] = {}
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
            _, rid, prompt_ids, params, max_tokens, stop_ids, logprobs = msg
            try:
                seq = self.engine.add(prompt_ids, params, max_tokens, stop_ids)
            except ValueError as e:  # the server checks what add checks: not expected
                self.send(("failed", [rid], str(e)))
                return
            self.seqs[rid], self.rids[seq.request_id], self.wants_logprobs[rid] = seq, rid, logprobs
        elif msg[0] == "abort":
            seq = self.seqs.get(msg[1])
            if seq is not None:
                self.engine.abort(seq)
                self.forget(msg[1])

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
                self.engine.abort(self.seqs[rid])
                self.forget(rid)
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
        events: List[Tuple[int, int, Optional[tuple], Optional[str]]] = []
        for seq in sampled:
            rid = self.rids.get(seq.request_id)
            if rid is None:  # aborted meanwhile
                continue
            if seq.error is not None:  # this request alone fails
                self.forget(rid)
                self.send(("failed", [rid], seq.error))
                continue
            events.append((rid, seq.tokens[-1], seq.logprobs[-1] if self.wants_logprobs[rid] else None,
                           seq.finish_reason, seq.prompt_logprobs if seq.num_output == 1 else None))
            if seq.finish_reason is not None:
                self.forget(rid)
        self.dirty = False
        self.send(("step", t0, events, self.changes(), self.kv_usage()))
        return True

    def forget(self, rid: int) -> None:
        seq = self.seqs.pop(rid)
        del self.rids[seq.request_id], self.wants_logprobs[rid]
        self.waiting.pop(rid, None)

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
