"""The HTTP server under load, beside ``transformers serve --continuous-batching`` and the engine alone.

    python -m bench.serve [--out DIR] [--concurrency 1 16 64] [--rounds 4] [--min-requests 8]
                          [--only ours engine peer]

On the GPU, both servers load one checkpoint directory, built first in a temporary directory by
``build_random_checkpoint(tokenizer="words", dtype=torch.bfloat16, **QWEN3_0_6B)``: bf16 random
weights of the Qwen3-0.6B shape, its 151,936-entry vocabulary included, with

- a word-level tokenizer.json (``build_word_tokenizer``: ``<unk>`` and 151,935 pseudo-words,
  split on whitespace), so a prompt of ``PROMPT_TOKENS`` random word ids, sent as text, encodes
  back to exactly those ids on either server (every response's ``usage.prompt_tokens`` is checked);
- no EOS in any file (``eos_token_id`` null in config.json and generation_config.json, no
  ``eos_token`` in tokenizer_config.json), so both servers generate exactly ``MAX_TOKENS`` tokens
  with the same request: transformers serve has no ``ignore_eos``, and its continuous batching
  takes a missing EOS as -1, "disabled" (every response's ``usage.completion_tokens`` is checked).

The parts, in this order (``--only`` picks some):

- ``ours``: ``python -m modeling.serve`` started here as a subprocess on 127.0.0.1, waited for
  (/health answers once the model is loaded and, on CUDA, its kernels compiled and graphs captured),
  warmed up with one round (c requests) at every concurrency c, measured, stopped. Warm-ups have
  prompts of their own, and each level its own (``level_ranges``): no measured prompt was sent
  before, so none is a prefix-cache hit;
- ``engine``: the engine alone (no HTTP): the requests of the c64 level through ``Engine`` in this
  process with at most 64 in flight, and the c1 level's prompts each alone, after the server's
  warm-ups (``engine_alone``) (``engine_tokens_per_s_c64``: what the server's HTTP layer costs at
  c64), then with c64 among the levels the json_schema level's requests held to ``JSON_SCHEMA``
  (``engine_tokens_per_s_c64_json_schema``, ``engine_json_schema_ratio_c64``: the engine's share
  of what structured output costs);
- ``peer``: ``transformers serve DIR --continuous-batching --dtype bfloat16`` the same way, run as
  ``python -m transformers.cli.transformers`` (the ``transformers`` command's module) with this
  interpreter (it preloads the model it is pinned to before /health answers; its continuous
  batching starts on the first warm-up request). One server holds the GPU at a time.

A level of concurrency c: c clients (asyncio, a ``RawClient`` each: one keep-alive HTTP/1.1
connection, chunked SSE parsed with json.loads; the httpx clients used before added host time of
their own to a c1 time to first token: ``bench.serve_host --client``), up to
``CLIENTS_PER_PROCESS`` of them a process (one process reading 64 streams was the bottleneck: see
``client_processes``), each sending streaming /v1/completions requests back to back until
``max(--min-requests, --rounds * c)`` are done, the same bodies for both servers: ``model`` the
checkpoint path as given on both command lines (a pinned transformers serve refuses any other
name; ours serves the ``--model`` it was given), the prompt text, ``max_tokens`` ``MAX_TOKENS``,
temperature 0 (greedy), ``stream_options.include_usage`` (transformers serve ignores it and sends
usage in its last chunk anyway). Per level: time to first token (the first chunk with text) p50 and
p99, time per output token (per request: (total - ttft) / (tokens - 1)) p50, requests/s and output
tokens/s over the level's wall time.

With c64 among the levels, ours then runs the c64 level once more with every request held to
``JSON_SCHEMA`` (``response_format`` json_schema: an array of at least ``MAX_TOKENS`` integers, which
no output completes, so each request still ends at ``MAX_TOKENS`` tokens, "length"), on prompts of
its own after a warm-up round: ``serve_{metric}_c64_json_schema`` and
``serve_json_schema_ratio_c64`` (its tokens/s over ``serve_tokens_per_s_c64``'s: the cost of
structured output; the target is >= 0.9). The word-level vocabulary's last ids spell the schema's
pieces (``JSON_WORDS``) so the grammar has tokens to allow.

Keys: ``serve_tokens_per_s_c{c}``, ``serve_ttft_p50_ms_c{c}``, ``serve_ttft_p99_ms_c{c}``,
``serve_tpot_p50_ms_c{c}``, ``serve_requests_per_s_c{c}``, ``serve_startup_s``, the same with
``transformers_`` for the peer, ``engine_tokens_per_s_c64``, ``engine_ttft_ms_c1`` (the engine's
median time to first token of the c1 level's prompts, each alone: what ``serve_ttft_p50_ms_c1`` is
compared with, median to median), ``engine_ttft_min_ms_c1`` (the best of them),
``engine_tokens_per_s_c64_json_schema`` and ``engine_json_schema_ratio_c64``;
``transformers_serve_error`` where the
peer did not start or failed (its log says why). Required of a full run: ``serve_tokens_per_s_c64``,
``transformers_serve_tokens_per_s_c64``, ``serve_ttft_p50_ms_c1``, ``engine_tokens_per_s_c64``.
Writes ``<date>-<gpu>-serve.json`` under ``--out`` (``-serve-ours-engine.json`` and so on with
``--only``: merge the files of a split run), after every number (a run cut short keeps what it
has), and each server's log. The GPU machine needs bench/serve_requirements.txt installed (the
server's and the client's packages, and transformers serve's openai), and accelerate (with psutil):
transformers serve loads its model with a device_map, which needs it.

Time: by default the levels c1, c16, c64 send 8, 64 and 256 requests (after warm-ups of 1, 16
and 64), sized for one device call of about 7 minutes on an H200 (an estimate: the slowest part
should be transformers serve at c1, 8 x 128 tokens one after another); ``total_s``,
``checkpoint_build_s`` and each ``*_startup_s`` in the JSON say what it took. A request gets
``REQUEST_TIMEOUT`` seconds, a server ``START_TIMEOUT`` to start. Under a 10-minute per-command
limit the run can be split across calls: ``--only ours engine``, then ``--only peer``.
"""
import argparse
import asyncio
import datetime
import json
import os
import queue
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

