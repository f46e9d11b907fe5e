"""The fused decode path (the model's default for decode steps) against the op-by-op path on
whole models: the same logits and the same cache contents."""
import pytest
import torch

from modeling import QwenConfig
from modeling.model.random_checkpoint import QWEN3_0_6B, QWEN3_5_0_8B, config_dict, random_model
from tests.helpers import decode, greedy, prefill, prompt, rel_err

TINY = {
    "qwen3": config_dict(256),
    "qwen2-bias": config_dict(256) | {"model_type": "qwen2"},
    "qwen3_5": config_dict(256, model_type="qwen3_5_text"),
}


def _prefill_then_decode(model, ids, prompt_len, fused, dtype):
    """Prefill ids[:, :prompt_len], then one decode call for the rest: (logits of every new token,
    every cache tensor)."""
    b, t = ids.shape[0], ids.shape[1] - prompt_len
    model.fused_decode = fused
    cache = model.new_cache(b, ids.shape[1] + 2, dtype)
    prefill(model, ids[:, :prompt_len], cache)
    positions = torch.arange(prompt_len, prompt_len + t, device=ids.device).expand(b, t)
    seqlens = torch.full((b,), prompt_len + t, dtype=torch.int32, device=ids.device)
    logits = model(ids[:, prompt_len:], positions, cache, seqlens, all_logits=True)
    return logits, [x for layer in cache.layers for x in vars(layer).values()]


@pytest.mark.parametrize("kind, new_tokens", [("qwen3", 1), ("qwen3", 3), ("qwen2-bias", 1), ("qwen2-bias", 3),
                                              ("qwen3_5", 1)])
@torch.no_grad()
def test_fused_decode_matches_unfused(kind, new_tokens):
    config = QwenConfig.from_dict(TINY[kind])
    model = random_model(config, torch.float32, std=0.1)
    ids = prompt(2, 7 + new_tokens, config.vocab_size)
    fused, fused_cache = _prefill_then_decode(model, ids, 7, True, torch.float32)
    unfused, unfused_cache = _prefill_then_decode(model, ids, 7, False, torch.float32)
    assert rel_err(fused, unfused) < 1e-5
    for a, b in zip(fused_cache, unfused_cache):
        assert rel_err(a, b) < 1e-5


def _teacher_forced(model, ids, prompt_len, fused):
    """Logits [B, steps, V] of decode steps fed the tokens of ids after the prompt, one at a time."""
    model.fused_decode = fused
    b, t = ids.shape
    cache = model.new_cache(b, t)
    prefill(model, ids[:, :prompt_len], cache)
    return torch.stack([decode(model, ids[:, pos], pos, cache).float() for pos in range(prompt_len, t)], 1)


@pytest.mark.cuda
@pytest.mark.parametrize("sizes, bf16_cap", [(QWEN3_0_6B | dict(num_hidden_layers=8), 2.5e-2),
                                             (QWEN3_5_0_8B | dict(num_hidden_layers=8), 0.1)],
                         ids=["qwen3-0.6b-8-layers", "qwen3.5-0.8b-8-layers"])
@torch.no_grad()
def test_fused_decode_on_real_shapes_cuda(sizes, bf16_cap):
    """fp32: the same 256 greedy tokens as the unfused path, except after a near-tie (random
    weights give nearly flat logits: the first differing token must be one whose logit the
    unfused step had within 1e-4 of the maximum's scale of the chosen one), and teacher-forced
    logits within 1e-4. bf16, teacher-forced on the unfused tokens: the fused logits are as close
    to the fp32 ones as the unfused path's (the same roundings, in another order), within the
    modeling tests' caps (2.5e-2 for Qwen3; 0.1 for Qwen3.5, whose bf16 error is larger in
    transformers too: 2.8e-2 for both our paths on the H200)."""
    config = QwenConfig.from_dict(config_dict(**sizes))
    model = random_model(config, torch.float32, device="cuda", std=0.02)
    ids = prompt(1, 16, config.vocab_size).cuda()
    model.fused_decode = False
    tokens = greedy(model, ids, 256)
    assert len(tokens.unique()) > 16  # not a trivial repetition
    seq = torch.cat([ids, tokens[:, :-1]], 1)
    ref = _teacher_forced(model, seq, 16, fused=False)  # ref[:, i] chose tokens[:, i + 1]
    assert rel_err(_teacher_forced(model, seq, 16, fused=True), ref) < 1e-4
    model.fused_decode = True
    fused_tokens = greedy(model, ids, 256)
    differ = (fused_tokens != tokens)[0].nonzero()
    if len(differ):
        i = int(differ[0])
        logits = ref[0, i - 1]
        gap = (logits[tokens[0, i]] - logits[fused_tokens[0, i]]).abs()
        assert gap <= 1e-4 * logits.abs().max(), f"token {i} differs without a near-tie (gap {float(gap):.3g})"

    ref = ref[:, :64]
    seq = seq[:, :16 + 64]
    model = model.to(torch.bfloat16)
    fused_err = rel_err(_teacher_forced(model, seq, 16, fused=True), ref)
    unfused_err = rel_err(_teacher_forced(model, seq, 16, fused=False), ref)
    assert fused_err < min(bf16_cap, 1.25 * unfused_err + 1e-3), (fused_err, unfused_err)
