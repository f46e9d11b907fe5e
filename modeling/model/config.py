"""QwenConfig: the architecture hyper-parameters read from a Hugging Face ``config.json``.

docs/modeling.md ("Supported checkpoints") lists the ``model_type`` values (qwen3, qwen2, the
Qwen3.5 and mixture-of-experts families), the fields read and their defaults, and what is refused;
its "Qwen3.5" and "Mixture of experts" sections hold those families' specifics (zero-centred norms,
``norm_offset`` 1.0; the sparse layers, ``config.moe_layers``). ``layer_types`` names the kind of
each layer; the kinds this package implements are ``FAMILY_LAYER_TYPES`` (each a key of
``modeling.model.layers.LAYER_TYPES``, which imports this module: never the other way round).
``rope_settings`` is shared with ``modeling.model.transformers_patch``.

Every field is type-checked (``ConfigError`` naming it): sizes are JSON integers between 1 and
their limit in ``MAX_SIZES`` (``MAX_SIZE`` for the others), flags JSON booleans, and ``rope_theta``,
``rms_norm_eps`` and ``partial_rotary_factor`` finite numbers; what a kernel would refuse at the
first forward is refused here too (head dims: ``qwen_ops.checks.HEAD_DIMS``). ``quantization_config``:
only Qwen's FP8 one (``FP8_QUANTIZATION``), read into ``quantization`` "fp8". ``from_pretrained``
reads config.json with ``modeling.model.files.read_json`` and starts each error with ``config.json:``.
"""

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from qwen_ops.checks import HEAD_DIMS, HEAD_DIMS_TEXT
from qwen_ops.moe import MAX_EXPERTS

from .files import read_json

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2")
"""The dense families (also what ``modeling.model.transformers_patch`` patches)."""
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
"""Qwen3.5 and Qwen3.5-MoE: text-only checkpoints and the hub's multimodal wrappers."""
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "qwen3_5_moe_text", "qwen3_5_moe")
"""The mixture-of-experts families: each another family's decoder with routed experts as MLPs."""
WRAPPER_TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
"""The multimodal wrappers and the model_type of their ``text_config``."""
MODEL_TYPES = SUPPORTED_MODEL_TYPES + ("qwen3_moe", "qwen2_moe") + HYBRID_MODEL_TYPES
"""Every ``model_type`` ``QwenConfig.from_dict`` reads."""

MAX_CONV_KERNEL = 16
"""Largest kernel the causal_conv1d kernels take (qwen_ops.causal_conv1d.MAX_KERNEL_SIZE)."""
QWEN3_5_SKIPPED_WEIGHTS = ("mtp.", "model.visual.")
"""Checkpoint tensors a Qwen3.5 text model does not use: the MTP head and the vision tower."""
MAX_SIZES = {"vocab_size": 1 << 24, "intermediate_size": 1 << 20, "num_hidden_layers": 1024,
             "max_position_embeddings": (1 << 31) - 1}