from bench import gpu_slug, require_cuda

PROMPT_TOKENS = 256
MAX_TOKENS = 128
MAX_MODEL_LEN = 1024
START_TIMEOUT = 300
REQUEST_TIMEOUT = 120
PARTS = ("ours", "engine", "peer")
CLIENTS_PER_PROCESS = 8
JSON_SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": MAX_TOKENS}
"""The constraint of the json_schema level: no output of ``MAX_TOKENS`` tokens completes it (an
item is at least a digit and a separator), so every request runs ``MAX_TOKENS`` tokens, as the
unconstrained ones do."""
JSON_WORDS = ("[", "]", ", ", "-", *"0123456789")
"""The words the schema's instances are made of (compact JSON: ", " between items): the last ids of
the word-level vocabulary spell them instead of pseudo-words (``add_json_words``); no prompt holds
them. No "," alone: the grammar allows it as the start of ", ", after which no word of this
vocabulary goes on (a dead end, which fails the request)."""
METRICS = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "requests_per_s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(log: Path) -> str:
    """The last line of a server's log with text on it ('' if none)."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def start(cmd, log: Path, url: str, timeout: float = START_TIMEOUT):
    """Start a server; return the process once GET /health answers 200 (both servers have it)."""
    import httpx

    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(cmd[:3])} exited with {proc.returncode} ({log_tail(log)}); see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"{' '.join(cmd[:3])} did not start in {timeout:.0f} s; see {log}")


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def server_command(part: str, model: str, port: int, max_num_seqs: int):
    """The command line of the server of ``part`` ("ours" or "peer") on 127.0.0.1:``port``."""
    if part == "ours":
        return [sys.executable, "-m", "modeling.serve", "--model", model, "--port", str(port),
                "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(MAX_MODEL_LEN)]
    return [sys.executable, "-m", "transformers.cli.transformers", "serve", model, "--continuous-batching",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16"]


def requests_at(c: int, rounds: int, min_requests: int) -> int:
    """Requests of the level of concurrency ``c``: ``rounds`` per client, at least ``min_requests``."""
    return max(min_requests, rounds * c)


def add_json_words(ckpt: Path) -> None:
    """The checkpoint's word-level tokenizer.json with its last ``len(JSON_WORDS)`` words replaced
    by ``JSON_WORDS`` (the vocabulary keeps its size; xgrammar reads it as raw strings)."""
    path = ckpt / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    by_id = {i: w for w, i in vocab.items()}
    first = len(vocab) - len(JSON_WORDS)
    for k, word in enumerate(JSON_WORDS):
        del vocab[by_id[first + k]]
        vocab[word] = first + k
    path.write_text(json.dumps(data))


def make_prompts(tokenizer, n: int, seed: int = 0):
    """``n`` prompts of ``PROMPT_TOKENS`` random word ids (never id 0, ``<unk>``, nor a
    ``JSON_WORDS`` id): (ids, texts)."""
    rng = random.Random(seed)
    top = tokenizer.vocab_size - len(JSON_WORDS)
    ids = [[rng.randrange(1, top) for _ in range(PROMPT_TOKENS)] for _ in range(n)]
    return ids, [tokenizer.decode(x) for x in ids]


def request_body(model: str, prompt: str, schema=None) -> dict:
    """One streaming /v1/completions request, the same for both servers; with ``schema``, its
    output held to that JSON schema (``response_format`` json_schema)."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
    return body


