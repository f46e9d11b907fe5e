"""Decode speed side by side, one process on the GPU: ours, plain PyTorch peers and the floor.

    python -m bench.decode [--out DIR] [--all]        # on the GPU: measure, write decode JSON
    python -m bench.decode --render FILE.json         # anywhere: docs/performance.md section + plot
    python -m bench.decode --tp N [--checkpoints DIR] # N GPUs: Qwen3-8B batch 1 at TP 1 and N (decode-tp JSON)

Rows (random weights, bf16, greedy, ms per decode step; one step decodes the whole batch):

- ours: the engine's decode-only steps (``modeling.engine.Engine``: what ``LLM``, the command
  line and the server run), ``batch`` prompts of ``context`` tokens prefilled, then ``--steps``
  decode steps timed from their first token on (CUDA graphs captured, lookahead on, every token
  read back on the host); with the decode kernels the step runner picks (``ours``:
  ``modeling.engine.runner.decode_kernels``' table, which these rows choose) and each forced
  (``ours, persistent kernel`` / ``fused ops`` / ``op by op``: ``Engine(decode_kernels=...)``),
  batch 1 at context 256 and 2048, batch 8 at context 256; Qwen3.5's likewise (its hybrid
  persistent kernel, ``decode_hybrid_layers``) at batch 1 and 8, context 256; with ``--all``
  Qwen3-1.7B's persistent kernel and fused ops at batch 1;
- ours, eager: the same steps without CUDA graphs (one Python launch per op);
- ours, weights after the PDL wait: the fused step with ``fused_decode.PREFETCH`` off (each
  program of a fused GEMV streams its weights only after the previous kernel has finished);
- torch eager / torch.compile: a plain PyTorch model of the same architecture (bf16 ``F.linear``,
  ``F.rms_norm``, rotate-half RoPE, SDPA over a static KV cache of exactly context + steps
  positions so masked attention over unused slots costs little), gpt-fast style, compiled with
  mode="reduce-overhead" (``--max-autotune`` for max-autotune, which compiles for minutes);
- transformers, static cache (when importable): ``generate(cache_implementation="static")``,
  the per-token time from two runs of different lengths;
- the floor: the model's weight bytes / the device-to-device copy bandwidth measured here.

JSON keys for the headline numbers: ``ours_b1_ms_per_token`` (Qwen3-0.6B, batch 1, context 256),
``ours_b8_ms_per_step``, ``qwen3_5_b1_ms_per_token`` (Qwen3.5-0.8B, batch 1, context 256),
``floor_ms``, ``qwen3_5_floor_ms``, ``kernels_per_token`` and ``qwen3_5_kernels_per_token`` (the
default decode step's kernels, from the profiler); the larger shapes (``LARGE``) at batch 1,
context 256, the default path, then the persistent kernel and the fused ops forced: ``qwen3_8b_b1_ms_per_token``,
``qwen3_8b_floor_ms``, ``qwen3_5_9b_b1_ms_per_token``, ``qwen3_5_9b_floor_ms``. The floor counts an
untied embedding as the one row a token reads.

Shapes: Qwen3-0.6B (all rows) and Qwen3.5-0.8B; with ``--all`` also the seed's shape (hidden 896,
8/2 heads of 128, intermediate 4864, 24 layers) and Qwen3-1.7B (28 layers, hidden 2048, 16/8
heads of 128, intermediate 6144, tied), ours, torch.compile and the floor at batch 1, context 256.
"""
import argparse
import contextlib
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import gpu_slug, require_cuda

