"""The engine in a process of its own: what ``python -m modeling.serve`` runs.

The server process keeps the HTTP side (requests, tokenizer, chat templates, detokenization,
streaming) and never loads the weights; a child process (``multiprocessing`` spawn: CUDA does not
survive a fork) loads them, builds the ``Engine``, warms it up on CUDA, says it is ready, then
runs ``engine_loop.EngineCore``. The two share no interpreter: the event loop's Python never delays
a step, and the engine's never delays a stream. Requests go to the child through a pipe that the
event loop writes without blocking (``put``), in ``multiprocessing.Connection``'s framing, so the
child reads them with ``recv``; reports come back through another pipe the event loop reads when
it is readable (``add_reader``). Not a ``multiprocessing`` queue: its feeder thread needs the
interpreter to write, so a request would wait for whatever Python the event loop runs next.

The child ignores SIGINT and SIGTERM (the server drains, then stops it: SIGKILL if it does not stop
in time, or if the server is interrupted while the child starts) and exits by itself when the
server process is gone. Its exit at any other time is the engine's death for the server.
"""
import contextlib
import logging
import os
import select
import signal
import struct
import time
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, Optional, Tuple

from ..api.commands import UsageError

START_POLL_S = 1.0
"""How often the child's wait for messages and the server's wait for the child's start look up."""
READ_BYTES = 1 << 20
"""The most one read of the report pipe takes."""


@dataclass
class EngineSpec:
    """What the child builds: the checkpoint directory, ``--device`` and ``--dtype`` as given, the
    ``Engine`` keyword arguments, the warm-up prompt's length (0: none), ``--quantization`` and
    ``--tensor-parallel-size`` (the child then starts the workers: it is not a daemon). ``factory``, when
    given, builds a stand-in instead (a picklable callable: benchmarks of the server's host path,
    tests): ``factory(spec)`` returns what ``EngineCore`` drives and the "ready" info."""

    checkpoint: str
    device: Optional[str]
    dtype: Optional[str]
    engine: Dict[str, Any] = field(default_factory=dict)
    warmup_tokens: int = 0
    log_level: str = "INFO"
    factory: Optional[Callable[["EngineSpec"], Tuple[Any, Dict[str, Any]]]] = None
    quantization: Optional[str] = None
    tensor_parallel_size: int = 1


class EngineStartError(Exception):
    """The child crashed building the engine (a problem with the flags or the model: ``UsageError``)."""


