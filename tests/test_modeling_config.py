"""QwenConfig from config.json dicts: qwen3 / qwen2, rope_theta locations, defaults, errors, the
type and bound of every field."""

import json
import math

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


@pytest.mark.parametrize("head_dim", [48, 80, 96, 160, 256])
def test_head_dims_that_are_multiples_of_16(head_dim):
    """Every multiple of 16 up to 256 (qwen_ops.checks.HEAD_DIMS), powers of two or not."""
    c = QwenConfig.from_dict(dict(BASE, model_type="qwen3", head_dim=head_dim))
    assert (c.head_dim, c.rotary_dim, c.qkv_size) == (head_dim, head_dim, (4 + 2 * 4) * head_dim)


def test_transformers_qwen2_config_round_trip():
    d = Qwen2Config(**BASE, num_key_value_heads=1, rope_theta=1e6).to_dict()
    c = QwenConfig.from_dict(d)
    assert (c.model_type, c.num_key_value_heads, c.head_dim, c.rope_theta) == ("qwen2", 1, 16, 1e6)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "qwen3_next"}, "unsupported model_type 'qwen3_next': supported are qwen3, qwen2, "
                                         "qwen3_moe, qwen2_moe, qwen3_5_text, qwen3_5, qwen3_5_moe_text, qwen3_5_moe"),
        ({"model_type": None}, "unsupported model_type None"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_type 'yarn'"),
        ({"use_sliding_window": True}, "unsupported use_sliding_window"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
        ({"model_type": "qwen3", "attention_bias": True}, "unsupported attention_bias"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "unsupported layer type 'sliding_attention'"),
        ({"layer_types": ["full_attention"]}, "layer_types names 1 layers, num_hidden_layers is 2"),
        ({"layer_types": ["full_attention", "linear_attention"]},
         "unsupported layer type 'linear_attention' in layer_types: implemented for qwen2 are full_attention"),
        # what a kernel would refuse only at the first forward
        ({"head_dim": 8}, r"unsupported head_dim 8 .*the attention kernels take multiples of 16 up to 256$"),
        ({"head_dim": 40}, "unsupported head_dim 40"),
        ({"head_dim": 272}, "unsupported head_dim 272"),
        ({"hidden_size": 80}, r"unsupported head_dim 20 \(head_dim, or hidden_size / num_attention_heads\)"),
        ({"partial_rotary_factor": 0.0}, "partial_rotary_factor 0.0 gives a rotary dim of 0 for head_dim 16"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5625}}, "rotary dim of 9"),
        ({"partial_rotary_factor": 2.0}, "rotary dim of 32 for head_dim 16: it must be even and in"),
        ({"hidden_size": 0}, "hidden_size must be a positive integer, got 0"),
        ({"vocab_size": -1}, "vocab_size must be a positive integer, got -1"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
        ({"intermediate_size": "96"}, "intermediate_size must be a positive integer, got '96'"),
        ({"num_attention_heads": True}, "num_attention_heads must be a positive integer, got True"),
        ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
        ({"head_dim": 0}, "head_dim must be a positive integer, got 0"),
        ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer"),
        ({"rope_theta": 0}, "rope_theta must be positive and finite, got 0"),
        ({"rope_theta": float("inf")}, "rope_theta must be a finite number, got inf"),
        ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be a finite number >= 0"),
        ({"vocab_size": None}, r"^vocab_size is missing \(a positive integer\)$"),
    ],
)
def test_unsupported_configs(change, message):
    with pytest.raises(ConfigError, match=message):
        QwenConfig.from_dict(dict(BASE, model_type="qwen2") | change)


# ------------------------------------------------------------------------------------------ Qwen3.5

QWEN3_5 = dict(BASE, model_type="qwen3_5_text", num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32, num_hidden_layers=4)


