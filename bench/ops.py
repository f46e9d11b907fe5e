"""Per-op benchmark on the GPU: every torch.ops.qwen op against its PyTorch peer.

    python -m bench.ops [--out DIR] [--sweep-splitk [--shapes NAME ...] [--linears NAME ...]]
    python -m bench.ops [--out DIR] --sweep-attn-bwd
    python -m bench.ops [--out DIR] --sweep-prefill [--tokens 256 2048] [--shapes NAME ...] [--linears NAME ...]
    python -m bench.ops [--out DIR] --sweep-attn-fwd

Shapes: Qwen3-0.6B (hidden 1024, 16 q / 8 kv heads, head_dim 128, intermediate 3072,
vocab 151936) and the seed's (hidden 896, 8 q / 2 kv heads, head_dim 128, intermediate
4864), at decode (M=1) and prefill (256 and 2048 tokens), bf16. Each case is timed as a
CUDA graph of calls (the host launch cost is not what we measure), cycling through
enough copies of the inputs that they do not sit in L2. Bandwidth is the fewest bytes
the op must move over the time, and "%copy" compares it with a device-to-device copy
measured in the same run.

--sweep-splitk runs only the decode GEMM sweep (no ops table): every M = 1 linear of the
`--shapes` models (`--linears` narrows the projections, as for --sweep-prefill) at each split-K
config, beside cuBLAS; records the fastest per shape as this GPU's table linear_decode
(``csrc_free_ops.devices.record``: csrc_free_ops/tuning/<gpu>.json) and writes splitk_sweep.md.

--sweep-prefill runs only the prefill GEMM sweep (no ops table): every linear shape of both
models at 256 and 2048 tokens (or --tokens), through the TMA GEMM at each tile config and K split
(checked against cuBLAS: a config whose ||ours - cuBLAS|| / ||cuBLAS|| exceeds 1e-2 is not eligible), beside
the strided tiled GEMM and cuBLAS. Records the fastest per (M class, N, K) as this GPU's table
linear_prefill; writes prefill_sweep.md. `--shapes` (qwen3-0.6b, seed; or qwen3.5-0.8b, qwen3-8b)
and `--linears` (qkv, o_proj, gate_up, down, lm_head; Qwen3.5's in_proj, out_proj) narrow it to some
models and projections.

--sweep-attn-fwd runs only the attention-forward tile sweep (no ops table): causal bf16, batch 1,
256 and 2048 tokens, for Qwen3 heads (16/8 x 128), Qwen2.5-0.5B heads (14/2 x 64) and Qwen3.5's
gated attention (8/2 x 256). Each candidate Tiles(block_m, block_n, warps, stages) is graph-timed
and checked against an fp32 SDPA (a config above 1e-2 relative error is not eligible), beside
SDPA's flash and cuDNN backends. Writes attn_fwd_sweep.md and records, per head dim, the eligible
tiles with the least time summed over its shapes and lengths as this GPU's table attention_forward.

--targets runs only the summary a GPU is judged by, on the Qwen3-0.6B, Qwen3-8B and Qwen3.5-0.8B
shapes (``TARGET_MODELS``), and writes ``<date>-<gpu>-ops-targets.json``: ``gemm_vs_cublas_median``
and ``gemm_vs_cublas_min`` (cuBLAS time / ours, every linear at 256 and 2048 tokens),
``gemv_bandwidth_share_median`` (the weight's bytes over the copy bandwidth, divided by our M = 1
time: 1.0 is the floor), ``attn_vs_sdpa_min`` (the fastest SDPA backend's time / ours, causal
attention at 256 and 2048 tokens with head dims 64, 128 and 256), and every row.

--sweep-attn-bwd runs only the attention-backward tile sweep (no ops table): causal bf16 at
B=4, S=2048 for Qwen3 heads (16/8 x 128) and Qwen2.5-0.5B heads (14/2 x 64). Each candidate
tile config of the dK/dV and of the dQ kernel is timed alone (triton do_bench, median) with
its ptxas registers, spills and shared memory, and checked against an fp32 SDPA backward
(||ours - ref|| / ||ref||); then the default and the fastest combination against SDPA's
cuDNN and flash backward. Writes attn_bwd_sweep.md and attn_bwd_configs.json.
"""
import argparse
import datetime
import json
import os
import statistics

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench_cudagraph

from bench import gpu_slug, require_cuda
import qwen_ops
from csrc_free_ops import attention, common, devices, linear
from csrc_free_ops.attention import BwdBlocks, Tiles

