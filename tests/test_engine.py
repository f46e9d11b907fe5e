"""The engine end to end: greedy tokens equal the model's own greedy continuation without a cache
(``recompute_greedy``; the model itself is held to transformers' by the parity tests), whether a
sequence runs alone, joins a running batch of other lengths, is prefilled in chunks, finds its
prefix in the cache or is preempted and recomputed, whichever decode kernels its steps take;
seeded sampling does not depend on the batch. float64 models: the PyTorch reference ops, exact and fast on the CPU; the
`cuda` cases run the kernels on a GPU."""


import threading
import time
from types import SimpleNamespace

import pytest
import torch

from modeling import QwenConfig
from modeling.engine import Engine, Status
from modeling.engine import engine as engine_module
from modeling.engine import runner as runner_module
from modeling.engine.prompts import ContextLengthError
from modeling.engine.runner import decode_kernels
from modeling.engine.sampling_params import SamplingParams
from modeling.model.random_checkpoint import random_model
from tests.helpers import recompute_greedy

QWEN3 = dict(model_type="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
QWEN3_5 = dict(model_type="qwen3_5_text", vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32, full_attention_interval=2,
               tie_word_embeddings=True)
GREEDY = SamplingParams()


def model_of(config, dtype=torch.float64, device="cpu"):
    return random_model(QwenConfig.from_dict(config), dtype=dtype, device=device, std=0.2, seed=0)


def prompts_of(lengths, vocab=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def setup(request):
    config = QWEN3 if request.param == "qwen3" else QWEN3_5
    model = model_of(config)
    prompts = prompts_of([5, 37, 1, 70, 16])
    return request.param, model, prompts, recompute_greedy(model, prompts, 10)


def test_one_continuous_batch_equals_recomputing(setup):
    _, model, prompts, want = setup
    engine = Engine(model, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=16)
    assert engine.generate(prompts, GREEDY, 10) == want
    assert engine.blocks.num_free == engine.size.num_blocks  # every block given back


def test_a_starting_sequence_ignores_what_its_state_slot_held():
    """State slots and KV blocks are not cleared when a sequence takes them: every recurrent op must
    read zeros for a sequence that starts (first position 0), and attention only positions written
    before, so a pool full of huge values changes no token."""
    model = model_of(QWEN3_5)
    prompts = prompts_of([5, 37, 1, 70, 16])
    engine = Engine(model, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=16)
    for entry in engine.pool.layers:
        for t in entry:
            t.fill_(1e6)
    assert engine.generate(prompts, GREEDY, 10) == recompute_greedy(model, prompts, 10)


def test_chunked_prefill_and_a_tiny_budget(setup):
    kind, model, prompts, want = setup
    engine = Engine(model, max_num_seqs=3, max_num_batched_tokens=70 if kind == "qwen3_5" else 9, max_model_len=128,
                    block_size=16)
    assert engine.generate(prompts, GREEDY, 10) == want


def test_a_sequence_joining_a_running_batch(setup):
    _, model, prompts, want = setup
    engine = Engine(model, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=128, block_size=16)
    first = [engine.add(p, GREEDY, 10) for p in prompts[:3]]
    for _ in range(5):
        engine.step()
    late = [engine.add(p, GREEDY, 10) for p in prompts[3:]]
    while engine.has_work():
        engine.step()
    assert [s.output_ids for s in first + late] == want


def test_preemption_recomputes_and_loses_nothing(setup):
    _, model, prompts, want = setup
    # 6 blocks of 16: the five requests need 13 at their longest, so some are preempted
    engine = Engine(model, max_num_seqs=6, max_num_batched_tokens=256, max_model_len=96, block_size=16, num_blocks=6)
    assert engine.generate(prompts, GREEDY, 10) == want
    assert engine.scheduler.preemptions > 0


def test_one_sequence_after_another_with_tables_of_one_length(setup):
    """One sequence a step, each the previous one's successor with as many KV blocks (2 of 16
    positions: a 20-token prompt, and 20 + 10 positions at the end): the runner copies the step's
    block table rows whenever its sequences change, not only when a table grows."""
    _, model, _, _ = setup
    prompts = prompts_of([20, 20, 20], seed=3)
    engine = Engine(model, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64, block_size=16,
                    prefix_caching=False)
    assert engine.generate(prompts, GREEDY, 10) == recompute_greedy(model, prompts, 10)


def test_prefix_caching_reuses_blocks_with_the_same_tokens():
    model = model_of(QWEN3)
    shared = prompts_of([40])[0]
    prompts = [shared + [1, 2, 3], shared + [4, 5]]
    want = recompute_greedy(model, prompts, 8)
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=16)
    assert engine.generate(prompts[:1], GREEDY, 8) == want[:1]
    second = engine.add(prompts[1], GREEDY, 8)
    engine.step()
    assert second.num_cached == 32  # two full blocks of the shared 40 tokens
    while engine.has_work():
        engine.step()
    assert second.output_ids == want[1]


def test_a_graph_capture_warm_up_after_any_step_stays_in_bounds():
    """A capture runs the step body on reset buffers before its first replay: after a large mixed
    step, the reset state must be valid for every smaller shape (the CPU raises on a bad index)."""
    engine = Engine(model_of(QWEN3), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=16)
    engine.generate(prompts_of([60, 3]), GREEDY, 2)
    runner = engine.runner
    for key in [("mixed", t, s) for t in runner.token_buckets for s in runner.seq_buckets[1:]] + \
            [("decode", s, s) for s in runner.seq_buckets]:
        runner.shape = key
        runner._reset()
        runner._body(key)()
        assert torch.isfinite(runner.logits[key]).all()


def test_stats_count_graph_captures_apart_from_scheduling(monkeypatch):
    """A step shape's first step captures its graph inside ``prepare``: the engine's stats count that
    host time as ``capture_s``, not as scheduling. The engine and the runner read a stand-in clock
    that moves only while a graph is made (no real time is read or compared)."""
    engine = Engine(model_of(QWEN3), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=16)
    clock = [0.0]
    fake_time = SimpleNamespace(perf_counter=lambda: clock[0], monotonic=time.monotonic, sleep=time.sleep)
    monkeypatch.setattr(engine_module, "time", fake_time)
    monkeypatch.setattr(runner_module, "time", fake_time)
    make = engine.runner.graphs.get

    def slow_make(key, body):
        clock[0] += 10.0
        return make(key, body)

    monkeypatch.setattr(engine.runner.graphs, "get", slow_make)
    engine.generate(prompts_of([20, 3]), GREEDY, 4)
    shapes = len(engine.runner.replays)
    assert shapes >= 2  # a mixed and a decode shape at least
    assert engine.stats.capture_s == 10.0 * shapes
    assert engine.stats.schedule_s == engine.stats.launch_s == engine.stats.sample_s == 0.0
    assert f"graph capture {10.0 * shapes:.2f}" in engine.stats.describe()


def test_hybrid_models_reuse_no_prefix():
    engine = Engine(model_of(QWEN3_5), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128, block_size=16)
    assert not engine.blocks.prefix_caching


def test_seeded_sampling_does_not_depend_on_the_batch(setup):
    _, model, prompts, _ = setup
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    alone = Engine(model, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=16)
    want = alone.generate(prompts[1:2], params, 10)
    crowd = Engine(model, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=16)
    others = [crowd.add(p, SamplingParams(temperature=1.0, seed=i), 10) for i, p in enumerate(prompts[2:])]
    mine = crowd.add(prompts[1], params, 10)
    while crowd.has_work():
        crowd.step()
    assert mine.output_ids == want[0] and all(s.status is Status.FINISHED for s in others)


def test_a_one_token_prompt_chunk_beside_decoding_sequences_samples_nothing():
    """Three sampling sequences decode while a 10-token prompt gets the budget's last token: a step
    of one token a sequence in which one sequence samples nothing (a mixed step, not a decode one).
    Each seeded sequence samples what it samples alone."""
    model = model_of(QWEN3)
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(4)]
    prompts = prompts_of([1, 1, 1, 10])
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=4, max_model_len=64, block_size=16)
    seqs = [engine.add(p, q, 8) for p, q in zip(prompts[:3], params)]
    engine.step()
    engine.step()
    seqs.append(engine.add(prompts[3], params[3], 8))
    while engine.has_work():
        engine.step()
    alone = [Engine(model, max_num_seqs=1, max_num_batched_tokens=4, max_model_len=64,
                    block_size=16).generate([p], q, 8)[0] for p, q in zip(prompts, params)]
    assert [s.output_ids for s in seqs] == alone


