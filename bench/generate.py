"""End-to-end generation benchmark on the GPU: the engine's steps with and without CUDA graphs.

    python -m bench.generate [--out DIR] [--new-tokens 128] [--reps 5] [--models qwen3 qwen3_5]

- time to first token: one prompt of 16 / 256 / 512 / 2048 tokens through the engine (a random
  Qwen3-0.6B-shaped model, bf16), its steps eager (``enforce_eager=True``: one Python launch per
  op) vs replayed from their CUDA graphs (the default); wall time from adding the request to its
  first token on the host;
- decode: ms per step over ``--new-tokens`` tokens (greedy), eager vs the CUDA graphs, at batch 1
  (the persistent kernel) and 8 (op by op), plus batch 1 with top-k / top-p sampling
  (``bench.decode.ours_ms``);
- ``--models qwen3_5`` (optional, not in the default run): a random Qwen3.5-0.8B-shaped model
  (18 Gated DeltaNet + 6 gated attention layers), greedy decode ms per token at context 256,
  batch 1, eager vs the CUDA graphs, and transformers' eager ``generate`` beside it when
  importable (its torch fallbacks for the Gated DeltaNet unless flash-linear-attention and
  causal-conv1d are installed; per token = the time difference of two lengths / their token
  difference, so its prefill cancels out). Also the floor (weight bytes / copy bandwidth measured
  in the run) and the kernel time per decoded token inside the graph, from the profiler.

Medians over ``--reps`` runs after a warm-up run (compilation and capture excluded). Prints a
markdown table and writes it to ``DIR/<date>-<gpu>-generate.md`` (default $OUT, else bench/results).
"""
import argparse
import datetime
import os
import statistics
import time

import torch

from bench import gpu_slug, require_cuda
from bench.decode import ours_ms
from modeling import Engine, QwenConfig, SamplingParams
from modeling.model.random_checkpoint import QWEN3_0_6B, QWEN3_5_0_8B, random_model