SHAPES = {
    "qwen3-0.6b": dict(hidden=1024, hq=16, hk=8, d=128, inter=3072, vocab=151936),
    "seed": dict(hidden=896, hq=8, hk=2, d=128, inter=4864, vocab=151936),
}
PREFILL_SHAPES = {**SHAPES, "qwen3.5-0.8b": dict(hidden=1024, hq=8, hk=2, d=256, inter=3584, vocab=248320, q_gate=True,
                                                 in_proj=8224, value_dim=2048),
                  "qwen3-8b": dict(hidden=4096, hq=32, hk=8, d=128, inter=12288, vocab=151936)}
"""--sweep-prefill's models: also Qwen3.5-0.8B's (gated attention: q_proj holds the query and its
gate; Gated DeltaNet's fused in_proj and its out_proj) and Qwen3-8B's."""
L2_BYTES = 60 << 20
BF16 = torch.bfloat16


def bench_us(fn_per_set, arg_sets):
    """Median microseconds per call: one graph replays fn over every argument set."""
    def run():
        for args in arg_sets:
            fn_per_set(*args)
    run()
    return do_bench_cudagraph(run, rep=50, return_mode="median") * 1e3 / len(arg_sets)


class Report(list):
    """The lines of a sweep's table, each printed as it is added (sweeps run for minutes)."""

    def add(self, *new):
        self.extend(new)
        print(*new, sep="\n", flush=True)