"""The largest value of these size fields: far above any released model's (Qwen's vocabularies
are 152k-248k tokens, MLPs under 30k wide, the deepest ~100 layers); max_position_embeddings is
bounded by the int32 positions. A config past one is refused before anything is sized from it."""
MAX_SIZE = 1 << 16
"""The largest value of every other size field (hidden_size, the head counts and head dims, ...)."""


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
    # Qwen3.5 (the defaults are qwen3 / qwen2's)
    norm_offset: float = 0.0  # RMSNorm weight offset: 1.0 = zero-centred (1 + weight)
    attn_output_gate: bool = False  # q_proj gives per head [query | gate]; output * sigmoid(gate)
    linear_num_key_heads: int = 0  # Gated DeltaNet (linear_attention) layers
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    weights_prefix: str = "model."  # checkpoint names of the text model: "model." or "model.language_model."
    skipped_weight_prefixes: Tuple[str, ...] = ()  # checkpoint tensors ignored (vision tower, MTP)
    qkv_bias: bool = False  # a bias on the q, k and v projections (qwen2; qwen2_moe by its qkv_bias)
    # mixture of experts (MOE_MODEL_TYPES)
    moe_layers: Tuple[int, ...] = ()  # the layers whose MLP is the routed experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    norm_topk_prob: bool = False  # the router renormalises its top-k weights
    quantization: Optional[str] = None  # "fp8": Qwen's FP8 checkpoints (``quantization_config``)

    @property
    def qk_norm(self) -> bool:
        """Qwen3 and Qwen3.5 (and their MoE) RMS-normalize each q and k head over head_dim before RoPE."""
        return self.model_type in ("qwen3", "qwen3_moe") or self.model_type in HYBRID_MODEL_TYPES

    @property
    def q_size(self) -> int:
        """Rows of q_proj: Hq * head_dim, twice that with the output gate."""
        return self.num_attention_heads * self.head_dim * (2 if self.attn_output_gate else 1)

    @property
    def qkv_size(self) -> int:
        """Rows of the fused QKV weight: (Hq + 2 * Hk) * head_dim (Hq twice with the output gate)."""
        return self.q_size + 2 * self.num_key_value_heads * self.head_dim

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the Gated DeltaNet's conv1d: q, k and v (2 * key_dim + value_dim)."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QwenConfig":
        """The config of a config.json dict; ``ConfigError`` naming the field for anything this
        package does not implement or that is not of its type (see the module doc)."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"a config must be a JSON object, got a {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"unsupported model_type {_show(model_type)}: supported are {', '.join(MODEL_TYPES)}")
        extra: Dict[str, Any] = {"quantization": _quantization(d)}  # the wrapper's, not text_config's
        if model_type in HYBRID_MODEL_TYPES:
            d = _qwen3_5_text(d)
            extra.update(_qwen3_5_fields(d, model_type))
        rope_theta, rotary_factor = rope_settings(d)
        _reject_unsupported_features(d, model_type)
        sizes = {name: _size(d, name) for name in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                    "num_attention_heads")}
        if model_type in MOE_MODEL_TYPES:
            extra.update(_moe_fields(d, model_type, sizes["num_hidden_layers"]))
        dense_layers = sizes["num_hidden_layers"] > len(extra.get("moe_layers", ()))
        # a model whose every MLP is sparse (Qwen3.5-MoE) has no dense intermediate_size
        sizes["intermediate_size"] = _size(d, "intermediate_size", None if dense_layers else 0)
        if model_type == "qwen2":
            extra["qkv_bias"] = True
        elif model_type == "qwen2_moe":
            extra["qkv_bias"] = _bool(d, "qkv_bias", True)
        layer_types = _layer_types(d, model_type, sizes["num_hidden_layers"])
        heads = sizes["num_attention_heads"]
        kv_heads = _size(d, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = _size(d, "head_dim", sizes["hidden_size"] // heads)
        if head_dim not in HEAD_DIMS and "full_attention" in layer_types:
            raise ConfigError(f"unsupported head_dim {head_dim} (head_dim, or hidden_size / num_attention_heads): "
                              f"the attention kernels take {HEAD_DIMS_TEXT}")
        rotary_dim = int(head_dim * rotary_factor)
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ConfigError(f"partial_rotary_factor {rotary_factor} gives a rotary dim of {rotary_dim} for head_dim "
                              f"{head_dim}: it must be even and in (0, head_dim]")
        theta = 10000.0 if rope_theta is None else rope_theta
        if theta <= 0.0:
            raise ConfigError(f"rope_theta must be positive and finite, got {rope_theta!r}")
        eps = _number(d, "rms_norm_eps", 1e-6)
        if eps < 0.0:
            raise ConfigError(f"rms_norm_eps must be a finite number >= 0, got {eps!r}")
        return cls(
            model_type=model_type,
            **sizes,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=theta,
            rms_norm_eps=eps,
            tie_word_embeddings=_bool(d, "tie_word_embeddings", False),
            max_position_embeddings=_size(d, "max_position_embeddings", 32768),
            layer_types=layer_types,
            **extra,
        )

    @classmethod
    def from_pretrained(cls, path: Union[str, Path]) -> "QwenConfig":
        """Read ``config.json`` from a checkpoint directory (or the file itself): a regular file
        (``modeling.model.files.read_json``); every error is a one-line ``ConfigError`` naming the file."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        d = read_json(path, ConfigError)
        try:
            return cls.from_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{path.name}: {e}") from None


def rope_settings(d: Mapping[str, Any]) -> Tuple[Optional[float], float]:
    """(rope_theta, partial_rotary_factor) of a config dict, read at the top level or inside
    ``rope_parameters`` (transformers >= 5) or ``rope_scaling`` (older), each a finite number;
    rope_theta is None when the config names none. A ``rope_type`` other than ``default`` (YaRN
    etc.) is a ConfigError."""
    rope = _object(d, "rope_parameters") or _object(d, "rope_scaling") or {}
    rope_type = next((rope[k] for k in ("rope_type", "type") if rope.get(k) is not None), "default")
    if rope_type != "default":
        raise ConfigError(f"unsupported rope_type {_show(rope_type)}: only 'default' RoPE is implemented")
    theta = _number(rope if rope.get("rope_theta") is not None else d, "rope_theta", None)
    factor = _number(rope if rope.get("partial_rotary_factor") is not None else d, "partial_rotary_factor", 1.0)
    return theta, factor


