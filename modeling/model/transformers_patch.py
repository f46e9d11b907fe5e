"""Swap torch.ops.qwen kernels into a transformers Qwen2 / Qwen3 model instance (for training).

    from modeling import patch_transformers
    handle = patch_transformers(model)   # model: Qwen3ForCausalLM, Qwen2ForCausalLM, or their .model
    ... train ...
    handle.undo()                        # or: with patch_transformers(model): ...

Like Liger-Kernel's `apply_liger_kernel_to_qwen3(model=...)`, but only module *instances* are
patched (their `forward` is replaced through the instance attribute), never the classes, so other
models in the process are untouched and `undo()` restores exactly what was there. docs/training.md
("With transformers") tables what each `*RMSNorm`, `*MLP`, `*Attention`, `*ForCausalLM` and
decoder stack (`*Model`) becomes, and when the attention falls back to the model's own function
(a mask, a sliding window). Only the default RoPE (`rope_type` "default") and `hidden_act` "silu"
are supported; other configurations raise ValueError. The model types and the RoPE settings are
read as `modeling.model.config` reads a config.json.
"""
import sys
import types

import torch
import torch.nn.functional as F

import qwen_ops  # noqa: F401  (registers torch.ops.qwen)

from .config import SUPPORTED_MODEL_TYPES, ConfigError, rope_settings

ops = torch.ops.qwen


class TransformersPatch:
    """What `patch_transformers` changed; `undo()` puts it back. Also a context manager."""

    def __init__(self, model):
        self.model = model
        self._saved = []  # (module, had an instance forward, that forward)
        self.counts: dict[str, int] = {}

    def _patch(self, module, fn, kind: str):
        had = "forward" in module.__dict__
        self._saved.append((module, had, module.__dict__.get("forward")))
        module.forward = types.MethodType(fn, module)
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def undo(self):
        for module, had, old in reversed(self._saved):
            if had:
                module.forward = old
            else:
                del module.forward
            module.__dict__.pop("_qwen_rope_theta", None)
        self._saved.clear()
        if self.model.__dict__.get("_qwen_patch") is self:
            del self.model.__dict__["_qwen_patch"]

    @property
    def active(self) -> bool:
        return bool(self._saved)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()

    def __repr__(self):
        return f"TransformersPatch({', '.join(f'{k}={v}' for k, v in sorted(self.counts.items()))}, active={self.active})"


def _rope_theta(config) -> float:
    try:
        theta, rotary_factor = rope_settings(config.to_dict())
    except ConfigError as e:
        raise ConfigError(f"patch_transformers: {e}") from None
    if theta is None:
        raise ValueError("patch_transformers: the config names no rope_theta")
    if rotary_factor != 1.0:
        raise ValueError("patch_transformers: partial_rotary_factor != 1 is not supported")
    return float(theta)


def _rms_norm_forward(self, hidden_states):
    return ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x):
    return self.down_proj(ops.silu_mul_split(self.gate_proj(x), self.up_proj(x)))


def _fallback_attention(self, q, k, v, attention_mask, kwargs):
    """The model's own attention function (eager / sdpa / flash ...) on [B, H, S, D] tensors."""
    mod = sys.modules[type(self).__module__]
    impl = self.config._attn_implementation
    registry = mod.ALL_ATTENTION_FUNCTIONS
    if hasattr(registry, "get_interface"):
        fn = registry.get_interface(impl, mod.eager_attention_forward)
    else:
        fn = mod.eager_attention_forward if impl == "eager" else registry[impl]
    kwargs = {k_: v_ for k_, v_ in kwargs.items() if k_ not in ("position_ids", "cache", "past_key_values",
                                                                "use_cache", "cache_position", "position_embeddings")}
    o, _ = fn(self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attention_mask,
              dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
              sliding_window=getattr(self, "sliding_window", None), **kwargs)
    return o  # [B, Sq, Hq, D]


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
    if args:
        raise TypeError("patched attention forward takes cache arguments by keyword only")
    input_shape = hidden_states.shape[:-1]
    d = self.head_dim
    q = self.q_proj(hidden_states).view(*input_shape, -1, d)
    k = self.k_proj(hidden_states).view(*input_shape, -1, d)
    v = self.v_proj(hidden_states).view(*input_shape, -1, d)
    positions = kwargs.get("position_ids")
    if positions is None:
        raise ValueError("patched Qwen attention needs position_ids (transformers' model forward passes them)")
    positions = positions.expand(input_shape)
    qw = kw = None
    eps = 1e-6
    if getattr(self, "q_norm", None) is not None:
        qw, kw, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.variance_epsilon
    q, k = ops.rope(q, k, positions, self._qwen_rope_theta, d, qw, kw, eps)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None:
        kc, vc = cache.update(k.transpose(1, 2), v.transpose(1, 2), self.layer_idx)
        k, v = kc.transpose(1, 2), vc.transpose(1, 2)
    if attention_mask is None and getattr(self, "sliding_window", None) is None:
        o, _ = ops.attention_with_lse(q, k, v, self.scaling, True)
    else:
        o = _fallback_attention(self, q, k, v, attention_mask, kwargs)
    o = o.reshape(*input_shape, -1)
    return self.o_proj(o), None