def copies(make, nbytes_each):
    """Enough fresh argument sets that together they are 4x the L2."""
    return [make() for _ in range(max(1, min(64, (4 * L2_BYTES) // max(1, nbytes_each) + 1)))]


def copy_bandwidth():
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), rep=200, return_mode="median")
    return 2 * a.numel() / (ms * 1e-3)


def rnd(*shape, scale=1.0):
    return torch.randn(*shape, device="cuda", dtype=BF16) * scale


def linear_cases(cfg):
    """Projection name -> (N, K) of a model's linears."""
    h, hq, hk, d, i, v = (cfg[k] for k in ("hidden", "hq", "hk", "d", "inter", "vocab"))
    q = hq * d * (2 if cfg.get("q_gate") else 1)
    cases = {"qkv": (q + 2 * hk * d, h), "o_proj": (h, hq * d), "gate_up": (2 * i, h), "down": (h, i), "lm_head": (v, h)}
    if "in_proj" in cfg:
        cases.update(in_proj=(cfg["in_proj"], h), out_proj=(h, cfg["value_dim"]))
    return cases


def bench_linear(rows, name, m, n, k, decode_cfg=None):
    nbytes = (n * k + m * k + m * n) * 2
    sets = copies(lambda: (rnd(m, k), rnd(n, k, scale=k ** -0.5)), n * k * 2)
    if decode_cfg is None:
        ours = bench_us(lambda x, w: torch.ops.qwen.linear(x, w), sets)
    else:
        ours = bench_us(lambda x, w: linear.linear(x, w, None, config=decode_cfg), sets)
    peer = bench_us(lambda x, w: F.linear(x, w), sets)
    rows.append((name, f"M={m} N={n} K={k}", ours, "cuBLAS F.linear", peer, nbytes))


def bench_model_ops(rows, cfg, m):
    h, hq, hk, d, i = (cfg[k] for k in ("hidden", "hq", "hk", "d", "inter"))
    act = m * h * 2
    sets = copies(lambda: (rnd(m, h), rnd(m, h), rnd(h)), 2 * act)
    rows.append(("rms_norm", f"M={m} N={h}", bench_us(lambda x, r, w: torch.ops.qwen.rms_norm(x, w, 1e-6), sets),
                 "eager", bench_us(lambda x, r, w: qwen_ops.rms_norm_reference(x, w, 1e-6), sets), 2 * act + 2 * h))
    rows.append(("add_rms_norm", f"M={m} N={h}",
                 bench_us(lambda x, r, w: torch.ops.qwen.add_rms_norm(x, r, w, 1e-6), sets), "eager",
                 bench_us(lambda x, r, w: qwen_ops.add_rms_norm_reference(x, r, w, 1e-6), sets), 4 * act + 2 * h))
    sets = copies(lambda: (rnd(m, 2 * i),), m * 3 * i * 2)
    rows.append(("silu_mul", f"M={m} I={i}", bench_us(lambda gu: torch.ops.qwen.silu_mul(gu), sets), "eager",
                 bench_us(lambda gu: qwen_ops.silu_mul_reference(gu), sets), m * 3 * i * 2))
    sets = copies(lambda: (rnd(m, h), rnd(2 * i, h, scale=h ** -0.5)), 2 * i * h * 2)
    rows.append(("linear_silu_mul", f"M={m} I={i} K={h}",
                 bench_us(lambda x, w: torch.ops.qwen.linear_silu_mul(x, w), sets), "linear + silu_mul",
                 bench_us(lambda x, w: torch.ops.qwen.silu_mul(torch.ops.qwen.linear(x, w)), sets),
                 (2 * i * h + m * h + m * i) * 2))
    qkv_dim = (hq + 2 * hk) * d

    def rope_set():
        qkv = rnd(1, m, qkv_dim)
        return (qkv[..., : hq * d].view(1, m, hq, d), qkv[..., hq * d : (hq + hk) * d].view(1, m, hk, d),
                torch.arange(m, device="cuda")[None] + 7, rnd(d), rnd(d))
    sets = copies(rope_set, m * qkv_dim * 2)
    rope_bytes = 2 * m * (hq + hk) * d * 2
    rows.append(("rope+qk_norm", f"T={m} {hq}/{hk}x{d}",
                 bench_us(lambda q, k, p, wq, wk: torch.ops.qwen.rope(q, k, p, 1e6, d, wq, wk), sets), "eager",
                 bench_us(lambda q, k, p, wq, wk: qwen_ops.rope_reference(q, k, p, 1e6, d, wq, wk), sets), rope_bytes))


def bench_attention(rows, cfg, s):
    hq, hk, d = cfg["hq"], cfg["hk"], cfg["d"]
    sets = copies(lambda: (rnd(1, s, hq, d), rnd(1, s, hk, d), rnd(1, s, hk, d)), s * (hq + 2 * hk) * d * 2)
    ours = bench_us(lambda q, k, v: torch.ops.qwen.attention(q, k, v, d ** -0.5), sets)
    peer = bench_us(lambda q, k, v: F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True), sets)
    rows.append(("attention", f"S={s} {hq}/{hk}x{d} causal", ours, "SDPA", peer, s * (2 * hq + 2 * hk) * d * 2))


def bench_paged_decode(rows, cfg, cache_len, batch=1):
    """A decode step over the paged cache (blocks of 16; each sequence's cache_len positions in
    blocks of its own): paged_attention of one new token per sequence against SDPA over the same
    keys laid out [B, H, L, D], and the slot store of one token per sequence against index_put."""
    hq, hk, d = cfg["hq"], cfg["hk"], cfg["d"]
    cache_bytes = 2 * batch * cache_len * hk * d * 2
    blocks = cache_len // 16
    i32 = dict(dtype=torch.int32, device="cuda")
    cu, lens = torch.arange(batch + 1, **i32), torch.full((batch,), cache_len, **i32)
    table = torch.arange(batch * blocks, **i32).view(batch, blocks)

    def make():
        kc, vc = rnd(batch * blocks, 16, hk, d), rnd(batch * blocks, 16, hk, d)
        kt, vt = (c.view(batch, cache_len, hk, d).transpose(1, 2).contiguous() for c in (kc, vc))
        return rnd(batch, hq, d), kc, vc, kt, vt
    sets = copies(make, 2 * cache_bytes)
    ours = bench_us(lambda q, kc, vc, kt, vt: torch.ops.qwen.paged_attention(q, kc, vc, cu, lens, table, d ** -0.5, 1),
                    sets)
    peer = bench_us(lambda q, kc, vc, kt, vt: F.scaled_dot_product_attention(q[:, :, None], kt, vt, enable_gqa=True),
                    sets)
    rows.append(("paged_attention", f"decode B={batch} L={cache_len} {hq}/{hk}x{d}", ours, "SDPA [B,H,L,D]", peer,
                 cache_bytes))

    slots = (table[:, cache_len // 32] * 16 + cache_len // 2 % 16).long()  # each sequence's position cache_len // 2

    def store_set():
        return rnd(batch, hk, d), rnd(batch, hk, d), rnd(batch * blocks, 16, hk, d), rnd(batch * blocks, 16, hk, d)
    sets = copies(store_set, 64 << 20)[:8]
    rows.append(("kv_cache_store_slots", f"B={batch} {hk}x{d}",
                 bench_us(lambda k, v, kc, vc: torch.ops.qwen.kv_cache_store_slots(k, v, kc, vc, slots), sets),
                 "index_put",
                 bench_us(lambda k, v, kc, vc: (kc.flatten(0, 1).index_put_((slots.long(),), k),
                                                vc.flatten(0, 1).index_put_((slots.long(),), v)), sets),
                 4 * batch * hk * d * 2))


def sweep_splitk(cfgs, linears=None):
    """Time each decode GEMM (the projections in `linears`, default all) at every (block_n, block_k,
    split_k); return the best per shape."""
    best, table = {}, []
    shapes = sorted({nk for cfg in cfgs for name, nk in linear_cases(cfg).items() if linears is None or name in linears})
    for n, k in shapes:
        sets = copies(lambda: (rnd(1, k), rnd(n, k, scale=k ** -0.5)), n * k * 2)
        results = []
        for block_n in (32, 64, 128):
            for block_k in (64, 128, 256):
                for split in (1, 2, 4, 8, 16):
                    if split * block_k > k * 2:
                        continue
                    c = linear.DecodeConfig(block_n, block_k, split)
                    results.append((bench_us(lambda x, w: linear.linear(x, w, None, config=c), sets), c))
        no_split = min(r for r in results if r[1].split_k == 1)
        winner = min(results)
        peer = bench_us(lambda x, w: F.linear(x, w), sets)
        best[(n, k)] = winner[1]
        table.append((n, k, no_split[0], no_split[1], winner[0], winner[1], peer))
    return best, table


PREFILL_TILES = [  # (block_m, block_n, block_k, num_warps, num_stages) of the TMA GEMM
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (64, 256, 64, 8, 3),
    (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 64, 4, 5), (64, 64, 64, 4, 4), (128, 128, 128, 8, 2),
    (64, 64, 128, 4, 3), (64, 128, 128, 4, 3), (128, 64, 128, 4, 3),
    # narrow, deep tiles: at 256 tokens against N = 1024 they give a wave of programs without a K split
    (64, 32, 256, 4, 3), (64, 32, 256, 4, 4), (64, 32, 128, 4, 4), (64, 64, 256, 4, 2), (64, 128, 128, 4, 4),
    (64, 64, 64, 4, 8),
]


def sweep_prefill(cfgs, tokens=(256, 2048), linears=None):
    """Time each prefill GEMM (M in `tokens`; the projections in `linears`, default all) through the
    TMA kernel at every tile config and split; return the table lines (printed as they come) and the
    fastest eligible config per (M class, N, K)."""
    lines, best = Report(), {}

    lines.add("| M | N | K | cuBLAS (us) | strided GEMM (us) | TMA best (us) | best config | vs cuBLAS | runner-up |",
        "|---|---|---|---|---|---|---|---|---|")
    shapes = sorted({nk for cfg in cfgs for name, nk in linear_cases(cfg).items()
                     if linears is None or name in linears})
    sms = common.cuda_properties(torch.device("cuda")).multi_processor_count
    for n, k in shapes:
        for m in tokens:
            sets = copies(lambda: (rnd(m, k), rnd(n, k, scale=k ** -0.5)), n * k * 2)
            x0, w0 = sets[0]
            ref = F.linear(x0, w0)
            peer = bench_us(lambda x, w: F.linear(x, w), sets)
            strided = bench_us(lambda x, w: common.mm(x, w.t(), torch.empty(m, n, dtype=BF16, device="cuda"), splits=1,
                                                      blocks=linear.prefill_blocks(m, n, 2, common.target_programs(x0.device))),
                               sets)
            results, failed = [], []
            for tile in PREFILL_TILES:
                for split in (1, 2, 3, 4):
                    cfg = linear.PrefillConfig(*tile, split_k=split)
                    if split > 1 and (common.cdiv(m, tile[0]) * common.cdiv(n, tile[1]) >= sms or k < 512 * split):
                        continue
                    try:
                        err = rel_error(linear.linear(x0, w0, None, config=cfg), ref)
                        us = bench_us(lambda x, w: linear.linear(x, w, None, config=cfg), sets)
                    except Exception as e:  # out of shared memory: not a candidate
                        failed.append(f"{tuple(cfg)}: {type(e).__name__}")
                        continue
                    if err > 1e-2:
                        failed.append(f"{tuple(cfg)}: rel err {err:.1e}")
                        continue
                    results.append((us, cfg))
            if not results:
                lines.add(f"| {m} | {n} | {k} | {peer:.1f} | {strided:.1f} | no eligible config | | | |")
                continue
            results.sort()
            (us, cfg), runner = results[0], results[1] if len(results) > 1 else (float("nan"), None)
            best[(linear.prefill_m_class(m), n, k)] = cfg
            lines.add(f"| {m} | {n} | {k} | {peer:.1f} | {strided:.1f} | {us:.1f} | {tuple(cfg)} | {peer / us:.2f}x "
                f"| {runner[0]:.1f} {tuple(runner[1]) if runner[1] else ''} |")
            if failed:
                print("   not eligible:", "; ".join(failed), flush=True)
    return lines, best


ATTN_FWD_SHAPES = {  # name: (q heads, kv heads, head_dim); bf16, causal, batch 1
    "qwen3 16/8x128": (16, 8, 128),
    "qwen2.5-0.5b 14/2x64": (14, 2, 64),
    "qwen3.5 8/2x256": (8, 2, 256),
}
ATTN_FWD_TILES = {  # head_dim -> candidate Tiles(block_m, block_n, num_warps, num_stages); the default joins
    64: [Tiles(128, 128, 8, 3), Tiles(128, 64, 4, 4), Tiles(64, 64, 4, 3), Tiles(128, 128, 4, 3), Tiles(64, 128, 4, 3),
         Tiles(128, 32, 4, 3)],
    128: [Tiles(128, 128, 8, 3), Tiles(128, 64, 4, 3), Tiles(64, 64, 4, 3), Tiles(128, 64, 8, 4), Tiles(128, 128, 8, 2),
          Tiles(64, 128, 4, 3), Tiles(128, 32, 4, 4)],
    256: [Tiles(64, 64, 8, 2), Tiles(128, 32, 8, 2), Tiles(64, 32, 8, 2), Tiles(128, 64, 8, 2), Tiles(64, 64, 4, 2),
          Tiles(64, 64, 4, 3), Tiles(64, 32, 4, 4), Tiles(32, 64, 4, 3), Tiles(64, 16, 4, 3)],
}


def sweep_attn_fwd():
    """Time the attention forward at each candidate tile config; return the table lines (printed as
    they come) and, per head dim, the eligible tiles with the least time summed over its cases
    (tiles that failed or were not eligible in one case are out)."""
    lines, totals, out = Report(), {}, set()

    for name, (hq, hk, d) in ATTN_FWD_SHAPES.items():
        for s in (256, 2048):
            sets = copies(lambda: (rnd(1, s, hq, d), rnd(1, s, hk, d), rnd(1, s, hk, d)), s * (hq + 2 * hk) * d * 2)
            q, k, v = sets[0]
            ref = F.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)), is_causal=True,
                                                 enable_gqa=True).transpose(1, 2)
            flops = 2 * hq * s * s * d  # two causal matmuls: 2 * (2 * Hq * S^2 / 2 * D)
            lines.add(f"## attention forward: {name}, S={s}, bf16 causal", "",
                "| tiles (m, n, warps, stages) | us | TFLOPS | rel err |", "|---|---|---|---|")
            gpu = q.device  # the launcher's choice on this GPU: its table's tiles, else the rule's
            default = attention.forward_tiles(d, s, 2, common.shared_memory_per_block(gpu),
                                              common.tuned("attention_forward", gpu, BF16, (common.next_power_of_2(d),)))
            for t in dict.fromkeys([default] + ATTN_FWD_TILES[d]):
                label = f"{tuple(t)}{' default' if t == default else ''}"
                try:
                    err = rel_error(attention.attention(q, k, v, d ** -0.5, True, tiles=t), ref)
                    us = bench_us(lambda q, k, v: attention.attention(q, k, v, d ** -0.5, True, tiles=t), sets)
                except Exception as e:  # out of shared memory / registers: a row, not the end of the sweep
                    lines.add(_row(label, f"failed: {type(e).__name__}", "", ""))
                    out.add((d, t))
                    continue
                verdict = "" if err <= 1e-2 else " (not eligible)"
                if verdict:
                    out.add((d, t))
                totals.setdefault(d, {})[t] = totals.get(d, {}).get(t, 0.0) + us
                lines.add(_row(label, f"{us:.1f}", f"{flops / (us * 1e6):.0f}", f"{err:.1e}{verdict}"))
            for label, backend in (("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION), ("SDPA flash", SDPBackend.FLASH_ATTENTION)):
                def sdpa(q, k, v):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                              is_causal=True, enable_gqa=True)
                try:
                    us = bench_us(sdpa, sets)
                except RuntimeError:
                    lines.add(_row(label, "not available", "", ""))
                    continue
                err = rel_error(sdpa(q, k, v).transpose(1, 2), ref)
                lines.add(_row(label, f"{us:.1f}", f"{flops / (us * 1e6):.0f}", f"{err:.1e}"))
            lines.add("")
    best = {(d,): min((t for t in times if (d, t) not in out), key=times.get) for d, times in totals.items()
            if any((d, t) not in out for t in times)}
    return lines, best


ATTN_BWD_SHAPES = {  # name: (batch, seq, q heads, kv heads, head_dim); bf16, causal
    "qwen3 16/8x128": (4, 2048, 16, 8, 128),
    "qwen2.5-0.5b 14/2x64": (4, 2048, 14, 2, 64),
}
# Tiles(block_m, block_n, num_warps, num_stages) per kernel; dK/dV owns block_n keys and walks
# block_m queries, dQ the reverse. Pruned ahead of time with ptxas (sm_90, Triton 3.9): all build
# without register spills at head_dim 64 and 128, in under 227 KB of shared memory (most 4-warp
# dK/dV tiles with 128 keys and 4-warp 128x64 dQ tiles spill hundreds of bytes). The defaults
# of csrc_free_ops/attention.py's backward_blocks are timed as well.
ATTN_BWD_DKDV = [
    Tiles(32, 64, 8, 2), Tiles(32, 64, 8, 3), Tiles(32, 64, 8, 4), Tiles(16, 64, 8, 3), Tiles(32, 128, 8, 2),
    Tiles(16, 128, 8, 2), Tiles(16, 128, 8, 3), Tiles(64, 128, 8, 1), Tiles(64, 64, 8, 2), Tiles(64, 64, 4, 1),
    Tiles(32, 64, 4, 3), Tiles(32, 32, 4, 2),
]
ATTN_BWD_DQ = [
    Tiles(64, 64, 8, 2), Tiles(64, 64, 8, 3), Tiles(64, 64, 4, 2), Tiles(128, 32, 8, 2), Tiles(128, 32, 8, 3),
    Tiles(128, 32, 8, 4), Tiles(128, 64, 8, 2), Tiles(128, 64, 8, 3), Tiles(64, 32, 4, 3), Tiles(128, 16, 8, 3),
]


def rel_error(a, ref):
    """||a - ref|| / ||ref|| (Frobenius), in fp32."""
    return ((a.float() - ref.float()).norm() / ref.float().norm()).item()


TARGET_MODELS = {"qwen3-0.6b": SHAPES["qwen3-0.6b"],
                 "qwen3-8b": PREFILL_SHAPES["qwen3-8b"],
                 "qwen3.5-0.8b": PREFILL_SHAPES["qwen3.5-0.8b"]}
TARGET_HEADS = ((14, 2, 64), (16, 8, 128), (8, 2, 256))
"""--targets' attention heads (q / kv x head_dim): Qwen2.5-0.5B, Qwen3, Qwen3.5's gated attention."""
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}


