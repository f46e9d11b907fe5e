"""The host side of decoding: launch steps, read the tokens back in chunks, apply the stop rule.

The host never waits for the GPU per token: every ``every`` steps it enqueues an asynchronous
copy of the new rows of the device token history into pinned memory plus an event, and reads a
chunk only once the *next* chunk has been enqueued, so the GPU always has queued steps while the
host detokenizes and checks for stop tokens.
"""

from collections import deque
from typing import Callable, List, Optional, Sequence

import torch
from torch import Tensor

TokenCallback = Callable[[int, int], object]  # (prompt index, token id) -> None, or STOP to end the row
FinishCallback = Callable[[int, List[int], str], None]  # (prompt index, new token ids, reason)


class _Stop:
    def __repr__(self) -> str:
        return "modeling.generation.readback.STOP"


STOP = _Stop()
"""Returned by an ``on_token`` callback: end this row now, reason ``stop`` (the token just taken
is kept). The host-side stop rule for what the device cannot see, e.g. stop strings."""


class TokenSink:
    """The tokens of one batch as the host reads them: a stop token ends its row (and is not
    kept), ``max_new`` kept tokens end it with reason ``length``. ``on_token`` gets each kept
    token (prompt index = ``offset`` + row) and may return ``STOP`` to end the row there (reason
    ``callback``, the token kept); ``on_finish`` gets each row once, when it ends. A row ended by
    ``STOP`` still runs on the device until the batch is done; its later tokens are ignored."""

    def __init__(self, n: int, offset: int, max_new: int, stop_ids: Sequence[int],
                 on_token: Optional[TokenCallback] = None, on_finish: Optional[FinishCallback] = None):
        self.tokens: List[List[int]] = [[] for _ in range(n)]
        self.reasons: List[Optional[str]] = [None] * n
        self.offset, self.max_new, self.stop_ids = offset, max_new, set(stop_ids)
        self.on_token, self.on_finish = on_token, on_finish

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.reasons)

    def take(self, row: int, token: int) -> None:
        if self.reasons[row] is not None:
            return
        if token in self.stop_ids:
            self.reasons[row] = "stop"
        else:
            self.tokens[row].append(token)
            if self.on_token is not None and self.on_token(self.offset + row, token) is STOP:
                self.reasons[row] = "callback"
            elif len(self.tokens[row]) == self.max_new:
                self.reasons[row] = "length"
        if self.reasons[row] is not None and self.on_finish is not None:
            self.on_finish(self.offset + row, self.tokens[row], self.reasons[row])


class Readback:
    """Reads ``history`` [steps, B] (device) back into a pinned host mirror, ``every`` rows at a
    time on CUDA (one row at a time, synchronously, on the CPU)."""

    def __init__(self, history: Tensor, every: int = 4):
        self.on_cuda = history.device.type == "cuda"
        self.history = history
        self.host = torch.zeros(history.shape, dtype=history.dtype, pin_memory=self.on_cuda)
        self.every = max(1, every) if self.on_cuda else 1

    def run(self, step: Callable[[], None], max_steps: int, sink: TokenSink) -> int:
        """Launch up to ``max_steps`` steps (each writes the next history row; row 0, the first
        tokens, is already on the host) until ``sink`` is done; returns the steps launched."""
        pending: deque = deque()  # (first history row, end row, event)
        launched, copied = 0, 1
        while launched < max_steps and not sink.done:
            step()
            launched += 1
            if launched + 1 - copied >= self.every or launched == max_steps:
                lo, hi = copied, launched + 1
                self.host[lo:hi].copy_(self.history[lo:hi], non_blocking=self.on_cuda)
                event = None
                if self.on_cuda:
                    event = torch.cuda.Event()
                    event.record()
                pending.append((lo, hi, event))
                copied = hi
                if len(pending) > 1 or not self.on_cuda:
                    self._read(sink, *pending.popleft())
        while pending:
            self._read(sink, *pending.popleft())
        return launched

    def _read(self, sink: TokenSink, lo: int, hi: int, event) -> None:
        if event is not None:
            event.synchronize()
        for row_tokens in self.host[lo:hi, : len(sink.tokens)].tolist():
            for row, token in enumerate(row_tokens):
                sink.take(row, token)