def prompt(length, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


def median_of(reps, fn):
    fn()  # warm-up: compile, capture
    return statistics.median(fn() for _ in range(reps))


def ttft_ms(engine, ids) -> float:
    """ms from adding one request to its first token on the host (its prefix not cached)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    seq = engine.add(ids, SamplingParams(), 1)
    while seq.num_output == 0:
        engine.step()
    ms = (time.perf_counter() - t0) * 1e3
    while engine.has_work():
        engine.step()
    return ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prefill-lengths", type=int, nargs="+", default=[16, 256, 512, 2048])
    ap.add_argument("--models", nargs="+", choices=["qwen3", "qwen3_5"], default=["qwen3"],
                    help="qwen3: the Qwen3-0.6B rows (default); qwen3_5: the Qwen3.5-0.8B decode row")
    args = ap.parse_args()
    require_cuda("bench.generate")
    rows = qwen3_rows(args) if "qwen3" in args.models else []
    hybrid_rows, hybrid_notes = qwen3_5_rows(args) if "qwen3_5" in args.models else ([], [])
    write(args, rows, hybrid_rows, hybrid_notes)


def qwen3_rows(args):
    config = QwenConfig.from_dict(QWEN3_0_6B)
    model = random_model(config, dtype=torch.bfloat16, device="cuda", std=0.02)
    vocab, new = config.vocab_size, args.new_tokens
    rows = []
    max_len = max(args.prefill_lengths) + 8
    for length in args.prefill_lengths:
        times = {}
        for eager in (True, False):
            engine = Engine(model, max_num_seqs=1, max_model_len=max_len, prefix_caching=False, enforce_eager=eager)
            times[eager] = median_of(args.reps, lambda: ttft_ms(engine, prompt(length, vocab, length)))
        rows.append((f"time to first token, {length} tokens", "batch 1", times[True], times[False], "ms"))
        print(rows[-1], flush=True)

    for name, batch, sampling in [("greedy", 1, None), ("greedy", 8, None),
                                  ("T=0.8 top-k 50 top-p 0.95", 1,
                                   SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=0))]:
        times = {eager: ours_ms(model, batch, 64, new, eager=eager, reps=max(1, args.reps // 2) if eager else args.reps,
                                params=sampling) for eager in (True, False)}
        rows.append((f"decode {name}, {new} tokens", f"batch {batch}", times[True], times[False], "ms/step"))
        print(rows[-1], flush=True)
    del model
    torch.cuda.empty_cache()
    return rows


def qwen3_5_rows(args, context=256):
    """Greedy decode ms/token of the Qwen3.5-0.8B shape at context ``context``, batch 1: ours eager
    and with the CUDA graphs, and transformers eager (None when it cannot be imported); and notes:
    the floor and the per-kernel profile of the graph's step."""
    from bench.decode import copy_bandwidth, kernel_profile, weight_bytes

    config = QwenConfig.from_dict(QWEN3_5_0_8B)
    model = random_model(config, dtype=torch.bfloat16, device="cuda", std=0.02)
    new = args.new_tokens
    times = {eager: ours_ms(model, 1, context, new, eager=eager, reps=max(1, args.reps // 2) if eager else args.reps)
             for eager in (True, False)}
    row = (f"Qwen3.5-0.8B decode greedy, context {context}, {new} tokens", "batch 1", times[True], times[False],
           transformers_decode_ms(context, new, args.reps), "ms/token")
    print(row, flush=True)
    floor = weight_bytes(model) / copy_bandwidth() * 1e3
    profile = kernel_profile(model)
    notes = [f"Floor: {weight_bytes(model) / 1e9:.2f} GB of weights / the copy bandwidth = {floor:.3f} ms/token. "
             f"Kernel time per decoded token inside the graph (profiler, batch 1, context 3-11): "
             f"{sum(n for n, _ in profile.values()):.0f} kernels, {sum(us for _, us in profile.values()):.0f} us.",
             "", "| kernel | launches | us |", "|---|---|---|"]
    notes += [f"| `{name[:50]}` | {n:.0f} | {us:.1f} |" for name, (n, us) in
              sorted(profile.items(), key=lambda kv: -kv[1][1])[:14]]
    print("\n".join(notes), flush=True)
    return [row], notes


def transformers_decode_ms(context, new, reps):
    """transformers' Qwen3_5ForCausalLM (same shape, its own random init, bf16, eager attention):
    ms per generated token of greedy ``generate``, from two lengths so the prefill cancels out."""
    try:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    except ImportError:
        return None

    hf_config = Qwen3_5TextConfig(**{k: v for k, v in QWEN3_5_0_8B.items() if k != "model_type"})
    with torch.device("cuda"):
        hf = Qwen3_5ForCausalLM._from_config(hf_config, dtype=torch.bfloat16, attn_implementation="eager").eval()
    ids = torch.tensor([prompt(context, hf_config.vocab_size, 7)], device="cuda")
    short, long = max(2, new // 4), new

    def timed(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        assert out.shape[1] == context + n
        return time.perf_counter() - t0

    return median_of(max(1, reps // 2), lambda: (timed(long) - timed(short)) / (long - short) * 1e3)


def write(args, rows, hybrid_rows, hybrid_notes):
    gpu = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    import triton

    lines = [f"# bench/generate.py on {gpu}, {date}, torch {torch.__version__}, triton {triton.__version__}"]
    if rows:
        lines += [
            "",
            "Random Qwen3-0.6B-shaped model (28 layers, hidden 1024, 16/8 heads of 128, intermediate 3072, "
            "vocab 151936), bf16, through the engine. Wall-clock medians; time to first token = request added to "
            "its first token on the host; decode = decode steps' time / steps (one step decodes the whole batch).",
            "",
            "| what | batch | eager | CUDA graph | unit | speed-up |",
            "|---|---|---|---|---|---|",
        ]
        for what, batch, eager, graph, unit in rows:
            lines.append(f"| {what} | {batch} | {eager:.3f} | {graph:.3f} | {unit} | {eager / graph:.1f}x |")
    if hybrid_rows:
        lines += [
            "",
            "Random Qwen3.5-0.8B-shaped model (24 layers: 18 Gated DeltaNet with 16/16 heads of 128, 6 gated "
            "attention with 8/2 heads of 256; hidden 1024, intermediate 3584, vocab 248320), bf16. Decode ms per "
            "token (one step, batch 1), wall-clock medians; transformers: eager `generate`, its own random weights.",
            "",
            "| what | batch | eager | CUDA graph | transformers eager | unit | graph vs transformers |",
            "|---|---|---|---|---|---|---|",
        ]
        for what, batch, eager, graph, hf, unit in hybrid_rows:
            hf_cell, ratio = ("n/a", "n/a") if hf is None else (f"{hf:.3f}", f"{hf / graph:.1f}x")
            lines.append(f"| {what} | {batch} | {eager:.3f} | {graph:.3f} | {hf_cell} | {unit} | {ratio} |")
        lines += [""] + hybrid_notes
    table = "\n".join(lines)
    print("\n" + table)
    os.makedirs(args.out, exist_ok=True)
    slug = gpu_slug(gpu)
    path = os.path.join(args.out, f"{date}-{slug}-generate{'' if rows else '-qwen3_5'}.md")
    with open(path, "w") as f:
        f.write(table + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
