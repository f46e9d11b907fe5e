"""``python -m modeling.serve`` on a paced stand-in for the engine, so that only the server's host
path runs: what ``bench.serve_host`` measures.

    python -m bench.serve_paced [--step-ms 2] [--counter FILE] [--profile FILE] [modeling.serve flags]
    python -m bench.serve_paced --step-ms 0 --trace FILE --model DIR [modeling.serve flags]   # the real engine

The server is the real one (``modeling.serve.__main__.main``: its command line, app, engine
process and pipes); only what its engine process builds differs (``EngineSpec.factory``): a
``PacedEngine`` instead of loading the weights. ``--counter FILE``: the engine's steps and tokens so
far, two int64 at the start of FILE, updated in place after every step (mmap: no system call in
the engine's loop). ``--profile FILE``: cProfile the server's process (its event loop: HTTP,
detokenization, JSON, the engine's reports), written to FILE when it exits (SIGTERM drains it).
``--trace FILE``: perf_counter stamps (one clock for every process of the machine) of each
request's first token along its path (``TRACE_HOPS``), the server's in FILE (JSON, at exit), the
engine process's in FILE.engine (a line per request, written after its first token's report):
what ``bench.serve_host --trace`` breaks a time to first token down with. The stamps come from
wrappers around the server's functions (the same code runs inside them, a few microseconds
more a request); a trace is for one stream at a time (c1): its stamps are matched in order.
``--step-ms 0``: the real engine instead of the stand-in (``--model``'s weights loaded as
``python -m modeling.serve`` loads them; no ``--counter``), so that a trace shows the server's hops
around a real step on the machine that runs it.
"""
import argparse
import cProfile
import functools
import json
import mmap
import os
import struct
import sys
import time
from types import SimpleNamespace
from typing import List, Optional

from modeling.engine import Sequence, Status

COUNTER = struct.Struct("<qq")
"""The counter file's layout: steps, tokens."""
DEFAULT_MAX_MODEL_LEN = 4096
NUM_BLOCKS = 1 << 20
"""KV blocks the stand-in reports (a running sequence holds one)."""


