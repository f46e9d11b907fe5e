"""The HTTP server under load, beside ``transformers serve --continuous-batching`` and the engine alone.

    python -m bench.serve [--out DIR] [--concurrency 1 16 64] [--requests-per-level 128] [--no-peer]

On the GPU (bf16, random weights of the Qwen3-0.6B body with the random checkpoint's small
tokenizer, so the lm_head has that tokenizer's vocabulary; both servers load the same directory):

- each server is started here as a subprocess on 127.0.0.1 (``python -m modeling.serve``, then
  ``transformers serve DIR --continuous-batching``), waited for, warmed up with a few requests at
  every concurrency, measured, and stopped before the next starts (one holds the GPU at a time);
- a level of concurrency c: c clients (asyncio, raw httpx, SSE parsed with json.loads: the client
  costs little host time), each sending streaming /v1/completions requests back to back until
  ``--requests-per-level`` are done; prompts of ``PROMPT_TOKENS`` random tokens (as text),
  ``MAX_TOKENS`` new tokens, greedy (our server also ignores EOS; the peer stops where it
  samples EOS, which random weights rarely do: tokens are counted from each response's usage);
- per level: time to first token (the first chunk with text) p50 and p99, time per output token
  (per request: (total - ttft) / (tokens - 1)) p50, requests/s and output tokens/s over the
  level's wall time;
- the engine alone (no HTTP): the same requests through ``Engine`` in this process with at most
  64 in flight (``engine_tokens_per_s_c64``), what the server's HTTP layer costs at c64.

Keys: ``serve_tokens_per_s_c{c}``, ``serve_ttft_p50_ms_c{c}``, ``serve_ttft_p99_ms_c{c}``,
``serve_tpot_p50_ms_c{c}``, ``serve_requests_per_s_c{c}``, the same with ``transformers_`` for the
peer, ``engine_tokens_per_s_c64``. Writes ``<date>-<gpu>-serve.json`` (and each server's log) under
``--out``. The GPU machine needs bench/serve_requirements.txt installed (the server's and the
client's packages).
"""
import argparse
import asyncio
import datetime
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import require_cuda

PROMPT_TOKENS = 256
MAX_TOKENS = 128
MAX_MODEL_LEN = 1024
START_TIMEOUT = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd, log: Path, url: str):
    """Start a server; return the process once /health (or /v1/models) answers."""
    import httpx

    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0:3]} exited with {proc.returncode}; see {log}")
        for path in ("/health", "/v1/models"):
            try:
                if httpx.get(url + path, timeout=2).status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{cmd[0:3]} did not start in {START_TIMEOUT} s; see {log}")


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def one(client, url: str, body: dict):
    """One streaming completion: (ttft s, total s, output tokens)."""
    t0 = time.perf_counter()
    first, tokens = None, None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if first is None and obj.get("choices") and obj["choices"][0].get("text"):
                first = time.perf_counter()
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
    end = time.perf_counter()
    if tokens is None:
        raise RuntimeError("the stream carried no usage (stream_options.include_usage)")
    return (first or end) - t0, end - t0, tokens


async def level(url: str, model: str, prompts, c: int, extra: dict):
    import httpx

    queue = list(prompts)
    results = []
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker():
            while queue:
                prompt = queue.pop()
                body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}, **extra}
                results.append(await one(client, url, body))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(c)))
        wall = time.perf_counter() - t0
    ttft = sorted(r[0] for r in results)
    tpot = [(total - t) / (n - 1) for t, total, n in results if n > 1]
    p99 = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]
    return {"ttft_p50_ms": 1e3 * statistics.median(ttft), "ttft_p99_ms": 1e3 * p99,
            "tpot_p50_ms": 1e3 * statistics.median(tpot), "requests_per_s": len(results) / wall,
            "tokens_per_s": sum(r[2] for r in results) / wall}


def measure(prefix: str, url: str, model: str, prompts, levels, per_level: int, extra: dict, report) -> None:
    for c in levels:  # warm-up: captures the graphs of every batch size the level reaches
        asyncio.run(level(url, model, prompts[:2 * c], c, extra))
    for c in levels:
        stats = asyncio.run(level(url, model, prompts[:per_level], c, extra))
        for key in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "requests_per_s"):
            report(f"{prefix}_{key}_c{c}", stats[key])