def test_abort_frees_the_blocks_and_stop_tokens_finish():
    model = model_of(QWEN3)
    prompts = prompts_of([20, 20])
    want = recompute_greedy(model, prompts[:1], 6)[0]
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=16)
    stopped = engine.add(prompts[0], GREEDY, 50, stop_token_ids=[want[3]])
    aborted = engine.add(prompts[1], GREEDY, 50)
    engine.step()
    engine.abort(aborted)
    while engine.has_work():
        engine.step()
    assert aborted.finish_reason == "abort" and stopped.finish_reason == "stop"
    assert stopped.output_ids == want[:4] and engine.blocks.num_free == engine.size.num_blocks


def test_aborts_from_other_threads_take_the_engine_lock(monkeypatch):
    """abort is called from other threads (the server's loop thread, a client gone) while a step may
    be scheduling: it finishes the sequence under the engine's lock, as schedule runs. Then a run
    with aborts from eight threads racing the steps ends with every sequence finished and every
    block free."""
    model = model_of(QWEN3)
    engine = Engine(model, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=16)
    finish, locked = engine.scheduler.finish, []

    def recording(seq, reason=None):
        if reason == "abort":
            locked.append(engine._lock.locked())
        return finish(seq, reason)

    monkeypatch.setattr(engine.scheduler, "finish", recording)
    seq = engine.add(prompts_of([9])[0], GREEDY, 20)
    engine.step()
    engine.abort(seq)
    assert locked == [True] and seq.finish_reason == "abort"

    seqs = [engine.add(p, GREEDY, 30) for p in prompts_of([5, 9, 3, 17, 2, 11, 6, 8], seed=2)]
    go = threading.Barrier(len(seqs) + 1)

    def abort_later(s):
        go.wait()
        engine.abort(s)

    threads = [threading.Thread(target=abort_later, args=(s,)) for s in seqs]
    for t in threads:
        t.start()
    engine.step()
    go.wait()
    while engine.has_work():
        engine.step()
    for t in threads:
        t.join()
    assert all(s.status is Status.FINISHED for s in seqs) and all(locked)
    assert engine.blocks.num_free == engine.size.num_blocks


