"""``python -m modeling.serve`` on a paced stand-in for the engine, so that only the server's host
path runs: what ``bench.serve_host`` measures.

    python -m bench.serve_paced [--step-ms 2] [--counter FILE] [--profile FILE] [modeling.serve flags]

The server is the real one (``modeling.serve.__main__.main``: its command line, app, engine
process and pipes); only what its engine process builds differs (``EngineSpec.factory``): a
``PacedEngine`` instead of loading the weights. ``--counter FILE``: the engine's steps and tokens so
far, two int64 at the start of FILE, updated in place after every step (mmap: no system call in
the engine's loop). ``--profile FILE``: cProfile the server's process (its event loop: HTTP,
detokenization, JSON, the engine's reports), written to FILE when it exits (SIGTERM drains it).
"""
import argparse
import cProfile
import functools
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
            seq.append(token, None if seq.logprobs is None else (0.0, [(token, 0.0)]))
        self.seqs = [seq for seq in self.seqs if seq.finish_reason is None]
        for seq in out:
            if seq.finish_reason is not None:
                seq.status = Status.FINISHED
        self.blocks.num_free = NUM_BLOCKS - min(len(self.seqs), self.max_num_seqs)
        self.steps, self.tokens = self.steps + 1, self.tokens + len(out)
        if self.counter is not None:
            COUNTER.pack_into(self.counter, 0, self.steps, self.tokens)
        return out


def paced_engine(spec, step_ms: float, counter: Optional[str]):
    """``EngineSpec.factory``: a ``PacedEngine`` with the spec's max_num_seqs and max_model_len."""
    max_model_len = spec.engine.get("max_model_len") or DEFAULT_MAX_MODEL_LEN
    engine = PacedEngine(step_ms, spec.engine.get("max_num_seqs", 256), max_model_len, counter)
    return engine, dict(max_model_len=max_model_len, num_blocks=NUM_BLOCKS, block_size=16,
                        backend=f"paced stand-in, {step_ms:g} ms a step", dtype="none")


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
    p.add_argument("--step-ms", type=float, default=2.0, help="wall time of one engine step (default 2)")
    p.add_argument("--counter", help="a file (created) the engine keeps its steps and tokens in")
    p.add_argument("--profile", help="write a cProfile of the server's process to this file at exit")
    own, rest = p.parse_known_args(argv)
    if own.counter is not None:
        new_counter(own.counter)
    factory = functools.partial(paced_engine, step_ms=own.step_ms,
                                counter=os.path.abspath(own.counter) if own.counter else None)
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