def engine_alone(path: Path, prompt_ids, max_num_seqs: int) -> float:
    """Output tokens/s of the engine with the same requests, at most ``max_num_seqs`` in flight."""
    import torch

    from modeling import QwenForCausalLM
    from modeling.engine import Engine
    from modeling.generation.sampling import SamplingParams

    model = QwenForCausalLM.from_pretrained(path, device="cuda", dtype=torch.bfloat16)
    engine = Engine(model, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN)
    for warm in (False, True):
        t0 = time.perf_counter()
        seqs = [engine.add(ids, SamplingParams(), MAX_TOKENS) for ids in prompt_ids]
        while engine.has_work():
            engine.step()
        torch.cuda.synchronize()
        rate = sum(s.num_output for s in seqs) / (time.perf_counter() - t0)
    del engine, model
    torch.cuda.empty_cache()
    return rate


def main():
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--requests-per-level", type=int, default=128)
    p.add_argument("--no-peer", action="store_true", help="skip transformers serve")
    a = p.parse_args()
    require_cuda("bench.serve")
    import torch

    from modeling import QwenTokenizer
    from modeling.model.random_checkpoint import QWEN3_0_6B, build_random_checkpoint

    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), torch=torch.__version__,
               prompt_tokens=PROMPT_TOKENS, max_tokens=MAX_TOKENS, requests_per_level=a.requests_per_level)
    slug = out["gpu"].lower().replace("nvidia ", "").replace(" ", "-")
    path = out_dir / f"{out['date']}-{slug}-serve.json"

    def report(key, value):
        out[key] = value
        print(f"{key:36s} {value:10.2f}", flush=True)
        path.write_text(json.dumps(out, indent=1))  # after every number: a run cut short keeps what it has

    shape = {k: v for k, v in QWEN3_0_6B.items() if k != "vocab_size"}
    ckpt = build_random_checkpoint(out_dir / "serve-qwen3-0.6b-random", std=0.02, **shape)
    tok = QwenTokenizer.from_pretrained(ckpt)
    rng = random.Random(0)
    n = max(a.requests_per_level, 2 * max(a.concurrency))
    prompt_ids = [[rng.randrange(3, tok.vocab_size) for _ in range(PROMPT_TOKENS)] for _ in range(n)]
    prompts = [tok.decode(ids) for ids in prompt_ids]
    out["vocab_size"] = tok.vocab_size

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ours = start([sys.executable, "-m", "modeling.serve", "--model", str(ckpt), "--port", str(port),
                  "--max-num-seqs", str(max(a.concurrency)), "--max-model-len", str(MAX_MODEL_LEN),
                  "--served-model-name", "bench"], out_dir / "serve-ours.log", url)
    try:
        measure("serve", url, "bench", prompts, a.concurrency, a.requests_per_level, {"ignore_eos": True}, report)
    finally:
        stop(ours)

    if 64 in a.concurrency:
        ids = [tok.encode(t) for t in prompts[:a.requests_per_level]]
        report("engine_tokens_per_s_c64", engine_alone(ckpt, ids, 64))

    if not a.no_peer:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        try:
            peer = start(["transformers", "serve", str(ckpt), "--continuous-batching", "--host", "127.0.0.1",
                          "--port", str(port), "--dtype", "bfloat16"], out_dir / "serve-transformers.log", url)
        except (RuntimeError, OSError) as e:  # its command line moves between releases: say why it did not run
            out["transformers_serve_error"] = str(e)
            print(f"transformers serve did not run: {e}", flush=True)
        else:
            try:
                measure("transformers_serve", url, str(ckpt), prompts, a.concurrency, a.requests_per_level, {}, report)
            except Exception as e:
                out["transformers_serve_error"] = f"{type(e).__name__}: {e}"
                print(f"transformers serve failed: {out['transformers_serve_error']}", flush=True)
            finally:
                stop(peer)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
