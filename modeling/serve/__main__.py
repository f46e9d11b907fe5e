"""Command line: ``python -m modeling.serve --model DIR_OR_ORG/NAME`` (``qwen-serve``), an
OpenAI-compatible HTTP server on the continuous-batching engine. See docs/serve.md.

Exit status: 0 after a drain (SIGTERM or SIGINT: ``drain.DrainingServer``), 2 bad input (one line
``error: ...``), 1 another failure, the engine unusable included.
"""

import argparse
import gc
import logging
import os
import sys
from typing import Callable, Optional, Sequence

from ..api.commands import (UsageError, add_model_flags, command_main, device_problem, load_checkpoint, prog_name,
                            quantization_problem, say)
from .chat_output import TOOL_PARSERS

API_KEY_ENV = "QWEN_API_KEY"
DEFAULT_MODEL_NAME = "qwen-triton-ops-default"
"""The served name of the shipped model (without ``--model`` or ``--served-model-name``)."""
WARMUP_PROMPT_TOKENS = 8
GC_GEN0_THRESHOLD = 20_000
"""Allocations between the collector's young-generation passes while serving (Python's default:
700): a stream allocates a few objects a token, nearly all freed by reference counting at once."""


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog_name("modeling.serve"),
        description="Serve a Qwen3, Qwen2/2.5 or Qwen3.5 checkpoint (dense or mixture of experts) over an "
                    "OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health, "
                    "/metrics) on the continuous-batching engine.",
        epilog="SIGTERM/SIGINT drain the server and exit 0. See docs/serve.md.")
    m = p.add_argument_group("model")
    m.add_argument("--model", help="a checkpoint directory or a Hugging Face Hub id ORG/NAME; default: the shipped "
                                   "model, a small Qwen3 trained on Tiny Shakespeare")
    m.add_argument("--served-model-name", help="the model id clients name and /v1/models lists (default: --model "
                                               f"as given, or {DEFAULT_MODEL_NAME!r} for the shipped model)")
    h = p.add_argument_group("http")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    h.add_argument("--port", type=int, default=8000, help="default 8000")
    h.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} if "
                                     "set, else no key)")
    h.add_argument("--max-waiting", type=int, default=1024,
                   help="sequences that may wait for the engine; a request past it gets 429 (default 1024)")
    h.add_argument("--max-body-bytes", type=int, default=8 << 20,
                   help="largest request body; a larger one gets 413 (default 8 MiB)")
    h.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a request's head (its line and headers) may take to arrive, from the "
                        "connection's opening or the previous response; then the connection is closed (default 10)")
    h.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request's body may take to arrive after its head; then 408 (default 30)")
    h.add_argument("--max-connections", type=int, default=1000,
                   help="connections open at once; one more is answered 503 and closed (default 1000)")
    h.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds running requests may take to finish after SIGTERM/SIGINT (default 30)")
    h.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    h.add_argument("--strict-requests", action="store_true",
                   help="refuse a request that holds a field the server does not know (400) instead of logging and "
                        "ignoring the field")
    h.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                   help="the tool-call form replies are parsed in and tool_choice forces: hermes or qwen3_json for "
                        "Qwen3's <tool_call>{JSON}</tool_call>, qwen3_xml or qwen3_coder for Qwen3.5's and "
                        "Qwen3-Coder's <tool_call><function=NAME>... (default: xml when the chat template writes "
                        "<function=, else json)")
    e = p.add_argument_group("engine")
    e.add_argument("--max-model-len", type=int, help="prompt + new tokens per sequence at most (default: the "
                                                      "model's max_position_embeddings)")
    e.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one engine step (default 256)")
    e.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="new tokens in one engine step (default 8192)")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the free device memory the KV cache pool takes (default 0.9; CUDA only)")
    e.add_argument("--enforce-eager", action="store_true", help="run every engine step eagerly (no CUDA graphs)")
    add_model_flags(m, e)
    e.add_argument("--memory-fraction", dest="gpu_memory_utilization", type=float, help=argparse.SUPPRESS)
    e.add_argument("--no-cuda-graph", dest="enforce_eager", action="store_const", const=True, help=argparse.SUPPRESS)
    return p.parse_args(argv)


RENAMED_FLAGS = {"--memory-fraction": "--gpu-memory-utilization", "--no-cuda-graph": "--enforce-eager"}
"""Earlier flags that still work, with a note naming the new one."""


