"""The persistent decode kernel alone on the GPU: `torch.ops.qwen.decode_layers` over a sweep of its
launch parameters, timed as a CUDA graph replay.

    python -m bench.decode_layers [--batch 1 8] [--context 256 2048] [--cache-len N]
                                  [--splits 0 4 8 16] [--block-t 32] [--tile-elems 16384] [--out DIR]
                                  [--timeline]

Shape: Qwen3-0.6B's 28 layers (hidden 1024, 16 / 8 heads of 128, intermediate 3072, q/k norms,
tied embeddings not involved: the op ends before the final norm), bf16, random weights; a
contiguous cache of `--cache-len` positions a sequence (default: context + 66, the cache of
`bench.decode`'s Generator at its default 64 steps), every sequence at `--context` cached positions.

Each row: one setting of num_splits (0: the model's choice, `default_splits(cache_len, batch)`), the
attention block `BLOCK_T` and the GEMV tile size `TILE_ELEMS` (module constants of
csrc_free_ops/decode_layers.py, set here before the call), the median microseconds of one call
(triton's do_bench_cudagraph), the weight bytes over that time, the largest difference from the
first row's output (the result does not depend on these settings beyond rounding) and the
watchdog flag (must stay 0); `programs`: the co-resident grid the launcher chose (from the
compiled kernel's registers). Prints a markdown table (and writes DIR/decode_layers.md with --out).

`--timeline`: also, per row, one call of a build of the kernel whose tasks stamp %globaltimer at
their start, when their wait is met and at their end (`csrc_free_ops.decode_layers.timeline`),
and per phase the median over layers 2 .. NL-1 (us): span (the phase's last end after the phase
before's last end), compute (end minus wait met: median and max over the phase's tasks),
lastready and laststart (the last task's wait met and start, after the phase before's last end).
"""
import argparse
import datetime
import itertools
import os
import statistics

import torch
from triton.testing import do_bench_cudagraph

from bench import require_cuda
import qwen_ops  # noqa: F401
from csrc_free_ops import decode_layers as kernels

LAYERS, HIDDEN, HQ, HK, D, INTER = 28, 1024, 16, 8, 128, 3072


def make_args(batch: int, context: int, cache_len: int, seed: int = 0) -> list:
    """qwen::decode_layers' arguments (num_splits last, to be set per row)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    f = dict(device="cuda", dtype=torch.bfloat16)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    nqkv = (HQ + 2 * HK) * D
    seqlens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    table = torch.arange(batch, dtype=torch.int32, device="cuda").view(batch, 1)
    return [r(batch, HIDDEN), (seqlens - 1).long(), seqlens, table,
            1 + 0.1 * r(LAYERS, HIDDEN), r(LAYERS, nqkv, HIDDEN, scale=HIDDEN ** -0.5), None,
            1 + 0.1 * r(LAYERS, D), 1 + 0.1 * r(LAYERS, D), r(LAYERS, HIDDEN, HQ * D, scale=(HQ * D) ** -0.5),
            1 + 0.1 * r(LAYERS, HIDDEN), r(LAYERS, 2 * INTER, HIDDEN, scale=HIDDEN ** -0.5),
            r(LAYERS, HIDDEN, INTER, scale=INTER ** -0.5),
            r(LAYERS, batch, cache_len, HK, D), r(LAYERS, batch, cache_len, HK, D),
            1e-6, 0.0, 1e6, D, HQ, 1]


PHASE_NAMES = ("qkv", "attn", "o", "gate_up", "down")


def timeline_table(args) -> list:
    """One call with every task stamping its start, wait met and end, as `phase_table`'s lines."""
    batch, hk = args[0].shape[0], args[13].shape[3]
    counts = kernels.phase_tasks(batch, args[5].shape[1], HIDDEN, HQ * D, INTER, hk, args[-1], 2)
    stamps = torch.zeros(3 * LAYERS * sum(counts), dtype=torch.int64, device="cuda")
    kernels.timeline = stamps
    try:
        torch.ops.qwen.decode_layers(*args)
        torch.cuda.synchronize()
    finally:
        kernels.timeline = None
    return phase_table(stamps.cpu().view(LAYERS, sum(counts), 3), counts)


