"""The HTTP routes (FastAPI): /v1/models, /v1/completions, /v1/chat/completions, /tokenize,
/detokenize, /version (``{"version": the package's version}``), /health (and vLLM's /ping), /metrics.

A generation request is read (at most ``max_body_bytes``, else 413; within ``body_timeout`` seconds,
else 408), validated into a ``Plan`` (``protocol``), admitted (429 past ``max_waiting`` waiting
sequences), submitted to the engine (``engine_loop.EngineClient``) and answered as one JSON object or
as Server-Sent Events. A client that goes away (while sending its body, mid-stream, or while waiting
for a whole response) is no error: it is logged as a 499 and its sequences are aborted, which frees
their KV blocks. Every error is OpenAI's JSON shape (``errors``); one log line per request says its
status, tokens and timings.
"""

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Dict, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..api.checkpoint import Checkpoint
from ..api.outputs import TokenStrings
from .engine_loop import EngineClient
from .errors import APIError, error_body
from .generation import ClientGone, EngineError, Generation, check_admission
from .metrics import CONTENT_TYPE, Metrics
from .protocol import ChatCompletionRequest, CompletionRequest, parse, plan_chat, plan_completion
from .responses import SSE_DONE, Envelope, sse, usage
from .structured import GrammarCheck
from .tokenize import DetokenizeRequest, detokenize, tokenize, tokenize_request

log = logging.getLogger("modeling.serve")


@dataclass
class Settings:
    served_model_name: str
    api_key: Optional[str] = None
    max_waiting: int = 1024
    max_body_bytes: int = 8 << 20
    body_timeout: float = 30.0
    strict_requests: bool = False  # refuse unknown fields (a 400) instead of logging and ignoring them
    tool_call_parser: Optional[str] = None  # --tool-call-parser (chat_output.TOOL_PARSERS); None: from the template