def _decoder_forward(self, *args, **kwargs):
    """The decoder stack's forward (patched only where every layer is full attention), told that
    its masks are purely causal (None) when they are: no attention mask, no cached tokens (under
    torch.compile some transformers releases would build a 4-D mask and send the layers to the
    fallback)."""
    if (len(args) <= 1 and kwargs.get("attention_mask") is None
            and _holds_no_tokens(kwargs.get("cache", kwargs.get("past_key_values")))):
        kwargs["attention_mask"] = {"full_attention": None}  # transformers' precomputed-mask mapping
    return type(self).forward(self, *args, **kwargs)


def _holds_no_tokens(cache) -> bool:
    """No cache, or one whose length is a Python 0 (a static cache's length is a tensor: reading
    it would sync, or break a compiled graph, so such a cache keeps transformers' masks)."""
    if cache is None:
        return True
    length = cache.get_seq_length()
    return isinstance(length, int) and length == 0


def _causal_lm_forward(self, input_ids=None, *args, labels=None, shift_labels=None, logits_to_keep=0,
                       return_dict=None, **kwargs):
    if args:
        raise TypeError("patched ForCausalLM forward takes only input_ids positionally")
    from transformers.modeling_outputs import CausalLMOutputWithPast

    num_items = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("ignore_index", None)
    outputs = self.model(input_ids=input_ids, **kwargs)
    hidden = outputs[0]
    extra = {k: v for k, v in outputs.items() if k != "last_hidden_state"}
    as_tuple = return_dict is False  # transformers' return_dict=False: the output's fields as a tuple
    if labels is None and shift_labels is None:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        out = CausalLMOutputWithPast(loss=None, logits=self.lm_head(hidden[:, keep, :]), **extra)
        return out.to_tuple() if as_tuple else out
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    shift_labels = shift_labels.reshape(-1).to(hidden.device)
    loss = ops.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight, shift_labels, -100)
    if num_items is not None:  # transformers' gradient-accumulation convention: sum / num_items_in_batch
        loss = loss * (shift_labels != -100).sum() / num_items
    out = CausalLMOutputWithPast(loss=loss, logits=None, **extra)
    return out.to_tuple() if as_tuple else out


def patch_transformers(model, *, rms_norm: bool = True, swiglu: bool = True, attention: bool = True,
                       loss: bool = True) -> TransformersPatch:
    """Patch a transformers Qwen2/Qwen3 model instance in place; returns the handle whose `undo()`
    restores it. `attention` covers q/k norm + RoPE + attention (one patched forward per layer)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"patch_transformers: model_type {model_type!r} is not supported ({', '.join(SUPPORTED_MODEL_TYPES)})")
    if swiglu and getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"patch_transformers: hidden_act {config.hidden_act!r} is not silu")
    if model.__dict__.get("_qwen_patch") is not None:
        raise ValueError("patch_transformers: this model is patched already: undo() that patch first")
    theta = _rope_theta(config) if attention else None
    handle = TransformersPatch(model)
    try:
        for module in model.modules():
            name = type(module).__name__
            if rms_norm and name.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
                handle._patch(module, _rms_norm_forward, "rms_norm")
            elif swiglu and name.endswith("MLP") and all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj")):
                handle._patch(module, _mlp_forward, "mlp")
            elif attention and name.endswith("Attention") and all(hasattr(module, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj")):
                module._qwen_rope_theta = theta
                handle._patch(module, _attention_forward, "attention")
            elif (attention and name.endswith("Model") and hasattr(module, "layers") and hasattr(module, "embed_tokens")
                  and set(getattr(module.config, "layer_types", None) or ["unknown"]) == {"full_attention"}):
                handle._patch(module, _decoder_forward, "causal_mask")
            elif loss and name.endswith("ForCausalLM") and hasattr(module, "lm_head") and hasattr(module, "model"):
                handle._patch(module, _causal_lm_forward, "loss")
    except Exception:
        handle.undo()
        raise
    model.__dict__["_qwen_patch"] = handle  # the patch undo() takes back (one at a time)
    return handle
