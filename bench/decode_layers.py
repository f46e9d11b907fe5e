"""The persistent decode kernels alone on the GPU: `torch.ops.qwen.decode_layers` (Qwen3) or
`torch.ops.qwen.decode_hybrid_layers` (Qwen3.5) over a sweep of its launch parameters, timed as a
CUDA graph replay.

    python -m bench.decode_layers [--model qwen3 | qwen3.5] [--batch 1 8] [--context 256 2048]
                                  [--cache-len N] [--splits 0 4 8 16] [--block-t 32]
                                  [--tile-elems 16384] [--out DIR] [--timeline]

Shape: `--model qwen3` (the default): Qwen3-0.6B's 28 layers (hidden 1024, 16 / 8 heads of 128,
intermediate 3072, q/k norms, tied embeddings not involved: the op ends before the final norm);
`--model qwen3.5`: Qwen3.5-0.8B's 24 layers (modeling/model/random_checkpoint.py's QWEN3_5_0_8B:
three Gated DeltaNet layers, 16 / 16 heads of 128 and a conv of 4 taps, then one gated attention
layer, 8 / 2 heads of 256, repeated; hidden 1024, intermediate 3584), a recurrent-state slot a
sequence, the states set back before each row's first call. Both bf16, random weights; a
contiguous cache of `--cache-len` positions a sequence (default: context + 66, the cache of
`bench.decode`'s Generator at its default 64 steps), every sequence at `--context` cached positions.

Each row: one setting of num_splits (0: the model's choice, `default_splits(cache_len, batch)`), the
attention block `BLOCK_T` and the GEMV tile size `TILE_ELEMS` (module constants of
csrc_free_ops/decode_layers.py, set here before the call; qwen3.5's BLOCK_T is the hybrid kernel's
`kv_block` of its head dim, not swept), the median microseconds of one call (triton's
do_bench_cudagraph), the weight bytes over that time, the largest difference from the first row's
output (the result does not depend on these settings beyond rounding) and the watchdog flag (must
stay 0); `programs`: the co-resident grid the launcher chose (from the compiled kernel's
registers). Prints a markdown table (and writes DIR/decode_layers.md with --out).

`--timeline`: also, per row, one call of a build of the kernel whose tasks stamp %globaltimer at
their start, when their wait is met and at their end (`csrc_free_ops.decode_layers.timeline`),
and per phase the median over layers 2 .. NL-1 (us; qwen3.5: a table per layer kind, over the
layers of that kind, phases in_proj, conv, delta, out, gate_up, down of a Gated DeltaNet layer and
qkv, attn, o, gate_up, down of an attention layer): span (the phase's last end after the phase
before's last end), compute (end minus wait met: median and max over the phase's tasks),
lastready and laststart (the last task's wait met and start, after the phase before's last end).
"""
import argparse
import datetime
import itertools
import os
import statistics
from typing import Callable, NamedTuple

import torch
from triton.testing import do_bench_cudagraph

from bench import require_cuda
import qwen_ops  # noqa: F401
from csrc_free_ops import decode_hybrid_layers as hybrid
from csrc_free_ops import decode_layers as kernels
from modeling import QwenConfig
from modeling.model.random_checkpoint import QWEN3_5_0_8B

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
HYBRID_PHASES = {hybrid.GATED_DELTANET: ("Gated DeltaNet", ("in_proj", "conv", "delta", "out", "gate_up", "down")),
                 hybrid.ATTENTION: ("gated attention", PHASE_NAMES)}
"""The hybrid kernel's layer kinds: (name, phase names)."""


