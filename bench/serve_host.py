"""The server's host path alone: ``python -m modeling.serve`` on a paced stand-in engine
(``bench.serve_paced``), driven over HTTP as ``bench.serve`` drives it. Runs anywhere (no GPU).

    python -m bench.serve_host [--concurrency 1 64] [--step-ms 2] [--rounds 8] [--client raw|httpx]
                               [--ceiling] [--profile] [--model DIR]
    python -m bench.serve_host --step-ms 0 --model DIR --concurrency 1 --trace   # the real engine (a GPU)

The stand-in steps every ``--step-ms`` while it has work and gives each running sequence one token
a step, so its own rate at a level of c streams is c tokens a step (``engine_tokens_per_s``: c *
1000 / step_ms, every slot full, as ``bench.serve``'s engine-alone run keeps them); what the
server passes on of it over HTTP (``tokens_per_s`` / ``engine_tokens_per_s``, ``of_engine``) is
what its host path costs, with no GPU and no model in the way. The requests are ``bench.serve``'s
(``PROMPT_TOKENS`` prompt words, ``MAX_TOKENS`` new tokens, streamed, usage included) on a
checkpoint with its word-level tokenizer (151,936 entries; a tiny random body the stand-in never
reads), built in a temporary directory unless ``--model`` names one.

Per level (after one warm-up round of c requests): tokens/s through HTTP, time to first token p50
(``ttft_p50_ms``; the stand-in's own is one step), the stand-in's steps/s (from its counter: it
kept its pace unless this is below 1000 / step_ms), and CPU time from /proc/PID/stat: the server's
process per engine step and per streamed token (``server_us_per_token``: what the cuts of the host
path are measured by), the engine process's (the stand-in: mostly asleep), the client's.

``--step-ms 0``: the real engine on ``--model``'s weights instead of the stand-in (``bench.serve_paced
--step-ms 0``), so that ``--trace`` shows the server's hops around real steps on the machine that
runs them (no steps/s: the engine keeps no counter).
``--client``: ``raw`` (default), ``bench.serve.RawClient``, a minimal asyncio socket client (HTTP/1.1 keep-alive, chunked
transfer decoding, one ``json.loads`` per event), or ``httpx``, ``bench.serve``'s own client
(``one``, what ``bench.serve`` used before ``RawClient``); an httpx client tops out below the server on a small machine,
and at c1 it adds host time of its own to the time to first token.
``--ceiling``: first, the client alone against a trivial SSE server (another process that answers
every request at once with ``MAX_TOKENS`` canned events): the most that client can read.
``--profile``: cProfile the server's process (``bench.serve_paced --profile``) and print its top
functions by own time. ``--trace``: stamp every request's first token along its path
(``bench.serve_paced --trace``, the raw client's send and first chunk included, not httpx's) and print, per hop
of ``bench.serve_paced.TRACE_HOPS``, the median over the measured requests of the time from the
hop before (meaningful at c1 only: the stamps are matched in order).
"""
import argparse
import asyncio
import json
import math
import multiprocessing
import os
import pstats
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from bench.serve import (MAX_TOKENS, PROMPT_TOKENS, REQUEST_TIMEOUT, RawClient, StreamTally, free_port, make_prompts,
                         request_body, requests_at, start, summarize)
from bench.serve_paced import TRACE_HOPS, read_counter

