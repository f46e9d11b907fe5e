"""Training-step benchmark on the GPU: transformers Qwen3 (Qwen3-0.6B shape, random init, bf16),
one forward + backward of the causal-LM loss on batch x seq tokens, in several setups:

    eager          transformers as is (sdpa attention)
    patch          + modeling.patch_transformers (our RMSNorm, q/k-norm+RoPE, attention, SwiGLU, fused LM-head loss)
    patch-no-plans the same with launch plans off (qwen_ops/plans.py: every op call runs its checks and launcher)
    liger          + Liger-Kernel's apply_liger_kernel_to_qwen3 (if liger_kernel imports)
    compile        transformers under torch.compile(fullgraph=True)
    patch+compile  our patch under torch.compile(fullgraph=True)

Each setup runs in its own subprocess (Liger patches transformers' classes, and peak memory
must not carry over). Reported: median step time over --steps timed steps after --warmup,
peak allocated memory, and the first step's loss (same seed and data: the setups should agree).

    python -m bench.train [--batch 4] [--seq 2048] [--steps 10] [--warmup 3] [--modes eager,patch,...]
                          [--profile 25]

--profile K adds one profiled step per setup after the timed ones and prints its K costliest GPU
kernels (torch.profiler, device-side events only) to stderr, to see where a setup spends its step.

Prints a markdown table (GPU name, date, versions); with $OUT (or --out) set, also writes
train_bench.md and train_bench.json there.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

from bench import require_cuda

MODES = ("eager", "patch", "patch-no-plans", "liger", "compile", "patch+compile")

QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, use_cache=False)


def run_one(mode: str, batch: int, seq: int, steps: int, warmup: int, layers: int | None, device: str = "cuda",
            profile: int = 0) -> dict:
    import torch

    cuda = device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()
    import transformers

    if mode == "liger":
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_qwen3
        except Exception as e:  # noqa: BLE001
            return {"mode": mode, "error": f"liger not available ({type(e).__name__}: {e})"}
        apply_liger_kernel_to_qwen3()  # class-level: before the model is built
    cfg_kw = dict(QWEN3_0_6B)
    if layers:
        cfg_kw["num_hidden_layers"] = layers
    cfg = transformers.Qwen3Config(**cfg_kw, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: the host CPU is slow
        model = transformers.Qwen3ForCausalLM(cfg)
    model = model.to(torch.bfloat16)
    model.train()
    if "patch" in mode:
        from modeling import patch_transformers

        patch_transformers(model)
    if mode == "patch-no-plans":
        from qwen_ops import plans

        plans.enabled = False

    def loss_fn(ids):
        return model(input_ids=ids, labels=ids).loss

    step_fn = torch.compile(loss_fn, fullgraph=True) if "compile" in mode else loss_fn
    g = torch.Generator(device=device).manual_seed(1)
    data = [torch.randint(0, cfg.vocab_size, (batch, seq), device=device, generator=g) for _ in range(warmup + steps)]
    times, first_loss = [], None
    sync()
    for i, ids in enumerate(data):
        if i == warmup:
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = step_fn(ids)
        loss.backward()
        model.zero_grad(set_to_none=True)
        sync()
        if i == 0:
            first_loss = loss.item()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    peak_gb = torch.cuda.max_memory_allocated() / 1e9 if cuda else float("nan")
    if profile and cuda:
        from bench.kernels import kernel_table

        def step():
            step_fn(data[-1]).backward()
            model.zero_grad(set_to_none=True)

        # GPU kernels only: the profiler's host-side ranges (aten::mm, our ops, Inductor's
        # per-launch ranges) repeat the CUDA time of the kernels they launch.
        table = kernel_table(step)
        print(f"--- {mode}: one step, {sum(n for n, _ in table.values())} kernel launches, "
              f"{sum(us for _, us in table.values()) / 1e3:.1f} ms of kernel time; the {profile} costliest ---",
              file=sys.stderr)
        for name, (n, us) in sorted(table.items(), key=lambda kv: -kv[1][1])[:profile]:
            print(f"{us / 1e3:9.3f} ms {n:5d}x  {name[:100]}", file=sys.stderr)
    return {"mode": mode, "ms": statistics.median(times), "ms_min": min(times), "peak_gb": peak_gb,
            "first_loss": first_loss, "tokens_per_s": batch * seq / (statistics.median(times) / 1e3)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=None, help="override the 28 layers (quick runs)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--device", default="cuda", help="cuda; cpu only to check the plumbing")
    p.add_argument("--profile", type=int, default=0, metavar="K", help="print the K costliest kernels of one step")
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print("RESULT " + json.dumps(run_one(a.child, a.batch, a.seq, a.steps, a.warmup, a.layers, a.device, a.profile)), flush=True)
        return
    if a.device.startswith("cuda"):
        require_cuda("bench.train", "--device cpu checks the plumbing")
    import torch
    import transformers
    import triton

    results = []
    for mode in a.modes.split(","):
        if mode not in MODES:
            sys.exit(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        cmd = [sys.executable, "-m", "bench.train", "--child", mode, "--batch", str(a.batch), "--seq", str(a.seq),
               "--steps", str(a.steps), "--warmup", str(a.warmup), "--device", a.device, "--profile", str(a.profile)]
        cmd += ["--layers", str(a.layers)] if a.layers else []
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            raised = [ln for ln in lines if ln and not ln[0].isspace() and "Error" in ln.split(":")[0]]
            tail = raised[-1:] or lines[-3:]  # the exception line, not CUDA's advice printed after it
            res = {"mode": mode, "error": f"exit {proc.returncode}: " + " | ".join(tail)[-400:]}
        else:
            res = json.loads(line[len("RESULT "):])
        if a.profile:
            print(proc.stderr[proc.stderr.find("--- "):], file=sys.stderr, flush=True)
        res["wall_s"] = round(time.time() - t0, 1)
        print(json.dumps(res), file=sys.stderr, flush=True)
        if "error" in res and mode == "liger" and "not available" in res["error"]:
            print("liger not available", flush=True)
        results.append(res)

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    layers = a.layers or QWEN3_0_6B["num_hidden_layers"]
    lines = [
        f"## Training step, transformers Qwen3-0.6B shape ({layers} layers), bf16, batch {a.batch} x seq {a.seq}",
        "",
        f"{gpu}, {datetime.date.today().isoformat()}; torch {torch.__version__}, triton {triton.__version__}, "
        f"transformers {transformers.__version__}. Forward + backward of the LM loss (no optimizer step); "
        f"median of {a.steps} steps after {a.warmup} warm-up steps; peak = max allocated over the timed steps.",
        "",
        "| setup | step (ms) | tokens/s | peak memory (GB) | first-step loss |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['error']} | | | |")
        else:
            lines.append(f"| {r['mode']} | {r['ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['peak_gb']:.1f} | {r['first_loss']:.4f} |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "train_bench.md"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(a.out, "train_bench.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
