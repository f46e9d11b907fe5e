"""QwenConfig from config.json dicts: qwen3 / qwen2, rope_theta locations, defaults, errors."""

import pytest
from transformers import Qwen2Config, Qwen3Config

from modeling import ConfigError, QwenConfig

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)


def test_qwen3_from_transformers_config():
    d = Qwen3Config(**BASE, num_key_value_heads=2, head_dim=32, rope_theta=1e6, tie_word_embeddings=True).to_dict()
    c = QwenConfig.from_dict(d)
    assert (c.model_type, c.num_key_value_heads, c.head_dim, c.rotary_dim) == ("qwen3", 2, 32, 32)
    assert (c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings) == (1e6, 1e-6, True)
    assert c.qk_norm and not c.qkv_bias
    assert c.qkv_size == (4 + 2 * 2) * 32
    assert c.layer_types == ("full_attention", "full_attention")  # transformers writes layer_types


def test_qwen2_defaults():
    c = QwenConfig.from_dict(dict(BASE, model_type="qwen2", rms_norm_eps=1e-5))
    assert (c.num_key_value_heads, c.head_dim, c.rope_theta, c.rms_norm_eps) == (4, 16, 10000.0, 1e-5)
    assert c.qkv_bias and not c.qk_norm and not c.tie_word_embeddings
    assert c.layer_types == ("full_attention", "full_attention")  # no layer_types: every layer attends


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_theta": 5e5},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
        {"rope_scaling": {"type": "default", "rope_theta": 5e5}},
        {"rope_theta": 5e5, "rope_scaling": None},
    ],
)
def test_rope_theta_locations(rope):
    assert QwenConfig.from_dict(dict(BASE, model_type="qwen2", **rope)).rope_theta == 5e5


def test_transformers_qwen2_config_round_trip():
    d = Qwen2Config(**BASE, num_key_value_heads=1, rope_theta=1e6).to_dict()
    c = QwenConfig.from_dict(d)
    assert (c.model_type, c.num_key_value_heads, c.head_dim, c.rope_theta) == ("qwen2", 1, 16, 1e6)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "qwen3_5"}, "unsupported model_type 'qwen3_5': supported are qwen3, qwen2"),
        ({"model_type": None}, "unsupported model_type None"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_type 'yarn'"),
        ({"use_sliding_window": True}, "unsupported use_sliding_window"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
        ({"model_type": "qwen3", "attention_bias": True}, "unsupported attention_bias"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "unsupported layer type 'sliding_attention'"),
        ({"layer_types": ["full_attention"]}, "layer_types names 1 layers, num_hidden_layers is 2"),
    ],
)
def test_unsupported_configs(change, message):
    with pytest.raises(ConfigError, match=message):
        QwenConfig.from_dict(dict(BASE, model_type="qwen2") | change)