def make_hybrid_args(batch: int, context: int, cache_len: int, seed: int = 0) -> list:
    """qwen::decode_hybrid_layers' arguments at Qwen3.5-0.8B's shapes (num_splits last): a contiguous
    cache and a state slot a sequence, every sequence continuing its states."""
    c = QwenConfig.from_dict(QWEN3_5_0_8B)
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    kinds = [hybrid.ATTENTION if t == "full_attention" else hybrid.GATED_DELTANET for t in c.layer_types]
    nl, na = len(kinds), kinds.count(hybrid.ATTENTION)
    ng, h, inter, hq, hk, d = nl - na, c.hidden_size, c.intermediate_size, c.num_attention_heads, \
        c.num_key_value_heads, c.head_dim
    hv, dk, dv, taps = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim, \
        c.linear_conv_kernel_dim
    channels, vd = 2 * c.linear_num_key_heads * dk + hv * dv, hv * dv
    seqlens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    table = torch.arange(batch, dtype=torch.int32, device="cuda").view(batch, 1)
    return [r(batch, h), (seqlens - 1).long(), seqlens, table, torch.arange(batch, device="cuda"), kinds,
            0.1 * r(nl, h), 0.1 * r(nl, h), r(nl, 2 * inter, h, scale=h ** -0.5), r(nl, h, inter, scale=inter ** -0.5),
            r(na, (2 * hq + 2 * hk) * d, h, scale=h ** -0.5), 0.1 * r(na, d), 0.1 * r(na, d),
            r(na, h, hq * d, scale=(hq * d) ** -0.5), r(na, batch, cache_len, hk, d), r(na, batch, cache_len, hk, d),
            r(ng, channels + vd + 2 * hv, h, scale=h ** -0.5), r(ng, channels, taps, scale=taps ** -0.5),
            (1 + 15 * torch.rand(ng, hv, generator=g, device="cuda")).log().to(torch.bfloat16), r(ng, hv),
            1 + 0.1 * r(ng, dv), r(ng, h, vd, scale=vd ** -0.5), r(ng, batch, channels, taps - 1),
            0.3 * torch.randn(ng, batch, hv, dk, dv, generator=g, device="cuda"),
            c.rms_norm_eps, c.norm_offset, c.rope_theta, c.rotary_dim, hq, 1]


class Model(NamedTuple):
    title: str  # the shapes, for the header
    op: str  # the torch.ops.qwen op
    make_args: Callable  # (batch, context, cache_len) -> its arguments, num_splits last
    weights: tuple  # the arguments that are weights (their bytes over the time: TB/s)
    states: tuple  # the arguments a call moves on (set back before each row's first call)
    layers: Callable  # arguments -> each layer's (kind, phase names, tasks of each phase), for `phase_table`


def _qwen3_layers(args) -> list:
    counts = kernels.phase_tasks(args[0].shape[0], args[5].shape[1], HIDDEN, HQ * D, INTER, args[13].shape[3],
                                 args[-1], 2)
    return [(None, PHASE_NAMES, counts)] * LAYERS


def _hybrid_layers(args) -> list:
    _, tasks = hybrid.step_tasks(args[0].shape[0], args[5], *(args[i] for i in (9, 14, 16, 17, 23)), args[-2],
                                 args[-1])
    return [(*HYBRID_PHASES[kind], counts) for kind, counts in zip(args[5], tasks)]


MODELS = {"qwen3": Model(f"Qwen3-0.6B's {LAYERS} layers", "decode_layers", make_args, tuple(range(4, 13)), (),
                         _qwen3_layers),
          "qwen3.5": Model(f"Qwen3.5-0.8B's {QWEN3_5_0_8B['num_hidden_layers']} layers", "decode_hybrid_layers",
                           make_hybrid_args, tuple(range(6, 14)) + tuple(range(16, 22)), (22, 23), _hybrid_layers)}


def timeline_table(model: Model, args) -> list:
    """One call with every task stamping its start, wait met and end, as `phase_table`'s lines."""
    layers = model.layers(args)
    stamps = torch.zeros(3 * sum(sum(counts) for *_, counts in layers), dtype=torch.int64, device="cuda")
    kernels.timeline = stamps
    try:
        getattr(torch.ops.qwen, model.op)(*args)
        torch.cuda.synchronize()
    finally:
        kernels.timeline = None
    return phase_table(stamps.cpu().view(-1, 3), layers)


