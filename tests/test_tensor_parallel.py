"""Tensor parallelism (``modeling.model.tensor_parallel``) on the CPU: the split rules; each rank's
shards read as slices of the checkpoint tensors and equal to the rows and columns of the whole
model's; and two ranks (processes over gloo) against one: fp32 logits of a pass without a cache
within 1e-5, and greedy tokens through the engine (each rank runs the same engine steps, the paged
cache and the real forward) equal but after a near-tie, for Qwen3 with 2 KV heads (untied lm_head),
Qwen3 with 1 KV head (replicated on both ranks), Qwen2 (the q, k, v bias; a transformers
checkpoint) and Qwen3.5 (Gated DeltaNet with 2 and with 1 key heads, gated attention). The ranks
run the ops' PyTorch references (no TRITON_INTERPRET: the split is what is tested, the kernels'
agreement with the references is the op tests'), and rank 0 runs the one-device model too.
"""

import math
import os
import signal
from collections import Counter
from dataclasses import replace
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import modeling.model.loader as loader
from modeling.model.causal_lm import QwenForCausalLM
from modeling.model.config import QwenConfig
from modeling.model.device import weight_bytes
from modeling.model.random_checkpoint import build_random_checkpoint, config_dict
from modeling.model.tensor_parallel import SINGLE, Split, TensorParallel
from tests.helpers import engine_greedy, prompt, rel_err

WORLD = 2
CASES = {
    "qwen3-2-kv-heads": dict(tie_word_embeddings=False),
    "qwen3-1-kv-head": dict(num_key_value_heads=1),
    "qwen3.5": dict(model_type="qwen3_5_text"),
    "qwen3.5-1-key-head": dict(model_type="qwen3_5_text", linear_num_key_heads=1),
}
QWEN2 = "qwen2-qkv-bias"  # a transformers Qwen2 (tests.test_modeling.random_hf_model): untied, 4 / 2 heads of 32
PROMPT_LEN, NEW_TOKENS = 12, 8


