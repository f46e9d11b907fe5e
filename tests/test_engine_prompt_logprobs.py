"""Prompt logprobs computed by the engine's prefill steps (``modeling.engine.prefill_logprobs``)
against a reference written here: log_softmax (fp32) of the model's forward over the whole prompt
without a cache. Prompts of several lengths and k in one batch, a prompt prefilled over several
steps, a prompt whose prefix is in the cache, preemption; the other rows' tokens do not change."""

import pytest
import torch

from modeling.engine import Engine
from modeling.engine.sampling_params import SamplingParams
from tests.test_engine import QWEN3, QWEN3_5, model_of, prompts_of


def check_prompt_logprobs(model, prompt, entries, k):
    """``entries`` (a ``Sequence.prompt_logprobs``) are the reference's: None first, then each
    prompt token's log-probability, the k most likely tokens' and its rank."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt]))[0, :-1].float(), dim=-1)
    assert len(entries) == len(prompt) and entries[0] is None
    for i, (chosen, top, rank) in enumerate(entries[1:]):
        assert chosen == pytest.approx(lp[i, prompt[i + 1]].item(), abs=1e-5)
        assert rank == 1 + (lp[i] > lp[i, prompt[i + 1]]).sum().item()
        want = lp[i].topk(k)
        assert [t for t, _ in top] == want.indices.tolist()
        assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-5)


@pytest.mark.parametrize("config", [QWEN3, QWEN3_5], ids=["qwen3", "qwen3_5"])
def test_prompt_logprobs_of_a_batch_prefilled_in_chunks(config):
    """Five prompts in one batch under a 16-token budget (the 70-token prompt takes five steps or
    more), k = 3, 0, None, 5, 1: each asking one gets the reference's entries, filled chunk by
    chunk; every sequence samples the tokens of a run where none asks; the steps after the
    prefills run as before (no prompt rows)."""
    model = model_of(config)
    prompts = prompts_of([5, 37, 9, 70, 1])
    ks = [3, 0, None, 5, 1]
    args = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128, block_size=16)
    plain = Engine(model, **args).generate(prompts, SamplingParams(), 6)
    engine = Engine(model, **args)
    seqs = [engine.add(p, SamplingParams(prompt_logprobs=k), 6) for p, k in zip(prompts, ks)]
    run, eager, filled = engine.runner.run, [], []

    def recorded(batch, prompt_rows=None):
        eager.append(prompt_rows is not None)
        return run(batch, prompt_rows)

    engine.runner.run = recorded
    while engine.has_work():
        engine.step()
        filled.append(len(seqs[3].prompt_logprobs))
    assert [s.output_ids for s in seqs] == plain
    for seq, prompt, k in zip(seqs, prompts, ks):
        if k is None:
            assert seq.prompt_logprobs is None
        else:
            check_prompt_logprobs(model, prompt, seq.prompt_logprobs, k)
    assert len({n for n in filled if n < 70}) >= 5  # the long prompt's entries came over five steps or more
    # scoring steps ran eagerly, and once the prompts were scored the steps went back to the graphs
    assert True in eager and True not in eager[eager.index(False, eager.index(True)):]


def test_a_prompt_asking_for_its_logprobs_skips_the_prefix_cache():
    """The prompt's first 32 tokens are cached: a sequence asking for prompt logprobs computes them
    (no hit) and gets the reference's entries; one that does not ask takes the cached blocks."""
    model = model_of(QWEN3)
    shared = prompts_of([40])[0]
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=16)
    engine.generate([shared + [1, 2]], SamplingParams(), 2)
    scored = engine.add(shared + [3, 4], SamplingParams(prompt_logprobs=2), 4)
    engine.step()
    cached = engine.add(shared + [5], SamplingParams(), 4)
    while engine.has_work():
        engine.step()
    assert scored.num_cached == 0 and cached.num_cached == 32
    check_prompt_logprobs(model, shared + [3, 4], scored.prompt_logprobs, 2)
    assert scored.output_ids == Engine(model, max_num_seqs=1, max_model_len=128).generate(
        [shared + [3, 4]], SamplingParams(), 4)[0]


def test_a_sequence_preempted_mid_prefill_is_not_scored_twice(monkeypatch):
    """6 KV blocks of 16: two decoding sequences of 10-token prompts and a 60-token prompt that
    takes the other four, prefilled 6 tokens a step; the first decoding sequence to need a third
    block preempts it halfway. Recomputed, it still has one entry a prompt token, the reference's."""
    model = model_of(QWEN3)
    prompts = prompts_of([10, 10, 60])
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=96, block_size=16, num_blocks=6)
    preempt, halfway = engine.scheduler._preempt, []

    def recorded(seq):
        halfway.append(seq.needs_prompt_logprobs)
        preempt(seq)

    monkeypatch.setattr(engine.scheduler, "_preempt", recorded)
    seqs = [engine.add(p, SamplingParams(prompt_logprobs=2), 20) for p in prompts[:2]]
    while any(s.num_output == 0 for s in seqs):
        engine.step()
    seqs.append(engine.add(prompts[2], SamplingParams(prompt_logprobs=2), 4))
    while engine.has_work():
        engine.step()
    assert halfway == [True]
    for seq, prompt in zip(seqs, prompts):
        check_prompt_logprobs(model, prompt, seq.prompt_logprobs, 2)
