"""Tensor parallelism (``modeling.model.tensor_parallel``): the split rules (heads, fused sections,
the per-rank config) and world size 1 adding nothing."""

import pytest
import torch

from modeling.model.config import QwenConfig
from modeling.model.random_checkpoint import config_dict
from modeling.model.tensor_parallel import SINGLE, Split, TensorParallel


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
