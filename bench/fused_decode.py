"""The fused decode ops against the op sequences they replace, and their config sweep (GPU).

    python -m bench.fused_decode [--out DIR] [--sweep] [--fp8]
    python -m bench.fused_decode [--out DIR] --rows M

Each case is one decode-step projection of Qwen3-0.6B or Qwen3.5-0.8B at batch 1, bf16, timed
as a CUDA graph of calls over enough input copies that the weights do not sit in L2
(`bench.ops.bench_us`): the fused op at its stored config, the unfused ops it replaces, and the
weight bytes over the time against the copy bandwidth measured in the same run. --sweep also
times every candidate (block_n, block_k, split_k) and records the fastest per case as this GPU's
table fused_decode (``csrc_free_ops.devices.record``; each candidate launched with its config's
stages cut to the program's K steps, as `_launch_shape` does for every launch).

--fp8: the layer projections of Qwen3-0.6B and Qwen3-8B (``FP8_CASES``) with FP8 weights in Qwen's
block format (``qwen_ops.quantize_weight_fp8_block``), each fused op against itself on the bf16
weight (the FP8 weight bytes over the time against the copy bandwidth); --sweep then records the
fastest config per case under float8_e4m3fn, which FP8 weights take before x's dtype's entry
(``fused_decode.gemv_config``).

--rows M: the same cases with M rows (M tokens of one step: a short prompt chunk such as a prefix
hit's), the fused ops at their stored configs against the op sequences, which take the prefill
GEMMs from 17 rows on; no step rows, no sweep.
"""
import argparse
import datetime
import os

import torch
import triton

import qwen_ops  # noqa: F401
from bench import require_cuda
from bench.ops import bench_us, copies, copy_bandwidth, rnd
from csrc_free_ops import devices, fused_decode as fd

ops = torch.ops.qwen
EPS = 1e-6

# name: (op, N, K, extra): N output rows of the weight (gate_up: 2I), K its input size
CASES = {
    "qwen3-0.6b qkv+rope+store": ("norm_qkv_rope_store", 4096, 1024, dict(hq=16, hk=8, d=128, rot=128, gated=False)),
    "qwen3-0.6b o_proj+residual": ("linear_residual", 1024, 2048, {}),
    "qwen3-0.6b norm+gate_up+silu": ("norm_gate_up_silu", 6144, 1024, {}),
    "qwen3-0.6b down+residual": ("linear_residual", 1024, 3072, {}),
    "qwen3-0.6b norm+lm_head": ("norm_linear", 151936, 1024, {}),
    "qwen3.5 gated qkv+rope+store": ("norm_qkv_rope_store", 5120, 1024, dict(hq=8, hk=2, d=256, rot=64, gated=True)),
    "qwen3.5 norm+in_proj": ("norm_linear", 8224, 1024, {}),
    "qwen3.5 out_proj+residual": ("linear_residual", 1024, 2048, {}),
    "qwen3.5 norm+gate_up+silu": ("norm_gate_up_silu", 7168, 1024, {}),
    "qwen3.5 down+residual": ("linear_residual", 1024, 3584, {}),
    "qwen3.5 norm+lm_head": ("norm_linear", 248320, 1024, {}),
}


QWEN3_8B_QKV = dict(hq=32, hk=8, d=128, rot=128, gated=False)
FP8_CASES = {
    **{name: case for name, case in CASES.items() if name.startswith("qwen3-0.6b") and "lm_head" not in name},
    "qwen3-8b qkv+rope+store": ("norm_qkv_rope_store", 6144, 4096, QWEN3_8B_QKV),
    "qwen3-8b o_proj+residual": ("linear_residual", 4096, 4096, {}),
    "qwen3-8b norm+gate_up+silu": ("norm_gate_up_silu", 24576, 4096, {}),
    "qwen3-8b down+residual": ("linear_residual", 4096, 12288, {}),
}
"""--fp8's cases: the projections an FP8 checkpoint holds in FP8 (its lm_head stays bf16)."""


