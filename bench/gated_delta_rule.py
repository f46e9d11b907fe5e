"""Gated DeltaNet benchmark on the GPU: our chunked prefill op beside flash-linear-attention's,
and the recurrent decode step inside a CUDA graph.

    python -m bench.gated_delta_rule [--out DIR] [--tokens 2048 8192] [--varlen 8 256] [--decode-steps 32]
                                     [--kernels]

Shape: Qwen3.5-0.8B's linear-attention layer, B=1, H=16 key = value heads, Dk=Dv=128, bf16
q/k/v and beta, fp32 g (from random gate projections through g = -exp(A_log) softplus(a + dt_bias)),
l2-normalised q and k in the kernel, scale Dk^-0.5, zero initial state.

- chunk: `torch.ops.qwen.chunk_gated_delta_rule` on fixed lengths and, if `fla` imports,
  `fla.ops.gated_delta_rule.chunk_gated_delta_rule`, each timed as a CUDA graph replay
  (triton's do_bench_cudagraph, median), with the relative error ||x - ref|| / ||ref|| of the
  output and of the final state against a float64 token-by-token recurrence.
- chunk varlen: `torch.ops.qwen.chunk_gated_delta_rule` with `cu_seqlens` over `--varlen S L` packed
  sequences of L tokens each (default 8 x 256, the engine's prefill of 8 prompts; `--varlen 0 0`
  skips it), each from a zero state, and FLA's `chunk_gated_delta_rule` with `cu_seqlens`; errors
  against the fp64 recurrence of each sequence (states: all S final states).
- `--kernels`: the device time of each kernel of one call of our chunk ops (torch.profiler, mean
  of 20 eager calls): the three chunk kernels `_wy_kernel`, `_state_kernel`, `_output_kernel`.
- conv: the layer's short convolution (`torch.ops.qwen.causal_conv1d` with `cu_seqlens`, SiLU
  fused) at Qwen3.5-0.8B's width, CONV_DIM channels of a CONV_PROJ-wide projection read through a
  strided view as the model does, over the `--varlen` sequences and over each `--tokens` length
  as one sequence, fresh states; beside transformers' PyTorch path on the same values (a
  depthwise `F.conv1d` over [B, C, T], then SiLU); errors of y and of the final states against
  float64.
- decode: `torch.ops.qwen.recurrent_gated_delta_rule_varlen` (one sequence of one token continuing
  its state slot, gates fused) captured in a CUDA graph; `--decode-steps` consecutive steps
  continue from the fp64 prefill state with fresh tokens copied into the graph's static inputs;
  errors against the fp64 recurrence over those steps, time of one replay (median).
  FLA's fused_recurrent_gated_delta_rule beside it when it imports (gates computed outside, as
  FLA takes g and beta).

Prints a markdown table (and writes it to DIR/gated_delta_rule.md with --out).
"""
import argparse
import datetime
import os

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

from bench import require_cuda
from bench.kernels import kernel_table
import qwen_ops  # noqa: F401
from qwen_ops.gated_delta_rule import gated_delta_gates_reference

B, H, D = 1, 16, 128
BF16 = torch.bfloat16
CONV_DIM, CONV_PROJ, CONV_K = 2 * H * D + H * D, 8224, 4
"""The conv's channels (q, k and v of every head), the width of the in_proj output they are a
view of (q, k, v, z, then b and a), and its taps (Qwen3.5-0.8B)."""