SHAPES = {
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=40960),
    "seed": dict(model_type="qwen3", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                 num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                 tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=40960),
    "qwen3-1.7b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=40960),
}
LARGE = {
    "qwen3-8b": dict(SHAPES["qwen3-0.6b"], hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3.5-9b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=4096, intermediate_size=12288,
                       num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                       linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                       tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=262144,
                       rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25)),
}
"""The larger shapes people run on one GPU, batch 1 against their floors: Qwen3-8B (36 layers,
hidden 4096, 32 / 8 heads of 128, intermediate 12288, untied) and Qwen3.5-9B (32 layers: 8 x (3
Gated DeltaNet with 16 key / 32 value heads of 128, 1 gated attention with 16 / 4 heads of 256),
hidden 4096, intermediate 12288, untied)."""
OURS = "ours"
KERNEL_ROWS = {"persistent": "persistent kernel", "fused": "fused ops", "ops": "op by op"}
AFTER_WAIT = "ours, fused ops, weights after the PDL wait"
MARK_BEGIN, MARK_END = "<!-- bench.decode:begin -->", "<!-- bench.decode:end -->"


class TorchDecoder(torch.nn.Module):
    """The same decoder in plain PyTorch (bf16 native ops), reading our model's weights, with a
    static KV cache [layers, B, L, Hk, D]; `forward` is one greedy decode step."""

    def __init__(self, model, batch: int, max_len: int):
        super().__init__()
        c = self.c = model.config
        self.m = model
        assert c.rotary_dim == c.head_dim and c.qk_norm, "the peer covers the qwen3 shapes benchmarked here"
        shape = (c.num_hidden_layers, batch, c.num_key_value_heads, max_len, c.head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=model.dtype, device=model.device))
        self.register_buffer("v", torch.zeros(shape, dtype=model.dtype, device=model.device))
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.rotary_dim, 2, device=model.device) / c.rotary_dim)
        self.register_buffer("inv_freq", inv_freq.float())

    def rope(self, x, pos):
        angle = pos[:, None, None].float() * self.inv_freq  # [B, 1, 1, R/2]
        cos, sin = angle.cos(), angle.sin()
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(self, tokens, pos):
        """tokens [B] int64, pos [] int64 (one position for the batch) -> next tokens [B]."""
        c, m = self.c, self.m
        B, Hq, Hk, D, eps = tokens.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        x = F.embedding(tokens, m.embed_tokens)
        positions = pos.expand(B)
        mask = (torch.arange(self.k.shape[3], device=x.device) <= pos)[None, :]  # [1, L]
        for i, layer in enumerate(m.layers):
            h = F.rms_norm(x, (c.hidden_size,), layer.input_norm, eps)
            q, k, v = F.linear(h, layer.qkv_weight).split([Hq * D, Hk * D, Hk * D], dim=-1)
            q = F.rms_norm(q.view(B, Hq, 1, D), (D,), layer.q_norm, eps)
            k = F.rms_norm(k.view(B, Hk, 1, D), (D,), layer.k_norm, eps)
            q, k = self.rope(q, positions), self.rope(k, positions)
            self.k[i].index_copy_(2, pos.view(1), k)
            self.v[i].index_copy_(2, pos.view(1), v.view(B, Hk, 1, D))
            o = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask, enable_gqa=True)
            x = x + F.linear(o.reshape(B, Hq * D), layer.o_weight)
            h = F.rms_norm(x, (c.hidden_size,), layer.post_norm, eps)
            gate, up = F.linear(h, layer.gate_up_weight).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down_weight)
        logits = F.linear(F.rms_norm(x, (c.hidden_size,), m.norm, eps), m.embed_tokens)
        return logits.argmax(dim=-1)


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy (read + write), 1 GiB buffers."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    from triton.testing import do_bench
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def weight_bytes(model) -> int:
    """The weight bytes one decode token reads: every parameter, an untied embedding as its one row."""
    embedding = model.embed_tokens
    unread = 0 if model.lm_head is None else (embedding.shape[0] - 1) * embedding.shape[1] * embedding.element_size()
    return sum(p.numel() * p.element_size() for p in model.parameters()) - unread


