"""Mixture-of-experts speed, one process on the GPU: the grouped GEMMs against torch's, batch-1
decode against its floor, and Qwen3-30B-A3B's offline throughput against its bound.

    python -m bench.moe [--out DIR] [--only gemm decode throughput] [--steps 128] [--requests 256]
    python -m bench.moe --sweep [--out DIR]     # tile configs: this GPU's table moe
    python -m bench.moe --only decode --fp8     # Qwen3-30B-A3B's FP8 decode against its FP8 floor

Random weights, bf16; router weights random (std 0.02), so the experts are picked near uniformly.

- grouped GEMM (``gemm``): ``qwen::fused_moe`` (the sort, gate_up with SiLU-and-multiply in its
  epilogue, down with the routing weight, the combine) for 512, 4096 and 16384 tokens routed
  top-8, at Qwen3-30B-A3B's (128 experts, hidden 2048, 768) and Qwen3.5-35B-A3B's (256, 2048,
  512) expert shapes, against ``torch._grouped_mm`` on the same pairs already sorted by expert,
  then torch's SiLU-multiply, the second ``_grouped_mm`` and the weighted combine (``index_add_``);
  ``moe_gemm_vs_torch_min`` is the smallest torch / ours time ratio over the six cases;
- batch-1 decode (``decode``): the engine's decode-only steps (``bench.decode.ours_ms``: one
  256-token prompt, then ``--steps`` steps, CUDA graphs) of Qwen3-30B-A3B and Qwen3.5-35B-A3B
  (text model) at full size; the floor is the bytes one token reads (``token_bytes``: every
  weight but the experts, the k experts a token picks, the shared expert, lm_head and one
  embedding row, the context's keys and values, Qwen3.5's recurrent and conv states read and
  written) over the device-to-device copy bandwidth measured here;
- throughput (``throughput``): Qwen3-30B-A3B in ``bench.throughput``'s workload (``--requests``
  requests, input and output lengths uniform in [100, 1024], ``max_num_seqs`` 256), output tokens
  per second after a warm-up run; the bound is the run's output tokens over (every weight, all
  experts, read once per engine step of the run, plus each decode token's reads of its context's
  keys and values) / the copy bandwidth.

With ``--fp8`` the decode rows are Qwen3-30B-A3B's weights quantised as ``quantization="fp8"``
quantises them (``random_model(..., quantization="fp8")``: the experts, the attention's
projections in FP8 blocks of 128, the router, embeddings and lm_head in bf16), keys
``qwen3_moe_fp8_b1_ms_per_token`` and ``qwen3_moe_fp8_b1_floor_ms`` (its FP8 bytes).

Keys: ``moe_gemm_vs_torch_min``, ``qwen3_moe_b1_ms_per_token``, ``qwen3_moe_b1_floor_ms``,
``qwen3_5_moe_b1_ms_per_token``, ``qwen3_5_moe_b1_floor_ms``, ``qwen3_moe_throughput_tokens_per_s``,
``qwen3_moe_throughput_bound``, each case under ``gemm``; writes ``<date>-<gpu>-moe.json`` after
every number. ``--sweep`` times ``fused_moe`` for each candidate tile config of gate_up, then of
down, at each token count of ``SWEEP_TOKENS`` for both expert shapes, writes the best as
``<date>-<gpu>-moe-configs.json`` and records them as this GPU's table moe
(``csrc_free_ops.devices.record``: csrc_free_ops/tuning/<gpu>.json).
"""
import argparse
import datetime
import itertools
import json
import os

import torch
import torch.nn.functional as F

import qwen_ops  # noqa: F401  (registers torch.ops.qwen)
from bench import gpu_slug, require_cuda

QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1e6, max_position_embeddings=40960,
                     tie_word_embeddings=False)
QWEN3_5_35B_A3B = dict(model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048,
                       moe_intermediate_size=512, shared_expert_intermediate_size=512, num_hidden_layers=40,
                       num_attention_heads=16, num_key_value_heads=2, head_dim=256, num_experts=256,
                       num_experts_per_tok=8, linear_num_key_heads=16, linear_num_value_heads=32,
                       linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                       full_attention_interval=4, rope_parameters=dict(rope_type="default", rope_theta=1e7,
                                                                       partial_rotary_factor=0.25),
                       max_position_embeddings=262144, tie_word_embeddings=False)
