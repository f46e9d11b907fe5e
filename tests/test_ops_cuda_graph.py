"""Each decode-shape op captured once in a CUDA graph, replayed with new inputs (a new position, its
KV slot in the paged cache and the sequence's length), compared with eager."""
import pytest
import torch

import qwen_ops  # noqa: F401

pytestmark = pytest.mark.cuda


def _decode_step(s):
    """One Qwen3-0.6B-shaped decode step through every op, reading the static inputs in `s`."""
    h, res = torch.ops.qwen.add_rms_norm(s["x"], s["res"], s["norm_w"], 1e-6)
    qkv = torch.ops.qwen.linear(torch.ops.qwen.rms_norm(h, s["norm_w"], 1e-6), s["w_qkv"])
    q = qkv[..., : 16 * 128].view(1, 16, 128)
    k = qkv[..., 16 * 128 : 24 * 128].view(1, 8, 128)
    v = qkv[..., 24 * 128 :].view(1, 8, 128)
    q, k = torch.ops.qwen.rope(q, k, s["positions"], 1e6, 128, s["qn"], s["kn"])
    torch.ops.qwen.kv_cache_store_slots(k, v, s["k_cache"], s["v_cache"], s["slots"])
    a = torch.ops.qwen.paged_attention(q, s["k_cache"], s["v_cache"], s["cu_seqlens"], s["seqlens"], s["table"],
                                       128 ** -0.5, 1)
    prefill = torch.ops.qwen.attention(q[None], k[None], v[None], 128 ** -0.5)
    mlp = torch.ops.qwen.silu_mul(torch.ops.qwen.linear(h, s["w_gu"]))
    return a, prefill, mlp, res


def _fill(s, step):
    g = torch.Generator(device="cuda").manual_seed(step)
    for name in ("x", "res"):
        s[name].copy_(torch.randn(s[name].shape, generator=g, device="cuda"))
    pos = 100 + 37 * step
    s["positions"].fill_(pos)
    s["slots"].copy_(s["table"][0, pos // 16] * 16 + pos % 16)
    s["seqlens"].fill_(pos + 1)


def test_decode_ops_replay_in_cuda_graph():
    bf = dict(device="cuda", dtype=torch.bfloat16)
    s = {
        "x": torch.empty(1, 1, 1024, **bf), "res": torch.empty(1, 1, 1024, **bf),
        "norm_w": torch.randn(1024, **bf), "w_qkv": torch.randn(4096, 1024, **bf) * 0.03,
        "qn": torch.randn(128, **bf), "kn": torch.randn(128, **bf), "w_gu": torch.randn(6144, 1024, **bf) * 0.03,
        "k_cache": torch.randn(256, 16, 8, 128, **bf), "v_cache": torch.randn(256, 16, 8, 128, **bf),
        "table": torch.randperm(256, device="cuda").to(torch.int32)[None],  # one sequence's blocks, shuffled
        "cu_seqlens": torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
        "positions": torch.zeros(1, dtype=torch.long, device="cuda"),
        "slots": torch.zeros(1, dtype=torch.long, device="cuda"),
        "seqlens": torch.zeros(1, dtype=torch.int32, device="cuda"),
    }
    _fill(s, 0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _decode_step(s)  # warm-up: compile every kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _decode_step(s)
    for step in range(1, 4):
        _fill(s, step)
        caches = (s["k_cache"].clone(), s["v_cache"].clone())
        graph.replay()
        replayed = [t.clone() for t in static_out]
        replayed_caches = (s["k_cache"].clone(), s["v_cache"].clone())
        s["k_cache"].copy_(caches[0])
        s["v_cache"].copy_(caches[1])
        eager = _decode_step(s)
        for r, e in zip(replayed, eager):
            assert torch.equal(r, e), f"step {step}: graph replay differs from eager"
        assert torch.equal(replayed_caches[0], s["k_cache"])
        assert torch.equal(replayed_caches[1], s["v_cache"])
