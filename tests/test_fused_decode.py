"""The engine's decode kernels on whole models: the fused decode step (the norms inside the
projections, the residual adds inside the projections before them) and the persistent kernel
against the op-by-op step: the same logits, tokens and pool contents."""
import pytest
import torch

from modeling import Engine, QwenConfig, SamplingParams
from modeling.model.random_checkpoint import QWEN3_0_6B, QWEN3_5_0_8B, config_dict, random_model
from tests.helpers import forced_logits, prompt, rel_err

TINY = {
    "qwen3": config_dict(256),
    "qwen2-bias": config_dict(256) | {"model_type": "qwen2"},
    "qwen3_5": config_dict(256, model_type="qwen3_5_text"),
}


def _run(model, prompts, new_tokens, kernels):
    """Greedy tokens of ``prompts`` (one continuous batch) with the decode kernels ``kernels``, and
    every tensor of the engine's pool afterwards."""
    engine = Engine(model, max_num_seqs=len(prompts), max_model_len=32, decode_kernels=kernels)
    tokens = engine.generate(prompts, SamplingParams(), new_tokens)
    return tokens, [t for entry in engine.pool.layers for t in entry]


@pytest.mark.parametrize("kind, kernels", [("qwen3", "fused"), ("qwen3", "persistent"), ("qwen2-bias", "fused"),
                                           ("qwen3_5", "fused")])
@torch.no_grad()
def test_decode_kernels_match_the_op_by_op_step(kind, kernels):
    """Two sequences decoding together (the kernels at batch 2) and teacher-forced decode steps of
    one: the tokens, the pool (keys, values, recurrent states) and the logits of the op-by-op step."""
    config = QwenConfig.from_dict(TINY[kind])
    model = random_model(config, torch.float32, std=0.1)
    prompts = [p.tolist() for p in prompt(2, 7, config.vocab_size)]
    tokens, pool = _run(model, prompts, 3, kernels)
    want, want_pool = _run(model, prompts, 3, "ops")
    assert tokens == want
    for a, b in zip(pool, want_pool):
        assert rel_err(a, b) < 1e-5
    forced = prompt(1, 3, config.vocab_size, seed=2)[0].tolist()
    logits = [forced_logits(Engine(model, max_num_seqs=1, max_model_len=32, decode_kernels=k), prompts[0], forced)
              for k in (kernels, "ops")]
    assert rel_err(*logits) < 1e-5


def _teacher_forced(model, prompt_ids, tokens, kernels):
    """Logits [steps, V] of decode steps fed ``tokens`` one at a time after ``prompt_ids``."""
    engine = Engine(model, max_num_seqs=1, max_model_len=len(prompt_ids) + len(tokens) + 1, decode_kernels=kernels)
    return forced_logits(engine, prompt_ids, tokens)


@pytest.mark.cuda
@pytest.mark.parametrize("sizes, bf16_cap, kernels", [(QWEN3_0_6B | dict(num_hidden_layers=8), 2.5e-2, "persistent"),
                                                      (QWEN3_0_6B | dict(num_hidden_layers=8), 2.5e-2, "fused"),
                                                      (QWEN3_5_0_8B | dict(num_hidden_layers=8), 0.1, "fused")],
                         ids=["qwen3-0.6b-8-layers-persistent", "qwen3-0.6b-8-layers-fused", "qwen3.5-0.8b-8-layers-fused"])
@torch.no_grad()
def test_decode_kernels_on_real_shapes_cuda(sizes, bf16_cap, kernels):
    """fp32: the same 256 greedy tokens as the op-by-op step, except after a near-tie (random
    weights give nearly flat logits: the first differing token must be one whose logit the
    op-by-op step had within 1e-4 of the maximum's scale of the chosen one), and teacher-forced
    logits within 1e-4. bf16, teacher-forced on the op-by-op tokens: the kernels' logits are as
    close to the fp32 ones as the op-by-op step's (the same roundings, in another order), within
    the modeling tests' caps (2.5e-2 for Qwen3; 0.1 for Qwen3.5, whose bf16 error is larger in
    transformers too)."""
    config = QwenConfig.from_dict(config_dict(**sizes))
    model = random_model(config, torch.float32, device="cuda", std=0.02)
    ids = prompt(1, 16, config.vocab_size)[0].tolist()

    def greedy(k):
        return Engine(model, max_num_seqs=1, max_model_len=300, decode_kernels=k).generate([ids], SamplingParams(),
                                                                                          256)[0]

    tokens = greedy("ops")
    assert len(set(tokens)) > 16  # not a trivial repetition
    ref = _teacher_forced(model, ids, tokens, "ops")  # ref[i] chose tokens[i]
    assert rel_err(_teacher_forced(model, ids, tokens, kernels), ref) < 1e-4
    other = greedy(kernels)
    differ = [i for i, (a, b) in enumerate(zip(other, tokens)) if a != b]
    if differ:
        i = differ[0]
        gap = (ref[i, tokens[i]] - ref[i, other[i]]).abs()
        assert gap <= 1e-4 * ref[i].abs().max(), f"token {i} differs without a near-tie (gap {float(gap):.3g})"

    ref, tokens = ref[:64], tokens[:64]
    model = model.to(torch.bfloat16)
    err = rel_err(_teacher_forced(model, ids, tokens, kernels), ref)
    ops_err = rel_err(_teacher_forced(model, ids, tokens, "ops"), ref)
    assert err < min(bf16_cap, 1.25 * ops_err + 1e-3), (err, ops_err)