EXPERT_SHAPES = {"qwen3_moe": (128, 2048, 768, 8), "qwen3_5_moe": (256, 2048, 512, 8)}
"""name -> (experts, hidden, moe_intermediate_size, top-k)."""
GEMM_TOKENS = (512, 4096, 16384)
SWEEP_TOKENS = (1, 4, 16, 64, 256, 512, 1024, 4096, 16384)
CONTEXT = 256


# ------------------------------------------------------------------------------------ grouped GEMM


def moe_inputs(m: int, e: int, h: int, inter: int, k: int, device="cuda", dtype=torch.bfloat16, seed=0):
    """x [m, h], w13 [e, 2I, h], w2 [e, h, I] ~ N(0, 0.02^2) and the top-k of random router logits."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return (torch.randn(shape, generator=g, device=device) * 0.02).to(dtype)

    x, w13, w2, router = randn(m, h), randn(e, 2 * inter, h), randn(e, h, inter), randn(e, h)
    weights, ids = torch.ops.qwen.moe_topk_softmax(torch.ops.qwen.linear(x, router), k, True)
    return x, w13, w2, weights, ids


def torch_inputs(x, weights, ids, num_experts: int):
    """The pairs sorted by expert, for ``torch_moe``: (rows of x [P, H], their tokens [P], their
    routing weights [P], offs [E] int32: the end of each expert's rows)."""
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    tokens = order // ids.shape[1]
    offs = torch.bincount(flat, minlength=num_experts).cumsum(0).to(torch.int32)
    return x[tokens], tokens, weights.reshape(-1)[order], offs


def torch_moe(xs, tokens, pair_weights, offs, w13, w2, m: int):
    """torch's grouped MoE on pairs already sorted by expert: ``_grouped_mm`` for gate_up, SiLU
    times up, ``_grouped_mm`` for down, the weighted sum per token -> [m, H] (x's dtype)."""
    inter = w2.shape[2]
    gate_up = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    y = torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs)
    out = torch.zeros((m, w2.shape[1]), dtype=torch.float32, device=xs.device)
    return out.index_add_(0, tokens, y.float() * pair_weights[:, None]).to(xs.dtype)


def gemm_case(name: str, m: int) -> dict:
    """ms of ours (sort included) and of torch (sorted input given) for one shape; their outputs' rel err."""
    from triton.testing import do_bench

    e, h, inter, k = EXPERT_SHAPES[name]
    x, w13, w2, weights, ids = moe_inputs(m, e, h, inter, k)
    sorted_args = torch_inputs(x, weights, ids, e)
    ours = torch.ops.qwen.fused_moe(x, w13, w2, weights, ids)
    ref = torch_moe(*sorted_args, w13, w2, m)
    err = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
    ours_ms = do_bench(lambda: torch.ops.qwen.fused_moe(x, w13, w2, weights, ids), warmup=25, rep=200,
                       return_mode="median")
    torch_ms = do_bench(lambda: torch_moe(*sorted_args, w13, w2, m), warmup=25, rep=200, return_mode="median")
    return dict(shape=name, tokens=m, top_k=k, ours_ms=ours_ms, torch_ms=torch_ms, torch_over_ours=torch_ms / ours_ms,
                rel_err_vs_torch=err)


# ------------------------------------------------------------------------------------- decode floor