class PacedEngine:
    """What ``EngineCore`` uses of ``modeling.engine.Engine``, without a model: a step takes
    ``step_ms`` of wall time and samples one token for each of up to ``max_num_seqs`` sequences,
    admitted in arrival order. It sleeps until the previous step's planned end plus ``step_ms``
    while steps run back to back (oversleeping one step does not slow the pace), for ``step_ms``
    after the engine was idle. A prompt's first token comes from the step that admits it (prefill
    costs one step too). The tokens are word ids ``1..997``, varied per sequence and position;
    logprobs, when asked for, are 0.0 with the token as the top one. ``counter``: a ``COUNTER``
    file to update after each step, or None."""

    def __init__(self, step_ms: float, max_num_seqs: int, max_model_len: int, counter: Optional[str] = None):
        self.step_s, self.max_num_seqs, self.max_model_len = step_ms / 1e3, max_num_seqs, max_model_len
        self.seqs: List[Sequence] = []  # in arrival order: the first max_num_seqs run
        self.blocks = SimpleNamespace(num_blocks=NUM_BLOCKS, num_free=NUM_BLOCKS)
        self.next_end, self.idle = 0.0, True
        self.steps = self.tokens = 0
        self.last_step_end = 0.0
        self.counter = None
        if counter is not None:
            with open(counter, "r+b") as f:
                self.counter = mmap.mmap(f.fileno(), COUNTER.size)

    def add(self, prompt_ids, params, max_tokens: int, stop_ids=()) -> Sequence:
        seq = Sequence(prompt_ids, params, max_tokens, tuple(stop_ids))
        self.seqs.append(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        if seq in self.seqs:
            self.seqs.remove(seq)
            seq.status, seq.finish_reason = Status.FINISHED, "abort"

    def has_work(self) -> bool:
        """``EngineCore`` asks before it waits for messages: without work, the next step starts a
        new pace."""
        self.idle = self.idle or not self.seqs
        return bool(self.seqs)

    def step(self) -> List[Sequence]:
        now = time.perf_counter()
        if self.idle:  # this step starts now
            self.next_end, self.idle = now, False
        self.next_end += self.step_s
        time.sleep(max(0.0, self.next_end - now))
        out = self.seqs[:self.max_num_seqs]
        for seq in out:
            seq.status = Status.RUNNING
            token = 1 + (seq.request_id * 31 + seq.num_output) % 997
            seq.append(token, None if seq.logprobs is None else (0.0, [(token, 0.0)], 1))
        self.seqs = [seq for seq in self.seqs if seq.finish_reason is None]
        for seq in out:
            if seq.finish_reason is not None:
                seq.status = Status.FINISHED
        self.blocks.num_free = NUM_BLOCKS - min(len(self.seqs), self.max_num_seqs)
        self.steps, self.tokens = self.steps + 1, self.tokens + len(out)
        self.last_step_end = time.perf_counter()
        if self.counter is not None:
            COUNTER.pack_into(self.counter, 0, self.steps, self.tokens)
        return out


TRACE_HOPS = (
    ("client_sent", "the client's write of the request (bench.serve_host's raw client)"),
    ("server_read", "the server's first read of its bytes (uvicorn's protocol's data_received)"),
    ("asgi", "uvicorn has parsed the request and calls the app (FastAPI.__call__)"),
    ("handler", "the route's handler reads the body (read_body called)"),
    ("body", "the body read"),
    ("parsed", "validated (pydantic)"),
    ("planned", "the Plan built: the prompt tokenized, the sampling params"),
    ("submitted", "Generation.submit returned: the add written to the engine's pipe"),
    ("engine_got", "the engine process handles the add (EngineCore.handle)"),
    ("step_start", "the step that runs it starts (EngineCore.step)"),
    ("step_end", "that step returned (the stand-in sleeps step_ms in it)"),
    ("report_sent", "its report written to the report pipe"),
    ("report_read", "the server handles the report (EngineClient.on_message)"),
    ("chunk_write", "the first token's chunk reaches uvicorn's send (the stream's first yield)"),
    ("chunk_written", "uvicorn's send returned (the bytes handed to the socket)"),
    ("client_first", "the client has parsed the first chunk with text"),
)
"""Where a request's first token is stamped, in path order."""


def trace_server(path: str) -> None:
    """Wrap the server's functions to stamp each request (``TRACE_HOPS`` from server_read to
    chunk_written, and the connections accepted so far); written to ``path`` at exit."""
    import atexit

    from fastapi import FastAPI
    from uvicorn.protocols.http import h11_impl

    from modeling.serve import app, engine_loop, generation

    records, state = [], {"read": None, "current": None, "asgi": None, "connections": 0}
    now = time.perf_counter

    def wrap(owner, name, before=None, after=None):
        fn = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if before is not None:
                before(*args)
            out = fn(*args, **kwargs)
            if after is not None:
                after(*args)
            return out
        setattr(owner, name, wrapped)

    def on_data(*_):
        if state["read"] is None:
            state["read"] = now()
    def on_connection(*_):
        state["connections"] += 1

    protocols = [h11_impl.H11Protocol]  # and httptools' protocol, which uvicorn takes when it is installed
    try:
        from uvicorn.protocols.http import httptools_impl
        protocols.append(httptools_impl.HttpToolsProtocol)
    except ImportError:
        pass
    for protocol in protocols:
        wrap(protocol, "data_received", before=on_data)
        wrap(protocol, "connection_made", before=on_connection)

    asgi = FastAPI.__call__

    async def traced_asgi(self, scope, receive, send):
        if scope["type"] == "http":
            state["asgi"] = now()
        await asgi(self, scope, receive, send)
    FastAPI.__call__ = traced_asgi

    read_body = app.read_body

    async def traced_read_body(request, limit, timeout):
        rec = {"server_read": state["read"], "asgi": state["asgi"], "handler": now(),
               "connections": state["connections"]}
        state["read"], state["current"] = None, rec
        records.append(rec)
        body = await read_body(request, limit, timeout)
        rec["body"] = now()
        return body
    app.read_body = traced_read_body

    def stamp(key):
        def f(*_):
            if state["current"] is not None:
                state["current"].setdefault(key, now())
        return f
    wrap(app, "parse", after=stamp("parsed"))
    wrap(app, "plan_completion", after=stamp("planned"))
    wrap(generation.Generation, "submit", after=stamp("submitted"))

    def on_message(client, msg):
        rec = state["current"]
        if rec is not None and msg[0] == "step" and msg[2] and "report_read" not in rec:
            rec["report_read"] = now()
    wrap(engine_loop.EngineClient, "on_message", before=on_message)

    call = app.ClosingStream.__call__

    async def traced_call(self, scope, receive, send):
        rec = state["current"]

        async def traced_send(message):
            first = (rec is not None and message["type"] == "http.response.body" and message.get("body")
                     and "chunk_write" not in rec)
            if first:
                rec["chunk_write"] = now()
            await send(message)
            if first:
                rec["chunk_written"] = now()
        await call(self, scope, receive, traced_send)
    app.ClosingStream.__call__ = traced_call

    def dump():
        with open(path, "w") as f:
            json.dump(records, f)
    atexit.register(dump)


def trace_engine(path: str) -> None:
    """In the engine's process: wrap ``EngineCore`` to stamp each request's add, the step that
    gave its first token, and that step's report; a JSON line a request appended to ``path``."""
    from modeling.serve import engine_loop

    got: dict = {}  # rid -> its add's stamp, until its first token
    handle, step = engine_loop.EngineCore.handle, engine_loop.EngineCore.step

    def traced_handle(core, msg):
        if msg[0] == "add":
            got[msg[1]] = time.perf_counter()
        return handle(core, msg)

    def traced_step(core):
        send, sent, engine_step, ended = core.send, [], core.engine.step, []

        def traced_send(msg):
            send(msg)
            sent.append((msg, time.perf_counter()))

        def timed_step():
            try:
                return engine_step()
            finally:
                ended.append(time.perf_counter())
        core.send, core.engine.step = traced_send, timed_step
        try:
            ok = step(core)
        finally:
            core.send = send
            del core.engine.step  # the class's again
        for msg, t in sent:
            if msg[0] != "step":
                continue
            for rid, *_ in msg[2]:
                if rid in got:
                    line = dict(rid=rid, engine_got=got.pop(rid), step_start=msg[1], step_end=ended[0],
                                report_sent=t)
                    with open(path, "a") as f:
                        f.write(json.dumps(line) + "\n")
        return ok
    engine_loop.EngineCore.handle, engine_loop.EngineCore.step = traced_handle, traced_step


def paced_engine(spec, step_ms: float, counter: Optional[str], trace: Optional[str] = None):
    """``EngineSpec.factory``: a ``PacedEngine`` with the spec's max_num_seqs and max_model_len
    (``trace``: ``trace_engine`` to that file first)."""
    if trace is not None:
        trace_engine(trace)
    max_model_len = spec.engine.get("max_model_len") or DEFAULT_MAX_MODEL_LEN
    engine = PacedEngine(step_ms, spec.engine.get("max_num_seqs", 256), max_model_len, counter)
    return engine, dict(max_model_len=max_model_len, num_blocks=NUM_BLOCKS, block_size=16,
                        backend=f"paced stand-in, {step_ms:g} ms a step", dtype="none")


def real_engine(spec, trace: Optional[str] = None):
    """``EngineSpec.factory`` of ``--step-ms 0``: the engine ``python -m modeling.serve`` builds
    (``trace``: ``trace_engine`` to that file first)."""
    from modeling.serve.engine_process import _build

    if trace is not None:
        trace_engine(trace)
    return _build(spec)


def read_counter(path: str):
    """(steps, tokens) from a ``--counter`` file."""
    with open(path, "rb") as f:
        return COUNTER.unpack(f.read(COUNTER.size))


def new_counter(path: str) -> None:
    """Create (or zero) a ``--counter`` file."""
    with open(path, "wb") as f:
        f.write(bytes(COUNTER.size))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_paced", description=__doc__.splitlines()[0],
                                epilog="Every other flag goes to python -m modeling.serve.")
    p.add_argument("--step-ms", type=float, default=2.0,
                   help="wall time of one engine step (default 2); 0: the real engine, no stand-in")
    p.add_argument("--counter", help="a file (created) the engine keeps its steps and tokens in")
    p.add_argument("--profile", help="write a cProfile of the server's process to this file at exit")
    p.add_argument("--trace", help="stamp each request's first token on its path: the server's to this file at "
                                   "exit, the engine's to this file + '.engine'")
    own, rest = p.parse_known_args(argv)
    if own.step_ms < 0 or (own.step_ms == 0 and own.counter is not None):
        p.error("--step-ms must be positive, or 0 (the real engine) without --counter")
    if own.counter is not None:
        new_counter(own.counter)
    engine_trace = os.path.abspath(own.trace) + ".engine" if own.trace else None
    if own.step_ms == 0:
        factory = functools.partial(real_engine, trace=engine_trace)
    else:
        factory = functools.partial(paced_engine, step_ms=own.step_ms,
                                    counter=os.path.abspath(own.counter) if own.counter else None, trace=engine_trace)
    if own.trace is not None:
        trace_server(os.path.abspath(own.trace))
    from modeling.serve.__main__ import main as serve_main

    if own.profile is None:
        return serve_main(rest, factory)
    profile = cProfile.Profile()
    try:
        return profile.runcall(serve_main, rest, factory)
    finally:
        profile.dump_stats(own.profile)


if __name__ == "__main__":
    sys.exit(main())
