"""Graceful shutdown: uvicorn's server with the server's own SIGTERM/SIGINT handling."""

import contextlib
import logging
import signal

import uvicorn

log = logging.getLogger("modeling.serve")


class DrainingServer(uvicorn.Server):
    """The first SIGTERM/SIGINT marks ``state`` draining (new requests get 503) and starts
    uvicorn's graceful shutdown: the listening socket closes, idle connections close, running
    requests finish within ``timeout_graceful_shutdown`` seconds (then uvicorn cancels them, which
    aborts their sequences). A second signal forces the exit. Unlike uvicorn's own handlers the
    signal is not re-raised afterwards, so a drained server exits 0."""

    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.state = state

    @contextlib.contextmanager
    def capture_signals(self):
        def handle(sig, frame):
            if self.should_exit:
                self.force_exit = True
                return
            self.state.draining = True
            counts = self.state.loop.counts()
            log.info("%s: draining (%d running, %d waiting; up to %g s), then exiting", signal.Signals(sig).name,
                     counts["running"], counts["waiting"], self.config.timeout_graceful_shutdown)
            self.should_exit = True

        original = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