def test_qwen3_5_text_defaults():
    c = QwenConfig.from_dict(QWEN3_5)
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",)  # full_attention_interval 4
    assert (c.rotary_dim, c.norm_offset, c.attn_output_gate, c.qk_norm, c.qkv_bias) == (8, 1.0, True, True, False)
    assert (c.linear_conv_kernel_dim, c.weights_prefix) == (4, "model.")
    c = QwenConfig.from_dict(QWEN3_5 | {"full_attention_interval": 2, "partial_rotary_factor": 0.5})
    assert c.layer_types == ("linear_attention", "full_attention") * 2 and c.rotary_dim == 16
    dense = QwenConfig.from_dict(dict(BASE, model_type="qwen3"))
    assert (dense.norm_offset, dense.attn_output_gate, dense.linear_conv_kernel_dim) == (0.0, False, 0)


def test_qwen3_5_head_dims_that_are_multiples_of_16():
    c = QwenConfig.from_dict(QWEN3_5 | {"linear_key_head_dim": 48, "linear_value_head_dim": 80, "head_dim": 80})
    assert (c.linear_key_head_dim, c.linear_value_head_dim, c.head_dim, c.rotary_dim) == (48, 80, 80, 20)
    assert c.linear_conv_dim == 2 * 2 * 48 + 4 * 80


def test_qwen3_5_wrapper():
    c = QwenConfig.from_dict({"model_type": "qwen3_5", "text_config": QWEN3_5 | {"tie_word_embeddings": False},
                              "tie_word_embeddings": True, "vision_config": {"depth": 1}})
    assert (c.model_type, c.tie_word_embeddings, c.weights_prefix) == ("qwen3_5", True, "model.language_model.")
    assert c.skipped_weight_prefixes == ("mtp.", "model.visual.")
    text_flag = QwenConfig.from_dict({"model_type": "qwen3_5", "text_config": QWEN3_5 | {"tie_word_embeddings": True}})
    assert text_flag.tie_word_embeddings  # the wrapper sets none: the text config's


@pytest.mark.parametrize(
    "change, message",
    [
        ({"linear_key_head_dim": 24}, "unsupported linear_key_head_dim 24: the gated delta rule kernels take "
                                      "multiples of 16 up to 256$"),
        ({"linear_value_head_dim": 512}, "unsupported linear_value_head_dim 512"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"),
        ({"linear_num_key_heads": 0}, "linear_num_key_heads must be a positive integer, got 0"),
        ({"linear_conv_kernel_dim": 1}, "unsupported linear_conv_kernel_dim 1: the conv kernels take 2 to 16"),
        ({"full_attention_interval": 0}, "full_attention_interval must be a positive integer, got 0"),
        ({"attn_output_gate": False}, "unsupported attn_output_gate=false"),
        ({"attention_bias": True}, "unsupported attention_bias=true for qwen3_5"),
        ({"layer_types": ["linear_attention", "sliding_attention"] * 2}, "unsupported layer type 'sliding_attention'"),
        ({"head_dim": 40}, "unsupported head_dim 40"),
        ({"partial_rotary_factor": 0.01}, "partial_rotary_factor 0.01 gives a rotary dim of 0"),
    ],
)
def test_unsupported_qwen3_5_configs(change, message):
    with pytest.raises(ConfigError, match=message):
        QwenConfig.from_dict(QWEN3_5 | change)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"model_type": "qwen3_5"}, "model_type 'qwen3_5' \\(the multimodal wrapper\\) needs a 'text_config' object"),
        ({"model_type": "qwen3_5", "text_config": QWEN3_5 | {"model_type": "qwen3_5_moe_text"}},
         "unsupported text_config model_type 'qwen3_5_moe_text'"),
        ({"model_type": "qwen3_5", "text_config": QWEN3_5 | {"linear_key_head_dim": 8}},
         "unsupported linear_key_head_dim 8"),
    ],
)
def test_unsupported_qwen3_5_wrappers(config, message):
    with pytest.raises(ConfigError, match=message):
        QwenConfig.from_dict(config)


# ---------------------------------------------------------------------------- types and bounds