class ServerState:
    """What the routes share: the checkpoint (``ck``: tokenizer, chat template, EOS ids), the
    engine's client (``loop``: started with the app, stopped after it), the metrics, and the
    draining flag."""

    def __init__(self, ck: Checkpoint, loop: EngineClient, settings: Settings):
        self.ck, self.loop, self.settings = ck, loop, settings
        self.strings = TokenStrings(ck.tokenizer)
        self.grammars = GrammarCheck(ck.tokenizer, ck.config.vocab_size)
        self.metrics = Metrics(loop)
        self.draining = False
        self.created = int(time.time())

    def unavailable(self) -> Optional[str]:
        if self.loop.dead is not None:
            return f"the engine failed and the server is shutting down ({self.loop.dead})"
        if self.draining:
            return "the server is shutting down (draining) and takes no new requests"
        return None

    def authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "Missing API key: send it as 'Authorization: Bearer <key>'", code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "Incorrect API key provided", code="invalid_api_key")


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request body, refused with a 413 as soon as it passes ``limit`` bytes, and with a 408
    (the connection then closes) when it has not all arrived ``timeout`` seconds after its head."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"The request body ({declared} bytes) is larger than this server takes ({limit} bytes)",
                       code="request_too_large")
    try:
        return await asyncio.wait_for(_read_body(request, limit), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"The request body did not arrive within {timeout:g} s", code="request_timeout") from None


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"The request body is larger than this server takes ({limit} bytes)",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop.start(asyncio.get_running_loop())
        await state.grammars.prepare()  # before the first request: never on a client's time
        try:
            yield
        finally:
            state.loop.stop()

    app = FastAPI(title="qwen-triton-ops", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    def error_response(request: Request, status: int, message: str, param=None, code=None) -> JSONResponse:
        state.metrics.errors.labels(str(status)).inc()
        log.info("request %s %s %d: %s", request.method, request.url.path, status, message)
        headers = {"Connection": "close"} if status == 408 else None  # what is left of the body is never read
        return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return error_response(request, e.status, e.message, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = {404: f"No route {request.url.path}", 405: f"{request.method} is not allowed on "
                   f"{request.url.path}"}.get(e.status_code, str(e.detail))
        return error_response(request, e.status_code, message)

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, e: ClientDisconnect):
        log.info("request %s %s 499: the client left while sending its body", request.method, request.url.path)
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("request %s %s failed", request.method, request.url.path)
        return error_response(request, 500, "The server failed while handling this request (see its log)",
                              code="internal_error")

    def model_card() -> Dict[str, Any]:
        return {"id": state.settings.served_model_name, "object": "model", "created": state.created,
                "owned_by": "qwen-triton-ops", "root": str(state.ck.path), "max_model_len": state.loop.max_model_len}

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers send HEAD
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's other name for it
    async def health():
        problem = state.unavailable()
        return JSONResponse({"status": problem or "ok"}, status_code=503 if problem else 200)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        state.authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        state.authorize(request)
        if model_id != state.settings.served_model_name:
            raise APIError(404, f"The model '{model_id}' does not exist", "model", "model_not_found")
        return model_card()

    @app.get("/version")
    async def get_version():  # the installed package's ("unknown" from a source tree not installed)
        try:
            return {"version": metadata.version("qwen-triton-ops")}
        except metadata.PackageNotFoundError:
            return {"version": "unknown"}

    @app.post("/tokenize")
    async def post_tokenize(request: Request):
        state.authorize(request)
        return tokenize(await read_request(request, tokenize_request), state.ck, state.loop.max_model_len)

    @app.post("/detokenize")
    async def post_detokenize(request: Request):
        state.authorize(request)
        req = await read_request(request, lambda body, strict: parse(DetokenizeRequest, body, strict))
        return detokenize(req, state.ck)

    async def read_request(request: Request, parser: Callable[[bytes, bool], Any]) -> Any:
        """The request's body parsed (``parser(body, strict)``); a 404 if it names another model."""
        body = await read_body(request, state.settings.max_body_bytes, state.settings.body_timeout)
        req, served = parser(body, state.settings.strict_requests), state.settings.served_model_name
        if req.model is not None and req.model != served:
            raise APIError(404, f"The model '{req.model}' does not exist (this server serves '{served}')", "model",
                           "model_not_found")
        return req

    # plain Starlette routes: the handler takes the request as it is (FastAPI's dependency solving and
    # exit stacks cost each request time before its prompt reaches the engine, for nothing here)
    async def completions(request: Request):
        return await generate(request, chat=False)

    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])

    async def generate(request: Request, chat: bool):
        arrival = time.perf_counter()
        state.authorize(request)
        problem = state.unavailable()
        if problem:
            raise APIError(503, problem, code="unavailable")
        req = await read_request(request, lambda body, strict: parse(
            ChatCompletionRequest if chat else CompletionRequest, body, strict))
        if chat:
            plan = plan_chat(req, state.ck, state.loop.max_model_len, state.settings.tool_call_parser)
        else:
            plan = plan_completion(req, state.ck, state.loop.max_model_len)
        await state.grammars.check(plan.params[0].structured_outputs, plan.constraint_field)
        check_admission(state.loop, plan, state.settings.max_waiting)
        gen = Generation(plan, chat, state.loop, state.strings, arrival)
        gen.submit()
        envelope = Envelope("chat" if chat else "completion", state.settings.served_model_name)
        if plan.stream:
            return ClosingStream(stream(request, gen, envelope), lambda: finish(request, gen, 499),
                                 lambda: state.draining)
        return await collect(request, gen, envelope)

    async def collect(request: Request, gen: Generation, envelope: Envelope) -> Response:
        """The whole response; its request's metrics and log line (``finish``) count an engine
        failure once, here, not again as an ``APIError``."""
        status = 499  # the client went away, unless the loop ends
        watcher = asyncio.create_task(_watch_disconnect(request, gen))
        try:
            while not gen.done:
                await gen.next()
            status = 200
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        except EngineError as e:
            status = 500
            return JSONResponse(engine_error(e), status_code=500)
        finally:
            watcher.cancel()
            finish(request, gen, status)
        choices = [gen.chat_choice(c) if gen.chat else gen.completion_choice(c) for c in gen.choices]
        return JSONResponse(envelope.response(choices, usage(gen.prompt_tokens, gen.completion_tokens),
                                              **gen.response_fields()))

    async def stream(request: Request, gen: Generation, envelope: Envelope):
        include, running = gen.plan.include_usage, gen.plan.continuous_usage

        def chunk(d: Dict[str, Any], **extra: Any) -> str:  # one choice's, with its usage so far if asked
            return envelope.chunk([d], include, gen.choice_usage(d["index"]) if running else None, **extra)

        status = 499
        try:  # one write per engine step: its chunks (one per choice) together, the last with [DONE]
            first = gen.first_chunk_fields()
            events = [chunk(d, **first) for d in gen.first_deltas()]
            while not gen.done:
                if events:
                    yield "".join(events)
                events = [chunk(d) for c, piece in await gen.next() if (d := gen.delta(c, piece)) is not None]
            if include:
                events.append(envelope.chunk([], True, usage(gen.prompt_tokens, gen.completion_tokens)))
            status = 200
            yield "".join(events) + SSE_DONE
        except EngineError as e:
            status = 500
            yield sse(engine_error(e))
            yield SSE_DONE
        finally:
            finish(request, gen, status)

    def finish(request: Request, gen: Generation, status: int) -> None:
        """Abort what is left of the request; its log line and metrics (once, however it ended)."""
        gen.abort()
        if gen.closed:
            return
        gen.closed = True
        m, t = state.metrics, gen.timings()
        m.prompt_tokens.inc(gen.prompt_tokens)
        m.generation_tokens.inc(gen.completion_tokens)
        for histogram, seconds in ((m.e2e, t["total"]), (m.queue, t["queue"]), (m.ttft, t["ttft"])):
            if seconds is not None:
                histogram.observe(seconds)
        for c in gen.choices:
            m.finished.labels(c.finish_reason).inc()
            if len(c.token_ids) > 1 and c.finished_at is not None:
                m.tpot.observe((c.finished_at - c.first_token) / (len(c.token_ids) - 1))
        if status >= 500:
            m.errors.labels(str(status)).inc()
        ms = {k: "-" if v is None else f"{v * 1e3:.1f}" for k, v in t.items()}
        reasons = ",".join(sorted({c.finish_reason for c in gen.choices}))
        log.info("request %s %s %d: %d prompt(s) x n=%d, tokens in %d out %d, queue %s ms, ttft %s ms, total %s ms, "
                 "finish %s%s", request.method, request.url.path, status, len(gen.plan.prompts), gen.plan.n,
                 gen.prompt_tokens, gen.completion_tokens, ms["queue"], ms["ttft"], ms["total"], reasons,
                 " (stream)" if gen.plan.stream else "")

    return app


class ClosingStream(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends, even when the client left before its
    generator started (whose own ``finally`` then never runs). Cancelled while ``draining()`` (the
    drain timeout passed), it ends quietly: the request is aborted and logged as such."""

    def __init__(self, content, on_close: Callable[[], None], draining: Callable[[], bool]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close, self.draining = on_close, draining

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            if not self.draining():
                raise
        finally:
            self.on_close()


def engine_error(e: EngineError) -> Dict[str, Any]:
    """The error body of a request the engine failed (a 500, or the last event of its stream)."""
    return error_body(500, f"The engine failed while running this request ({e}); see the server log",
                      code="engine_error")


async def _watch_disconnect(request: Request, gen: Generation) -> None:
    """Wake ``gen``'s handler with ``ClientGone`` when the client disconnects before its response
    is sent (no cancellation: the handler ends as it does for any other reason)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gen.sink.put(ClientGone())
            return