def targets(copy_bw: float) -> dict:
    """The --targets summary (module doc) and its rows."""
    gemm, gemv, attn = [], [], []
    for model, cfg in TARGET_MODELS.items():
        for lname, (n, k) in linear_cases(cfg).items():
            for m in (1, 256, 2048):
                rows = []
                bench_linear(rows, f"{model} {lname}", m, n, k)
                _, _, ours, _, peer, _ = rows[0]
                row = dict(model=model, linear=lname, m=m, n=n, k=k, ours_us=ours, cublas_us=peer)
                if m == 1:
                    gemv.append(row | dict(bandwidth_share=n * k * 2 / copy_bw / (ours * 1e-6)))
                else:
                    gemm.append(row | dict(cublas_over_ours=peer / ours))
    for hq, hk, d in TARGET_HEADS:
        for s in (256, 2048):
            sets = copies(lambda: (rnd(1, s, hq, d), rnd(1, s, hk, d), rnd(1, s, hk, d)), s * (hq + 2 * hk) * d * 2)
            ours = bench_us(lambda q, k, v: torch.ops.qwen.attention(q, k, v, d ** -0.5), sets)
            peers = {}
            for label, backend in SDPA_BACKENDS.items():
                def sdpa(q, k, v, backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                              is_causal=True, enable_gqa=True)
                try:
                    peers[label] = bench_us(sdpa, sets)
                except RuntimeError as e:  # a backend that does not take this shape or GPU
                    print(f"SDPA {label} {hq}/{hk}x{d} S={s}: {str(e).splitlines()[0][:100]}", flush=True)
            best = min(peers, key=peers.get)
            attn.append(dict(heads=f"{hq}/{hk}x{d}", s=s, ours_us=ours, sdpa_us=peers, sdpa_best=best,
                             sdpa_over_ours=peers[best] / ours))
    ratios = sorted(r["cublas_over_ours"] for r in gemm)
    return dict(gemm_vs_cublas_median=statistics.median(ratios), gemm_vs_cublas_min=ratios[0],
                gemv_bandwidth_share_median=statistics.median(r["bandwidth_share"] for r in gemv),
                attn_vs_sdpa_min=min(r["sdpa_over_ours"] for r in attn), gemm=gemm, gemv=gemv, attention=attn)