def rel_error(a, ref):
    """||a - ref|| / ||ref|| (Frobenius), in float64."""
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def make_inputs(t, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    x = dict(q=r(B, t, H, D).to(BF16), k=r(B, t, H, D).to(BF16), v=r(B, t, H, D).to(BF16),
             a=r(B, t, H).to(BF16), b=r(B, t, H).to(BF16))
    x["A_log"] = torch.empty(H, device="cuda").uniform_(0.01, 16.0, generator=g).log()  # transformers' init range
    x["dt_bias"] = r(H) * 0.5
    x["g"], x["beta"] = gated_delta_gates_reference(x["a"], x["b"], x["A_log"], x["dt_bias"])
    return x


def recurrence_fp64(x, state=None):
    """Token-by-token gated delta rule in float64 on the GPU (scale D^-0.5) -> (o [B, T, H, D], state)."""
    scale = D ** -0.5
    q, k, v, g, beta = (x[n].double() for n in ("q", "k", "v", "g", "beta"))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * scale
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    s = torch.zeros(B, H, D, D, dtype=torch.float64, device="cuda") if state is None else state.double().clone()
    out = torch.empty(v.shape, dtype=torch.float64, device="cuda")
    for i in range(q.shape[1]):
        s.mul_(g[:, i].exp()[..., None, None])
        delta = (v[:, i] - torch.einsum("bhk,bhkv->bhv", k[:, i], s)) * beta[:, i, :, None]
        s.add_(k[:, i, :, :, None] * delta[:, :, None, :])
        out[:, i] = torch.einsum("bhk,bhkv->bhv", q[:, i], s)
    return out, s


def fla_ops():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as e:  # noqa: BLE001  (not installed, or an incompatible build)
        print(f"flash-linear-attention not available: {type(e).__name__}: {e}")
        return None, None


def bench_ms(fn):
    fn()
    torch.cuda.synchronize()
    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as e:  # noqa: BLE001  (a peer that cannot be captured: time it eagerly)
        print(f"  (not capturable, timed eagerly: {type(e).__name__})")
        return do_bench(fn, rep=100, return_mode="median")


def bench_chunk(rows, t, fla_chunk, kernels):
    x = make_inputs(t)
    ref_o, ref_s = recurrence_fp64(x)
    scale = D ** -0.5
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], scale, None, None, None, None, True)
    s = torch.zeros(ref_s.shape, dtype=torch.float32, device="cuda")  # the final state, written in place
    o = torch.ops.qwen.chunk_gated_delta_rule(*args[:6], s, *args[7:])
    ms = bench_ms(lambda: torch.ops.qwen.chunk_gated_delta_rule(*args))
    rows.append(("chunk", "qwen (ours)", t, ms, t / ms / 1e3, rel_error(o, ref_o), rel_error(s, ref_s)))
    if kernels:
        print_kernels(f"chunk {t} tokens (ours)", lambda: torch.ops.qwen.chunk_gated_delta_rule(*args))
    if fla_chunk is not None:
        call = lambda: fla_chunk(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], scale=scale,  # noqa: E731
                                 initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
        o, s = call()
        ms = bench_ms(call)
        rows.append(("chunk", "fla", t, ms, t / ms / 1e3, rel_error(o, ref_o), rel_error(s, ref_s)))
    return x, ref_s


def print_kernels(title: str, fn) -> None:
    table = {name: us for name, (_, us) in kernel_table(fn, calls=20).items()}
    print(f"{title}: {sum(table.values()):.1f} us of kernel time per call")
    for name, us in sorted(table.items(), key=lambda kv: -kv[1]):
        print(f"  {name[:60]:60s} {us:9.1f} us")


