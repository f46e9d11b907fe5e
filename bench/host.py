"""Host time of one op call, side by side with the native PyTorch op of the same kind.

    python -m bench.host [--calls 500] [--loops 9] [--rounds 3] [--out DIR]

Decode-sized inputs (Qwen3-0.6B shapes, bf16, batch 1), so the GPU finishes each kernel long
before the host issues the next: the wall time of a loop of calls, divided by the calls, is
the host cost per call (dispatcher, checks, launcher, Triton launch). Each cell is the best of
several short loops, since a shared host's noise comes in bursts: the loops of a row's columns
interleaved, so that drift reaches them alike, over --rounds passes of the whole table (the
first rows of a pass ran slower than later ones in early runs). Each row also times the
csrc_free_ops launcher alone (no dispatcher, no checks), and the op under torch.inference_mode()
(where PyTorch skips the Autograd key, so the op's Python autograd kernel does not run). The
peer: F.rms_norm, F.linear, F.scaled_dot_product_attention (same mode as "ours"); ops without a
native peer are compared with F.rms_norm. Prints a table; with --out writes host.json there.

"ours" calls the op as a user does: the same inputs every call, so after its first calls each
op replays its launch plan (qwen_ops/plans.py: no checks, no launcher Python). "no plan" is the
same call with plans switched off (`plans.enabled`, set around each call), the path every op call
took before plans. Where that time goes, from nested measurements: "triton" replays the Triton
launches that one launcher call makes, through the compiled kernels' C launchers with the
arguments already built (the floor for a Triton kernel started from Python: Triton's
`CudaLauncher.__call__` and the driver call); "launcher" adds our launcher's Python (output
allocation, sizes, the launch-cache key); "no plan" adds the dispatcher, the op's checks and its
Autograd kernel.
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F

from bench import require_cuda
import qwen_ops  # noqa: F401
from qwen_ops import plans
from csrc_free_ops import activation, launch, linear, norm, paged_attention, rope

ops = torch.ops.qwen


def per_call_us(fns, calls: int, loops: int) -> list:
    """The best per-call time of each function over `loops` timed loops, the functions' loops
    interleaved so that the host's drift (clocks, neighbours) reaches all of them alike."""
    for fn in fns:
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    best = [float("inf")] * len(fns)
    for _ in range(loops):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            best[i] = min(best[i], (time.perf_counter() - t0) / calls * 1e6)
    return best


def bare_launches(launcher_call):
    """A function that repeats the Triton launches of one `launcher_call` through the cached
    compiled kernels' C launchers alone, arguments prebuilt (the same tensors every time)."""
    recorded, original = [], launch.Kernel.launch

    def record(self, grid, args, meta):
        recorded.append((self, grid, args, meta))
        return original(self, grid, args, meta)

    launcher_call()  # compiled and cached before the recording
    launch.Kernel.launch = record
    try:
        launcher_call()
    finally:
        launch.Kernel.launch = original
    stream = torch.cuda.current_stream().cuda_stream
    calls = []
    for k, grid, args, meta in recorded:
        run, function, metadata, constexprs, _ = k.compiled[k._key(args, meta)]
        g0, g1, g2 = tuple(grid) + (1,) * (3 - len(grid))
        calls.append((run, g0, g1, g2, function, metadata, (*args, *constexprs)))

    def replay():
        for run, g0, g1, g2, function, metadata, args in calls:
            run(g0, g1, g2, stream, function, metadata, None, None, None, *args)
    return replay


def without_plans(op_call):
    """op_call with launch plans switched off around it."""
    def call():
        plans.enabled = False
        op_call()
        plans.enabled = True
    return call


