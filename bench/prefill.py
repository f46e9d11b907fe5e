"""Prefill side by side on the GPU: ours eager, ours under torch.compile, and a plain PyTorch peer.

    python -m bench.prefill [--lengths 256 2048] [--reps 10] [--out DIR]

One forward of a prompt (batch 1, random Qwen3-0.6B-shaped weights, bf16) to every position's
logits (the model's forward without a cache, as training and scoring run it), wall time on the
host from the call to the logits on the device (synchronized), median over `--reps` after
warm-ups (compilation excluded):

- ours eager: `model(ids)`, one Python launch per op; "ours eager, no plans": the same with
  launch plans off (`qwen_ops.plans.enabled`, set around each call), every op call running its
  checks and launcher (qwen_ops/plans.py replays them after an op's first calls);
- ours compiled: `torch.compile(model, fullgraph=True)` (Inductor; our ops are traced into their
  Triton kernels, see qwen_ops/registry.py);
- torch eager / compiled: the same architecture in plain PyTorch (`F.linear`, `F.rms_norm`,
  rotate-half RoPE, `F.scaled_dot_product_attention(is_causal=True)`), reading our weights.

Then the kernel time of one forward per row (profiler, summed over kernels) and, per length, the
kernels of ours eager that take the most time. Prints markdown; with --out writes
<date>-<gpu>-prefill.md there.
"""
import argparse
import datetime
import os
import statistics
import time

import torch
import torch.nn.functional as F

from bench import gpu_slug, require_cuda
from bench.kernels import kernel_table
from modeling import QwenConfig
from modeling.model.random_checkpoint import QWEN3_0_6B, random_model
from qwen_ops import plans


def torch_prefill(model, ids):
    """The plain-PyTorch prefill of ids [B, T] -> logits [B, T, V] (no cache kept)."""
    c = model.config
    b, t = ids.shape
    hq, hk, d, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, d, 2, device=ids.device) / d)
    angle = torch.arange(t, device=ids.device)[:, None].float() * inv_freq  # [T, D/2]
    cos, sin = angle.cos(), angle.sin()

    def rope(x):  # [B, H, T, D]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    x = F.embedding(ids, model.embed_tokens)
    for layer in model.layers:
        h = F.rms_norm(x, (c.hidden_size,), layer.input_norm, eps)
        q, k, v = F.linear(h, layer.qkv_weight).split([hq * d, hk * d, hk * d], dim=-1)
        q = rope(F.rms_norm(q.view(b, t, hq, d), (d,), layer.q_norm, eps).transpose(1, 2))
        k = rope(F.rms_norm(k.view(b, t, hk, d), (d,), layer.k_norm, eps).transpose(1, 2))
        o = F.scaled_dot_product_attention(q, k, v.view(b, t, hk, d).transpose(1, 2), is_causal=True,
                                           enable_gqa=True)
        x = x + F.linear(o.transpose(1, 2).reshape(b, t, hq * d), layer.o_weight)
        gate, up = F.linear(F.rms_norm(x, (c.hidden_size,), layer.post_norm, eps), layer.gate_up_weight).chunk(2, -1)
        x = x + F.linear(F.silu(gate) * up, layer.down_weight)
    return F.linear(F.rms_norm(x, (c.hidden_size,), model.norm, eps), model.embed_tokens)


def wall_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def without_plans(model, ids):
    """model(ids) with launch plans off."""
    plans.enabled = False
    try:
        return model(ids)
    finally:
        plans.enabled = True


def main():
    p = argparse.ArgumentParser(prog="python -m bench.prefill", description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    require_cuda("bench.prefill")
    config = QwenConfig.from_dict(QWEN3_0_6B)
    model = random_model(config, dtype=torch.bfloat16, device="cuda", std=0.02)
    compiled_model = torch.compile(model, fullgraph=True)
    compiled_torch = torch.compile(torch_prefill, fullgraph=True)
    rows, notes = [], []
    with torch.inference_mode():
        for t in a.lengths:
            ids = torch.randint(0, config.vocab_size, (1, t), device="cuda")
            runs = {
                "ours eager": lambda: model(ids),
                "ours eager, no plans": lambda: without_plans(model, ids),
                "ours torch.compile": lambda: compiled_model(ids),
                "torch eager": lambda: torch_prefill(model, ids),
                "torch torch.compile": lambda: compiled_torch(model, ids),
            }
            ref = runs["torch eager"]().float()
            for name, fn in runs.items():
                err = (fn().float() - ref).abs().max().item()
                kernels = kernel_table(fn)
                kernel_ms = sum(us for _, us in kernels.values()) / 1e3
                rows.append((t, name, wall_ms(fn, a.reps), kernel_ms, sum(n for n, _ in kernels.values()), err))
                print(f"{t} tokens, {name}: {rows[-1][2]:.3f} ms wall, {kernel_ms:.3f} ms in "
                      f"{rows[-1][4]} kernels, max |logit - torch eager| {err:.3f}", flush=True)
                if name == "ours eager":
                    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:8]
                    notes += [f"Ours eager, {t} tokens, top kernels: " + ", ".join(
                        f"`{k[:40]}` {n}x {us / 1e3:.3f} ms" for k, (n, us) in top)]
    lines = [f"# Prefill, Qwen3-0.6B shape, bf16, batch 1 ({torch.cuda.get_device_name()}, "
             f"{datetime.date.today()}, torch {torch.__version__})", "",
             "Command: `python -m bench.prefill " + " ".join(f"--lengths {' '.join(map(str, a.lengths))}".split())
             + f" --reps {a.reps}`", "",
             "| tokens | path | wall ms | kernel ms | kernels | max abs logit diff vs torch eager |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {t} | {name} | {w:.3f} | {k:.3f} | {n} | {e:.3f} |" for t, name, w, k, n, e in rows]
    lines += [""] + notes
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        gpu = gpu_slug(torch.cuda.get_device_name())
        with open(os.path.join(a.out, f"{datetime.date.today()}-{gpu}-prefill.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
