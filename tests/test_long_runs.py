"""Long runs on the GPU (`cuda` tests): what short tests cannot show.

- One sequence decoded in the CUDA graph to the end of an 8192-position cache on a random
  Qwen3-0.6B-shaped model: the same tokens as eager decoding for the first 512, and nothing
  non-finite anywhere (the cache every step wrote, one more step at the full length, and the
  logits of a full-length prefill over the generated text).
- 200 consecutive `Generator.generate` calls with varied prompt lengths, batch sizes and sampling
  modes: the device memory in use after the last call equals that after the first, and no more
  graphs are captured than there are (bucket, mode) keys.

    python -m pytest -q -s -m cuda tests/test_long_runs.py     (-s prints timings and the prefill agreement)

Meant to take about a minute each on an H200 (compilation included); not yet measured there.
"""
import random
import time

import pytest
import torch

from modeling import QwenConfig
from modeling.generation.generator import Generator
from modeling.model.random_checkpoint import QWEN3_0_6B, random_model
from modeling.generation.sampling import MODES, SamplingParams

pytestmark = pytest.mark.cuda


def _cache_tensors(cache):
    """Every floating tensor of every layer's cache (k and v for attention layers)."""
    return [t for layer in cache.layers for t in vars(layer).values()
            if isinstance(t, torch.Tensor) and t.is_floating_point()]


def test_graph_decode_to_full_cache_length_qwen3_0_6b():
    cache_len, prompt_len, eager_tokens = 8192, 16, 512
    model = random_model(QwenConfig.from_dict(QWEN3_0_6B), dtype=torch.bfloat16, device="cuda", std=0.02)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    new_tokens = cache_len - prompt_len  # the most the generator allows: the cache ends at position 8191

    graph = Generator(model, max_batch_size=1, max_seq_len=cache_len)
    t0 = time.perf_counter()
    r = graph.generate([prompt], new_tokens)
    t_graph = time.perf_counter() - t0
    tokens = r.tokens[0]
    assert r.cuda_graph and r.finish_reasons == ["length"] and len(tokens) == new_tokens
    assert all(0 <= t < vocab for t in tokens)
    # Each step's layer inputs went through its k/v projections into the cache: all finite means
    # no step of any layer produced inf or NaN (the unfilled tail is zeros).
    for i, t in enumerate(_cache_tensors(graph.cache)):
        assert torch.isfinite(t).all(), f"cache tensor {i} holds a non-finite value after {new_tokens} graph steps"

    with torch.no_grad():  # one more step, at the full length: decode_attention over all 8192 positions
        logits = model(torch.tensor([[tokens[-1]]], device="cuda"), torch.tensor([[cache_len - 1]], device="cuda"),
                       graph.cache, torch.tensor([cache_len], dtype=torch.int32, device="cuda"))
    assert torch.isfinite(logits).all(), "non-finite logits at the full cache length"

    eager = Generator(model, max_batch_size=1, max_seq_len=cache_len, use_cuda_graph=False)  # same split plan
    t0 = time.perf_counter()
    e = eager.generate([prompt], eager_tokens)
    t_eager = time.perf_counter() - t0
    assert not e.cuda_graph
    first_diff = next((i for i, (a, b) in enumerate(zip(e.tokens[0], tokens)) if a != b), None)
    assert first_diff is None, f"graph and eager decoding differ first at new token {first_diff}"
    del eager, e

    # A prefill of the whole text (the flash attention kernel, not decode_attention) at full length:
    # finite logits everywhere, and the greedy choice at each position mostly that of the decode
    # (teacher-forced: the two kernels round differently, so near-ties may flip, but a decode that
    # drifted at long range would disagree everywhere past the drift).
    with torch.no_grad():
        ids = torch.tensor([prompt + tokens], device="cuda")
        full = model(ids, torch.arange(cache_len, device="cuda")[None], model.new_cache(1, cache_len), all_logits=True)
        assert torch.isfinite(full).all(), "non-finite logits in the full-length prefill"
        predicted = full[0, prompt_len - 1 : cache_len - 1].argmax(-1)
        del full
        agree = (predicted == ids[0, prompt_len:]).float()
    quarters = [round(q.mean().item(), 3) for q in agree.chunk(4)]
    print(f"\n  graph decode of {new_tokens} tokens: {t_graph:.1f} s ({t_graph / new_tokens * 1e3:.2f} ms/token, "
          f"with capture); eager {eager_tokens} tokens: {t_eager:.1f} s; prefill argmax = decoded token, "
          f"by quarter of the sequence: {quarters}")
    assert min(quarters) > 0.5, f"the decode disagrees with a full-length prefill: agreement by quarter {quarters}"