def bench_chunk_varlen(rows, seqs, length, fla_chunk, kernels):
    """`seqs` packed sequences of `length` tokens, each from a zero state (continues = False)."""
    t = seqs * length
    x = make_inputs(t, seed=2)
    refs = [recurrence_fp64({n: x[n][:, i * length:(i + 1) * length] for n in ("q", "k", "v", "g", "beta")})
            for i in range(seqs)]
    ref_o = torch.cat([o for o, _ in refs], 1)[0]
    ref_s = torch.cat([s for _, s in refs], 0)
    scale = D ** -0.5
    cu = torch.arange(0, t + 1, length, dtype=torch.int32, device="cuda")
    pool = torch.zeros(seqs, H, D, D, device="cuda")
    slots = torch.arange(seqs, device="cuda")
    cont = torch.zeros(seqs, dtype=torch.bool, device="cuda")
    flat = [x[n][0] for n in ("q", "k", "v", "g", "beta")]

    def ours():
        return torch.ops.qwen.chunk_gated_delta_rule(*flat, scale, pool, cu, slots, cont, True)

    o = ours()
    err = (rel_error(o, ref_o), rel_error(pool, ref_s))
    what = f"chunk varlen {seqs}x{length}"
    ms = bench_ms(ours)
    rows.append((what, "qwen (ours)", t, ms, t / ms / 1e3, *err))
    if kernels:
        print_kernels(f"{what} (ours)", ours)
    if fla_chunk is not None:
        cu64 = cu.long()
        call = lambda: fla_chunk(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], scale=scale,  # noqa: E731
                                 initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                 cu_seqlens=cu64)
        o, s = call()
        ms = bench_ms(call)
        rows.append((what, "fla", t, ms, t / ms / 1e3, rel_error(o[0], ref_o), rel_error(s, ref_s)))


def bench_conv(rows, seqs, length, device="cuda"):
    """`seqs` packed sequences of `length` tokens through the layer's short convolution, fresh states."""
    t = seqs * length
    g = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(t, CONV_PROJ, generator=g, device=device).to(BF16)[:, :CONV_DIM]
    w = (torch.randn(CONV_DIM, CONV_K, generator=g, device=device) * 0.5).to(BF16)
    pool = torch.zeros(seqs, CONV_DIM, CONV_K - 1, dtype=BF16, device=device)
    cu = torch.arange(0, t + 1, length, dtype=torch.int32, device=device)
    slots = torch.arange(seqs, device=device)
    cont = torch.zeros(seqs, dtype=torch.bool, device=device)
    per_seq = x.double().reshape(seqs, length, CONV_DIM).transpose(1, 2)  # [S, C, L]
    ref = F.silu(F.conv1d(F.pad(per_seq, (CONV_K - 1, 0)), w.double()[:, None, :], groups=CONV_DIM))
    ref_state = F.pad(per_seq, (CONV_K - 1, 0))[..., -(CONV_K - 1):]

    def ours():
        return torch.ops.qwen.causal_conv1d(x, w, pool, cu, slots, cont)

    def torch_path():  # transformers' Qwen3.5 fallback: [B, C, T], padded by K - 1, cut to T
        xt = x.reshape(seqs, length, CONV_DIM).transpose(1, 2)
        return F.silu(F.conv1d(xt, w[:, None, :], padding=CONV_K - 1, groups=CONV_DIM)[..., :length])

    what = f"conv varlen {seqs}x{length}" if seqs > 1 else "conv"
    y = ours()
    err = (rel_error(y.reshape(seqs, length, CONV_DIM).transpose(1, 2), ref), rel_error(pool, ref_state))
    ms = bench_ms(ours)
    rows.append((what, "qwen (ours)", t, ms, t / ms / 1e3, *err))
    y = torch_path()
    ms = bench_ms(torch_path)
    rows.append((what, "torch F.conv1d", t, ms, t / ms / 1e3, rel_error(y, ref), float("nan")))


