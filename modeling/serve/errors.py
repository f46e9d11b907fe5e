"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client sees is an ``APIError`` turned into that JSON (``error_body``), never a
traceback: 400 invalid parameters (``param`` names the field), 401 a missing or wrong API key,
404 an unknown model or route, 408 a body that did not arrive in time, 413 a body over the size
limit, 429 the waiting queue full, 500 a failure inside the server (details in its log only), 503
draining, the engine unusable or too many connections.
"""

from typing import Any, Dict, Optional

TYPES = {429: "rate_limit_error", 500: "server_error", 503: "server_error"}
"""The ``type`` of each status, as OpenAI names them (any other: ``invalid_request_error``)."""


class APIError(Exception):
    """A request that fails with ``status``; ``message`` says why in one sentence."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> Dict[str, Any]:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def invalid(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    """A 400: the request itself is wrong."""
    return APIError(400, message, param, code)


def unsupported(param: str, detail: str) -> APIError:
    """A 400 for a parameter this server does not implement (never silently ignored)."""
    return APIError(400, f"'{param}' is not supported by this server: {detail}", param, "unsupported_parameter")