def make_args(op, n, k, extra, fp8: bool = False, rows: int = 1):
    """A fresh argument tuple (the weight is the big part) for one call of the fused op on ``rows``
    rows; ``fp8``: the weight in FP8, its scales last (the launchers' next positional argument)."""
    if fp8:
        args = make_args(op, n, k, extra, rows=rows)
        i = 1 if op == "linear_residual" else 2
        weight, scales = qwen_ops.quantize_weight_fp8_block(args[i])
        return (*args[:i], weight, *args[i + 1:], scales)
    x, nw = rnd(1, rows, k), rnd(k, scale=0.1) + 1
    w = rnd(n, k, scale=k**-0.5)
    if op == "norm_qkv_rope_store":  # x [N, K]; paged caches of 32 blocks of 16, positions from 300 at their slots
        cache = lambda: torch.zeros(32, 16, extra["hk"], extra["d"], dtype=torch.bfloat16, device="cuda")  # noqa: E731
        pos = torch.arange(300, 300 + rows, device="cuda")
        return (x[0], nw, w, None, rnd(extra["d"]) + 1, rnd(extra["d"]) + 1, cache(), cache(), pos, pos.clone(), EPS,
                1.0 if extra["gated"] else 0.0, 1e6, extra["rot"], extra["hq"], extra["gated"])
    if op == "linear_residual":
        return (x, w, rnd(1, rows, n))
    return (x, nw, w, None, EPS, 0.0) if op == "norm_linear" else (x, nw, w, EPS, 0.0)


def fused(op, cfg=None):
    launcher = getattr(fd, op)
    return lambda *a: launcher(*a, cfg=cfg)


def unfused(op, extra):
    """The op-by-op sequence the fused op replaces (the residual stream's add_rms_norm included
    where the fused op absorbs it)."""
    def qkv(x, nw, w, b, qn, kn, kc, vc, pos, slots, eps, offset, theta, rot, hq, gated):
        h, _ = ops.add_rms_norm(x, x, nw, eps, offset)
        qkv = ops.linear(h, w, b)
        d, hk = extra["d"], extra["hk"]
        q_rows = hq * d * (2 if gated else 1)
        m = qkv.shape[0]
        q = qkv[:, :q_rows].view(m, hq, -1)[..., :d]
        k = qkv[:, q_rows : q_rows + hk * d].view(m, hk, d)
        v = qkv[:, q_rows + hk * d :].view(m, hk, d)
        q, k = ops.rope(q, k, pos, theta, rot, qn, kn, eps, offset)
        ops.kv_cache_store_slots(k, v, kc, vc, slots)

    return {
        "norm_qkv_rope_store": qkv,
        "linear_residual": lambda x, w, r: ops.add_rms_norm(ops.linear(x, w), r, r[0, 0], EPS)[1],
        "norm_gate_up_silu": lambda x, nw, w, eps, off: ops.linear_silu_mul(ops.add_rms_norm(x, x, nw, eps)[0], w),
        "norm_linear": lambda x, nw, w, b, eps, off: ops.linear(ops.add_rms_norm(x, x, nw, eps)[0], w),
    }[op]


