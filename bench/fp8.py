"""FP8 block-scaled linears on the GPU against our bf16 linear, at Qwen3-8B's projections.

    python -m bench.fp8 [--out DIR] [--tokens 4096] [--sweep]

Shapes: Qwen3-8B (hidden 4096, intermediate 12288, 32 q / 8 kv heads of 128): qkv 6144 x 4096,
o_proj 4096 x 4096, gate_up 24576 x 4096, down 4096 x 12288 (N x K). Random bf16 weights (std
K^-0.5), quantised with `qwen_ops.quantize_weight_fp8_block` into Qwen's checkpoint format.

- prefill, `--tokens` rows: `qwen::fp8_block_linear` (the activation quantisation and the FP8
  GEMM, both kernels) against `qwen::linear` on the bf16 weight. `speedup` = bf16 time / FP8 time;
  `fp8_gemm_over_bf16_min` is the smallest over the shapes.
- decode, M = 1: the weight-only FP8 GEMV against `qwen::linear`'s split-K GEMV. `ratio` = FP8
  time / bf16 time; `fp8_gemv_over_bf16_b1_max` is the largest over the shapes. GB/s counts the
  weight's bytes (and its scales) over the time.

Each case is timed as a CUDA graph of calls (bench.ops.bench_us) over enough copies of the inputs
that they do not sit in L2. Errors: ||fp8 - reference|| / ||reference|| against the op's PyTorch
reference (the same quantisation), and against the bf16 weight's product in fp32 (what FP8 costs).

`--models NAME ...` (qwen3-0.6b, qwen3-1.7b, qwen3-8b) also times batch-1 decode through the engine
(``bench.decode.ours_ms``: a 256-token prompt, then ``--steps`` decode steps, CUDA graphs) of a
random bf16 checkpoint of that shape (written once under ``--checkpoints``) loaded as it is (our
fastest bf16 path: the persistent kernel) and with ``quantization="fp8"`` (the default: the fused
decode ops; then the persistent kernel's FP8 tiles, ``decode_kernels="persistent"``):
``fp8_over_bf16_b1_<name>`` and ``fp8_persistent_over_bf16_b1_<name>`` = FP8 time / bf16 time, same run.

`--sweep` first times the prefill GEMM at each of SWEEP_TILES (a tile whose error against the
reference exceeds 1e-2 is not eligible), prints the fastest per shape and records it as this GPU's
table fp8_prefill (``csrc_free_ops.devices.record``), which the prefill rows then run.

Prints markdown; with --out writes <date>-<gpu>-fp8.md and .json there (the JSON names the device).
"""
import argparse
import datetime
import json
import os

from pathlib import Path

import torch
import torch.nn.functional as F
import triton

import qwen_ops
from bench import gpu_slug, require_cuda
from bench.ops import bench_us, copies, linear_cases, rel_error
from csrc_free_ops import devices, fp8
from modeling.model.random_checkpoint import QWEN3_0_6B, build_random_checkpoint, is_complete

QWEN3_8B = dict(hidden=4096, hq=32, hk=8, d=128, inter=12288, vocab=151936)
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")
SWEEP_TILES = [fp8.PrefillTiles(bm, bn, w, s) for bm, bn, w, s in
               ((64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 5), (128, 64, 4, 4), (128, 128, 8, 3),
                (128, 128, 8, 4), (64, 256, 8, 3))]
"""--sweep's candidates: those that compile for sm_90 without spilling registers (128 x 128 on 4
warps, 128 x 256 and 256 x 128 on 8 spill: each block's product is held beside the accumulator)."""


def _weights(n, k):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    q, s = qwen_ops.quantize_weight_fp8_block(w)
    return w, q, s