CLK_TCK = os.sysconf("SC_CLK_TCK")
MODEL_NAME = "m"
WORD_VOCAB = 151936
"""The word-level tokenizer's size: Qwen3's vocabulary, as ``bench.serve``'s checkpoint has."""


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc/PID/stat utime, stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def engine_pid(server_pid: int) -> int:
    """The server's engine process: its child that multiprocessing spawned (not the resource tracker)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    engines = [int(c) for c in children if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]
    if len(engines) != 1:
        raise RuntimeError(f"expected one engine process among the server's children {children}")
    return engines[0]


def client_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def one(client, url: str, body: dict):
    """One streaming completion: (ttft s, total s, completion tokens, prompt tokens), the tokens from
    the stream's usage (ours: a last chunk without choices, then [DONE]; transformers serve: usage
    on its last chunk, no [DONE]). The body is read to its end, past [DONE], as the openai client
    reads a stream: a response left unread (its last chunk, which ends a chunked body, comes after
    [DONE]) makes httpx close the connection, and the next request paid a new one (an earlier
    version paid it on every request to ours, and on none to transformers serve, which sends no
    [DONE]: a visible share of ours' c1 TTFT, see bench/results/2026-12-03-cpu-serve-ttft.md)."""
    t0 = time.perf_counter()
    stream = StreamTally()
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
        async for line in r.aiter_lines():  # to the body's end, past [DONE]: see ``one``'s docstring
            if line.startswith("data: "):
                stream.add(line[6:])
    return stream.result(t0)


async def run_level(kind: str, port: int, prompts, c: int):
    """``prompts`` sent by ``c`` clients back to back: (results, wall seconds)."""
    queue, results = list(prompts), []
    url = f"http://127.0.0.1:{port}"
    if kind == "httpx":
        import httpx

        limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
        http = httpx.AsyncClient(timeout=REQUEST_TIMEOUT, limits=limits)
        clients = [None] * c
    else:
        clients = [RawClient("127.0.0.1", port) for _ in range(c)]

    async def worker(client):
        while queue:
            body = request_body(MODEL_NAME, queue.pop())
            if client is None:
                results.append(await one(http, url, body))
            else:
                results.append(await asyncio.wait_for(client.one(body), REQUEST_TIMEOUT))

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker(client) for client in clients))
    finally:
        if kind == "httpx":
            await http.aclose()
        for client in clients:
            if client is not None:
                client.close()
    return results, time.perf_counter() - t0