def cases():
    dev, bf = "cuda", torch.bfloat16
    hidden, hq, hk, d, inter, cache_len = 1024, 16, 8, 128, 3072, 1024
    x = torch.randn(1, hidden, device=dev, dtype=bf)
    r = torch.randn(1, hidden, device=dev, dtype=bf)
    w = torch.randn(hidden, device=dev, dtype=bf)
    w_qkv = torch.randn((hq + 2 * hk) * d, hidden, device=dev, dtype=bf)
    gate_up = torch.randn(1, 2 * inter, device=dev, dtype=bf)
    q = torch.randn(1, 1, hq, d, device=dev, dtype=bf)
    k = torch.randn(1, 1, hk, d, device=dev, dtype=bf)
    v = torch.randn(1, 1, hk, d, device=dev, dtype=bf)
    qn, kn = torch.randn(d, device=dev, dtype=bf), torch.randn(d, device=dev, dtype=bf)
    pos = torch.tensor([[cache_len - 1]], device=dev)
    k_cache = torch.randn(cache_len // 16, 16, hk, d, device=dev, dtype=bf)  # paged: one sequence's blocks of 16
    v_cache = torch.randn_like(k_cache)
    table = torch.arange(cache_len // 16, dtype=torch.int32, device=dev)[None]
    slots = pos[0]  # the table is the identity: position p is slot p
    q1, k1, v1 = q[0], k[0], v[0]  # the paged ops' rows [N, H, D]
    cu = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    lens = torch.tensor([cache_len], dtype=torch.int32, device=dev)
    qs, ks, vs = q.transpose(1, 2), *(c.view(1, cache_len, hk, d).transpose(1, 2) for c in (k_cache, v_cache))
    rms_peer = ("F.rms_norm", lambda: F.rms_norm(x, (hidden,), w, 1e-6))
    return [
        ("rms_norm", lambda: ops.rms_norm(x, w, 1e-6), lambda: norm.rms_norm(x, w, 1e-6, 0.0), rms_peer),
        ("add_rms_norm", lambda: ops.add_rms_norm(x, r, w, 1e-6), lambda: norm.add_rms_norm(x, r, w, 1e-6, 0.0),
         rms_peer),
        ("linear M=1 4096x1024", lambda: ops.linear(x, w_qkv), lambda: linear.linear(x, w_qkv, None),
         ("F.linear", lambda: F.linear(x, w_qkv))),
        ("silu_mul", lambda: ops.silu_mul(gate_up), lambda: activation.silu_mul(gate_up), rms_peer),
        ("rope + qk norm", lambda: ops.rope(q, k, pos, 1e6, d, qn, kn),
         lambda: rope.rope(q, k, pos, 1e6, d, qn, kn, 1e-6, 0.0), rms_peer),
        ("kv_cache_store_slots", lambda: ops.kv_cache_store_slots(k1, v1, k_cache, v_cache, slots),
         lambda: paged_attention.kv_cache_store_slots(k1, v1, k_cache, v_cache, slots), rms_peer),
        ("paged_attention L=1024", lambda: ops.paged_attention(q1, k_cache, v_cache, cu, lens, table, d ** -0.5, 1),
         lambda: paged_attention.paged_attention(q1, k_cache, v_cache, cu, lens, table, d ** -0.5, 1),
         ("F.sdpa", lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True))),
    ]


def main():
    p = argparse.ArgumentParser(prog="python -m bench.host", description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=500, help="calls per timed loop")
    p.add_argument("--loops", type=int, default=9, help="timed loops per row; the fastest counts")
    p.add_argument("--rounds", type=int, default=3, help="passes over all rows; each cell keeps its best")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    require_cuda("bench.host")
    timings = {}  # op -> best (ours, no plan, launcher, triton, peer, ours inference_mode, peer inference_mode)
    for _ in range(a.rounds):
        for name, op_call, launcher_call, (peer_name, peer_call) in cases():
            t = per_call_us((op_call, without_plans(op_call), launcher_call, bare_launches(launcher_call), peer_call),
                            a.calls, a.loops)
            with torch.inference_mode():
                t += per_call_us((op_call, peer_call), a.calls, a.loops)
            timings[name] = (peer_name, [min(x, y) for x, y in zip(timings.get(name, (None, t))[1], t)])
    rows = []
    for name, (peer_name, (ours, no_plan, launcher, bare, peer, ours_inf, peer_inf)) in timings.items():
        rows.append(dict(op=name, ours_us=ours, no_plan_us=no_plan, launcher_us=launcher, triton_us=bare,
                         peer=peer_name, peer_us=peer,
                         ratio=ours / peer, ours_inference_us=ours_inf, peer_inference_us=peer_inf,
                         ratio_inference=ours_inf / peer_inf))
    print(f"{'op':26s} {'ours us':>8s} {'no plan':>8s} {'launcher':>9s} {'triton':>7s} {'peer':>12s} {'peer us':>8s}"
          f" {'ours/peer':>9s} {'inference_mode: ours':>21s} {'peer':>6s} {'ratio':>6s}")
    for r in rows:
        print(f"{r['op']:26s} {r['ours_us']:8.1f} {r['no_plan_us']:8.1f} {r['launcher_us']:9.1f} {r['triton_us']:7.1f} "
              f"{r['peer']:>12s} "
              f"{r['peer_us']:8.1f} {r['ratio']:9.2f} {r['ours_inference_us']:21.1f} {r['peer_inference_us']:6.1f} "
              f"{r['ratio_inference']:6.2f}")
    if a.out:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
        with open(f"{a.out}/host.json", "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
