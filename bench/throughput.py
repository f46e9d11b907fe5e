"""The engine's offline throughput and time to first token, beside transformers' continuous batching.

    python -m bench.throughput [--out DIR] [--requests 256] [--peer-requests 8] [--no-peer] [--profile] [--ttft-only]
                               [--block-sizes 16 32 64 128]
    python -m bench.throughput --tp N [--checkpoints DIR] [--requests 256]

``--tp N`` (N GPUs) runs only Qwen3-8B's throughput at tensor-parallel sizes 1 and N
(``bench.tensor_parallel``) and writes ``<date>-<gpu>-throughput-tp.json``.

On the GPU (bf16, random weights, one process):

- throughput, nano-vllm's benchmark shape: ``--requests`` requests of random token ids, input
  lengths uniform in [100, 1024], output lengths uniform in [100, 1024], EOS ignored, all
  submitted at once; output tokens per second of wall time, after a warm-up run of the same
  workload (CUDA graphs captured). Qwen3-0.6B shape. Key ``throughput_tokens_per_s``;
- time to first token: from submitting the prompts (all at once) until the last of them has its
  first token on the host, warm: Qwen3-0.6B eight 256-token prompts (``qwen3_ttft_ms_8x256``),
  Qwen3.5-0.8B one and eight (``qwen3_5_ttft_ms_256``, ``qwen3_5_ttft_ms_8x256``);
- prefix caching: a 2048-token prompt, then another with the same 2048 tokens and a 32-token
  suffix; the second's time to first token over the first's (``prefix_hit_ttft_ratio``);
- the peer: transformers' continuous batching (``init_continuous_batching``, paged SDPA) on the
  first ``--peer-requests`` requests with their own output lengths, after ours has freed its pool
  (``transformers_cb_tokens_per_s``).

The timed throughput run's engine counters (steps, host time by phase: ``EngineStats``) are printed
and kept under ``throughput_stats``; ``--profile`` also runs the workload's first 64 requests, one prefix hit and
Qwen3.5's one and eight prompts under ``torch.profiler`` and prints the kernels that took the most device
time in each.

``--block-sizes``: first the throughput run (warm-up, then timed) with an engine of each KV block
size, keys ``throughput_tokens_per_s_block{B}``: the benchmark that picks ``engine.BLOCK_SIZE``.

Writes ``<date>-<gpu>-throughput.json`` with ``gpu`` and ``date``.
"""
import argparse
import datetime
import gc
import json
import os
import random
import time

import torch

from bench import gpu_slug, require_cuda

INPUT_LENS = OUTPUT_LENS = (100, 1024)
ENGINE = dict(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2176)
"""The Qwen3 engine's settings (every run of the workload)."""


def workload(n: int, vocab: int, seed: int = 0):
    """[(prompt ids, output length)] of nano-vllm's benchmark."""
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(rng.randint(*INPUT_LENS))], rng.randint(*OUTPUT_LENS))
            for _ in range(n)]


def run_all(engine, requests, params) -> float:
    """Submit every request at once, step until all finish; output tokens per second."""
    t0 = time.perf_counter()
    seqs = [engine.add(ids, params, out) for ids, out in requests]
    while engine.has_work():
        engine.step()
    torch.cuda.synchronize()
    return sum(s.num_output for s in seqs) / (time.perf_counter() - t0)


def ttft_ms(engine, prompts, params) -> float:
    """Submit ``prompts`` at once; ms until the last has its first token (then they are aborted)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    seqs = [engine.add(p, params, 1) for p in prompts]
    while any(s.num_output == 0 for s in seqs):
        engine.step()
    ms = (time.perf_counter() - t0) * 1e3
    while engine.has_work():
        engine.step()
    return ms


def throughput_at(model, requests, params, block_size: int) -> float:
    """The throughput run (warm, then timed) with an engine of ``block_size``-position KV blocks."""
    from modeling.engine import Engine

    engine = Engine(model, block_size=block_size, **ENGINE)
    run_all(engine, requests, params)
    rate = run_all(engine, requests, params)
    del engine
    free_device_memory()
    return rate


def free_device_memory() -> None:
    """Return the memory of deleted engines to the device: an engine's step graphs hold it in a
    reference cycle (the runner's graph cache keeps a bound method of the runner), which only the
    collector breaks; without it the next engine sizes its pool from what is left."""
    gc.collect()
    torch.cuda.empty_cache()


def profile(title: str, run, rows: int = 15) -> None:
    """The kernels of ``run()`` by device time, under a title."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
    print(f"profile: {title}", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60), flush=True)


def best_ttft(engine, prompts, params, reps: int = 5) -> float:
    ttft_ms(engine, prompts, params)  # warm
    return min(ttft_ms(engine, prompts, params) for _ in range(reps))