def ours_ms(model, batch: int, context: int, steps: int, kernels=None, eager: bool = False, reps: int = 3,
            params=None, workers=None) -> float:
    """ms per decode-only step of the engine: ``batch`` prompts of ``context`` tokens (one prefill
    step), then ``steps`` decode steps timed from their first token on; the median of ``reps`` runs
    after a warm-up run (graph captures). ``kernels``: ``Engine(decode_kernels=...)``; ``params``:
    the ``SamplingParams`` (default greedy); ``workers``: a tensor-parallel model's (``LLM.workers``)."""
    from modeling import Engine, SamplingParams

    params = params or SamplingParams()
    engine = Engine(model, max_num_seqs=batch, max_num_batched_tokens=batch * context,
                    max_model_len=context + steps + 1, decode_kernels=kernels, enforce_eager=eager, workers=workers)
    g = torch.Generator().manual_seed(context)
    prompts = [torch.randint(0, model.config.vocab_size, (context,), generator=g).tolist() for _ in range(batch)]

    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    def run():
        seqs = [engine.add(p, params, steps + 1) for p in prompts]
        while any(s.num_output == 0 for s in seqs):
            engine.step()
        sync()
        t0 = time.perf_counter()
        decode_steps = engine.stats.decode_steps
        while engine.has_work():
            engine.step()
        sync()
        assert engine.stats.decode_steps - decode_steps == steps and all(s.num_output == steps + 1 for s in seqs)
        return (time.perf_counter() - t0) / steps * 1e3

    run()
    return statistics.median(run() for _ in range(reps))