def _sampling(mode: str, seed: int) -> SamplingParams:
    return {"greedy": SamplingParams(),
            "sample": SamplingParams(temperature=0.8, seed=seed),
            "top": SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=seed)}[mode]


def test_many_generate_calls_keep_memory_and_graph_count_steady():
    config = QwenConfig.from_dict(dict(model_type="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=32, tie_word_embeddings=True))
    model = random_model(config, dtype=torch.bfloat16, device="cuda", std=0.1)
    max_seq = 128
    gen = Generator(model, max_batch_size=8, max_seq_len=max_seq, prefill_graph=True, prefill_buckets=(16, 32, 64))
    assert set(MODES) == {"greedy", "sample", "top"}
    bound = (len(gen.batch_buckets) + len(gen.prefill_buckets)) * len(MODES)  # (4 + 3) x 3 = 21

    rnd = random.Random(0)
    calls = []
    for i in range(199):
        n = rnd.choice([1, 1, 2, 3, 4, 5, 7, 8, 11])  # 11: a batch of 8, then one of 3
        lengths = [rnd.randint(1, 90) for _ in range(n)]  # above 64: exact-length eager prefill
        max_new = rnd.randint(1, max_seq - max(lengths))
        mode = MODES[(i + 1) % len(MODES)]  # the first call samples (seeded): the last call repeats it
        stop = [rnd.randrange(config.vocab_size)] if i % 5 == 0 else []
        prompts = [[rnd.randrange(config.vocab_size) for _ in range(k)] for k in lengths]
        calls.append((prompts, min(max_new, 40), _sampling(mode, seed=i), stop))
    calls.append(calls[0])  # the last call repeats the first: same tokens (seeded) after 198 others

    memory, graphs, results = [], [], []
    t0 = time.perf_counter()
    for prompts, max_new, sampling, stop in calls:
        r = gen.generate(prompts, max_new, sampling, stop_token_ids=stop)
        torch.cuda.synchronize()
        memory.append(torch.cuda.memory_allocated())
        graphs.append(len(gen.graphs.keys()))
        results.append(r)
        assert all(0 <= t < config.vocab_size for row in r.tokens for t in row)
        assert all(len(row) <= max_new for row in r.tokens)
    elapsed = time.perf_counter() - t0

    changed = [(i, memory[i] - memory[i - 1], graphs[i] - graphs[i - 1]) for i in range(1, len(calls))
               if memory[i] != memory[i - 1]]
    print(f"\n  {len(calls)} generate calls in {elapsed:.1f} s; {graphs[-1]} graphs (bound {bound}); "
          f"memory_allocated after the first call {memory[0]} B, after the last {memory[-1]} B")
    assert memory[-1] == memory[0], (
        f"device memory in use grew by {memory[-1] - memory[0]} B over {len(calls)} calls; "
        f"(call, bytes, graphs captured in that call) where it changed: {changed[:20]}")
    assert graphs[-1] <= bound, sorted(gen.graphs.keys())
    for key in gen.graphs.keys():
        kind, bucket, mode = key
        assert mode in MODES and bucket in (gen.batch_buckets if kind == "decode" else gen.prefill_buckets), key
    assert results[-1].tokens == results[0].tokens, "a repeated seeded call gave other tokens after 198 calls"