def _row(*cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _sdpa_backward(backend, q, k, v, do, scale):
    """(ms, (dq, dk, dv), note) of SDPA's backward alone under `backend` (the forward runs once,
    untimed), or None if the backend cannot run it; kv heads are repeated for a backend without GQA."""
    for gqa in (True, False):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        qh, kh, vh = (t.transpose(1, 2) for t in leaves)
        if not gqa:
            kh, vh = (t.repeat_interleave(q.shape[2] // k.shape[2], dim=1) for t in (kh, vh))
        dout = do.transpose(1, 2)
        try:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
            grads = torch.autograd.grad(out, leaves, dout, retain_graph=True)
        except RuntimeError:
            continue
        ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True),
                                     return_mode="median")
        return ms, grads, "" if gqa else " (kv heads repeated)"
    return None


def sweep_attn_bwd():
    """Time every candidate tile config of the two attention-backward kernels; return the table
    lines (also printed as they come) and the fastest BwdBlocks per shape."""
    lines, best_blocks = Report(), {}

    for name, (b, s, hq, hk, d) in ATTN_BWD_SHAPES.items():
        q, k, v, do = rnd(b, s, hq, d), rnd(b, s, hk, d), rnd(b, s, hk, d), rnd(b, s, hq, d)
        scale = d ** -0.5
        leaves = [t.float().requires_grad_(True) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=True, scale=scale,
                                             enable_gqa=True)
        ref = torch.autograd.grad(out, leaves, do.float().transpose(1, 2))
        del leaves, out
        o, lse = attention.attention_with_lse(q, k, v, scale, True)
        delta = attention.bwd_delta(o, do)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        mm_flops = b * hq * s * s * d  # one causal matmul: 2 * B * Hq * (S^2 / 2) * D
        default = attention.backward_blocks(d, 2)
        lines.add(f"## attention backward tiles: {name}, B={b} S={s} bf16 causal", "",
            "| kernel | tiles (m, n, warps, stages) | regs | spill B | smem KB | ms | TFLOPS | rel err |",
            "|---|---|---|---|---|---|---|---|")
        best = {}
        for kernel, cands, run, n_mm, grads in (
                ("dkdv", ATTN_BWD_DKDV, attention.dkdv_backward, 4, (1, 2)),
                ("dq", ATTN_BWD_DQ, attention.dq_backward, 3, (0,))):
            for t in dict.fromkeys([getattr(default, kernel)] + cands):
                label = (kernel, f"{tuple(t)}{' default' if t == getattr(default, kernel) else ''}")
                outs = (dq,) if kernel == "dq" else (dk, dv)
                try:
                    handle = run(do, q, k, v, lse, delta, *outs, scale, True, t)
                    got = attention.attention_backward(do, q, k, v, o, lse, scale, True,
                                                                blocks=default._replace(**{kernel: t}))
                    ms = triton.testing.do_bench(lambda: run(do, q, k, v, lse, delta, *outs, scale, True, t),
                                                 return_mode="median")
                except Exception as e:  # out of shared memory / registers: a row, not the end of the sweep
                    lines.add(_row(*label, "", "", "", f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", "", ""))
                    continue
                err = " / ".join(f"d{'qkv'[i]} {rel_error(got[i], ref[i]):.1e}" for i in grads)
                tflops = n_mm * mm_flops / (ms * 1e9)
                lines.add(_row(*label, getattr(handle, "n_regs", "?"), getattr(handle, "n_spills", "?"),
                         f"{handle.metadata.shared / 1024:.0f}", f"{ms:.3f}", f"{tflops:.0f}", err))
                best[kernel] = min(best.get(kernel, (ms, t)), (ms, t))
        lines.add("", "| backward (preprocess + dK/dV + dQ) | ms | TFLOPS (5 matmuls) | rel err dq / dk / dv |",
            "|---|---|---|---|")
        fastest = BwdBlocks(best["dkdv"][1], best["dq"][1]) if len(best) == 2 else None
        best_blocks[name] = fastest
        candidates = [("ours, default " + str(tuple(map(tuple, default))), default)]
        if fastest is not None and fastest != default:
            candidates.append(("ours, fastest " + str(tuple(map(tuple, fastest))), fastest))
        for label, blocks in candidates:
            def ours():
                return attention.attention_backward(do, q, k, v, o, lse, scale, True, blocks=blocks)
            ms = triton.testing.do_bench(ours, return_mode="median")
            lines.add(_row(label, f"{ms:.3f}", f"{5 * mm_flops / (ms * 1e9):.0f}",
                     " / ".join(f"{rel_error(g, r):.1e}" for g, r in zip(ours(), ref))))
        for label, backend in (("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION), ("SDPA flash", SDPBackend.FLASH_ATTENTION)):
            res = _sdpa_backward(backend, q, k, v, do, scale)
            if res is None:
                lines.add(_row(label, "not available", "", ""))
                continue
            ms, g, note = res
            lines.add(_row(label + note, f"{ms:.3f}", f"{5 * mm_flops / (ms * 1e9):.0f}",
                     " / ".join(f"{rel_error(x, r):.1e}" for x, r in zip(g, ref))))
        lines.add("")
    return lines, best_blocks


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--sweep-splitk", action="store_true")
    ap.add_argument("--sweep-attn-bwd", action="store_true")
    ap.add_argument("--sweep-prefill", action="store_true")
    ap.add_argument("--sweep-attn-fwd", action="store_true")
    ap.add_argument("--targets", action="store_true", help="only the summary keys (module doc), as JSON")
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 2048], help="--sweep-prefill's M values")
    ap.add_argument("--shapes", nargs="+", choices=sorted(PREFILL_SHAPES), default=sorted(SHAPES),
                    help="--sweep-prefill's and --sweep-splitk's models")
    ap.add_argument("--linears", nargs="+", choices=("qkv", "o_proj", "gate_up", "down", "lm_head", "in_proj", "out_proj"),
                    default=None,
                    help="--sweep-prefill's and --sweep-splitk's projections (default: all)")
    args = ap.parse_args()
    require_cuda("bench.ops")
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()
    header = f"# bench/ops.py on {gpu}, {datetime.date.today()}, torch {torch.__version__}, triton {triton.__version__}"
    if args.sweep_prefill:
        print(header + ": --sweep-prefill\n", flush=True)
        lines, best = sweep_prefill([PREFILL_SHAPES[name] for name in args.shapes], args.tokens, args.linears)
        with open(os.path.join(args.out, "prefill_sweep.md"), "w") as f:
            f.write("\n".join([header + ": --sweep-prefill", ""] + lines) + "\n")
        print("recorded in", devices.record("linear_prefill", gpu, BF16, best))
        return
    if args.sweep_attn_fwd:
        print(header + ": --sweep-attn-fwd\n", flush=True)
        lines, best = sweep_attn_fwd()
        with open(os.path.join(args.out, "attn_fwd_sweep.md"), "w") as f:
            f.write("\n".join([header + ": --sweep-attn-fwd", ""] + lines) + "\n")
        print("recorded in", devices.record("attention_forward", gpu, BF16, best))
        return
    if args.sweep_attn_bwd:
        print(header + ": --sweep-attn-bwd\n", flush=True)
        lines, best = sweep_attn_bwd()
        with open(os.path.join(args.out, "attn_bwd_sweep.md"), "w") as f:
            f.write("\n".join([header + ": --sweep-attn-bwd", ""] + lines) + "\n")
        with open(os.path.join(args.out, "attn_bwd_configs.json"), "w") as f:
            json.dump({name: blocks and blocks._asdict() for name, blocks in best.items()}, f)
        print("fastest:", {name: blocks and tuple(map(tuple, blocks)) for name, blocks in best.items()})
        return
    copy_bw = copy_bandwidth()
    if args.targets:
        out = dict(gpu=gpu, date=datetime.date.today().isoformat(), torch=torch.__version__, triton=triton.__version__,
                   copy_bandwidth_tb_s=copy_bw / 1e12, **targets(copy_bw))
        path = os.path.join(args.out, f"{out['date']}-{gpu_slug(gpu)}-ops-targets.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print("\n".join(f"{k:28s} {v:.3f}" for k, v in out.items() if isinstance(v, float)) + f"\nwrote {path}")
        return
    lines = [header,
             f"device-to-device copy: {copy_bw / 1e12:.2f} TB/s (read + write)", ""]
    if args.sweep_splitk:
        best, table = sweep_splitk([PREFILL_SHAPES[name] for name in args.shapes], args.linears)
        lines += ["## decode GEMM (M=1): split-K sweep", "",
                  "| N | K | no split (us) | config | best (us) | best config | cuBLAS (us) | best %copy |",
                  "|---|---|---|---|---|---|---|---|"]
        for n, k, t1, c1, tb, cb, peer in table:
            pct = 100 * (n * k * 2 / (tb * 1e-6)) / copy_bw
            lines.append(f"| {n} | {k} | {t1:.1f} | {tuple(c1)[:2]} | {tb:.1f} | {tuple(cb)[:3]} | {peer:.1f} | {pct:.0f}% |")
        lines += ["", f"recorded in {devices.record('linear_decode', gpu, BF16, best)}", ""]
        with open(os.path.join(args.out, "splitk_sweep.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
        return
    rows = []
    for shape_name, cfg in SHAPES.items():
        for lname, (n, k) in linear_cases(cfg).items():
            for m in (1, 256, 2048):
                bench_linear(rows, f"{shape_name} {lname}", m, n, k)
        for m in (1, 256, 2048):
            bench_model_ops(rows, cfg, m)
        for s in (256, 2048):
            bench_attention(rows, cfg, s)
        for cache_len in (1024, 4096):
            bench_paged_decode(rows, cfg, cache_len)
    lines += ["## ops (bf16)", "", "| op | shape | ours (us) | peer | peer (us) | speedup | ours GB/s | %copy |",
              "|---|---|---|---|---|---|---|---|"]
    for name, shape, ours, peer_name, peer, nbytes in rows:
        bw = nbytes / (ours * 1e-6)
        lines.append(f"| {name} | {shape} | {ours:.1f} | {peer_name} | {peer:.1f} | {peer / ours:.2f}x | {bw / 1e9:.0f} | {100 * bw / copy_bw:.0f}% |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "ops.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