def token_bytes(model, context: int) -> int:
    """Bytes one decode token of one sequence reads (see the module doc): parameters (the routed
    experts' k / E share, one embedding row unless tied), keys and values of ``context`` positions
    per attention layer, Qwen3.5's per-sequence states read and written."""
    c = model.config
    share = c.num_experts_per_tok / c.num_experts if c.num_experts else 0.0
    total = 0.0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if name.endswith(("mlp.experts_gate_up", "mlp.experts_down", "mlp.experts_gate_up_scale_inv",
                          "mlp.experts_down_scale_inv")):
            size *= share
        elif name == "embed_tokens" and not c.tie_word_embeddings:
            size = c.hidden_size * p.element_size()
        total += size
    for layer in model.layers:
        spec = layer.cache_spec(c, model.embed_tokens.dtype)
        total += sum(context * _numel(shape) * dtype.itemsize for shape, dtype in spec.per_position)
        total += sum(2 * _numel(shape) * dtype.itemsize for shape, dtype in spec.per_sequence)
    return int(total)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def decode_rows(out: dict, steps: int, bandwidth: float, report, fp8: bool = False) -> None:
    """Batch-1 decode of both models against their floors; ``fp8``: Qwen3-30B-A3B with its weights
    quantised as ``quantization="fp8"`` does (keys ``qwen3_moe_fp8_b1_*``)."""
    from bench.decode import ours_ms
    from bench.throughput import free_device_memory
    from modeling import QwenConfig
    from modeling.model.random_checkpoint import random_model

    models = [("qwen3_moe_fp8", QWEN3_30B_A3B)] if fp8 else [("qwen3_moe", QWEN3_30B_A3B),
                                                             ("qwen3_5_moe", QWEN3_5_35B_A3B)]
    for key, shape in models:
        model = random_model(QwenConfig.from_dict(shape), dtype=torch.bfloat16, device="cuda", std=0.02,
                             quantization="fp8" if fp8 else None)
        report(f"{key}_b1_floor_ms", token_bytes(model, CONTEXT) / bandwidth * 1e3, "ms")
        report(f"{key}_b1_ms_per_token", ours_ms(model, 1, CONTEXT, steps), "ms")
        out[f"{key}_b1_x_floor"] = out[f"{key}_b1_ms_per_token"] / out[f"{key}_b1_floor_ms"]
        del model
        free_device_memory()


# --------------------------------------------------------------------------------------- throughput