def test_requests_that_cannot_fit_are_refused():
    """What ``add`` refuses, each a ``ValueError`` naming it; a request that fits exactly runs."""
    engine = Engine(model_of(QWEN3), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, block_size=16)
    with pytest.raises(ContextLengthError, match="max_model_len 64 .max_tokens of at most 4 fit"):
        engine.add(list(range(60)), GREEDY, 10)
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.add([], GREEDY, 10)
    with pytest.raises(ValueError, match=r"outside the model's vocabulary \[0, 96\)"):
        engine.add([96], GREEDY, 1)
    with pytest.raises(ValueError, match=r"the prompt\[1\] must be an integer token id, got 2.0"):
        engine.add([1, 2.0], GREEDY, 1)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got 0"):
        engine.add([1], GREEDY, 0)
    assert engine.generate([list(range(54))], GREEDY, 10)[0] == recompute_greedy(engine.model, [list(range(54))], 10)[0]
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1"):
        Engine(engine.model, max_num_seqs=0)
    positions = engine.model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"max_model_len {positions + 1} exceeds the model's "
                                         f"max_position_embeddings \\({positions}\\)"):
        Engine(engine.model, max_num_seqs=2, max_model_len=positions + 1)
    assert Engine(engine.model, max_num_seqs=1, max_num_batched_tokens=64).max_model_len == positions


def test_the_kernels_path_equals_recomputing():
    """fp32: the Triton kernels (the interpreter on the CPU) in the engine's padded steps."""
    model = model_of(QWEN3, dtype=torch.float32)
    prompts = prompts_of([5, 37])
    want = recompute_greedy(model, prompts, 4)
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=16)
    assert engine.generate(prompts, GREEDY, 4) == want


