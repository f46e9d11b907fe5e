"""QwenConfig: the architecture hyper-parameters read from a Hugging Face ``config.json``.

Supported ``model_type`` values:

- ``qwen3``: RMSNorm on q and k per head (``q_norm``/``k_norm``), no qkv bias.
- ``qwen2``: bias on q, k and v, no q/k norm (Qwen2 and Qwen2.5 checkpoints).

``layer_types`` names the kind of each layer (``config.json``'s ``layer_types``; every layer is
``full_attention`` when it is absent); the kinds this package implements are the keys of
``modeling.layers.LAYER_TYPES``. ``rope_settings`` is shared with ``modeling.transformers_patch``.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Tuple, Union

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2")


class ConfigError(ValueError):
    """The config.json describes a model this package does not implement."""


@dataclass(frozen=True)
class QwenConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    layer_types: Tuple[str, ...]  # one per layer, e.g. "full_attention"

    @property
    def qkv_bias(self) -> bool:
        """Qwen2 has a bias on the q, k and v projections."""
        return self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """Qwen3 RMS-normalizes each q and k head over head_dim before RoPE."""
        return self.model_type == "qwen3"

    @property
    def qkv_size(self) -> int:
        """Rows of the fused QKV weight: (Hq + 2 * Hk) * head_dim."""
        return (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QwenConfig":
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}: supported are {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        rope_theta, rotary_factor = rope_settings(d)
        _reject_unsupported_features(d)
        layer_types = _layer_types(d)
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        rotary_dim = int(head_dim * rotary_factor)
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=float(10000.0 if rope_theta is None else rope_theta),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            layer_types=layer_types,
        )

    @classmethod
    def from_pretrained(cls, path: Union[str, Path]) -> "QwenConfig":
        """Read ``config.json`` from a checkpoint directory (or the file itself)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(json.loads(path.read_text()))


def rope_settings(d: Mapping[str, Any]) -> Tuple[Optional[float], float]:
    """(rope_theta, partial_rotary_factor) of a config dict, read at the top level or inside
    ``rope_parameters`` (transformers >= 5) or ``rope_scaling`` (older); rope_theta is None when
    the config names none. A ``rope_type`` other than ``default`` (YaRN etc.) is a ConfigError."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"unsupported rope_type {rope_type!r}: only 'default' RoPE is implemented")
    theta = rope.get("rope_theta", d.get("rope_theta"))
    return theta, float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))


def _layer_types(d: Mapping[str, Any]) -> Tuple[str, ...]:
    from .layers import LAYER_TYPES  # the layer kinds this package implements (imported here: layers imports us)

    n = d["num_hidden_layers"]
    types = tuple(d.get("layer_types") or ("full_attention",) * n)
    if len(types) != n:
        raise ConfigError(f"layer_types names {len(types)} layers, num_hidden_layers is {n}")
    for t in types:
        if t not in LAYER_TYPES:
            raise ConfigError(f"unsupported layer type {t!r} in layer_types: implemented are {', '.join(LAYER_TYPES)}")
    return types


def _reject_unsupported_features(d: Mapping[str, Any]) -> None:
    if d.get("use_sliding_window"):
        raise ConfigError("unsupported use_sliding_window=true: only full attention is implemented")
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported hidden_act {d['hidden_act']!r}: only 'silu' is implemented")
    if d["model_type"] == "qwen3" and d.get("attention_bias"):
        raise ConfigError("unsupported attention_bias=true for qwen3: Qwen3 checkpoints have no attention bias")
