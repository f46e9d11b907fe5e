"""Random workloads through the engine against each request run alone: requests of random
lengths (some sharing a prefix) arrive at random steps with random token limits, some sampled
with a seed, some aborted on the way; a small pool forces preemption and a small token budget
chunks the prompts. Every finished request's tokens must equal the same request run alone
(greedy: the model's own continuation without a cache; seeded: an engine holding only that request), an aborted one's must be
a prefix of them, and the engine must end with every block, state slot and step given back.
float64 models: the PyTorch reference ops, exact and fast on the CPU."""

import random

import pytest

from modeling.engine import Engine, Status
from modeling.engine.sampling_params import SamplingParams
from tests.helpers import recompute_greedy
from tests.test_engine import GREEDY, QWEN3, QWEN3_5, model_of

SETTINGS = dict(max_num_seqs=4, max_model_len=96, block_size=16)


def workload(rng: random.Random, vocab: int):
    """[(arrival step, prompt, max_tokens, params, abort after this many steps or None)]."""
    shared = [rng.randrange(vocab) for _ in range(40)]
    requests = []
    for i in range(7):
        n = rng.randint(1, 50)
        prompt = (shared[:rng.choice([16, 33, 40])] if rng.random() < 0.4 else []) + \
            [rng.randrange(vocab) for _ in range(n)]
        params = SamplingParams(temperature=0.9, top_p=0.9, seed=rng.randrange(1000)) if rng.random() < 0.3 \
            else GREEDY
        abort = rng.randint(1, 6) if rng.random() < 0.2 else None
        requests.append((rng.randint(0, 8), prompt[:64], rng.randint(1, 30), params, abort))
    return requests


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("config", [QWEN3, QWEN3_5], ids=["qwen3", "qwen3_5"])
def test_a_random_workload_gives_every_request_its_solo_tokens(config, seed):
    model = model_of(config)
    hybrid = config is QWEN3_5
    rng = random.Random(seed)
    requests = workload(rng, config["vocab_size"])
    # 7 blocks of 16 positions: fewer than the running requests can need at once (preemption); 24
    # tokens a step: longer prompts are chunked
    engine = Engine(model, num_blocks=7, max_num_batched_tokens=24, **SETTINGS)
    seqs, step = {}, 0
    while len(seqs) < len(requests) or engine.has_work():
        for i, (arrival, prompt, max_tokens, params, _) in enumerate(requests):
            if arrival == step and i not in seqs:
                seqs[i] = (engine.add(prompt, params, max_tokens), step)
        for i, (seq, added) in seqs.items():
            abort = requests[i][4]
            if abort is not None and step - added == abort:
                engine.abort(seq)
        engine.step()
        step += 1
        assert step < 500, "the workload did not finish"
    assert engine.blocks.num_free == engine.size.num_blocks and engine._inflight is None
    if hybrid:
        assert len(engine.scheduler.state_slots.free) == engine.size.num_state_slots
    for i, (seq, _) in seqs.items():
        _, prompt, max_tokens, params, abort = requests[i]
        assert seq.status is Status.FINISHED
        if params is GREEDY:
            solo = recompute_greedy(model, [prompt], max_tokens)[0]
        else:
            solo = Engine(model, max_num_batched_tokens=96, **SETTINGS).generate([prompt], params, max_tokens)[0]
        if seq.finish_reason == "abort":
            assert seq.output_ids == solo[:len(seq.output_ids)], f"request {i} (aborted)"
        else:
            assert seq.output_ids == solo, f"request {i}"
    assert engine.scheduler.preemptions > 0 or hybrid  # the pool was too small for them all at once