@pytest.mark.parametrize("kernels, op", [("persistent", "decode_layers"), ("fused", "norm_qkv_rope_store")])
def test_decode_steps_through_the_decode_kernels_equal_recomputing(kernels, op):
    """fp32, the decode kernels forced (``decode_kernels``): the persistent kernel (every layer in
    ``qwen::decode_layers`` over the pool's stacked caches) or the fused decode ops, under the
    interpreter; three sequences in the 4-row graph shape (a padding row, whose stale block table
    row they must not write through), then fewer as they finish."""
    import qwen_ops

    model = model_of(QWEN3, dtype=torch.float32)
    prompts = prompts_of([5, 37, 20])
    want = recompute_greedy(model, prompts, 4)
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=16,
                    decode_kernels=kernels)
    seqs = [engine.add(p, GREEDY, n) for p, n in zip(prompts, (4, 2, 3))]
    calls = qwen_ops.kernel_calls[op]
    while engine.has_work():
        engine.step()
    assert qwen_ops.kernel_calls[op] > calls, f"{op} did not run"
    assert [s.output_ids for s in seqs] == [w[:n] for w, n in zip(want, (4, 2, 3))]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_graph_steps_equal_eager_steps_qwen3_0_6b_shape(dtype):
    """The Qwen3-0.6B shape: the engine's CUDA-graph steps give the eager steps' tokens, greedy and
    seeded (top-k / top-p) sampling, a ragged batch beside one sequence alone (the persistent
    decode kernel at one row, the op-by-op steps at more)."""
    from modeling.model.random_checkpoint import QWEN3_0_6B

    model = random_model(QwenConfig.from_dict(QWEN3_0_6B), dtype=dtype, device="cuda", std=0.02)
    prompts = prompts_of([17, 64, 5, 200], vocab=QWEN3_0_6B["vocab_size"])
    for params in (GREEDY, SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=3)):
        runs = [Engine(model, max_num_seqs=4, max_model_len=512, enforce_eager=eager).generate(prompts, params, 24)
                for eager in (False, True)]
        alone = Engine(model, max_num_seqs=1, max_model_len=512).generate(prompts[:1], params, 24)
        assert runs[0] == runs[1] and len({tuple(t) for t in runs[0]}) == 4
        if dtype == torch.float32:
            assert alone[0] == runs[0][0]


@pytest.mark.cuda
@pytest.mark.parametrize("up_front", [False, True], ids=["as-shapes-occur", "captured-up-front"])
@pytest.mark.parametrize("config", [QWEN3, QWEN3_5], ids=["qwen3", "qwen3_5"])
def test_engine_on_cuda_equals_recomputing(config, up_front):
    """Graphs captured as shapes first occur, or all captured up front as a server does
    (``capture_graphs``: the mixed graphs share one logits buffer). Four sequences at once and 48
    tokens a step: eight prompts queue, long ones take several chunks, and capturing every shape
    up front stays a few hundred graphs."""
    model = model_of(config, dtype=torch.float32, device="cuda")
    prompts = prompts_of([5, 37, 1, 70, 16, 23, 300, 129])
    want = recompute_greedy(model, prompts, 16)
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=48, max_model_len=512, block_size=16,
                    gpu_memory_utilization=0.1)
    if up_front:
        assert engine.capture_graphs() == len(engine.runner.all_keys())
    assert engine.generate(prompts, GREEDY, 16) == want


def test_hybrid_mixed_steps_in_the_padded_bodies(monkeypatch):
    """A hybrid model's mixed steps (prefill chunks beside decode tokens) through the runner's padded
    mixed bodies, as its step graphs would run them (eager on the CPU: a padding sequence holding the
    padding tokens, empty ones after it, all on the padding state slot): the recomputed tokens."""
    model = model_of(QWEN3_5)
    prompts = prompts_of([5, 37, 1, 70, 16])
    want = recompute_greedy(model, prompts, 10)
    engine = Engine(model, max_num_seqs=3, max_num_batched_tokens=40, max_model_len=128, block_size=16)
    runner, kinds = engine.runner, []
    key = runner.key

    def recorded(num_tokens, num_seqs, decode_only):
        k = key(num_tokens, num_seqs, decode_only)
        kinds.append(k[0])
        return k

    monkeypatch.setattr(runner, "key", recorded)
    assert engine.generate(prompts, GREEDY, 10) == want
    assert "mixed" in kinds and "decode" in kinds


@pytest.mark.parametrize("max_num_seqs", [6, 8])
def test_capture_all_takes_exactly_the_shapes_steps_run_in(max_num_seqs):
    """``StepRunner.all_keys`` (what a server captures before its first client) is the set of graph
    keys of every step the scheduler can make: S decoding sequences (1..max_num_seqs), or S
    sequences sharing n tokens in a prefill or mixed step (S <= n <= the token budget)."""
    engine = Engine(model_of(QWEN3), max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=128,
                    block_size=16)
    runner = engine.runner

    steps = {runner.key(s, s, True) for s in range(1, max_num_seqs + 1)}
    steps |= {runner.key(n, s, False) for s in range(1, max_num_seqs + 1) for n in range(s, 65)}
    assert set(runner.all_keys()) == steps and len(runner.all_keys()) == len(steps)