def transformers_cb(config_dict: dict, requests) -> float:
    """transformers' continuous batching: output tokens per second over ``requests``."""
    import transformers
    from transformers import GenerationConfig

    cfg = transformers.Qwen3Config(**{k: v for k, v in config_dict.items() if k != "model_type"})
    hf = transformers.Qwen3ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    hf.set_attn_implementation("paged|sdpa")
    gen = GenerationConfig(max_new_tokens=max(out for _, out in requests), do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    manager = hf.init_continuous_batching(generation_config=gen)
    manager.start()
    try:
        t0 = time.perf_counter()
        for i, (ids, out) in enumerate(requests):
            manager.add_request(ids, request_id=str(i), max_new_tokens=out)
        tokens = done = 0
        while done < len(requests):
            result = manager.get_result(timeout=30)
            if result is None:
                raise RuntimeError(f"transformers' manager stopped with {done} of {len(requests)} requests done")
            if result.is_finished():
                done += 1
                tokens += len(result.generated_tokens)
        return tokens / (time.perf_counter() - t0)
    finally:
        manager.stop(block=True)


def main():
    p = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--peer-requests", type=int, default=8)
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="profile the kernels of 64 requests, a prefix hit and Qwen3.5's eight prompts")
    p.add_argument("--ttft-only", action="store_true", help="skip the throughput run (and the peer)")
    p.add_argument("--tp", type=int, metavar="N", help="only Qwen3-8B's throughput at tensor-parallel sizes 1 and N")
    p.add_argument("--checkpoints", help="--tp's random checkpoint directory")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[],
                   help="first, the throughput run at each of these KV block sizes")
    a = p.parse_args()
    require_cuda("bench.throughput")
    from modeling import QwenConfig
    from modeling.engine import Engine
    from modeling.model.random_checkpoint import QWEN3_0_6B, QWEN3_5_0_8B, random_model
    from modeling import SamplingParams

    greedy = SamplingParams()
    out = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), torch=torch.__version__,
               requests=a.requests)

    os.makedirs(a.out, exist_ok=True)
    slug = gpu_slug(out["gpu"])
    if a.tp is not None:
        if a.tp < 2:
            p.error(f"--tp takes a size of 2 or more (size 1 runs beside it), got {a.tp}")
        from bench import tensor_parallel as tp

        out.update(gpus=a.tp, **tp.throughput_rows(tp.checkpoint(a.checkpoints or tp.DEFAULT_ROOT), (1, a.tp),
                                                   a.requests))
        path = os.path.join(a.out, f"{out['date']}-{slug}-throughput-tp.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps(out, indent=1))
        return
    path = os.path.join(a.out, f"{out['date']}-{slug}-throughput.json")

    def report(key, value, unit):
        out[key] = value
        print(f"{key:32s} {value:10.3f} {unit}", flush=True)
        with open(path, "w") as f:  # after every number: a run cut short keeps what it measured
            json.dump(out, f, indent=1)

    model = random_model(QwenConfig.from_dict(QWEN3_0_6B), dtype=torch.bfloat16, device="cuda", std=0.02)
    requests = workload(a.requests, model.config.vocab_size)
    for block_size in a.block_sizes:
        report(f"throughput_tokens_per_s_block{block_size}", throughput_at(model, requests, greedy, block_size),
               "output tokens/s")
    engine = Engine(model, **ENGINE)
    print(engine.size.describe(model), flush=True)
    if not a.ttft_only:
        run_all(engine, requests, greedy)  # warm: compile, capture every decode bucket
        engine.stats = type(engine.stats)()
        report("throughput_tokens_per_s", run_all(engine, requests, greedy), "output tokens/s")
        print(engine.stats.describe(), flush=True)
        out["throughput_stats"] = dict(vars(engine.stats))
        if a.profile:
            profile("the first 64 requests", lambda: run_all(engine, requests[:64], greedy))
    rng = random.Random(1)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(256)] for _ in range(8)]
    report("qwen3_ttft_ms_256", best_ttft(engine, prompts[:1], greedy), "ms")
    report("qwen3_ttft_ms_8x256", best_ttft(engine, prompts, greedy), "ms")
    prefix = [rng.randrange(model.config.vocab_size) for _ in range(2048)]
    cold = []
    for _ in range(3):  # a fresh prefix each time: no hit for the first request
        fresh = [rng.randrange(model.config.vocab_size) for _ in range(2048)]
        cold.append(ttft_ms(engine, [fresh], greedy))
    ttft_ms(engine, [prefix], greedy)  # now cached
    engine.stats = type(engine.stats)()
    hit = min(ttft_ms(engine, [prefix + [rng.randrange(1000) for _ in range(32)]], greedy) for _ in range(3))
    print(f"prefix hits, 3 runs: {engine.stats.describe()}", flush=True)
    out["prefix_hit_stats"] = dict(vars(engine.stats))  # the host's time by phase over the 3 hits
    if a.profile:
        profile("a prefix hit (2048 cached + 32 new)",
                lambda: ttft_ms(engine, [prefix + [rng.randrange(1000) for _ in range(32)]], greedy))
    report("prefix_miss_ttft_ms", min(cold), "ms")
    report("prefix_hit_ttft_ms", hit, "ms")
    report("prefix_hit_ttft_ratio", hit / min(cold), "")
    del engine, model
    free_device_memory()

    model = random_model(QwenConfig.from_dict(QWEN3_5_0_8B), dtype=torch.bfloat16, device="cuda", std=0.02)
    engine = Engine(model, max_num_seqs=16, max_num_batched_tokens=8192, max_model_len=4096)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(256)] for _ in range(8)]
    report("qwen3_5_ttft_ms_256", best_ttft(engine, prompts[:1], greedy), "ms")
    report("qwen3_5_ttft_ms_8x256", best_ttft(engine, prompts, greedy), "ms")
    if a.profile:
        profile("Qwen3.5, one 256-token prompt", lambda: ttft_ms(engine, prompts[:1], greedy), rows=25)
        profile("Qwen3.5, eight 256-token prompts", lambda: ttft_ms(engine, prompts, greedy), rows=25)
    del engine, model
    free_device_memory()

    if not (a.no_peer or a.ttft_only):
        try:
            report("transformers_cb_tokens_per_s", transformers_cb(QWEN3_0_6B, requests[:a.peer_requests]),
                   f"output tokens/s ({a.peer_requests} requests)")
        except Exception as e:  # the peer's API moves between releases: say why it did not run
            out["transformers_cb_error"] = f"{type(e).__name__}: {e}"
            print(f"transformers' continuous batching did not run: {out['transformers_cb_error']}", flush=True)
            with open(path, "w") as f:
                json.dump(out, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