class StreamTally:
    """One streamed completion's server-sent events, fed their ``data:`` payloads in order: when
    the first text came, and the usage. Payloads after ``[DONE]`` are ignored."""

    def __init__(self):
        self.first, self.use, self.done = None, None, False

    def add(self, payload) -> None:
        """``payload``: str or bytes, the text after ``data: ``."""
        if self.done:
            return
        if payload in ("[DONE]", b"[DONE]"):
            self.done = True
            return
        obj = json.loads(payload)
        if "error" in obj:
            raise RuntimeError(f"the stream carried an error: {obj['error']}")
        if self.first is None and obj.get("choices") and obj["choices"][0].get("text"):
            self.first = time.perf_counter()
        if obj.get("usage"):
            self.use = obj["usage"]

    def result(self, t0: float) -> tuple:
        """(ttft, total, completion tokens, prompt tokens) of a request sent at ``t0``, now that its
        stream has ended."""
        end = time.perf_counter()
        if self.use is None:
            raise RuntimeError("the stream carried no usage")
        return (self.first or end) - t0, end - t0, self.use["completion_tokens"], self.use["prompt_tokens"]


class RawClient:
    """One keep-alive HTTP/1.1 connection (opened again after a response that closes it), requests
    one at a time; ``one(body)`` posts a streaming /v1/completions request and reads the whole
    chunked body, one ``json.loads`` per event (``StreamTally``): (ttft s, total s, completion
    tokens, prompt tokens). Its clock starts once the body is encoded, right before the write."""

    STAMPS: list = []
    """(send, first chunk with text) perf_counter stamps of every request, all clients (``--trace``)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def one(self, body: dict):
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        t0 = time.perf_counter()
        self.writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (self.host.encode(), self.port, len(data), data))
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        headers = head.lower()
        if status != 200 or b"transfer-encoding: chunked" not in headers:
            length = re.search(rb"content-length: *(\d+)", headers)
            body = await self.reader.readexactly(int(length.group(1))) if length else b""
            self.close()
            raise RuntimeError(f"HTTP {status}: {(body or head).decode(errors='replace')[:300]}")
        stream, buf = StreamTally(), b""
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await self.reader.readexactly(size + 2)
            if size == 0:
                break
            buf += chunk[:-2]
            *events, buf = buf.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: "):
                    stream.add(event[6:])
        if b"connection: close" in headers:
            self.close()
        result = stream.result(t0)
        RawClient.STAMPS.append((t0, t0 + result[0]))
        return result

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def summarize(results, wall: float) -> dict:
    """A level's numbers from its (ttft, total, completion tokens, prompt tokens) results. A
    ``ValueError`` unless every request had ``PROMPT_TOKENS`` prompt tokens (the text round trip)
    and ``MAX_TOKENS`` new ones (no EOS)."""
    prompts = sorted({r[3] for r in results})
    outputs = sorted({r[2] for r in results})
    if prompts != [PROMPT_TOKENS] or outputs != [MAX_TOKENS]:
        raise ValueError(f"expected {PROMPT_TOKENS} prompt and {MAX_TOKENS} completion tokens in every response, "
                         f"got prompt tokens {prompts}, completion tokens {outputs}")
    ttft = sorted(r[0] for r in results)
    tpot = [(total - t) / (n - 1) for t, total, n, _ in results]
    p99 = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]
    return {"ttft_p50_ms": 1e3 * statistics.median(ttft), "ttft_p99_ms": 1e3 * p99,
            "tpot_p50_ms": 1e3 * statistics.median(tpot), "requests_per_s": len(results) / wall,
            "tokens_per_s": sum(r[2] for r in results) / wall}


async def clients(url: str, model: str, prompts, c: int, schema=None,
                  timeout: float = REQUEST_TIMEOUT) -> tuple[list, float, float]:
    """``prompts`` sent by ``c`` clients of this process back to back, a ``RawClient`` connection
    each, each request given ``timeout`` seconds: (results, start, end), the clock
    ``time.perf_counter`` (CLOCK_MONOTONIC, one clock for every process of the machine)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    todo, results = list(prompts), []

    async def worker():
        client = RawClient(host, int(port))
        try:
            while todo:
                body = request_body(model, todo.pop(), schema)
                results.append(await asyncio.wait_for(client.one(body), timeout))
        finally:
            client.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(c)))
    return results, t0, time.perf_counter()