def _size(d: Mapping[str, Any], name: str, default: Optional[int] = None) -> int:
    """``d[name]``, an integer in [1, its ``MAX_SIZES`` limit]; ``default`` when absent or null
    (None: the field is required)."""
    v = d.get(name)
    if v is None:
        if default is None:
            raise ConfigError(f"{name} is missing (a positive integer)")
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {_show(v)}")
    limit = MAX_SIZES.get(name, MAX_SIZE)
    if v > limit:
        raise ConfigError(f"{name} {_show(v)} is above {limit:,}, the most this package takes")
    return v


def _bool(d: Mapping[str, Any], name: str, default: bool) -> bool:
    """``d[name]``, a JSON boolean; ``default`` when absent or null."""
    v = d.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(f"{name} must be true or false (a JSON boolean), got {_show(v)}")
    return v


def _number(d: Mapping[str, Any], name: str, default: Optional[float]) -> Optional[float]:
    """``d[name]`` as a float, a finite number (not a bool); ``default`` when absent or null."""
    v = d.get(name)
    if v is None:
        return default
    try:
        finite = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    except OverflowError:  # an integer too large for a float
        finite = False
    if not finite:
        raise ConfigError(f"{name} must be a finite number, got {_show(v)}")
    return float(v)


def _object(d: Mapping[str, Any], name: str) -> Optional[Mapping[str, Any]]:
    """``d[name]``, a JSON object, or None when absent or null."""
    v = d.get(name)
    if v is not None and not isinstance(v, Mapping):
        raise ConfigError(f"{name} must be a JSON object, got {_show(v)}")
    return v


def _show(v: Any) -> str:
    """``repr(v)``, cut to 60 characters."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _qwen3_5_text(d: Mapping[str, Any]) -> Dict[str, Any]:
    """The text model's fields: ``text_config`` of a multimodal wrapper (``WRAPPER_TEXT_TYPES``, with
    the wrapper's ``tie_word_embeddings`` when it sets one: Qwen3_5ForConditionalGeneration ties by
    it), or the text config itself. Qwen3.5's default partial_rotary_factor is 0.25."""
    wrapper = d["model_type"]
    if wrapper in WRAPPER_TEXT_TYPES:
        text = d.get("text_config")
        expected = WRAPPER_TEXT_TYPES[wrapper]
        if not isinstance(text, Mapping):
            raise ConfigError(f"model_type {wrapper!r} (the multimodal wrapper) needs a 'text_config' object")
        if text.get("model_type", expected) != expected:
            raise ConfigError(f"unsupported text_config model_type {_show(text.get('model_type'))} in a {wrapper} "
                              f"config: expected {expected!r}")
        out = dict(text)
        if "tie_word_embeddings" in d:
            out["tie_word_embeddings"] = d["tie_word_embeddings"]
    else:
        out = dict(d)
    out["model_type"] = d["model_type"]
    if out.get("partial_rotary_factor") is None:
        out["partial_rotary_factor"] = 0.25
    return out


def _qwen3_5_fields(d: Mapping[str, Any], model_type: str) -> Dict[str, Any]:
    if not _bool(d, "attn_output_gate", True):
        raise ConfigError("unsupported attn_output_gate=false: Qwen3.5 attention always has the output gate")
    if _bool(d, "attention_bias", False):
        raise ConfigError("unsupported attention_bias=true for qwen3_5: only bias-free projections are implemented")
    fields = {name: _size(d, name, default) for name, default in (
        ("linear_num_key_heads", 16), ("linear_num_value_heads", 32), ("linear_key_head_dim", 128),
        ("linear_value_head_dim", 128), ("linear_conv_kernel_dim", 4))}
    if fields["linear_num_value_heads"] % fields["linear_num_key_heads"]:
        raise ConfigError(f"linear_num_value_heads={fields['linear_num_value_heads']} is not a multiple of "
                          f"linear_num_key_heads={fields['linear_num_key_heads']}")
    for name in ("linear_key_head_dim", "linear_value_head_dim"):
        if fields[name] not in HEAD_DIMS:
            raise ConfigError(f"unsupported {name} {fields[name]}: the gated delta rule kernels take {HEAD_DIMS_TEXT}")
    if not 2 <= fields["linear_conv_kernel_dim"] <= MAX_CONV_KERNEL:
        raise ConfigError(f"unsupported linear_conv_kernel_dim {fields['linear_conv_kernel_dim']}: the conv "
                          f"kernels take 2 to {MAX_CONV_KERNEL}")
    wrapper = model_type in WRAPPER_TEXT_TYPES
    return dict(fields, norm_offset=1.0, attn_output_gate=True,
                weights_prefix="model.language_model." if wrapper else "model.",
                skipped_weight_prefixes=QWEN3_5_SKIPPED_WEIGHTS)


