"""Long runs on the GPU (`cuda` tests): what short tests cannot show.

- One sequence decoded in the engine's CUDA graphs to the end of an 8192-position
  ``max_model_len`` on a random Qwen3-0.6B-shaped model: the same tokens as eager steps for the
  first 512, and nothing non-finite anywhere (the pool every step wrote, and the logits of a
  full-length pass over the generated text).
- 200 consecutive ``Engine.generate`` calls on one engine with varied prompt lengths, batch sizes
  and sampling modes, every step shape captured first: the device memory in use never changes
  from call to call, and no graph is captured again.

    python -m pytest -q -s -m cuda tests/test_long_runs.py     (-s prints timings and the prefill agreement)

Meant to take about a minute each on an H200 (compilation included); not yet measured there.
"""
import random
import time

import pytest
import torch

from modeling import Engine, QwenConfig, SamplingParams
from modeling.model.random_checkpoint import QWEN3_0_6B, random_model

pytestmark = pytest.mark.cuda


def test_graph_decode_to_full_model_len_qwen3_0_6b():
    max_model_len, prompt_len, eager_tokens = 8192, 16, 512
    model = random_model(QwenConfig.from_dict(QWEN3_0_6B), dtype=torch.bfloat16, device="cuda", std=0.02)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    new_tokens = max_model_len - prompt_len  # the most a sequence holds: it ends at position 8191

    graph = Engine(model, max_num_seqs=1, max_model_len=max_model_len)
    t0 = time.perf_counter()
    seq = graph.add(prompt, SamplingParams(), new_tokens)
    while graph.has_work():
        graph.step()
    t_graph = time.perf_counter() - t0
    tokens = seq.output_ids
    assert seq.finish_reason == "length" and len(tokens) == new_tokens
    assert all(0 <= t < vocab for t in tokens)
    # Each step's layer inputs went through its k/v projections into the pool: all finite means no
    # step of any layer produced inf or NaN (the unwritten blocks are zeros).
    for i, t in enumerate(graph.pool.kv):
        assert torch.isfinite(t).all(), f"pool tensor {i} holds a non-finite value after {new_tokens} graph steps"

    eager = Engine(model, max_num_seqs=1, max_model_len=max_model_len, enforce_eager=True)  # the same kernels
    t0 = time.perf_counter()
    e = eager.generate([prompt], SamplingParams(), eager_tokens)[0]
    t_eager = time.perf_counter() - t0
    first_diff = next((i for i, (a, b) in enumerate(zip(e, tokens)) if a != b), None)
    assert first_diff is None, f"graph and eager steps differ first at new token {first_diff}"
    del eager, graph

    # A pass over the whole text (the flash attention kernel, not paged attention) at full length:
    # finite logits everywhere, and the greedy choice at each position mostly that of the decode
    # (teacher-forced: the two kernels round differently, so near-ties may flip, but a decode that
    # drifted at long range would disagree everywhere past the drift).
    with torch.no_grad():
        ids = torch.tensor([prompt + tokens[:-1]], device="cuda")
        full = model(ids)
        assert torch.isfinite(full).all(), "non-finite logits in the full-length pass"
        predicted = full[0, prompt_len - 1:].argmax(-1)
        del full
        agree = (predicted == torch.tensor(tokens, device="cuda")).float()
    quarters = [round(q.mean().item(), 3) for q in agree.chunk(4)]
    print(f"\n  graph decode of {new_tokens} tokens: {t_graph:.1f} s ({t_graph / new_tokens * 1e3:.2f} ms/token, "
          f"with capture); eager {eager_tokens} tokens: {t_eager:.1f} s; full-pass argmax = decoded token, "
          f"by quarter of the sequence: {quarters}")
    assert min(quarters) > 0.5, f"the decode disagrees with a full-length pass: agreement by quarter {quarters}"


def _sampling(mode: str, seed: int) -> SamplingParams:
    return {"greedy": SamplingParams(),
            "sample": SamplingParams(temperature=0.8, seed=seed),
            "top": SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=seed)}[mode]


def test_many_generate_calls_keep_memory_and_graph_count_steady():
    config = QwenConfig.from_dict(dict(model_type="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=32, tie_word_embeddings=True))
    model = random_model(config, dtype=torch.bfloat16, device="cuda", std=0.1)
    max_model_len = 128
    engine = Engine(model, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=max_model_len)
    bound = engine.capture_graphs()  # every shape now: then no call may allocate anything that stays
    modes = ("greedy", "sample", "top")

    rnd = random.Random(0)
    calls = []
    for i in range(199):
        n = rnd.choice([1, 1, 2, 3, 4, 5, 7, 8, 11])  # 11: more than max_num_seqs, some wait
        lengths = [rnd.randint(1, 90) for _ in range(n)]
        max_new = rnd.randint(1, max_model_len - max(lengths))
        mode = modes[(i + 1) % len(modes)]  # the first call samples (seeded): the last call repeats it
        stop = [rnd.randrange(config.vocab_size)] if i % 5 == 0 else []
        prompts = [[rnd.randrange(config.vocab_size) for _ in range(k)] for k in lengths]
        calls.append((prompts, min(max_new, 40), _sampling(mode, seed=i), stop))
    calls.append(calls[0])  # the last call repeats the first: same tokens (seeded) after 198 others

    memory, graphs, results = [], [], []
    t0 = time.perf_counter()
    for prompts, max_new, sampling, stop in calls:
        tokens = engine.generate(prompts, sampling, max_new, stop)
        torch.cuda.synchronize()
        memory.append(torch.cuda.memory_allocated())
        graphs.append(len(engine.runner.graphs.graphs))
        results.append(tokens)
        assert all(0 <= t < config.vocab_size for row in tokens for t in row)
        assert all(len(row) <= max_new for row in tokens)
    elapsed = time.perf_counter() - t0

    changed = [(i, memory[i] - memory[i - 1], graphs[i] - graphs[i - 1]) for i in range(1, len(calls))
               if memory[i] != memory[i - 1]]
    print(f"\n  {len(calls)} generate calls in {elapsed:.1f} s; {graphs[-1]} graphs (bound {bound}); "
          f"memory_allocated after the first call {memory[0]} B, after the last {memory[-1]} B")
    assert memory[-1] == memory[0] and not changed, (
        f"device memory in use changed over {len(calls)} calls; (call, bytes, graphs captured in that call) where it "
        f"changed: {changed[:20]}")
    assert graphs[-1] == bound == len(engine.runner.all_keys())
    assert results[-1] == results[0], "a repeated seeded call gave other tokens after 198 calls"