def torch_ms(model, batch: int, context: int, steps: int, mode) -> float:
    """The plain model's decode step; mode None: eager, else torch.compile(mode=mode)."""
    dec = TorchDecoder(model, batch, context + steps + 2)
    step = dec if mode is None else torch.compile(dec, mode=mode, fullgraph=True)
    tokens = torch.zeros(batch, dtype=torch.int64, device="cuda")
    pos = torch.tensor(context, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            step(tokens, pos)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            tokens = step(tokens, pos + i).clone()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def transformers_ms(config_dict: dict, context: int, steps: int):
    try:
        import transformers
    except ImportError:
        return None
    cfg = transformers.Qwen3Config(**{k: v for k, v in config_dict.items() if k != "model_type"})
    hf = transformers.Qwen3ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, context), device="cuda")

    def run(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static")
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    with torch.no_grad():
        run(8), run(8 + steps)  # warm-up of both lengths: a static cache of a new size may recompile
        short, long = run(8), run(8 + steps)
    return (long - short) / steps * 1e3


def kernel_profile(model, kernels=None, steps: int = 8) -> dict:
    """Kernel name -> [launches, microseconds] per decoded token (batch 1, the engine's CUDA graph
    steps with ``kernels``), from the profiler: a run of 1 + steps tokens minus a run of 1 (the
    prefill and its first token)."""
    from torch.profiler import ProfilerActivity, profile

    from modeling import Engine, SamplingParams

    engine = Engine(model, max_num_seqs=1, max_model_len=64, decode_kernels=kernels)
    engine.generate([[1, 2, 3]], SamplingParams(), steps + 1)  # compile, capture

    def kernels_of(n):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate([[1, 2, 3]], SamplingParams(), n)
        stats = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and \
                    not any(w in e.name.lower() for w in ("memcpy", "memset")):
                count_us = stats.setdefault(e.name, [0, 0.0])
                count_us[0] += 1
                count_us[1] += e.time_range.elapsed_us()
        return stats

    decode, prefill = kernels_of(steps + 1), kernels_of(1)
    return {name: [(n - prefill.get(name, [0, 0.0])[0]) / steps, (us - prefill.get(name, [0, 0.0])[1]) / steps]
            for name, (n, us) in decode.items() if n > prefill.get(name, [0, 0.0])[0]}


def print_profile(title: str, table: dict) -> None:
    print(f"{title}: {sum(n for n, _ in table.values()):.0f} kernels, "
          f"{sum(us for _, us in table.values()):.0f} us of kernel time per token", flush=True)
    for name, (n, us) in sorted(table.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"  {name[:60]:60s} {n:6.1f} x {us:8.1f} us", flush=True)


def measure(args) -> dict:
    from modeling import QwenConfig
    from modeling.model.random_checkpoint import QWEN3_5_0_8B, random_model

    import triton

    bandwidth = copy_bandwidth()
    out = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=datetime.date.today().isoformat(), copy_bandwidth_tb_s=bandwidth / 1e12, steps=args.steps, rows=[])

    def row(shape, what, batch, context, ms):
        out["rows"].append(dict(shape=shape, what=what, batch=batch, context=context, ms_per_step=ms))
        print(f"{shape:11s} {what:34s} b{batch:<3d} ctx {context:<5d} {ms:8.3f} ms/step", flush=True)
        save(args.out, out)  # after every row: a run cut short keeps what it measured

    compile_mode = "max-autotune" if args.max_autotune else "reduce-overhead"
    for name in (SHAPES if args.all else ["qwen3-0.6b"]):
        config = QwenConfig.from_dict(SHAPES[name])
        model = random_model(config, dtype=torch.bfloat16, device="cuda", std=0.02)
        floor = weight_bytes(model) / bandwidth * 1e3
        row(name, "floor (weights / copy bandwidth)", 1, 0, floor)
        row(name, OURS, 1, 256, ours_ms(model, 1, 256, args.steps))
        if name == "qwen3-1.7b":
            for kernels in ("persistent", "fused"):
                row(name, f"{OURS}, {KERNEL_ROWS[kernels]}", 1, 256, ours_ms(model, 1, 256, args.steps, kernels))
        if name == "qwen3-0.6b":
            out["floor_ms"] = floor
            out["ours_b1_ms_per_token"] = out["rows"][-1]["ms_per_step"]
            for kernels in ("persistent", "fused", "ops"):
                row(name, f"{OURS}, {KERNEL_ROWS[kernels]}", 1, 256, ours_ms(model, 1, 256, args.steps, kernels))
            out["persistent_b1_ms_per_token"] = out["rows"][-3]["ms_per_step"]
            row(name, OURS, 1, 2048, ours_ms(model, 1, 2048, args.steps))
            row(name, f"{OURS}, {KERNEL_ROWS['fused']}", 1, 2048, ours_ms(model, 1, 2048, args.steps, "fused"))
            row(name, OURS, 8, 256, ours_ms(model, 8, 256, args.steps))
            out["ours_b8_ms_per_step"] = out["rows"][-1]["ms_per_step"]
            for kernels in ("fused", "persistent"):
                row(name, f"{OURS}, {KERNEL_ROWS[kernels]}", 8, 256, ours_ms(model, 8, 256, args.steps, kernels))
            row(name, OURS, 32, 256, ours_ms(model, 32, 256, args.steps))
            default = kernel_profile(model)
            out["kernels_per_token"] = round(sum(n for n, _ in default.values()))
            print_profile("the default decode step", default)
            if args.quick:
                return out
            with weights_after_wait():
                row(name, AFTER_WAIT, 1, 256, ours_ms(model, 1, 256, args.steps, "fused"))
            row(name, f"{OURS}, eager", 1, 256, ours_ms(model, 1, 256, min(args.steps, 32), eager=True, reps=1))
            fused, unfused = kernel_profile(model, "fused"), kernel_profile(model, "ops")
            out["fused_kernels_per_token"] = round(sum(n for n, _ in fused.values()))
            out["unfused_kernels_per_token"] = round(sum(n for n, _ in unfused.values()))
            out["profile"] = dict(default=default, fused=fused, unfused=unfused)
            print_profile("fused decode step", fused)
            print_profile("op-by-op decode step", unfused)
            row(name, "torch eager", 1, 256, torch_ms(model, 1, 256, 32, None))
        row(name, f"torch.compile {compile_mode}", 1, 256, torch_ms(model, 1, 256, args.steps, compile_mode))
        if name == "qwen3-0.6b" and not args.no_transformers:
            ms = transformers_ms(SHAPES[name], 256, 32)
            if ms is not None:
                row(name, "transformers, static cache", 1, 256, ms)
        del model
        torch.cuda.empty_cache()
    model = random_model(QwenConfig.from_dict(QWEN3_5_0_8B), dtype=torch.bfloat16, device="cuda", std=0.02)
    out["qwen3_5_floor_ms"] = weight_bytes(model) / bandwidth * 1e3
    row("qwen3.5-0.8b", "floor (weights / copy bandwidth)", 1, 0, out["qwen3_5_floor_ms"])
    row("qwen3.5-0.8b", OURS, 1, 256, ours_ms(model, 1, 256, args.steps))
    out["qwen3_5_b1_ms_per_token"] = out["rows"][-1]["ms_per_step"]
    row("qwen3.5-0.8b", f"{OURS}, {KERNEL_ROWS['ops']}", 1, 256, ours_ms(model, 1, 256, args.steps, "ops"))
    row("qwen3.5-0.8b", f"{OURS}, {KERNEL_ROWS['fused']}", 1, 256, ours_ms(model, 1, 256, args.steps, "fused"))
    row("qwen3.5-0.8b", OURS, 8, 256, ours_ms(model, 8, 256, args.steps))
    for kernels in ("fused", "ops", "persistent"):
        row("qwen3.5-0.8b", f"{OURS}, {KERNEL_ROWS[kernels]}", 8, 256, ours_ms(model, 8, 256, args.steps, kernels))
    hybrid = kernel_profile(model)
    out["qwen3_5_kernels_per_token"] = round(sum(n for n, _ in hybrid.values()))
    print_profile("Qwen3.5 default decode step", hybrid)
    with weights_after_wait():
        row("qwen3.5-0.8b", AFTER_WAIT, 1, 256, ours_ms(model, 1, 256, args.steps, "fused"))
    del model
    torch.cuda.empty_cache()
    for name, key in (("qwen3-8b", "qwen3_8b"), ("qwen3.5-9b", "qwen3_5_9b")):  # the larger dense shapes
        model = random_model(QwenConfig.from_dict(LARGE[name]), dtype=torch.bfloat16, device="cuda", std=0.02)
        out[f"{key}_floor_ms"] = weight_bytes(model) / bandwidth * 1e3
        row(name, "floor (weights / copy bandwidth)", 1, 0, out[f"{key}_floor_ms"])
        row(name, OURS, 1, 256, ours_ms(model, 1, 256, args.steps))
        out[f"{key}_b1_ms_per_token"] = out["rows"][-1]["ms_per_step"]
        for kernels in ("persistent", "fused"):
            row(name, f"{OURS}, {KERNEL_ROWS[kernels]}", 1, 256, ours_ms(model, 1, 256, args.steps, kernels))
        del model
        torch.cuda.empty_cache()
    return out