class ProcessTransport:
    """Starts the child and waits until its engine is ready (``info``: max_model_len, num_blocks,
    block_size, backend, dtype), or raises ``EngineStartError`` or ``UsageError``."""

    def __init__(self, spec: EngineSpec):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child_end = ctx.Pipe(duplex=False)  # reports: the child writes
        child_inbox, self._out = ctx.Pipe(duplex=False)  # requests: we write
        self.proc = ctx.Process(target=_child_main, args=(spec, child_inbox, child_end, os.getpid()),
                                name="qwen-serve-engine", daemon=spec.tensor_parallel_size == 1)
        self.proc.start()
        child_end.close()  # the child holds the only write end: its exit is our EOF
        child_inbox.close()
        os.set_blocking(self._out.fileno(), False)
        self._pending = bytearray()  # framed requests the pipe has not taken yet
        self._received = bytearray()  # framed reports read, not handled yet (a report's start)
        self._writing = False  # flush registered with the loop
        self._loop = None
        try:
            self.info = self._wait_ready()
        except BaseException:  # Ctrl-C while it loads, or it failed: it ignores SIGINT and SIGTERM
            self._kill()
            raise

    def _wait_ready(self) -> Dict[str, Any]:
        while not self._conn.poll(START_POLL_S) and self.proc.is_alive():
            pass
        try:
            msg = self._conn.recv()
        except EOFError:  # it exited without a word (killed, or crashed in the interpreter)
            self.proc.join()
            raise EngineStartError(f"the engine process exited with code {self.proc.exitcode} before it was ready "
                                   "(see the log above)") from None
        if msg[0] == "error":
            self.proc.join()
            raise (UsageError if msg[1] == "usage" else EngineStartError)(msg[2])
        return msg[1]

    def start(self, callback: Callable[[tuple], None], loop) -> None:
        self._callback, self._loop = callback, loop
        loop.add_reader(self._conn.fileno(), self._readable)
        self._flush()

    def _readable(self) -> None:
        """Every report the pipe holds, in one read (``Connection.recv`` takes two and a poll a
        report), unframed here; a report's end that has not come yet waits for the next read."""
        data = self._read()
        if not data:  # EOF: the child holds the only write end
            self._loop.remove_reader(self._conn.fileno())
            self.proc.join(START_POLL_S)
            self._callback(("dead", f"the engine process exited (code {self.proc.exitcode})"))
            return
        self._received += data
        start, end = 0, len(self._received)
        while end - start >= 4:
            size = struct.unpack_from("!i", self._received, start)[0]  # reports are far below 2 GiB
            if end - start - 4 < size:
                break
            msg = ForkingPickler.loads(memoryview(self._received)[start + 4:start + 4 + size])
            start += 4 + size
            self._callback(msg)
        del self._received[:start]

    def _read(self) -> bytes:
        """What the report pipe holds, at most ``READ_BYTES``; b"" at EOF (or a failed read)."""
        try:
            return os.read(self._conn.fileno(), READ_BYTES)
        except OSError:
            return b""

    def put(self, msg: tuple) -> None:
        """Send ``msg`` now, as far as the pipe takes it; never blocks."""
        if self._out.closed:
            return
        data = ForkingPickler.dumps(msg)
        self._pending += struct.pack("!i", len(data)) + data  # Connection.send's framing
        self._flush()

    def _flush(self) -> None:
        try:
            while self._pending:
                del self._pending[:os.write(self._out.fileno(), self._pending)]
        except BlockingIOError:  # full: the rest when it is writable
            pass
        except OSError:  # the child is gone: its death reaches us through the report pipe
            self._pending.clear()
        if self._loop is not None and not self._loop.is_closed() and self._writing != bool(self._pending):
            if self._pending:
                self._loop.add_writer(self._out.fileno(), self._flush)
            else:
                self._loop.remove_writer(self._out.fileno())
            self._writing = bool(self._pending)

    def stop(self, timeout: float) -> None:
        """"stop" to the child, then SIGKILL after ``timeout`` seconds. Its reports meanwhile are
        read and dropped: one larger than the pipe holds would block it before it reads "stop"."""
        if self._loop is not None and not self._conn.closed:
            self._loop.remove_reader(self._conn.fileno())
            if self._writing:
                self._loop.remove_writer(self._out.fileno())
            self._loop = None  # from here on, this method writes what is pending
        if self.proc.is_alive():
            self.put(("stop",))
            deadline = time.monotonic() + timeout
            while self.proc.is_alive() and time.monotonic() < deadline:
                writable = [self._out] if self._pending else []
                readable, writable, _ = select.select([self._conn, self.proc.sentinel], writable, [],
                                                      max(0.0, deadline - time.monotonic()))
                if writable:
                    self._flush()
                # dropped unframed: _readable may have read a report's start; b"": it is exiting
                if self._conn in readable and not self._read():
                    self.proc.join(max(0.0, deadline - time.monotonic()))
                    break
        self._kill()

    def _kill(self) -> None:
        """SIGKILL the child if it still runs (it ignores SIGTERM), reap it, close both pipes (what
        it did not read is dropped)."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self._conn.close()
        self._out.close()
        self._pending.clear()


def _build(spec: EngineSpec) -> Tuple[Any, Dict[str, Any]]:
    """The ``Engine`` of ``spec`` (weights loaded, warmed up) and its "ready" info."""
    from ..api.checkpoint import Checkpoint
    from ..api.commands import load_llm
    from ..engine import Engine
    from ..engine.sampling_params import SamplingParams

    import torch

    llm = load_llm(Checkpoint.load(spec.checkpoint, progress=False), spec.device, spec.dtype,
                   quantization=spec.quantization, tensor_parallel_size=spec.tensor_parallel_size)
    try:
        engine = Engine(llm.model, tokenizer=llm.tokenizer, workers=llm.workers, **spec.engine)
    except (ValueError, MemoryError, torch.OutOfMemoryError) as e:
        raise UsageError(f"the engine does not fit: {e}") from None
    with contextlib.suppress(ImportError):  # without xgrammar, constrained requests are refused with a 400
        engine.prepare_grammars()
    if spec.warmup_tokens:  # compile the kernels, capture the graphs, run a request: not on a client's time
        warm_up(engine)
        n = min(spec.warmup_tokens, engine.max_model_len - 1)
        engine.generate([[0] * n], SamplingParams(), min(2, engine.max_model_len - n))
    return engine, dict(max_model_len=engine.max_model_len, num_blocks=engine.size.num_blocks,
                        block_size=engine.size.block_size, backend=llm.backend,
                        dtype=str(llm.dtype).replace("torch.", ""))


def warm_up(engine) -> None:
    """Before the first client (with CUDA graphs): capture the graph of every step shape
    (``Engine.capture_graphs``), compiling every kernel on the way; a shape's first occurrence
    otherwise stalls every running sequence while it compiles or captures."""
    t0 = time.perf_counter()
    n = engine.capture_graphs()
    if n:
        logging.getLogger("modeling.serve").info("captured %d step graphs in %.1f s", n, time.perf_counter() - t0)


def _child_main(spec: EngineSpec, inbox, conn, parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .engine_loop import EngineCore

    try:
        engine, info = (spec.factory or _build)(spec)
    except UsageError as e:
        conn.send(("error", "usage", str(e)))
        return
    except Exception as e:  # one line, as the command line reports its own failures
        conn.send(("error", "crash", f"{type(e).__name__}: {' '.join(str(e).split())}"))
        return
    conn.send(("ready", info))

    def get(block: bool) -> Optional[tuple]:
        if not block and not inbox.poll():
            return None
        while block and not inbox.poll(START_POLL_S):
            if os.getppid() != parent_pid:  # the server is gone
                return ("stop",)
        try:
            return inbox.recv()
        except (EOFError, OSError):  # the server closed its end
            return ("stop",)

    try:
        EngineCore(engine, conn.send).run(get)
    finally:
        if getattr(engine, "workers", None) is not None:  # tensor parallelism: stop the workers this process started
            engine.workers.close()
