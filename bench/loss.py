"""Fused lm_head + cross-entropy on the GPU: time and memory of forward + backward, ours beside
torch (cuBLAS logits + F.cross_entropy) and Liger-Kernel's fused loss (if it imports).

    python -m bench.loss [--tokens 8192] [--hidden 1024] [--vocab 151936]

Per setup: median forward + backward time (triton.testing.do_bench), the GEMM rate over the three
N x V x H products a loss needs (forward, dhidden, dweight; ours computes a fourth), the memory
the call adds on top of its inputs (peak allocated minus allocated before), and the relative
error of loss and gradients against an fp32 torch reference.
"""
import argparse
import datetime
import os

import torch
import torch.nn.functional as F
import triton

import qwen_ops
from bench import require_cuda
from bench.ops import rel_error


def _torch_loss(h, w, t):
    return F.cross_entropy((h @ w.t()).float(), t)


def _setups():
    setups = {"qwen (ours)": qwen_ops.linear_cross_entropy, "torch (cuBLAS + F.cross_entropy)": _torch_loss}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss()
        setups["Liger fused"] = lambda h, w, t: liger(w, h, t)
    except ImportError:
        pass
    return setups


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args()
    require_cuda("bench.loss")
    n, hd, v = a.tokens, a.hidden, a.vocab
    torch.manual_seed(0)
    h = (torch.randn(n, hd, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(v, hd, device="cuda") * hd ** -0.5).to(torch.bfloat16).requires_grad_(True)
    t = torch.randint(0, v, (n,), device="cuda")
    t[::7] = -100
    hf, wf = h.detach().float().requires_grad_(True), w.detach().float().requires_grad_(True)
    ref_loss = _torch_loss(hf, wf, t)
    ref_loss.backward()
    flops = 3 * 2 * n * hd * v
    lines = [f"## Fused lm_head + cross-entropy, forward + backward, bf16, N={n} H={hd} V={v}", "",
             f"{torch.cuda.get_device_name()}, {datetime.date.today().isoformat()}, torch {torch.__version__}, "
             f"triton {triton.__version__}. Rate = 3 x 2NHV flops / time.", "",
             "| setup | ms | TFLOP/s (3 GEMMs) | extra memory (GB) | loss err | dh err | dW err |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, fn in _setups().items():
        def step():
            h.grad = w.grad = None
            fn(h, w, t).backward()
        try:
            h.grad = w.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            loss = fn(h, w, t)
            loss.backward()
            torch.cuda.synchronize()
            extra = (torch.cuda.max_memory_allocated() - before) / 1e9
            errs = rel_error(loss, ref_loss), rel_error(h.grad, hf.grad), rel_error(w.grad, wf.grad)
            ms = triton.testing.do_bench(step, warmup=100, rep=500, return_mode="median")
            lines.append(f"| {name} | {ms:.2f} | {flops / ms / 1e9:.0f} | {extra:.2f} | "
                         + " | ".join(f"{e:.1e}" for e in errs) + " |")
        except Exception as e:  # noqa: BLE001 - report and go on with the other setups
            lines.append(f"| {name} | error: {type(e).__name__}: {str(e)[:120]} | | | | | |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "loss_bench.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