def phase_table(stamps, layers) -> list:
    """stamps [tasks, 3] (ns: start, wait met, end of each task of the call, in the task list's
    order), layers each layer's (kind, phase names, tasks of each phase) in order -> markdown
    lines: per kind of layer a table (one kind: the table alone), per phase the medians over the
    kind's layers from the third on (see the module doc), us."""
    t = (stamps.double() - stamps[:, 0].min().double()) / 1e3
    stats, counts_of, first, prev_end = {}, {}, 0, None
    for layer, (kind, names, counts) in enumerate(layers):
        bounds = [first + b for b in itertools.accumulate([0] + list(counts))]
        if layer >= 2:
            counts_of[kind] = counts
            kind_stats = stats.setdefault(kind, {name: {k: [] for k in ("span", "med", "max", "ready", "start")}
                                                 for name in names})
            for p, name in enumerate(names):
                tasks = t[bounds[p]:bounds[p + 1]]
                compute = tasks[:, 2] - tasks[:, 1]
                row = kind_stats[name]
                row["span"].append(float(tasks[:, 2].max() - prev_end))
                row["med"].append(float(compute.median()))
                row["max"].append(float(compute.max()))
                row["ready"].append(float(tasks[:, 1].max() - prev_end))
                row["start"].append(float(tasks[:, 0].max() - prev_end))
                prev_end = tasks[:, 2].max()
        first = bounds[-1]
        prev_end = t[bounds[-2]:first, 2].max()
    span, single = f"kernel span {float(t[:, 2].max()):.1f} us", len(stats) == 1
    lines = [] if single else [f"timeline: {span}"]
    for kind, kind_stats in stats.items():
        what = f"{sum(counts_of[kind])} tasks a layer {list(counts_of[kind])}"
        med = {name: {k: statistics.median(v) for k, v in row.items()} for name, row in kind_stats.items()}
        lines += [f"timeline: {what}, {span}"] if single else ["", f"{kind} layers: {what}"]
        lines += ["", "| phase | span | compute median | compute max | lastready | laststart |",
                  "|---|---|---|---|---|---|"]
        for name, r in med.items():
            lines.append(f"| {name} | {r['span']:.2f} | {r['med']:.2f} | {r['max']:.2f} | {r['ready']:.2f} | "
                         f"{r['start']:.2f} |")
        lines.append(f"| layer | {sum(r['span'] for r in med.values()):.2f} | | | | |")
    return lines


def weight_bytes(model: Model, args) -> int:
    return sum(args[i].numel() * args[i].element_size() for i in model.weights if args[i] is not None)


def main():
    p = argparse.ArgumentParser(prog="python -m bench.decode_layers", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="qwen3")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--cache-len", type=int, default=None, help="positions a sequence (default: context + 66)")
    p.add_argument("--splits", type=int, nargs="+", default=[0], help="num_splits values (0: default_splits)")
    p.add_argument("--block-t", type=int, nargs="+", default=None, help=f"qwen3 only (default {kernels.BLOCK_T})")
    p.add_argument("--tile-elems", type=int, nargs="+", default=[kernels.TILE_ELEMS])
    p.add_argument("--out", default=None)
    p.add_argument("--timeline", action="store_true", help="also a per-phase timeline of one call a row")
    a = p.parse_args()
    model = MODELS[a.model]
    if a.block_t and a.model != "qwen3":
        raise SystemExit("error: --block-t sets decode_layers' BLOCK_T (the hybrid kernel's is kv_block(head dim))")
    block_ts = a.block_t or [kernels.BLOCK_T if a.model == "qwen3" else hybrid.kv_block(QWEN3_5_0_8B["head_dim"])]
    require_cuda("bench.decode_layers")
    flag = kernels.error_flag(torch.device("cuda"))
    lines = [f"# qwen::{model.op} alone, {model.title}, bf16 ({torch.cuda.get_device_name()}, "
             f"{datetime.date.today()}, torch {torch.__version__})", "",
             "| batch | context | cache | splits | BLOCK_T | TILE_ELEMS | programs | us a call | TB/s of weights | "
             "max diff | watchdog |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for batch, context in itertools.product(a.batch, a.context):
        cache_len = a.cache_len or context + 66
        if context > cache_len:
            raise SystemExit(f"error: --context {context} exceeds --cache-len {cache_len}")
        args = model.make_args(batch, context, cache_len)
        states = [args[i].clone() for i in model.states]
        first = None
        for splits, block_t, tile in itertools.product(a.splits, block_ts, a.tile_elems):
            kernels.TILE_ELEMS = tile
            if a.model == "qwen3":
                kernels.BLOCK_T = block_t
            args[-1] = splits or kernels.default_splits(cache_len, batch)
            for i, state in zip(model.states, states):
                args[i].copy_(state)
            fn = lambda: getattr(torch.ops.qwen, model.op)(*args)  # noqa: E731
            out = fn()
            torch.cuda.synchronize()
            first = out if first is None else first
            us = do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3
            row = (f"| {batch} | {context} | {cache_len} | {args[-1]}{'' if splits else ' (default)'} | {block_t} "
                   f"| {tile} | {list(kernels._grids.values())[-1][0]} | {us:.1f} | "
                   f"{weight_bytes(model, args) / us / 1e6:.2f} | "
                   f"{(out.float() - first.float()).abs().max().item():.3g} | {int(flag.item())} |")
            lines.append(row)
            print(row, flush=True)
            if a.timeline:
                timeline = timeline_table(model, args)
                print("\n".join(timeline), flush=True)
                lines += [""] + timeline + [""]
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "decode_layers.md"), "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