def bench_shape(name, m, n, k, tiles=None):
    """One row: bf16 and FP8 times (us), errors, and the weight bytes each reads."""
    w, q, s = _weights(n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = qwen_ops.fp8_block_linear(x, q, s)
    errors = (rel_error(out, qwen_ops.fp8_block_linear_reference(x, q, s)),
              rel_error(out, F.linear(x.float(), w.float())))
    bf16_sets = copies(lambda: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16), _weights(n, k)[0]),
                       (m * k + n * k) * 2)
    fp8_sets = copies(lambda: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16), *_weights(n, k)[1:]),
                      m * k * 2 + n * k)
    bf16_us = bench_us(lambda x, w: torch.ops.qwen.linear(x, w), bf16_sets)
    fp8_us = bench_us(lambda x, q, s: torch.ops.qwen.fp8_block_linear(x, q, s), fp8_sets)
    return dict(name=name, m=m, n=n, k=k, bf16_us=bf16_us, fp8_us=fp8_us, err_vs_reference=errors[0],
                err_vs_bf16_weight=errors[1], fp8_weight_bytes=n * k + s.numel() * 4, bf16_weight_bytes=2 * n * k)


def sweep(m, n, k):
    """(time us, tiles) per eligible tile of the prefill GEMM (activation quantisation included)."""
    w, q, s = _weights(n, k)
    sets = copies(lambda: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16), q, s), m * k * 2)
    ref = qwen_ops.fp8_block_linear_reference(sets[0][0], q, s)
    results = []
    for tiles in SWEEP_TILES:
        try:
            if rel_error(fp8.block_linear(sets[0][0], q, s, None, tiles), ref) > 1e-2:
                continue
            results.append((bench_us(lambda x, q, s: fp8.block_linear(x, q, s, None, tiles), sets), tiles))
        except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit is not eligible
            print(f"{tiles}: {type(e).__name__}: {str(e)[:120]}", flush=True)
    return sorted(results, key=lambda r: r[0])


MODELS = {"qwen3-0.6b": QWEN3_0_6B,
          "qwen3-1.7b": dict(QWEN3_0_6B, hidden_size=2048, intermediate_size=6144),
          "qwen3-8b": dict(QWEN3_0_6B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                           num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)}
"""--models: config.json fields of the random checkpoints (Qwen3-8B: its lm_head untied, in bf16)."""