def _moe_fields(d: Mapping[str, Any], model_type: str, n: int) -> Dict[str, Any]:
    """The experts' sizes, the router's renormalisation and the sparse layers (see the module doc)."""
    # the Hub's configs say num_experts; transformers 5's Qwen3MoeConfig writes num_local_experts
    named = [name for name in ("num_experts", "num_local_experts") if d.get(name) is not None]
    experts, top_k = _size(d, named[0] if named else "num_experts"), _size(d, "num_experts_per_tok")
    if len(named) == 2 and d["num_local_experts"] != experts:
        raise ConfigError(f"num_experts={experts} and num_local_experts={_show(d['num_local_experts'])} differ")
    if experts > MAX_EXPERTS:
        raise ConfigError(f"num_experts {experts} is above {MAX_EXPERTS}, the most the MoE kernels take")
    if top_k > experts:
        raise ConfigError(f"num_experts_per_tok={top_k} is more than num_experts={experts}")
    fields: Dict[str, Any] = dict(num_experts=experts, num_experts_per_tok=top_k,
                                  moe_intermediate_size=_size(d, "moe_intermediate_size"))
    if model_type != "qwen3_moe":
        fields["shared_expert_intermediate_size"] = _size(d, "shared_expert_intermediate_size")
    if model_type in HYBRID_MODEL_TYPES:
        if not _bool(d, "norm_topk_prob", True):
            raise ConfigError(f"unsupported norm_topk_prob=false for {model_type}: its router always renormalises")
        return dict(fields, norm_topk_prob=True, moe_layers=tuple(range(n)))
    step = _size(d, "decoder_sparse_step", 1)
    dense = d.get("mlp_only_layers") or []
    if not isinstance(dense, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n
                                                       for i in dense):
        raise ConfigError(f"mlp_only_layers must be a list of layer indices below num_hidden_layers={n}, got "
                          f"{_show(dense)}")
    return dict(fields, norm_topk_prob=_bool(d, "norm_topk_prob", False),
                moe_layers=tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0))


FAMILY_LAYER_TYPES = {"dense": ("full_attention",), "hybrid": ("linear_attention", "full_attention")}
"""The layer kinds each family may name: every one is a key of ``layers.LAYER_TYPES`` (the layers
import this module, not the other way round; tests/test_modeling_config.py checks the two agree)."""


def _layer_types(d: Mapping[str, Any], model_type: str, n: int) -> Tuple[str, ...]:
    """The kind of each of the ``n`` layers: ``layer_types`` (a list of names), or the family's default."""
    hybrid = model_type in HYBRID_MODEL_TYPES
    given = d.get("layer_types")
    if given is not None:
        if not isinstance(given, (list, tuple)) or not all(isinstance(t, str) for t in given):
            raise ConfigError(f"layer_types must be a list of layer type names, got {_show(given)}")
        types = tuple(given)
    elif hybrid:
        interval = _size(d, "full_attention_interval", 4)
        types = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n))
    else:
        types = ("full_attention",) * n
    if len(types) != n:
        raise ConfigError(f"layer_types names {len(types)} layers, num_hidden_layers is {n}")
    allowed = FAMILY_LAYER_TYPES["hybrid" if hybrid else "dense"]
    for t in types:
        if t not in allowed:
            raise ConfigError(f"unsupported layer type {_show(t)} in layer_types: implemented for {model_type} are "
                              f"{', '.join(allowed)}")
    return types


FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}
"""The ``quantization_config`` of Qwen's FP8 checkpoints, the one quantisation that loads (``fmt`` may
be absent; ``modules_to_not_convert`` is read from the tensors: a weight without ``weight_scale_inv``
is not quantised)."""


def _quantization(d: Mapping[str, Any]) -> Optional[str]:
    """"fp8" for a ``quantization_config`` of ``FP8_QUANTIZATION``, None without one; else a
    ``ConfigError`` naming the field."""
    q = _object(d, "quantization_config")
    if q is None:
        return None
    for name, want in FP8_QUANTIZATION.items():
        got = q.get(name)
        if got is None and name == "fmt":  # absent or null: e4m3, the only format Qwen's FP8 checkpoints use
            got = want
        if got != want:
            raise ConfigError(f"unsupported quantization_config {name} {_show(got)}: only Qwen's FP8 checkpoints load "
                              f"(quant_method 'fp8', fmt 'e4m3', activation_scheme 'dynamic', weight_block_size "
                              f"[128, 128])")
    return "fp8"


def _reject_unsupported_features(d: Mapping[str, Any], model_type: str) -> None:
    if _bool(d, "use_sliding_window", False):
        raise ConfigError("unsupported use_sliding_window=true: only full attention is implemented")
    if d.get("hidden_act") not in (None, "silu"):
        raise ConfigError(f"unsupported hidden_act {_show(d['hidden_act'])}: only 'silu' is implemented")
    if model_type in ("qwen3", "qwen3_moe") and _bool(d, "attention_bias", False):
        raise ConfigError(f"unsupported attention_bias=true for {model_type}: Qwen3 checkpoints have no attention bias")