@contextlib.contextmanager
def weights_after_wait():
    """The fused decode GEMVs without their weight prefetch (`csrc_free_ops.fused_decode.PREFETCH`):
    every program waits for the previous kernel, then streams its weights."""
    from csrc_free_ops import fused_decode

    saved, fused_decode.PREFETCH = fused_decode.PREFETCH, False
    try:
        yield
    finally:
        fused_decode.PREFETCH = saved


def render(path: str, doc: str = "docs/performance.md", plot: str = "docs/decode.png") -> None:
    """Rewrite the decode section of docs/performance.md (between the markers) from a JSON result,
    and draw the plot (matplotlib, optional)."""
    with open(path) as f:
        res = json.load(f)
    lines = [MARK_BEGIN, "",
             f"`python -m bench.decode` on {res['gpu']}, {res['date']}, torch {res['torch']}, triton {res['triton']}; "
             f"random weights, bf16, greedy, {res['steps']} steps; copy bandwidth {res['copy_bandwidth_tb_s']:.2f} TB/s. "
             f"Kernels per decoded token (ours, batch 1): {res.get('kernels_per_token', 'n/a')} (the default step), "
             f"{res.get('fused_kernels_per_token', 'n/a')} fused, {res.get('unfused_kernels_per_token', 'n/a')} "
             "op by op. "
             f"Result file: `{path}`.", "",
             "| shape | what | batch | context | ms / step | x floor |", "|---|---|---|---|---|---|"]
    floors = {r["shape"]: r["ms_per_step"] for r in res["rows"] if r["what"].startswith("floor")}
    notes = [r["note"] for r in res["rows"] if "note" in r]
    for r in res["rows"]:
        mark = f" ({notes.index(r['note']) + 1})" if "note" in r else ""
        lines.append(f"| {r['shape']} | {r['what']}{mark} | {r['batch']} | {r['context'] or '-'} | "
                     f"{r['ms_per_step']:.3f} | {r['ms_per_step'] / floors[r['shape']]:.2f} |")
    lines += [""] * bool(notes or res.get("notes")) + [f"({i}) {n}." for i, n in enumerate(notes, 1)]
    if res.get("notes"):
        lines.append(f"Run: {res['notes']}.")
    for path_name, table in res.get("profile", {}).items():
        lines += ["", f"Kernel time per decoded token inside the graph, {path_name} path (batch 1, context 3-11):", "",
                  "| kernel | launches | us |", "|---|---|---|"]
        for name, (n, us) in sorted(table.items(), key=lambda kv: -kv[1][1])[:10]:
            lines.append(f"| `{name[:50]}` | {n:.0f} | {us:.1f} |")
        lines.append(f"| all | {sum(n for n, _ in table.values()):.0f} | {sum(us for _, us in table.values()):.1f} |")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        b1 = [r for r in res["rows"] if r["shape"] == "qwen3-0.6b" and r["batch"] == 1 and r["context"] in (0, 256)]
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.barh([r["what"] for r in b1], [r["ms_per_step"] for r in b1], color="tab:blue")
        ax.set_xlabel("ms per decoded token (Qwen3-0.6B shape, batch 1, context 256)")
        ax.invert_yaxis()
        fig.tight_layout()
        fig.savefig(plot, dpi=120)
        lines += ["", f"![decode, batch 1]({os.path.basename(plot)})"]
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
    lines += ["", MARK_END]
    text = open(doc).read()
    section = "\n".join(lines)
    if MARK_BEGIN in text:
        start, end = text.index(MARK_BEGIN), text.index(MARK_END) + len(MARK_END)
        text = text[:start] + section + text[end:]
    else:
        text = text.rstrip() + "\n\n## Decode, side by side\n\n" + section + "\n"
    with open(doc, "w") as f:
        f.write(text)
    print(f"rewrote the decode section of {doc}")