def model_decode(name: str, root: Path, steps: int) -> dict:
    """Batch-1 decode ms/token of ``name``'s random bf16 checkpoint, as it is and quantised at load."""
    from bench.decode import ours_ms
    from bench.throughput import free_device_memory
    from modeling import QwenForCausalLM

    fields = MODELS[name]
    path = root / name
    if not is_complete(path):
        build_random_checkpoint(path, vocab_size=fields["vocab_size"], tokenizer="words", dtype=torch.bfloat16,
                                std=0.02, **{k: v for k, v in fields.items() if k != "vocab_size"})
    out = {}
    for label, quantization in (("bf16", None), ("fp8", "fp8")):
        model = QwenForCausalLM.from_pretrained(path, device="cuda", dtype=torch.bfloat16, quantization=quantization)
        out[f"{label}_b1_ms_per_token"] = ours_ms(model, 1, 256, steps)
        if quantization:  # the persistent kernel's FP8 tiles, asked for
            out["fp8_persistent_b1_ms_per_token"] = ours_ms(model, 1, 256, steps, "persistent")
        del model
        free_device_memory()
    for label in ("fp8", "fp8_persistent"):
        out[f"{label}_over_bf16"] = out[f"{label}_b1_ms_per_token"] / out["bf16_b1_ms_per_token"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--models", nargs="*", choices=sorted(MODELS), default=[],
                    help="also time batch-1 decode of these model shapes, bf16 against quantised at load")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per run (--models)")
    ap.add_argument("--checkpoints", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "qwen-fp8-bench")
    a = ap.parse_args()
    require_cuda("bench.fp8")
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()
    shapes = {name: nk for name, nk in linear_cases(QWEN3_8B).items() if name in PROJECTIONS}
    swept = {name: sweep(a.tokens, n, k) for name, (n, k) in shapes.items()} if a.sweep else {}
    if swept:
        print("recorded in", devices.record("fp8_prefill", gpu, torch.bfloat16,
                                            {shapes[name]: ranked[0][1] for name, ranked in swept.items() if ranked}))
    prefill = [bench_shape(name, a.tokens, n, k) for name, (n, k) in shapes.items()]
    decode = [bench_shape(name, 1, n, k) for name, (n, k) in shapes.items()]
    result = {
        "device": gpu, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "triton": triton.__version__, "tokens": a.tokens, "prefill": prefill, "decode": decode,
        "fp8_gemm_over_bf16_min": min(r["bf16_us"] / r["fp8_us"] for r in prefill),
        "fp8_gemv_over_bf16_b1_max": max(r["fp8_us"] / r["bf16_us"] for r in decode),
    }
    lines = [f"# FP8 block-scaled linears, Qwen3-8B projections ({gpu}, {result['date']}, torch {torch.__version__}, "
             f"triton {triton.__version__})", "",
             f"## Prefill, {a.tokens} tokens: fp8_block_linear (activation quantisation included) vs bf16 linear", "",
             "| projection | N x K | bf16 us | fp8 us | speedup | err vs reference | err vs bf16 weight |",
             "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['name']} | {r['n']} x {r['k']} | {r['bf16_us']:.1f} | {r['fp8_us']:.1f} | "
              f"{r['bf16_us'] / r['fp8_us']:.2f}x | {r['err_vs_reference']:.1e} | {r['err_vs_bf16_weight']:.1e} |"
              for r in prefill]
    lines += ["", f"fp8_gemm_over_bf16_min: {result['fp8_gemm_over_bf16_min']:.2f}", "",
              "## Decode, M = 1: the weight-only FP8 GEMV vs the bf16 GEMV", "",
              "| projection | N x K | bf16 us | fp8 us | fp8 / bf16 | bf16 GB/s | fp8 GB/s | err vs reference |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['name']} | {r['n']} x {r['k']} | {r['bf16_us']:.1f} | {r['fp8_us']:.1f} | "
              f"{r['fp8_us'] / r['bf16_us']:.2f} | {r['bf16_weight_bytes'] / r['bf16_us'] / 1e3:.0f} | "
              f"{r['fp8_weight_bytes'] / r['fp8_us'] / 1e3:.0f} | {r['err_vs_reference']:.1e} |" for r in decode]
    lines += ["", f"fp8_gemv_over_bf16_b1_max: {result['fp8_gemv_over_bf16_b1_max']:.2f}"]
    if a.models:
        lines += ["", "## Batch-1 decode through the engine, context 256 (ms/token)", "",
                  "| model shape | bf16 | fp8 (quantised at load), fused ops | fp8 / bf16 | fp8, persistent kernel "
                  "| fp8 persistent / bf16 |", "|---|---:|---:|---:|---:|---:|"]
    for name in a.models:
        row = model_decode(name, a.checkpoints, a.steps)
        key = name.replace('-', '_').replace('.', '_')
        result[f"fp8_over_bf16_b1_{key}"] = row["fp8_over_bf16"]
        result[f"fp8_persistent_over_bf16_b1_{key}"] = row["fp8_persistent_over_bf16"]
        result.setdefault("models", {})[name] = row
        lines.append(f"| {name} | {row['bf16_b1_ms_per_token']:.3f} | {row['fp8_b1_ms_per_token']:.3f} | "
                     f"{row['fp8_over_bf16']:.2f} | {row['fp8_persistent_b1_ms_per_token']:.3f} | "
                     f"{row['fp8_persistent_over_bf16']:.2f} |")
    if swept:
        lines += ["", f"## Prefill GEMM tiles, {a.tokens} tokens (fastest first, us)", ""]
        result["sweep"] = {name: [dict(us=us, tiles=tiles._asdict()) for us, tiles in ranked]
                           for name, ranked in swept.items()}
        lines += [f"- {name} ({shapes[name][0]} x {shapes[name][1]}): "
                  + ", ".join(f"{tuple(t)} {us:.1f}" for us, t in ranked[:4]) for name, ranked in swept.items()]
    table = "\n".join(lines)
    print(table)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        stem = os.path.join(a.out, f"{result['date']}-{gpu_slug(gpu)}-fp8")
        with open(stem + ".md", "w") as f:
            f.write(table + "\n")
        with open(stem + ".json", "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