def test_heads_split_evenly_or_replicate():
    """n >= W heads: rank r takes [r n/W, (r+1) n/W); n < W: head r n // W (the one its query
    heads read); anything else is refused."""
    assert [TensorParallel(r, 2).heads(4) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [TensorParallel(r, 2).heads(1) for r in range(2)] == [range(0, 1), range(0, 1)]
    assert [TensorParallel(r, 4).heads(2) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert SINGLE.heads(3) == range(3)
    with pytest.raises(ValueError, match="3 heads do not split over 2 ranks"):
        TensorParallel(0, 2).heads(3)
    with pytest.raises(ValueError, match="3 heads do not replicate over 4 ranks"):
        TensorParallel(0, 4).heads(3)


def test_ranges_take_each_section_by_heads():
    """A fused tensor (the Gated DeltaNet's q, k, v channels: 2, 2 and 4 heads of 32) splits
    section by section."""
    split = Split(0, ((2, 32), (2, 32), (4, 32)))
    assert TensorParallel(0, 2).ranges(split) == [(0, 32), (64, 96), (128, 192)]
    assert TensorParallel(1, 2).ranges(split) == [(32, 64), (96, 128), (192, 256)]
    assert TensorParallel(1, 4).ranges(split) == [(0, 32), (64, 96), (160, 192)]


def test_local_config_and_refusals():
    config = QwenConfig.from_dict(config_dict(512, num_key_value_heads=1))
    assert SINGLE.local_config(config) is config
    local = TensorParallel(1, 2).local_config(config)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (2, 1, 128)
    assert (local.hidden_size, local.vocab_size, local.head_dim) == (128, 512, 32)
    hybrid = TensorParallel(0, 4).local_config(QwenConfig.from_dict(config_dict(512, model_type="qwen3_5_text")))
    assert (hybrid.linear_num_key_heads, hybrid.linear_num_value_heads, hybrid.num_attention_heads) == (1, 1, 1)
    with pytest.raises(ValueError, match="num_attention_heads 4 does not split over tensor_parallel_size 8"):
        TensorParallel(0, 8).local_config(config)
    with pytest.raises(ValueError, match="num_key_value_heads: 3 heads do not split over 2 ranks"):
        TensorParallel(0, 2).local_config(QwenConfig.from_dict(config_dict(512, num_attention_heads=6,
                                                                           num_key_value_heads=3)))
    with pytest.raises(ValueError, match="vocab_size 510 does not split"):
        TensorParallel(0, 4).local_config(QwenConfig.from_dict(config_dict(510)))
    with pytest.raises(ValueError, match="mixture-of-experts and FP8 models run on one device"):
        TensorParallel(0, 2).local_config(QwenConfig.from_dict(config_dict(512) | dict(
            model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)))


def test_one_device_adds_nothing():
    """World size 1: the collectives return their input, the lookup is the plain embedding."""
    x = torch.randn(3, 8)
    assert SINGLE.all_reduce(x) is x and SINGLE.gather_logits(x) is x
    ids = torch.tensor([0, 2, 1])
    assert torch.equal(SINGLE.embedding(ids, x), x[ids])


def test_split_model_runs_op_by_op():
    """A split model takes neither the fused decode ops nor the persistent kernel, and does not
    train; its shards are its rank's sizes."""
    config = QwenConfig.from_dict(config_dict(512, tie_word_embeddings=False))
    with torch.device("meta"):
        model = QwenForCausalLM(config, TensorParallel(1, 2))
    assert not model.supports_fused_decode and not model.supports_persistent_decode
    with pytest.raises(ValueError, match="loss takes a model on one device"):
        model.loss(torch.zeros(1, 4, dtype=torch.long))
    layer = model.layers[0]
    assert model.embed_tokens.shape == model.lm_head.shape == (256, 128)
    assert layer.qkv_weight.shape == ((2 + 2 * 1) * 32, 128) and layer.o_weight.shape == (128, 2 * 32)
    assert layer.gate_up_weight.shape == (2 * 128, 128) and layer.down_weight.shape == (128, 128)


@contextmanager
def recorded_reads():
    """Patch the loader's ``safe_open``: the elements read of each tensor, whole (``get_tensor``)
    or as slices (``get_slice(name)[...]``), counted by name."""
    reads = Counter()
    real = loader.safe_open

    class Slice:
        def __init__(self, tensor_slice, name):
            self.slice, self.name = tensor_slice, name

        def __getitem__(self, index):
            part = self.slice[index]
            reads[self.name] += part.numel()
            return part

        def __getattr__(self, attr):  # get_shape, get_dtype: the header only
            return getattr(self.slice, attr)

    class Handle:
        def __init__(self, *args, **kwargs):
            self.handle = real(*args, **kwargs)

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_tensor(self, name):
            t = self.handle.get_tensor(name)
            reads[name] += t.numel()
            return t

        def get_slice(self, name):
            return Slice(self.handle.get_slice(name), name)

    with mock.patch.object(loader, "safe_open", Handle):
        yield reads


@pytest.mark.parametrize("case", ["qwen3-2-kv-heads", "qwen3-1-kv-head", QWEN2, "qwen3.5-1-key-head"])
def test_rank_reads_only_its_slices(checkpoints, case):
    """Each rank reads its slices of every split tensor and nothing more of it (replicated tensors
    whole); its shards are the whole model's rows and columns of its heads: q, k, v rows of each
    attention QKV and its bias (the one KV head on both ranks where there is one), the q, k, v channels, z, b, a
    rows of each Gated DeltaNet in_proj, gate and up rows, o_proj / down / out_proj columns, the
    vocabulary rows of the embedding and lm_head. The memory check counts the rank's bytes."""
    path = checkpoints[case]
    config = QwenConfig.from_pretrained(path)
    whole = loader.load_state_dict(path, config, dtype=torch.float32)
    sizes = {name: shape for sources in loader.load_plan(config).values() for name, shape in sources}
    splits = loader.split_plan(config)
    for rank in range(WORLD):
        parallel = TensorParallel(rank, WORLD)
        with recorded_reads() as reads:
            shards = loader.load_state_dict(path, config, dtype=torch.float32, parallel=parallel)
        for name, shape in sizes.items():
            numel = math.prod(shape)
            if name in splits:  # the rank's elements along the split dim, whole along the others
                numel = numel // shape[splits[name].dim] * sum(b - a for a, b in parallel.ranges(splits[name]))
            assert reads[name] == numel, name
        assert shards.keys() == whole.keys()
        assert weight_bytes(config, torch.float32, parallel=parallel) == sum(4 * t.numel() for t in shards.values())
        for target, tensor in shards.items():
            assert torch.equal(tensor, _shard_of(whole[target], target, config, parallel)), target


def _shard_of(tensor: torch.Tensor, target: str, config: QwenConfig, parallel: TensorParallel) -> torch.Tensor:
    """Rank ``parallel.rank``'s rows / columns of the whole model's tensor ``target``, from the
    sources of the plan and their splits."""
    sources = loader.load_plan(config)[target]
    splits = loader.split_plan(config)
    parts, row = [], 0
    for name, shape in sources:
        source = tensor[row : row + shape[0]]
        row += shape[0]
        split = splits.get(name)
        if split is None:
            parts.append(source)
            continue
        parts.append(torch.cat([source.narrow(split.dim, a, b - a) for a, b in parallel.ranges(split)], split.dim))
    return torch.cat(parts)


@torch.no_grad()
def _run(model) -> dict:
    """The model's logits [2, PROMPT_LEN, V] of the prompt without a cache, and its greedy tokens
    [2, NEW_TOKENS] through the engine."""
    ids = prompt(2, PROMPT_LEN, model.config.vocab_size)
    return dict(logits=model(ids), tokens=engine_greedy(model, ids, NEW_TOKENS))


def _rank(rank: int, init_method: str, paths: dict, out: str) -> None:
    """One rank of the two: each checkpoint's TP-2 ``_run``; rank 0 also the one-device model's,
    with the logits of its prompt and tokens (``forced``: row i chose token i), and saves them."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
    try:
        parallel = TensorParallel.from_group()
        results = {}
        for case, path in paths.items():
            tp = _run(QwenForCausalLM.from_pretrained(path, dtype=torch.float32, parallel=parallel))
            if rank == 0:
                model = QwenForCausalLM.from_pretrained(path, dtype=torch.float32)
                one = _run(model)
                ids = prompt(2, PROMPT_LEN, model.config.vocab_size)
                with torch.no_grad():
                    one["forced"] = model(torch.cat([ids, one["tokens"]], 1))[:, PROMPT_LEN - 1 : -1]
                results[case] = dict(tp=tp, one=one)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.test_modeling import random_hf_model, save_checkpoint  # transformers: here, not in the ranks

    root = tmp_path_factory.mktemp("tp")
    paths = {case: str(build_random_checkpoint(root / case, **sizes)) for case, sizes in CASES.items()}
    paths[QWEN2] = str(save_checkpoint(random_hf_model("qwen2", False, 4, 2, 32), root / QWEN2))
    return paths


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory):
    """Every case's ``_rank`` results from two processes over gloo."""
    root = tmp_path_factory.mktemp("tp-run")
    out = str(root / "results.pt")
    with mock.patch.dict(os.environ):
        os.environ.pop("TRITON_INTERPRET", None)  # the ranks run the references
        # join: returns when both finish; a rank that fails ends the other and raises here
        mp.start_processes(_rank, (f"file://{root / 'init'}", checkpoints, out), nprocs=WORLD, start_method="spawn")
    return torch.load(out)


@pytest.mark.parametrize("case", [*CASES, QWEN2])
def test_two_ranks_match_one(two_ranks, case):
    """TP-2 against TP-1 (fp32): logits within 1e-5; greedy tokens equal, or a row's first
    difference at a near-tie (the TP-1 logits of the two tokens within 1e-4 of the row's largest)."""
    tp, one = two_ranks[case]["tp"], two_ranks[case]["one"]
    assert rel_err(tp["logits"], one["logits"]) < 1e-5
    tokens, ref_tokens = tp["tokens"], one["tokens"]
    assert len(set(ref_tokens.flatten().tolist())) > 2  # not a trivial repetition
    for b in range(tokens.shape[0]):
        differ = (tokens[b] != ref_tokens[b]).nonzero()
        if len(differ):
            i = int(differ[0])
            row = one["forced"][b, i]
            gap = row[ref_tokens[b, i]] - row[tokens[b, i]]
            assert gap <= 1e-4 * row.abs().max(), f"row {b} token {i} differs without a near-tie (gap {float(gap):.3g})"


@pytest.mark.parametrize("case", ["qwen3-2-kv-heads", "qwen3.5"])
def test_llm_with_workers_matches_one_device(checkpoints, case):
    """``LLM(..., tensor_parallel_size=2)``: this process is rank 0 and starts one worker; greedy
    and seeded tokens, n completions and prompt logprobs equal the one-device LLM's (fp64: every process runs the
    reference ops), over
    prefill, mixed and decode steps with the lookahead (penalties defer the sampling)."""
    from modeling import LLM, SamplingParams

    path = checkpoints[case]
    prompts = [{"prompt_token_ids": list(range(3 + i, 30 + 5 * i))} for i in range(3)]
    cases = [SamplingParams(max_tokens=10, temperature=0),
             SamplingParams(max_tokens=10, temperature=0.9, seed=5, n=2, presence_penalty=0.5),
             SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2)]
    outputs = {}
    for size in (1, 2):
        llm = LLM(path, device="cpu", dtype=torch.float64, tensor_parallel_size=size, progress=False)
        try:
            outputs[size] = [llm.generate(prompts, params, use_tqdm=False) for params in cases]
        finally:
            llm.close()
    for one, two in zip(outputs[1], outputs[2]):
        for a, b in zip(one, two):
            assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
            if a.prompt_logprobs is not None:
                for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                    assert x.keys() == y.keys()
                    assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    assert len({tuple(c.token_ids) for r in outputs[2][1] for c in r.outputs}) > 1


def test_a_worker_that_dies_ends_the_engine(checkpoints, monkeypatch):
    """A worker killed mid-step (after it took the step, before rank 0's collectives): the call
    raises ``WorkerDied`` naming rank 1 (the failed collective is traced to the dead worker), and
    ``close`` still returns."""
    from modeling import LLM, SamplingParams
    from modeling.engine.workers import WorkerDied

    llm = LLM(checkpoints["qwen3-2-kv-heads"], device="cpu", dtype=torch.float64, tensor_parallel_size=2,
              progress=False)
    try:
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), use_tqdm=False)
        send, steps = llm.workers.send, []

        def send_then_kill(message):
            send(message)
            steps.append(message[0])
            if steps.count("step") == 3:
                llm.workers.procs[0].kill()
                llm.workers.procs[0].join()

        monkeypatch.setattr(llm.workers, "send", send_then_kill)
        with pytest.raises(WorkerDied, match="tensor-parallel worker rank 1 exited"):
            llm.generate([{"prompt_token_ids": list(range(5, 40))}] * 4,
                         SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
        assert steps.count("step") == 3  # the step the worker died in: no later one was sent
    finally:
        llm.close()


def test_llm_refuses_a_split_that_does_not_fit(checkpoints):
    """A size that is not an integer >= 1, or one the model's heads do not split over, is refused
    before any process starts."""
    from modeling import LLM

    path = checkpoints["qwen3-2-kv-heads"]
    for bad in (0, 1.5, "2"):
        with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
            LLM(path, device="cpu", dtype="float32", tensor_parallel_size=bad, progress=False)
    with pytest.raises(ValueError, match="num_attention_heads 4 does not split over tensor_parallel_size 3"):
        LLM(path, device="cpu", dtype="float32", tensor_parallel_size=3, progress=False)


def test_fp8_quantization_with_a_split_is_refused_before_any_process_starts(checkpoints, monkeypatch, capsys):
    """``quantization="fp8"`` takes a model on one device: with ``tensor_parallel_size`` 2 it is
    refused at once, naming both, and no worker is started (one would fail loading, with a
    traceback of its own); both command lines refuse the two flags together in one line."""
    import modeling.api.llm as llm_module
    from modeling.generate import main as generate_main
    from modeling.serve.__main__ import main as serve_main

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(llm_module, "start_workers", no_workers)
    path = str(checkpoints["qwen3-2-kv-heads"])
    with pytest.raises(ValueError, match="quantization='fp8' .* tensor_parallel_size 2"):
        llm_module.LLM(path, device="cpu", dtype="float32", quantization="fp8", tensor_parallel_size=2,
                       progress=False)
    flags = ["--model", path, "--device", "cpu", "--quantization", "fp8", "--tensor-parallel-size", "2"]
    for main, argv in ((generate_main, ["--prompt", "hi", *flags]), (serve_main, flags)):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: --quantization fp8"), err
        assert "--tensor-parallel-size 2" in err[0]


def test_tp_bench_rows_on_the_cpu(checkpoints):
    """``bench.decode --tp``'s rows (``bench.tensor_parallel.decode_rows``): the checkpoint loaded at
    sizes 1 and 2 in turn (the workers stopped between), each size's ms a token and the ratio."""
    from bench import tensor_parallel as tp

    rows = tp.decode_rows(checkpoints["qwen3-2-kv-heads"], (1, 2), steps=3, context=8, device="cpu",
                          dtype=torch.float64)
    assert set(rows) == {"qwen3_8b_b1_ms_tp1", "qwen3_8b_b1_ms_tp2", "qwen3_8b_b1_tp2_over_tp1"}
    assert rows["qwen3_8b_b1_tp2_over_tp1"] == rows["qwen3_8b_b1_ms_tp2"] / rows["qwen3_8b_b1_ms_tp1"] > 0
    assert not dist.is_initialized()


def test_a_step_in_flight_is_read_before_a_larger_engine_and_close(checkpoints):
    """Penalties defer sampling, and a call that ends on a stop token leaves the step launched
    ahead in flight, its workers waiting for its tokens: the LLM reads it before it builds a larger
    engine (a 300-token prompt next: the same tokens as one device) and before ``close``, which then
    stops each worker cleanly (not after the collectives' timeout)."""
    from modeling import LLM, SamplingParams

    path = checkpoints["qwen3-2-kv-heads"]
    short = {"prompt_token_ids": list(range(3, 30))}
    long = {"prompt_token_ids": [(7 * i) % 500 + 1 for i in range(300)]}
    params = SamplingParams(max_tokens=10, temperature=0, presence_penalty=0.5)
    tokens = {}
    for size in (1, 2):
        llm = LLM(path, device="cpu", dtype=torch.float64, tensor_parallel_size=size, progress=False)
        try:
            first = llm.generate(short, params, use_tqdm=False)[0].outputs[0].token_ids
            stop = next(t for i, t in enumerate(first) if i >= 2 and t not in first[:i])
            stopped = llm.generate(short, replace(params, stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
            assert stopped.finish_reason == "stop" and llm.engine._inflight is not None  # a deferred step in flight
            tokens[size] = [first, stopped.token_ids, llm.generate(long, params, use_tqdm=False)[0].outputs[0].token_ids]
            assert llm.engine.max_model_len >= 310
            llm.generate(short, replace(params, stop_token_ids=[stop]), use_tqdm=False)
        finally:
            procs = llm.workers.procs if llm.workers is not None else []
            llm.close()
        assert all(p.exitcode == 0 for p in procs)  # each took "stop": none was waiting for the step's tokens
    assert tokens[1] == tokens[2]
    with pytest.raises(RuntimeError, match="this LLM was closed"):
        llm.generate(short, params, use_tqdm=False)


def test_a_failed_step_leaves_the_engine_refusing_steps(checkpoints, monkeypatch):
    """A step of rank 0 that raises after its workers started it (here its sampling) leaves them
    waiting for a collective it will not make: the error comes out, every later step is refused
    with ``WorkerDied`` saying so, and ``close`` kills the stuck worker instead of waiting for its
    collective's timeout."""
    import modeling.engine.engine as engine_module
    from modeling import LLM, SamplingParams
    from modeling.engine.workers import WorkerDied

    llm = LLM(checkpoints["qwen3-2-kv-heads"], device="cpu", dtype=torch.float64, tensor_parallel_size=2,
              progress=False)
    try:
        prompt = {"prompt_token_ids": list(range(3, 20))}
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)

        def broken(*args, **kwargs):
            raise ValueError("sampling broke")

        monkeypatch.setattr(engine_module, "sample_sequences", broken)
        with pytest.raises(ValueError, match="sampling broke"):
            llm.generate(prompt, SamplingParams(max_tokens=4), use_tqdm=False)
        monkeypatch.undo()
        with pytest.raises(WorkerDied, match="out of step"):
            llm.generate(prompt, SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        procs = llm.workers.procs
        llm.close()
    assert procs[0].exitcode == -signal.SIGKILL  # stopped at once, not left to its collective's timeout


def _free_rank(rank: int, init_method: str, cases: list, out: str) -> None:
    """One rank of ``least_free_memory`` in each case, with ``free[rank]`` bytes free (None: cannot
    tell) for each case's ``free``; saves what it got per case."""
    import modeling.engine.workers as workers

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=len(cases[0]))
    try:
        got = []
        for free in cases:
            with mock.patch.object(workers, "available_memory", lambda device: free[rank]):
                got.append(workers.least_free_memory(torch.device("cpu")))
        torch.save(got, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_every_rank_sizes_its_pool_from_the_fullest_device(tmp_path):
    """``least_free_memory``: every rank gets the least free memory of any rank (rank 0's pool size,
    which the workers build too), or None when a rank cannot tell. Two ranks, three cases in turn."""
    cases = [([5 << 30, 3 << 30], 3 << 30), ([2 << 30, 7 << 30], 2 << 30), ([4 << 30, None], None)]
    frees = [free for free, _ in cases]
    mp.start_processes(_free_rank, (f"file://{tmp_path / 'init'}", frees, str(tmp_path / "least")), nprocs=2,
                       start_method="spawn")
    expected = [least for _, least in cases]
    assert [torch.load(tmp_path / f"least.{rank}") for rank in range(2)] == [expected] * 2