def candidates(op, n, k, extra, fp8: bool = False):
    """(block_n, block_k, split) configs; FP8 weights: K steps of one scale block, wider tiles (an
    element is half the bytes)."""
    block_ns = [extra["d"]] if op == "norm_qkv_rope_store" else [16, 32, 64] if n < 32768 else [64, 128, 256]
    if fp8 and op != "norm_qkv_rope_store":
        block_ns += [2 * block_ns[-1], 4 * block_ns[-1]]
    for block_n in block_ns:
        tiles = triton.cdiv(n // 2 if op == "norm_gate_up_silu" else n, block_n)
        for block_k in (128,) if fp8 else (128, 256):
            for split in (1, 2, 4, 8, 16, 32) if fp8 else (1, 2, 4, 8, 16):
                if split * block_k <= k and (split == 1 or 64 <= tiles * split <= 1056):
                    yield fd.GemvConfig(block_n, block_k, split)


def step_rows():
    """One whole decode step of the Qwen3-0.6B shape (batch 1, context 300) through the engine
    (its CUDA graph), the fused decode ops and the op-by-op step, with and without PDL: us a step
    (``bench.decode.ours_ms``: the engine's host work per step included)."""
    from bench.decode import ours_ms
    from csrc_free_ops import common
    from modeling import QwenConfig
    from modeling.model.random_checkpoint import QWEN3_0_6B, config_dict, random_model

    model = random_model(QwenConfig.from_dict(config_dict(**QWEN3_0_6B)), device="cuda")
    lines = ["| decode step, Qwen3-0.6B shape, the engine's graph | us |", "|---|---|"]
    for kernels, pdl in (("fused", True), ("fused", False), ("ops", True), ("ops", False)):
        common._PDL_OFF = not pdl
        try:
            us = ours_ms(model, 1, 300, 64, kernels) * 1e3
        finally:
            common._PDL_OFF = False
        lines.append(f"| {'fused' if kernels == 'fused' else 'op by op'}{', PDL' if pdl else ''} | {us:.0f} |")
        print(lines[-1], flush=True)
    return lines


def main():
    ap = argparse.ArgumentParser(prog="python -m bench.fused_decode", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="FP8 weights (FP8_CASES) against bf16; --sweep records "
                    "their configs under float8_e4m3fn")
    ap.add_argument("--rows", type=int, default=1, help="rows of each call (module doc); not with --sweep")
    args = ap.parse_args()
    if args.rows < 1:
        ap.error(f"--rows must be at least 1, got {args.rows}")
    if args.rows > 1 and args.sweep:
        ap.error("--sweep records batch-1 configs: run it without --rows")
    require_cuda("bench.fused_decode")
    torch.manual_seed(0)
    qwen_ops.reserve_semaphores("cuda")
    bw = copy_bandwidth()
    head = (f"# bench/fused_decode.py on {torch.cuda.get_device_name()}, {datetime.date.today()}, torch "
            f"{torch.__version__}, triton {triton.__version__}; copy {bw / 1e12:.2f} TB/s, "
            f"{f'{args.rows} rows' if args.rows > 1 else 'batch 1'}, bf16{', FP8 weights' if args.fp8 else ''}")
    lines = [head, ""]
    print(head, flush=True)
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "fused_decode.log"), "w")
    if not args.fp8 and args.rows == 1:
        lines += step_rows()
    peer = "bf16 weight us" if args.fp8 else "unfused us"
    lines += ["", f"| case | weight MB | fused us | %copy | {peer} | best config | best us |", "|---|---|---|---|---|---|---|"]
    best = {}
    for name, (op, n, k, extra) in (FP8_CASES if args.fp8 else CASES).items():
        nbytes = n * k * (1 if args.fp8 else 2)
        sets = copies(lambda: make_args(op, n, k, extra, args.fp8, args.rows), nbytes)
        t_fused = bench_us(fused(op), sets)
        if args.fp8:
            t_peer = bench_us(fused(op), copies(lambda: make_args(op, n, k, extra, rows=args.rows), 2 * nbytes))
        else:
            t_peer = bench_us(unfused(op, extra), sets)
        win = (t_fused, None)
        if args.sweep:
            for cfg in candidates(op, n, k, extra, args.fp8):
                try:
                    win = min(win, (bench_us(fused(op, cfg), sets), cfg), key=lambda r: r[0])
                except triton.runtime.errors.OutOfResources:
                    continue
            if win[1] is not None:
                best[(op, n // 2 if op == "norm_gate_up_silu" else n, k)] = win[1]
        pct = 100 * nbytes / (win[0] * 1e-6) / bw
        line = (f"| {name} | {nbytes / 1e6:.1f} | {t_fused:.1f} | {100 * nbytes / (t_fused * 1e-6) / bw:.0f}% | "
                f"{t_peer:.1f} | {tuple(win[1]) if win[1] else 'stored'} | {win[0]:.1f} ({pct:.0f}%) |")
        lines.append(line)
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()
        del sets
        torch.cuda.empty_cache()
    if best:
        dtype = torch.float8_e4m3fn if args.fp8 else torch.bfloat16
        lines += ["", f"recorded in {devices.record('fused_decode', torch.cuda.get_device_name(), dtype, best)}"]
    os.makedirs(args.out, exist_ok=True)
    name = "fused_decode" + ("_fp8" if args.fp8 else "") + (f"_rows{args.rows}" if args.rows > 1 else "")
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(lines[-1] if best else "", flush=True)


if __name__ == "__main__":
    main()