def bench_decode(rows, prefill_state, steps, fla_recurrent):
    """`steps` decode tokens from the prefill's fp64 state, each one a replay of a captured step."""
    x = make_inputs(steps, seed=1)
    scale = D ** -0.5
    ref_o, ref_s = recurrence_fp64(x, prefill_state)
    static = {n: x[n][0, :1].clone() for n in ("q", "k", "v", "a", "b")}  # one packed token: [1, H, ...]
    state = prefill_state.float().clone()  # the state pool: one slot
    cu = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    slots, cont = torch.zeros(1, dtype=torch.long, device="cuda"), torch.ones(1, dtype=torch.bool, device="cuda")

    def step():
        return torch.ops.qwen.recurrent_gated_delta_rule_varlen(static["q"], static["k"], static["v"], static["a"],
                                                                static["b"], x["A_log"], x["dt_bias"], state, cu,
                                                                slots, cont, scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    state.copy_(prefill_state.float())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    outs = []
    for i in range(steps):
        for n, buf in static.items():
            buf.copy_(x[n][0, i:i + 1])
        graph.replay()
        outs.append(out.clone())
    o = torch.cat(outs)[None]
    err_o, err_s = rel_error(o, ref_o), rel_error(state, ref_s)
    ms = do_bench(graph.replay, rep=100, return_mode="median")  # the state keeps evolving: it stays bounded
    rows.append(("decode step (graph)", "qwen (ours)", 1, ms, None, err_o, err_s))
    if fla_recurrent is not None:
        st = prefill_state.float().clone()
        outs = []
        for i in range(steps):
            sl = slice(i, i + 1)
            o_i, st = fla_recurrent(x["q"][:, sl], x["k"][:, sl], x["v"][:, sl], g=x["g"][:, sl], beta=x["beta"][:, sl],
                                    scale=scale, initial_state=st, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True)
            outs.append(o_i)
        err = (rel_error(torch.cat(outs, 1), ref_o), rel_error(st, ref_s))
        st0 = prefill_state.float().clone()
        sl = slice(0, 1)
        call = lambda: fla_recurrent(x["q"][:, sl], x["k"][:, sl], x["v"][:, sl], g=x["g"][:, sl],  # noqa: E731
                                     beta=x["beta"][:, sl], scale=scale, initial_state=st0, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True)
        rows.append(("decode step (graph)", "fla fused_recurrent", 1, bench_ms(call), None, *err))


def table(rows):
    lines = ["| op | impl | tokens | ms | Mtok/s | rel err o | rel err state |", "|---|---|---|---|---|---|---|"]
    for op, impl, t, ms, tput, eo, es in rows:
        lines.append(f"| {op} | {impl} | {t} | {ms:.4f} | {'' if tput is None else f'{tput:.2f}'} | "
                     f"{eo:.2e} | {es:.2e} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--varlen", type=int, nargs=2, default=[8, 256], metavar=("S", "L"),
                   help="packed sequences and tokens per sequence of the varlen row (0 0: none)")
    p.add_argument("--decode-steps", type=int, default=32, help="decode steps of the recurrent row (0: none)")
    p.add_argument("--kernels", action="store_true", help="print each chunk kernel's device time (profiler)")
    args = p.parse_args()
    require_cuda("bench.gated_delta_rule")
    torch.backends.cuda.matmul.allow_tf32 = False
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    fla_chunk, fla_recurrent = fla_ops()
    rows, prefill_state = [], None
    for t in args.tokens:
        _, s = bench_chunk(rows, t, fla_chunk, args.kernels)
        prefill_state = prefill_state if prefill_state is not None else s
    if args.varlen[0] * args.varlen[1] > 0:
        bench_chunk_varlen(rows, *args.varlen, fla_chunk, args.kernels)
        bench_conv(rows, *args.varlen)
    for t in args.tokens:
        bench_conv(rows, 1, t)
    if args.decode_steps > 0:
        bench_decode(rows, prefill_state, args.decode_steps, fla_recurrent)
    text = (f"# Gated DeltaNet, {torch.cuda.get_device_name()}, {datetime.date.today()}\n\n"
            f"B={B}, H={H}, Dk=Dv={D}, bf16 q/k/v, l2norm in kernel; errors against an fp64 recurrence.\n"
            f"decode: {args.decode_steps} graph replays from the {args.tokens[0]}-token prefill state; "
            f"chunk ms: CUDA graph replay (median); decode ms: one graph replay of the step.\n\n" + table(rows))
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gated_delta_rule.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