def phase_table(stamps, counts) -> list:
    """stamps [layers, tasks a layer, 3] (ns: start, wait met, end of each task, in the task list's
    order), counts the tasks a layer of each phase -> markdown lines: per phase the medians over
    layers 2 .. (see the module doc), us."""
    t = (stamps.double() - stamps[:, :, 0].min().double()) / 1e3
    bounds = [0] + list(itertools.accumulate(counts))
    stats = {name: {k: [] for k in ("span", "med", "max", "ready", "start")} for name in PHASE_NAMES}
    for layer in range(2, t.shape[0]):
        prev_end = t[layer - 1, bounds[-2]:, 2].max()
        for p, name in enumerate(PHASE_NAMES):
            tasks = t[layer, bounds[p]:bounds[p + 1]]
            compute = tasks[:, 2] - tasks[:, 1]
            row = stats[name]
            row["span"].append(float(tasks[:, 2].max() - prev_end))
            row["med"].append(float(compute.median()))
            row["max"].append(float(compute.max()))
            row["ready"].append(float(tasks[:, 1].max() - prev_end))
            row["start"].append(float(tasks[:, 0].max() - prev_end))
            prev_end = tasks[:, 2].max()
    med = {name: {k: statistics.median(v) for k, v in row.items()} for name, row in stats.items()}
    lines = [f"timeline: {sum(counts)} tasks a layer {list(counts)}, kernel span {float(t[:, :, 2].max()):.1f} us",
             "", "| phase | span | compute median | compute max | lastready | laststart |", "|---|---|---|---|---|---|"]
    for name, r in med.items():
        lines.append(f"| {name} | {r['span']:.2f} | {r['med']:.2f} | {r['max']:.2f} | {r['ready']:.2f} | "
                     f"{r['start']:.2f} |")
    lines.append(f"| layer | {sum(r['span'] for r in med.values()):.2f} | | | | |")
    return lines


def weight_bytes(args) -> int:
    return sum(t.numel() * t.element_size() for t in args[4:13] if t is not None)


def main():
    p = argparse.ArgumentParser(prog="python -m bench.decode_layers", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--cache-len", type=int, default=None, help="positions a sequence (default: context + 66)")
    p.add_argument("--splits", type=int, nargs="+", default=[0], help="num_splits values (0: default_splits)")
    p.add_argument("--block-t", type=int, nargs="+", default=[kernels.BLOCK_T])
    p.add_argument("--tile-elems", type=int, nargs="+", default=[kernels.TILE_ELEMS])
    p.add_argument("--out", default=None)
    p.add_argument("--timeline", action="store_true", help="also a per-phase timeline of one call a row")
    a = p.parse_args()
    require_cuda("bench.decode_layers")
    flag = kernels.error_flag(torch.device("cuda"))
    lines = [f"# qwen::decode_layers alone, Qwen3-0.6B's {LAYERS} layers, bf16 ({torch.cuda.get_device_name()}, "
             f"{datetime.date.today()}, torch {torch.__version__})", "",
             "| batch | context | cache | splits | BLOCK_T | TILE_ELEMS | programs | us a call | TB/s of weights | "
             "max diff | watchdog |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for batch, context in itertools.product(a.batch, a.context):
        cache_len = a.cache_len or context + 66
        if context > cache_len:
            raise SystemExit(f"error: --context {context} exceeds --cache-len {cache_len}")
        args = make_args(batch, context, cache_len)
        first = None
        for splits, block_t, tile in itertools.product(a.splits, a.block_t, a.tile_elems):
            kernels.BLOCK_T, kernels.TILE_ELEMS = block_t, tile
            args[-1] = splits or kernels.default_splits(cache_len, batch)
            fn = lambda: torch.ops.qwen.decode_layers(*args)  # noqa: E731
            out = fn()
            torch.cuda.synchronize()
            first = out if first is None else first
            us = do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3
            row = (f"| {batch} | {context} | {cache_len} | {args[-1]}{'' if splits else ' (default)'} | {block_t} "
                   f"| {tile} | {list(kernels._grids.values())[-1][0]} | {us:.1f} | {weight_bytes(args) / us / 1e6:.2f} | "
                   f"{(out.float() - first.float()).abs().max().item():.3g} | {int(flag.item())} |")
            lines.append(row)
            print(row, flush=True)
            if a.timeline:
                timeline = timeline_table(args)
                print("\n".join(timeline), flush=True)
                lines += [""] + timeline + [""]
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "decode_layers.md"), "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