def kv_bytes_of_workload(model, requests) -> int:
    """Each decode token's reads of its sequence's keys and values: request (prompt p, output o)
    reads p + t positions for its t-th output token."""
    c = model.config
    per_position = sum(_numel(shape) * dtype.itemsize for layer in model.layers
                       for shape, dtype in layer.cache_spec(c, model.embed_tokens.dtype).per_position)
    positions = sum(o * len(p) + o * (o - 1) // 2 for p, o in requests)
    return positions * per_position


def throughput_rows(out: dict, n: int, bandwidth: float, report) -> None:
    from bench.throughput import ENGINE, free_device_memory, run_all, workload
    from modeling import QwenConfig, SamplingParams
    from modeling.engine import Engine
    from modeling.model.random_checkpoint import random_model

    model = random_model(QwenConfig.from_dict(QWEN3_30B_A3B), dtype=torch.bfloat16, device="cuda", std=0.02)
    requests = workload(n, model.config.vocab_size)
    engine = Engine(model, **ENGINE)
    print(engine.size.describe(model), flush=True)
    greedy = SamplingParams()
    run_all(engine, requests, greedy)  # warm: capture the graphs
    engine.stats = type(engine.stats)()
    rate = run_all(engine, requests, greedy)
    stats = engine.stats
    print(stats.describe(), flush=True)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    seconds = (stats.steps * weights + kv_bytes_of_workload(model, requests)) / bandwidth
    out["qwen3_moe_throughput_stats"] = dict(vars(stats))
    report("qwen3_moe_throughput_bound", stats.output_tokens / seconds, "output tokens/s")
    report("qwen3_moe_throughput_tokens_per_s", rate, "output tokens/s")
    out["qwen3_moe_throughput_of_bound"] = rate / out["qwen3_moe_throughput_bound"]
    del engine, model
    free_device_memory()


# -------------------------------------------------------------------------------------------- sweep


def candidates():
    """Tile configs tried by ``--sweep`` (block_m, block_n, block_k, group_m, warps, stages)."""
    from csrc_free_ops.moe import MoeConfig

    for bm, bn, bk, warps, stages in itertools.product((16, 32, 64, 128), (32, 64, 128), (64, 128), (4, 8), (3, 4)):
        if bm * bn * bk <= 128 * 128 * 128 and not (warps == 8 and bm * bn < 64 * 64):
            yield MoeConfig(bm, bn, bk, 1 if bm <= 16 else 8, warps, stages)


def sweep(out: dict) -> dict:
    """The best gate_up config, then the best down config (with gate_up's block_m), per token count;
    recorded as this GPU's table moe (``csrc_free_ops.devices.record``)."""
    from triton.testing import do_bench

    from csrc_free_ops import devices, moe as kernels

    table = {}
    dtype = torch.bfloat16
    stored = kernels.moe_config
    for name, (e, h, inter, k) in EXPERT_SHAPES.items():
        up_key, down_key = (e, 2 * inter, h), (e, h, inter)
        table[up_key], table[down_key] = {}, {}
        for m in SWEEP_TOKENS:
            if m <= kernels.GEMV_MAX_TOKENS:
                continue
            args = moe_inputs(m, e, h, inter, k, dtype=dtype)
            timed = {}

            def run(up, down):
                kernels.moe_config = lambda m, e, n, k, *rest: up if n == 2 * inter else down
                try:
                    return do_bench(lambda: kernels.fused_moe(*args), warmup=10, rep=50, return_mode="median")
                except Exception:  # a config that does not compile or fit shared memory
                    return float("inf")
                finally:
                    kernels.moe_config = stored

            default_down = kernels.default_config(m, e, h, inter, k, dtype.itemsize)
            for cfg in candidates():
                timed[cfg] = run(cfg, default_down._replace(block_m=cfg.block_m))
            best_up = min(timed, key=timed.get)
            down_timed = {cfg: run(best_up, cfg) for cfg in candidates() if cfg.block_m == best_up.block_m}
            best_down = min(down_timed, key=down_timed.get)
            table[up_key][m], table[down_key][m] = best_up, best_down
            print(f"{name} M={m}: gate_up {best_up}, down {best_down}: {down_timed[best_down]:.3f} ms", flush=True)
    out["configs"] = {",".join(map(str, key)): {m: list(cfg) for m, cfg in row.items()} for key, row in table.items()}
    print("recorded in", devices.record("moe", torch.cuda.get_device_name(), dtype, table))
    return out


# --------------------------------------------------------------------------------------------- main


def main():
    p = argparse.ArgumentParser(prog="python -m bench.moe", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    p.add_argument("--only", nargs="+", choices=("gemm", "decode", "throughput"), default=["gemm", "decode", "throughput"])
    p.add_argument("--steps", type=int, default=128, help="decode steps timed per run")
    p.add_argument("--requests", type=int, default=256, help="requests of the throughput workload")
    p.add_argument("--sweep", action="store_true", help="only the tile-config sweep")
    p.add_argument("--fp8", action="store_true", help="decode: Qwen3-30B-A3B quantised to FP8 (the gemm and "
                   "throughput rows stay bf16)")
    a = p.parse_args()
    require_cuda("bench.moe")
    from bench.decode import copy_bandwidth

    out = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), torch=torch.__version__)
    os.makedirs(a.out, exist_ok=True)
    slug = gpu_slug(out["gpu"])
    path = os.path.join(a.out, f"{out['date']}-{slug}-moe{'-configs' if a.sweep else '-fp8' if a.fp8 else ''}.json")

    def save():
        with open(path, "w") as f:  # after every number: a run cut short keeps what it measured
            json.dump(out, f, indent=1)

    def report(key, value, unit):
        out[key] = value
        print(f"{key:36s} {value:10.3f} {unit}", flush=True)
        save()

    if a.sweep:
        sweep(out)
        save()
        print(f"wrote {path}")
        return
    bandwidth = copy_bandwidth()
    out["copy_bandwidth_tb_s"] = bandwidth / 1e12
    if "gemm" in a.only:
        out["gemm"] = []
        for name in EXPERT_SHAPES:
            for m in GEMM_TOKENS:
                case = gemm_case(name, m)
                out["gemm"].append(case)
                print(f"{name:12s} M={m:6d} ours {case['ours_ms']:8.3f} ms  torch {case['torch_ms']:8.3f} ms  "
                      f"x{case['torch_over_ours']:.2f}  rel err {case['rel_err_vs_torch']:.1e}", flush=True)
        report("moe_gemm_vs_torch_min", min(c["torch_over_ours"] for c in out["gemm"]), "")
    if "decode" in a.only:
        decode_rows(out, a.steps, bandwidth, report, a.fp8)
    if "throughput" in a.only:
        throughput_rows(out, a.requests, bandwidth, report)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