@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_hidden_layers": 30_000_000},
         r"^num_hidden_layers 30000000 is above 1,024, the most this package takes$"),
        ({"num_hidden_layers": 10**10}, "num_hidden_layers 10000000000 is above 1,024"),
        ({"num_hidden_layers": 1025}, "num_hidden_layers 1025 is above 1,024"),
        ({"vocab_size": 2**24 + 1}, "vocab_size 16777217 is above 16,777,216"),
        ({"hidden_size": 2**16 + 64}, "hidden_size 65600 is above 65,536"),
        ({"intermediate_size": 2**20 + 1}, "intermediate_size 1048577 is above 1,048,576"),
        ({"num_attention_heads": 2**17, "head_dim": 16}, "num_attention_heads 131072 is above 65,536"),
        ({"num_key_value_heads": 10**30}, r"num_key_value_heads 1000000000000000000000000000000 is above 65,536"),
        ({"head_dim": 2**20}, "head_dim 1048576 is above 65,536"),
        ({"max_position_embeddings": 2**31}, "max_position_embeddings 2147483648 is above 2,147,483,647"),
        ({"vocab_size": 10**100}, r"^vocab_size 10{56}\.\.\. is above 16,777,216"),  # a long value is cut
        ({"partial_rotary_factor": float("inf")}, r"^partial_rotary_factor must be a finite number, got inf$"),
        ({"partial_rotary_factor": float("-inf")}, "partial_rotary_factor must be a finite number, got -inf"),
        ({"partial_rotary_factor": float("nan")}, "partial_rotary_factor must be a finite number, got nan"),
        ({"partial_rotary_factor": 10**400}, "partial_rotary_factor must be a finite number, got 1000"),
        ({"partial_rotary_factor": "0.5"}, "partial_rotary_factor must be a finite number, got '0.5'"),
        ({"rope_parameters": {"rope_theta": float("nan")}}, "rope_theta must be a finite number, got nan"),
        ({"rope_theta": "1e6"}, "rope_theta must be a finite number, got '1e6'"),
        ({"rms_norm_eps": True}, "rms_norm_eps must be a finite number, got True"),
        ({"rms_norm_eps": float("inf")}, "rms_norm_eps must be a finite number, got inf"),
        ({"tie_word_embeddings": "false"},
         r"^tie_word_embeddings must be true or false \(a JSON boolean\), got 'false'$"),
        ({"tie_word_embeddings": 0}, "tie_word_embeddings must be true or false"),
        ({"use_sliding_window": "false"}, "use_sliding_window must be true or false"),
        ({"model_type": "qwen3", "attention_bias": "false"}, "attention_bias must be true or false"),
        ({"hidden_size": 64.0}, "hidden_size must be a positive integer, got 64.0"),
        ({"num_key_value_heads": True}, "num_key_value_heads must be a positive integer, got True"),
        ({"max_position_embeddings": 4096.0}, "max_position_embeddings must be a positive integer, got 4096.0"),
        ({"rope_parameters": "default"}, "rope_parameters must be a JSON object, got 'default'"),
        ({"rope_scaling": [1]}, r"rope_scaling must be a JSON object, got \[1\]"),
        ({"layer_types": "full_attention"}, "layer_types must be a list of layer type names, got 'full_attention'"),
        ({"layer_types": [1, 2]}, r"layer_types must be a list of layer type names, got \[1, 2\]"),
        ({"hidden_act": ["silu"]}, r"unsupported hidden_act \['silu'\]"),
    ],
)
def test_field_types_and_bounds(change, message):
    with pytest.raises(ConfigError, match=message):
        QwenConfig.from_dict(dict(BASE, model_type="qwen2") | change)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attn_output_gate": "true"}, "attn_output_gate must be true or false"),
        ({"attention_bias": 0}, "attention_bias must be true or false"),
        ({"full_attention_interval": 4.0}, "full_attention_interval must be a positive integer, got 4.0"),
        ({"full_attention_interval": 10**6}, "full_attention_interval 1000000 is above 65,536"),
        ({"linear_num_key_heads": "2"}, "linear_num_key_heads must be a positive integer, got '2'"),
        ({"linear_num_value_heads": 2**17}, "linear_num_value_heads 131072 is above 65,536"),
    ],
)
def test_qwen3_5_field_types_and_bounds(change, message):
    with pytest.raises(ConfigError, match=message):
        QwenConfig.from_dict(QWEN3_5 | change)