def client_process(url: str, model: str, prompts, c: int, barrier, out, schema=None,
                   timeout: float = REQUEST_TIMEOUT) -> None:
    """One client process of ``level``: starts with the others (``barrier``), puts its ``clients``
    triple on ``out``, or the traceback's text if it failed."""
    try:
        barrier.wait()
        out.put(asyncio.run(clients(url, model, prompts, c, schema, timeout)))
    except BaseException:
        out.put(traceback.format_exc())


def client_processes(c: int) -> int:
    """How many processes carry ``c`` clients: one per ``CLIENTS_PER_PROCESS``. One asyncio
    process parsing every chunk of 64 streams is what limits it (through one process the server
    passed on about a quarter of the engine's rate: bench/results/HISTORY.md)."""
    return max(1, min(c, -(-c // CLIENTS_PER_PROCESS)))


def level(url: str, model: str, prompts, c: int, schema=None, timeout: float = REQUEST_TIMEOUT) -> dict:
    """``prompts`` sent by ``c`` clients back to back (held to ``schema`` when given; ``timeout``
    seconds a request), spread over ``client_processes(c)`` processes (each its share of the
    clients and of the prompts, all started at once); the level's wall time from the first
    process's start to the last one's end; ``summarize`` of the results."""
    procs = client_processes(c)
    if procs == 1:
        results, t0, t1 = asyncio.run(clients(url, model, prompts, c, schema, timeout))
        return summarize(results, t1 - t0)
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # the bench process may hold CUDA: never fork it
    barrier, out = ctx.Barrier(procs + 1), ctx.Queue()
    children = [ctx.Process(target=client_process, daemon=True,
                            args=(url, model, prompts[i::procs], c // procs + (i < c % procs), barrier, out,
                                  schema, timeout))
                for i in range(procs)]
    for child in children:
        child.start()
    try:
        barrier.wait(timeout=START_TIMEOUT)
        shares, deadline = [], time.monotonic() + timeout * -(-len(prompts) // c)
        while len(shares) < procs:
            try:
                shares.append(out.get(timeout=1.0))
            except queue.Empty:
                if time.monotonic() > deadline or any(ch.exitcode not in (None, 0) for ch in children):
                    raise RuntimeError(f"{procs - len(shares)} of {procs} client processes gave no result "
                                       f"(exit codes {[ch.exitcode for ch in children]})") from None
    finally:
        for child in children:
            child.join(timeout=5)
            if child.is_alive():
                child.kill()
    for share in shares:
        if isinstance(share, str):
            raise RuntimeError(f"a client process failed:\n{share}")
    results = [r for share in shares for r in share[0]]
    return summarize(results, max(s[2] for s in shares) - min(s[1] for s in shares))


def level_ranges(levels, counts) -> dict:
    """Concurrency -> (first, end) of its prompts: each level its own, so no measured prompt was
    sent before (none finds its blocks in the prefix cache; the warm-ups have prompts of their own)."""
    ranges, start = {}, 0
    for c, n in zip(levels, counts):
        ranges[c], start = (start, start + n), start + n
    return ranges


def measure(prefix: str, url: str, model: str, prompts, warm, levels, counts, report, json_prompts=None) -> None:
    """Warm-ups first (``warm[:c]`` at each level c: one round reaches the level's batch sizes; ours
    captures their graphs), then each level on its ``level_ranges`` prompts; with ``json_prompts``,
    then the c64 level again on them with every request held to ``JSON_SCHEMA`` (after a warm-up
    round of it: the grammar compiled and cached on both sides), keys ``{prefix}_{metric}_c64_json_schema``."""
    for c in levels:
        level(url, model, warm[:c], c)
    for c, (lo, hi) in level_ranges(levels, counts).items():
        stats = level(url, model, prompts[lo:hi], c)
        for key in METRICS:
            report(f"{prefix}_{key}_c{c}", stats[key])
    if json_prompts is not None:
        level(url, model, warm[:64], 64, JSON_SCHEMA)
        stats = level(url, model, json_prompts, 64, JSON_SCHEMA)
        for key in METRICS:
            report(f"{prefix}_{key}_c64_json_schema", stats[key])


def engine_alone(path: Path, warm_ids, ttft_ids, rate_ids, max_num_seqs: int,
                 json_ids=None) -> tuple[float, float, float, Optional[float]]:
    """The engine in this process as the server ran it: (output tokens/s over ``rate_ids`` at most ``max_num_seqs`` in
    flight; the median and the best time to first token, ms, of each of ``ttft_ids`` alone; with ``json_ids``, output
    tokens/s over them held to ``JSON_SCHEMA``, after a warm-up round of ``warm_ids[:max_num_seqs]`` held to it, else
    None). Warmed up as the server was: its start-up routine (``engine_process.warm_up``), then
    ``warm_ids[:max_num_seqs]`` (the server's largest warm-up round) and one prompt alone (its c1 warm-up),
    ``warm_ids[max_num_seqs]``. The prompts measured are the server's c1 and c64 levels': never run before, as there
    (until 2026-12-03's last H200 run every measured prompt had run before on both sides, and the engine's rate was of a
    second pass of the same requests: all prefix hits, against a quarter on the server). The clock of a time to first
    token runs from ``add`` to the step that returns the token."""
    import torch

    from modeling import QwenForCausalLM, QwenTokenizer, SamplingParams
    from modeling.engine import Engine
    from modeling.serve.engine_process import warm_up

    model = QwenForCausalLM.from_pretrained(path, device="cuda", dtype=torch.bfloat16)
    engine = Engine(model, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN,
                    tokenizer=QwenTokenizer.from_pretrained(path))
    warm_up(engine)
    greedy = SamplingParams()
    held = SamplingParams(structured_outputs={"json": json.dumps(JSON_SCHEMA)})

    def run(prompts, params=greedy) -> float:
        t0 = time.perf_counter()
        tokens = sum(map(len, engine.generate(prompts, params, MAX_TOKENS)))
        torch.cuda.synchronize()
        return tokens / (time.perf_counter() - t0)

    run(warm_ids[:max_num_seqs])
    ttfts = []
    for ids in [warm_ids[max_num_seqs]] + list(ttft_ids):  # the first warms the one-prompt step
        t0 = time.perf_counter()
        seq = engine.add(ids, greedy, MAX_TOKENS)
        while seq.num_output == 0:
            engine.step()
        ttfts.append((time.perf_counter() - t0) * 1e3)
        engine.abort(seq)
        while engine.has_work():
            engine.step()
    rate = run(rate_ids)
    json_rate = None
    if json_ids is not None:
        run(warm_ids[:max_num_seqs], held)
        json_rate = run(json_ids, held)
    del engine, model
    torch.cuda.empty_cache()
    return rate, statistics.median(ttfts[1:]), min(ttfts[1:]), json_rate


def main():
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--rounds", type=int, default=4, help="requests per client at a level (default 4)")
    p.add_argument("--min-requests", type=int, default=8, help="requests of a level at least (default 8)")
    p.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS),
                   help="the parts to run (default all: ours engine peer)")
    a = p.parse_args()
    require_cuda("bench.serve")
    from importlib.metadata import version

    import torch

    from modeling import QwenTokenizer
    from modeling.model.random_checkpoint import QWEN3_0_6B, build_random_checkpoint

    t_start = time.perf_counter()
    parts = [part for part in PARTS if part in a.only]
    levels = a.concurrency
    counts = [requests_at(c, a.rounds, a.min_requests) for c in levels]
    engine_levels = [c for c in (1, 64) if c not in levels]  # the engine's prompts, where no level has them
    ranges = level_ranges(levels + engine_levels, counts + [requests_at(c, a.rounds, a.min_requests)
                                                            for c in engine_levels])
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), torch=torch.__version__,
               transformers=version("transformers"), parts=parts, prompt_tokens=PROMPT_TOKENS,
               max_tokens=MAX_TOKENS, requests=dict(zip(map(str, levels), counts)))
    slug = gpu_slug(out["gpu"])
    name = "serve" if len(parts) == len(PARTS) else "-".join(["serve", *parts])
    path = out_dir / f"{out['date']}-{slug}-{name}.json"

    def report(key, value):
        out[key] = value
        print(f"{key:40s} {value:10.2f}", flush=True)
        path.write_text(json.dumps(out, indent=1))

    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        t0 = time.perf_counter()
        ckpt = build_random_checkpoint(Path(tmp) / "qwen3-0.6b-random", std=0.02, tokenizer="words",
                                       dtype=torch.bfloat16, **QWEN3_0_6B)
        add_json_words(ckpt)
        report("checkpoint_build_s", time.perf_counter() - t0)
        tok = QwenTokenizer.from_pretrained(ckpt)
        end = max(hi for _, hi in ranges.values())
        json_count = requests_at(64, a.rounds, a.min_requests)
        prompt_ids, prompts = make_prompts(tok, end + json_count)
        json_prompts = prompts[end:] if 64 in levels else None
        warm_ids, warm = make_prompts(tok, max(levels + [64]) + 1, seed=1)
        model = str(ckpt)

        if "ours" in parts:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            t0 = time.perf_counter()
            ours = start(server_command("ours", model, port, max(levels)), out_dir / "serve-ours.log", url)
            report("serve_startup_s", time.perf_counter() - t0)
            try:
                measure("serve", url, model, prompts, warm, levels, counts, report, json_prompts)
                if json_prompts is not None:
                    report("serve_json_schema_ratio_c64",
                           out["serve_tokens_per_s_c64_json_schema"] / out["serve_tokens_per_s_c64"])
            finally:
                stop(ours)

        if "engine" in parts:
            rate, ttft, best, json_rate = engine_alone(ckpt, warm_ids, prompt_ids[slice(*ranges[1])],
                                                       prompt_ids[slice(*ranges[64])], 64,
                                                       prompt_ids[end:] if 64 in levels else None)
            report("engine_tokens_per_s_c64", rate)
            report("engine_ttft_ms_c1", ttft)
            report("engine_ttft_min_ms_c1", best)
            if json_rate is not None:
                report("engine_tokens_per_s_c64_json_schema", json_rate)
                report("engine_json_schema_ratio_c64", json_rate / rate)

        if "peer" in parts:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            try:
                t0 = time.perf_counter()
                peer = start(server_command("peer", model, port, max(levels)), out_dir / "serve-transformers.log", url)
            except (RuntimeError, OSError) as e:  # its command line moves between releases: say why it did not run
                out["transformers_serve_error"] = str(e)
                print(f"transformers serve did not run: {e}", flush=True)
            else:
                report("transformers_serve_startup_s", time.perf_counter() - t0)
                try:
                    measure("transformers_serve", url, model, prompts, warm, levels, counts, report)
                except Exception as e:
                    out["transformers_serve_error"] = f"{type(e).__name__}: {e}"
                    print(f"transformers serve failed: {out['transformers_serve_error']}", flush=True)
                finally:
                    stop(peer)
    report("total_s", time.perf_counter() - t_start)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
