"""What one connection may hold: uvicorn's HTTP protocol with a deadline for each request's head and
a cap on the connections open at once.

uvicorn closes a connection idle between requests (its keep-alive timeout) but waits forever for
a request that is sent slowly or never finished, so half-sent requests would hold their sockets
(and file descriptors) for good. ``guarded_protocol`` gives each request ``header_timeout``
seconds, from the connection's opening (or its first byte after the previous response), to
complete its head: past that the connection is closed. A connection past ``max_connections`` open
at once is answered 503 in OpenAI's error shape and closed before anything is read. The body's
own deadline is the app's (``app.read_body``: a 408).
"""

import asyncio
import json
import logging
from typing import Optional

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from .errors import error_body

log = logging.getLogger("modeling.serve")


def guarded_protocol(header_timeout: float, max_connections: int) -> type:
    """uvicorn's HTTP protocol class (httptools', else h11's) with the head deadline and the
    connection cap; given to ``uvicorn.Config(http=...)``."""
    body = json.dumps(error_body(503, f"The server holds its maximum of {max_connections} connections "
                                      "(--max-connections). Retry later.", code="too_many_connections")).encode()
    busy = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))  # the raw response past the cap

    class GuardedProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self.head_deadline: Optional[asyncio.TimerHandle] = None
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                log.warning("a connection past --max-connections %d: answered 503", max_connections)
                transport.write(busy)
                transport.close()
                return
            self._start_head()

        def data_received(self, data: bytes) -> None:
            if self.head_deadline is None and (self.cycle is None or self.cycle.response_complete):
                self._start_head()  # the first bytes of the next request on a kept-alive connection
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._end_head()  # uvicorn starts a request (a cycle) once its head is whole

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._end_head()
            super().connection_lost(exc)

        def _start_head(self) -> None:
            self.head_deadline = self.loop.call_later(header_timeout, self._head_timed_out)

        def _end_head(self) -> None:
            if self.head_deadline is not None:
                self.head_deadline.cancel()
                self.head_deadline = None

        def _head_timed_out(self) -> None:
            self.head_deadline = None
            if not self.transport.is_closing():
                log.debug("a request head not complete within %g s: connection closed", header_timeout)
                self.transport.close()

    return GuardedProtocol