def check_args(a: argparse.Namespace) -> None:
    if not 0 <= a.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {a.port}")
    for flag, value in (("--max-waiting", a.max_waiting), ("--max-num-seqs", a.max_num_seqs),
                        ("--max-num-batched-tokens", a.max_num_batched_tokens), ("--max-body-bytes", a.max_body_bytes),
                        ("--max-connections", a.max_connections), ("--tensor-parallel-size", a.tensor_parallel_size)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    problem = quantization_problem(a.quantization, a.tensor_parallel_size)
    if problem:
        raise UsageError(problem)
    if a.max_model_len is not None and a.max_model_len < 2:
        raise UsageError(f"--max-model-len must be >= 2, got {a.max_model_len}")
    if not 0 < a.gpu_memory_utilization <= 1:
        raise UsageError(f"--gpu-memory-utilization must lie in (0, 1], got {a.gpu_memory_utilization}")
    if not 0 <= a.drain_timeout < float("inf"):
        raise UsageError(f"--drain-timeout must be a finite number of seconds >= 0, got {a.drain_timeout}")
    for flag, value in (("--header-timeout", a.header_timeout), ("--body-timeout", a.body_timeout)):
        if not 0 < value < float("inf"):
            raise UsageError(f"{flag} must be a finite number of seconds > 0, got {value}")
    problem = device_problem(a.device)
    if problem:
        raise UsageError(problem)
    a.api_key = a.api_key or os.environ.get(API_KEY_ENV) or None  # an empty key is no key


def main(argv: Optional[Sequence[str]] = None, factory: Optional[Callable] = None) -> int:
    """The command line's exit status. ``factory``: ``EngineSpec.factory``, a stand-in engine (the
    server's host-path benchmark, ``bench.serve_paced``)."""
    return command_main(argv, parse_args, RENAMED_FLAGS, check_args, lambda a: serve(a, factory))


def serve(a: argparse.Namespace, factory: Optional[Callable] = None) -> int:
    try:
        import uvicorn

        from .app import ServerState, Settings, create_app
        from .connections import guarded_protocol
        from .drain import DrainingServer
    except ImportError as e:
        raise UsageError(f"the server needs the 'serve' extra (missing {e.name}): "
                         "pip install 'qwen-triton-ops[serve]'") from None
    from .engine_loop import EngineClient
    from .engine_process import EngineSpec, EngineStartError, ProcessTransport

    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("modeling.serve")
    ck = load_checkpoint(a)
    spec = EngineSpec(str(ck.path), a.device, a.dtype, dict(
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
        gpu_memory_utilization=a.gpu_memory_utilization, enforce_eager=a.enforce_eager), WARMUP_PROMPT_TOKENS,
        a.log_level.upper(), factory, quantization=a.quantization, tensor_parallel_size=a.tensor_parallel_size)
    try:
        transport = ProcessTransport(spec)  # loads the weights in the engine's process, warms it up
    except EngineStartError as e:
        say(f"error: {e}")
        return 1
    info = transport.info
    name = a.served_model_name or a.model or DEFAULT_MODEL_NAME
    log.info("serving %r (%s, %s, %s) on http://%s:%d: %d KV blocks of %d positions, max_model_len %d, "
             "max_num_seqs %d%s", name, ck.path, info["backend"], info["dtype"], a.host, a.port, info["num_blocks"],
             info["block_size"], info["max_model_len"], a.max_num_seqs, ", API key required" if a.api_key else "")

    def on_dead(error: BaseException) -> None:  # called once the app runs: ``server`` is set
        server.should_exit = True

    client = EngineClient(transport, info["max_model_len"], on_dead)
    state = ServerState(ck, client, Settings(name, a.api_key, a.max_waiting, a.max_body_bytes, a.body_timeout,
                                             a.strict_requests, a.tool_call_parser))
    config = uvicorn.Config(create_app(state), host=a.host, port=a.port, log_level=a.log_level, access_log=False,
                            timeout_graceful_shutdown=a.drain_timeout, lifespan="on",
                            http=guarded_protocol(a.header_timeout, a.max_connections))
    server = DrainingServer(config, state)
    gc.collect()  # what start-up built lives as long as the server: out of the collector's sight
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
    try:
        server.run()
    finally:
        transport.stop(a.drain_timeout)  # the app's shutdown stopped it, unless uvicorn never started
    if client.dead is not None:
        say(f"error: the engine failed: {client.dead}")
        return 1
    return 0 if server.started else 1  # not started: uvicorn has logged why (the port taken, ...)


if __name__ == "__main__":
    sys.exit(main())