def main():
    p = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--all", action="store_true", help="also the seed and Qwen3-1.7B shapes")
    p.add_argument("--max-autotune", action="store_true", help="compile the torch peer with max-autotune")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--quick", action="store_true", help="only Qwen3-0.6B's rows of ours (no peers, no profiles "
                   "of the forced kernels, no Qwen3.5)")
    p.add_argument("--render", metavar="JSON", help="only rewrite docs/performance.md from a result file")
    p.add_argument("--tp", type=int, metavar="N", help="only Qwen3-8B's batch-1 rows at tensor-parallel sizes 1 and N "
                   "(bench.tensor_parallel)")
    p.add_argument("--checkpoints", type=Path, default=None, help="--tp's random checkpoint directory")
    a = p.parse_args()
    if a.render:
        return render(a.render)
    require_cuda("bench.decode", "--render works anywhere")
    if a.tp is not None:
        if a.tp < 2:
            p.error(f"--tp takes a size of 2 or more (size 1 runs beside it), got {a.tp}")
        from bench import tensor_parallel as tp

        res = dict(gpu=torch.cuda.get_device_name(), gpus=a.tp, date=datetime.date.today().isoformat(),
                   torch=torch.__version__, **tp.decode_rows(tp.checkpoint(a.checkpoints or tp.DEFAULT_ROOT),
                                                             (1, a.tp), a.steps))
        print(json.dumps(res, indent=1))
        print(f"wrote {save(a.out, res, 'decode-tp')}")
        return
    print(f"wrote {save(a.out, measure(a))}")


def save(out_dir: str, res: dict, name: str = "decode") -> str:
    os.makedirs(out_dir, exist_ok=True)
    slug = gpu_slug(res["gpu"])
    path = os.path.join(out_dir, f"{res['date']}-{slug}-{name}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    return path


if __name__ == "__main__":
    main()