class RecordingGraphs:
    """A stand-in for the runner's CUDA graph cache on the CPU: a "capture" resets the buffers and
    runs the body once, as a capture's warm-up does; a "replay" runs the body."""

    enabled = True

    def __init__(self, reset):
        self.reset, self.graphs = reset, {}

    def get(self, key, body):
        if key not in self.graphs:
            self.reset()
            body()
            self.graphs[key] = body
        return self.graphs[key]


def test_steps_captured_at_their_first_occurrence_get_the_eager_tokens():
    """A step whose shape is new captures its graph inside ``StepRunner.run`` (the capture resets
    the static buffers, so the step's batch must be copied in after it): with the CPU stand-in
    for the graph cache, every step's first occurrence is such a capture."""
    model, prompts = model_of(QWEN3), prompts_of([5, 37, 1, 70, 16])
    settings = dict(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=128, block_size=16)
    want = Engine(model, **settings).generate(prompts, GREEDY, 6)
    engine = Engine(model, **settings)
    engine.runner.graphs = RecordingGraphs(engine.runner._reset)
    assert engine.generate(prompts, GREEDY, 6) == want
    assert len(engine.runner.graphs.graphs) > 3  # decode and mixed shapes were captured on the way


def test_a_server_warm_up_captures_every_shape_and_changes_no_token():
    """``engine_process.warm_up`` runs every shape's step body on the runner's reset buffers:
    afterwards no block is held, nothing is left to capture, and requests get the tokens they get
    from an engine that never warmed up."""
    from modeling.serve.engine_process import warm_up

    model, prompts = model_of(QWEN3_5), prompts_of([5, 37, 1, 70, 16])
    settings = dict(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=128, block_size=16)
    want = Engine(model, **settings).generate(prompts, GREEDY, 6)
    engine = Engine(model, **settings)
    engine.runner.graphs = RecordingGraphs(engine.runner._reset)
    warm_up(engine)
    assert list(engine.runner.graphs.graphs) == engine.runner.all_keys()
    assert engine.capture_graphs() == 0
    assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.has_work()
    assert engine.generate(prompts, GREEDY, 6) == want


def test_decode_kernel_table():
    """``runner.decode_kernels``' table (measured on an H100): on CUDA one sequence of a model the
    persistent kernels take, hidden size at most 2048 and at most 4096 positions, runs them (bf16 or
    FP8, Qwen3 or Qwen3.5's hybrid kernel), wider models and longer engines the fused ops; two to
    eight sequences the dense persistent kernel on 16-bit weights, else the fused ops, more op by
    op; on the CPU one sequence the fused ops, more op by op; a model the fused ops do not take
    (experts, tensor-parallel) always op by op."""
    def model(hidden=1024, device="cuda", persistent=True, hybrid=False, fused=True, fp8=False):
        return SimpleNamespace(supports_fused_decode=fused, supports_persistent_decode=persistent and not hybrid,
                               supports_hybrid_persistent_decode=persistent and hybrid, device=torch.device(device),
                               config=SimpleNamespace(hidden_size=hidden), holds_fp8=fp8)
    assert decode_kernels(model(), 1, 4096) == "persistent"
    assert decode_kernels(model(hidden=2048, hybrid=True), 1, 4096) == "persistent"
    assert decode_kernels(model(hidden=4096), 1, 4096) == "fused"
    assert decode_kernels(model(hidden=4096, hybrid=True), 1, 4096) == "fused"
    assert decode_kernels(model(), 1, 8192) == "fused"
    assert decode_kernels(model(persistent=False), 1, 4096) == "fused"
    assert [decode_kernels(model(), n, 4096) for n in (2, 8, 9)] == ["persistent", "persistent", "ops"]
    assert decode_kernels(model(fp8=True), 1, 4096) == "persistent"
    assert [decode_kernels(model(fp8=True), n, 4096) for n in (2, 8)] == ["fused", "fused"]
    assert [decode_kernels(model(hybrid=True), n, 4096) for n in (2, 8, 9)] == ["fused", "fused", "ops"]
    assert [decode_kernels(model(hidden=4096), n, 4096) for n in (2, 8)] == ["fused", "fused"]
    assert decode_kernels(model(), 8, 8192) == "fused"
    assert [decode_kernels(model(device="cpu"), n, 4096) for n in (1, 2)] == ["fused", "ops"]
    assert [decode_kernels(model(fused=False), n, 4096) for n in (1, 2)] == ["ops", "ops"]