def test_null_fields_take_their_defaults():
    c = QwenConfig.from_dict(dict(BASE, model_type="qwen2", tie_word_embeddings=None, num_key_value_heads=None,
                                  max_position_embeddings=None, rms_norm_eps=None, rope_theta=None, head_dim=None,
                                  layer_types=None, use_sliding_window=None))
    assert (c.tie_word_embeddings, c.num_key_value_heads, c.max_position_embeddings) == (False, 4, 32768)
    assert (c.rms_norm_eps, c.rope_theta, c.head_dim, c.layer_types) == (1e-6, 10000.0, 16, ("full_attention",) * 2)
    assert QwenConfig.from_dict(QWEN3_5 | {"partial_rotary_factor": None}).rotary_dim == 8  # Qwen3.5's 0.25
    for null in ({"hidden_act": None}, {"rope_scaling": {"rope_type": None, "type": None}}):
        assert QwenConfig.from_dict(dict(BASE, model_type="qwen3", **null)) == QwenConfig.from_dict(dict(BASE, model_type="qwen3"))
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert QwenConfig.from_dict(dict(BASE, model_type="qwen3", quantization_config=fp8 | {"fmt": None})).quantization == "fp8"


def test_from_pretrained_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, model_type="qwen2", tie_word_embeddings="false")))
    with pytest.raises(ConfigError, match=r"^config.json: tie_word_embeddings must be true or false"):
        QwenConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, model_type="qwen2", partial_rotary_factor=math.inf)))
    assert "Infinity" in (tmp_path / "config.json").read_text()  # what json.dumps writes, and json.loads reads
    with pytest.raises(ConfigError, match=r"^config.json: partial_rotary_factor must be a finite number, got inf$"):
        QwenConfig.from_pretrained(tmp_path / "config.json")


WRONG_VALUES = ["x", "", 1.5, 0, -1, 10**30, True, False, None, [], [1], {}, {"a": 1}, float("inf"), float("nan")]
FIELDS = sorted(set(BASE) | set(QWEN3_5) | {
    "model_type", "num_key_value_heads", "head_dim", "rope_theta", "rope_parameters", "rope_scaling",
    "partial_rotary_factor", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "layer_types",
    "use_sliding_window", "hidden_act", "attention_bias", "attn_output_gate", "full_attention_interval",
    "linear_conv_kernel_dim", "text_config"})


@pytest.mark.parametrize("base", ["qwen2", "qwen3", "qwen3_5_text", "qwen3_5"])
def test_any_json_value_in_any_field_is_a_config_error_or_a_config(base):
    """Every field set to every kind of JSON value: from_dict returns a config or raises ConfigError,
    never another exception (so QwenConfig.from_pretrained needs no guard of its own)."""
    configs = {"qwen2": dict(BASE, model_type="qwen2"), "qwen3": dict(BASE, model_type="qwen3"),
               "qwen3_5_text": QWEN3_5, "qwen3_5": {"model_type": "qwen3_5", "text_config": QWEN3_5}}
    d = configs[base]
    for field in FIELDS:
        for value in WRONG_VALUES:
            variants = [d | {field: value}, d | {"rope_parameters": {field: value}}]
            if base == "qwen3_5":
                variants.append(d | {"text_config": QWEN3_5 | {field: value}})
            for changed in variants:
                try:
                    QwenConfig.from_dict(changed)
                except ConfigError as e:
                    assert "\n" not in str(e) and len(str(e)) < 300, (field, value, str(e))


def test_every_layer_kind_a_config_names_is_implemented():
    """config.py names the layer kinds (``FAMILY_LAYER_TYPES``) without importing the layers (they
    import it): each name must be a ``LAYER_TYPES`` class, and every class a name some family takes."""
    from modeling.model.config import FAMILY_LAYER_TYPES
    from modeling.model.layers import LAYER_TYPES

    assert {t for kinds in FAMILY_LAYER_TYPES.values() for t in kinds} == set(LAYER_TYPES)