def http_chunk(data: bytes) -> bytes:
    """``data`` framed as one chunk of a chunked HTTP/1.1 body (b"": the last)."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def trivial_sse_server(port: int, ready) -> None:
    """Answers every POST at once with a whole stream: ``MAX_TOKENS`` one-word chunks, the usage
    chunk, [DONE], one HTTP chunk an event as the server writes them (a ``multiprocessing`` target)."""
    def event(obj) -> bytes:
        return http_chunk(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

    base = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": MODEL_NAME}
    token = event({**base, "choices": [{"index": 0, "text": " word", "logprobs": None, "finish_reason": None}],
                   "usage": None})
    last = event({**base, "choices": [], "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": MAX_TOKENS,
                                                    "total_tokens": PROMPT_TOKENS + MAX_TOKENS}})
    response = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                + token * MAX_TOKENS + last + http_chunk(b"data: [DONE]\n\n") + http_chunk(b""))

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                              if line.startswith(b"content-length:"))
                await reader.readexactly(length)
                writer.write(response)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def serve():
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        ready.set()
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


def ceiling(kind: str, prompts, levels, rounds: int, min_requests: int) -> None:
    """The client alone against ``trivial_sse_server``, at each level."""
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=trivial_sse_server, args=(port, ready), daemon=True)
    proc.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("the trivial SSE server did not start")
        for c in levels:
            asyncio.run(run_level(kind, port, prompts[:c], c))
            cpu0 = client_cpu_s()
            results, wall = asyncio.run(run_level(kind, port, prompts[:requests_at(c, rounds, min_requests)], c))
            stats = summarize(results, wall)
            print(f"ceiling  c{c:<3d} {kind:5s} client alone: {stats['tokens_per_s']:9.0f} tok/s, client "
                  f"{(client_cpu_s() - cpu0) / len(results) / MAX_TOKENS * 1e6:5.1f} us/token", flush=True)
    finally:
        proc.kill()
        proc.join()


def measure(kind: str, port: int, server_pid: int, counter: Optional[str], prompts, c: int, n: int,
            step_ms: float) -> dict:
    """One level of ``c`` streams: a warm-up round, then ``n`` requests measured (``counter``: the
    stand-in's, None for the real engine)."""
    asyncio.run(run_level(kind, port, prompts[:c], c))
    engine = engine_pid(server_pid)
    steps0, tokens0 = read_counter(counter) if counter else (0, 0)
    server0, engine0, client0 = cpu_s(server_pid), cpu_s(engine), client_cpu_s()
    results, wall = asyncio.run(run_level(kind, port, prompts[:n], c))
    server_cpu, engine_cpu, client_cpu = cpu_s(server_pid) - server0, cpu_s(engine) - engine0, client_cpu_s() - client0
    stats = summarize(results, wall)
    if counter:
        steps, tokens = (x - x0 for x, x0 in zip(read_counter(counter), (steps0, tokens0)))
    else:  # the real engine counts nothing for us: its tokens are what the clients got, its steps unknown
        steps, tokens = math.nan, stats["tokens_per_s"] * wall
    engine_rate = c * 1e3 / step_ms if step_ms else math.nan
    return dict(c=c, requests=n, wall_s=wall, tokens_per_s=stats["tokens_per_s"], engine_tokens_per_s=engine_rate,
                of_engine=stats["tokens_per_s"] / engine_rate, ttft_p50_ms=stats["ttft_p50_ms"],
                steps_per_s=steps / wall, server_cpu_s=server_cpu, server_us_per_step=server_cpu / steps * 1e6,
                server_us_per_token=server_cpu / tokens * 1e6, engine_cpu_s=engine_cpu,
                client_us_per_token=client_cpu / tokens * 1e6)


def print_level(kind: str, r: dict) -> None:
    print(f"server   c{r['c']:<3d} {kind:5s} {r['tokens_per_s']:9.0f} tok/s = {100 * r['of_engine']:5.1f}% of the "
          f"stand-in's {r['engine_tokens_per_s']:.0f}; ttft p50 {r['ttft_p50_ms']:6.2f} ms; {r['steps_per_s']:6.0f} "
          f"steps/s; server CPU {r['server_us_per_step']:7.1f} us/step, {r['server_us_per_token']:5.1f} us/token "
          f"({r['server_cpu_s']:.2f} s); engine CPU {r['engine_cpu_s']:.2f} s; client "
          f"{r['client_us_per_token']:5.1f} us/token", flush=True)


def print_trace(trace: Path, skip: int) -> None:
    """The median time of each hop of ``TRACE_HOPS`` from the one before, over the requests after
    the first ``skip`` (warm-ups), from the server's and the engine's stamps and the client's."""
    server = json.loads(trace.read_text())
    engine = {}
    for line in Path(str(trace) + ".engine").read_text().splitlines():
        rec = json.loads(line)
        engine[rec["rid"]] = rec
    engine = [engine[rid] for rid in sorted(engine)]  # rids in submission order
    if not RawClient.STAMPS:  # httpx: no client stamps
        RawClient.STAMPS.extend([(math.nan, math.nan)] * len(server))
    if not len(server) == len(engine) == len(RawClient.STAMPS):
        raise RuntimeError(f"trace: {len(server)} server, {len(engine)} engine, {len(RawClient.STAMPS)} client records")
    rows = [{**s, **e, "client_sent": c[0], "client_first": c[1]}
            for s, e, c in zip(server, engine, RawClient.STAMPS)][skip:]
    keys = [k for k, _ in TRACE_HOPS]
    print(f"trace over {len(rows)} requests (median ms from the hop before; perf_counter of every process):")
    for prev, (key, what) in zip([None] + keys, TRACE_HOPS):
        if prev is None:
            print(f"  {key:14s}  0.000  {what}")
            continue
        d = statistics.median((r[key] - r[prev]) * 1e3 for r in rows)
        print(f"  {key:14s} {d:6.3f}  {what}")
    total = statistics.median((r["client_first"] - r["client_sent"]) * 1e3 for r in rows)
    print(f"  {'total':14s} {total:6.3f}  client_sent -> client_first (median of the sums)")
    print(f"  connections the server accepted over them: {rows[-1]['connections'] - rows[0]['connections'] + 1}")


def build_model(path: Path) -> Path:
    """A checkpoint with ``bench.serve``'s word-level tokenizer and a tiny body the stand-in never reads."""
    from modeling.model.random_checkpoint import build_random_checkpoint

    return build_random_checkpoint(path, tokenizer="words", vocab_size=WORD_VOCAB, hidden_size=16,
                                   intermediate_size=32, num_hidden_layers=1, num_attention_heads=1,
                                   num_key_value_heads=1, head_dim=16, max_position_embeddings=4096)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_host", description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    p.add_argument("--step-ms", type=float, default=2.0,
                   help="the stand-in engine's step (default 2); 0: the real engine on --model's weights (a GPU)")
    p.add_argument("--rounds", type=int, default=8, help="requests per client at a level (default 8)")
    p.add_argument("--min-requests", type=int, default=8, help="requests of a level at least (default 8)")
    p.add_argument("--client", choices=("raw", "httpx"), default="raw")
    p.add_argument("--ceiling", action="store_true", help="first measure the client alone on a trivial SSE server")
    p.add_argument("--profile", action="store_true", help="cProfile the server's process; print its top functions")
    p.add_argument("--trace", action="store_true", help="stamp each request's first token along its path; print "
                                                         "the hops (with --concurrency 1)")
    p.add_argument("--top", type=int, default=30, help="functions --profile prints (default 30)")
    p.add_argument("--model", help="a checkpoint directory for the server's text side (default: built here)")
    p.add_argument("--json", help="also write the levels' numbers to this file")
    a = p.parse_args(argv)
    from modeling import QwenTokenizer

    with tempfile.TemporaryDirectory(prefix="bench-serve-host-") as tmp:
        model = Path(a.model) if a.model else build_model(Path(tmp) / "words")
        counts = [requests_at(c, a.rounds, a.min_requests) for c in a.concurrency]
        _, prompts = make_prompts(QwenTokenizer.from_pretrained(model), max(counts))
        if a.ceiling:
            ceiling(a.client, prompts, a.concurrency, a.rounds, a.min_requests)
        if a.step_ms == 0 and not a.model:
            p.error("--step-ms 0 (the real engine) takes --model")
        port, profile = free_port(), str(Path(tmp) / "server.prof")
        counter = str(Path(tmp) / "counter") if a.step_ms else None
        trace = str(Path(tmp) / "trace.json")
        if a.trace and ( a.concurrency != [1] or a.ceiling):
            p.error("--trace takes --concurrency 1 and no --ceiling")
        cmd = [sys.executable, "-m", "bench.serve_paced", "--step-ms", str(a.step_ms),
               *(["--counter", counter] if counter else []),
               *(["--profile", profile] if a.profile else []), *(["--trace", trace] if a.trace else []), "--model", str(model), "--served-model-name",
               MODEL_NAME, "--port", str(port), "--max-num-seqs", str(max(a.concurrency)), "--log-level", "warning"]
        log = Path(tmp) / "server.log"
        proc = start(cmd, log, f"http://127.0.0.1:{port}", timeout=120)
        levels = []
        try:
            for c, n in zip(a.concurrency, counts):
                levels.append(measure(a.client, port, proc.pid, counter, prompts, c, n, a.step_ms))
                print_level(a.client, levels[-1])
        finally:
            proc.send_signal(signal.SIGTERM)  # drains, then exits (and writes the profile)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            if code != 0:
                print(f"the server exited with {code}:\n{log.read_text()[-3000:]}", file=sys.stderr)
        if a.json:
            Path(a.json).write_text(json.dumps(dict(step_ms=a.step_ms, client=a.client, levels=levels), indent=1))
        if a.trace and code == 0:
            print_trace(Path(trace), len(RawClient.STAMPS) - counts[0])
        if a.profile:
            pstats.Stats(profile).sort_stats("tottime").print_stats(a.top)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
