"""The kinds of decoder layer, each declared in one class: parameters, load plan, cache, forward.

Every layer is a pre-norm block, token mixer then SwiGLU MLP (``DecoderLayer``); a kind is a
subclass that declares its mixer:

- ``init_mixer(config)``: creates the mixer's parameters;
- ``mixer_plan(config, hf)``: for each mixer parameter, the Hugging Face tensors under the prefix
  ``hf`` (e.g. ``"model.layers.3."``) that are concatenated along dim 0 to make it, with shapes;
- ``new_cache(batch_size, max_len, dtype, device)``: the layer's per-sequence state;
- ``mix(h, positions, cache, cache_seqlens)``: the mixer's forward.

``LAYER_TYPES`` maps the names of ``config.layer_types`` to these classes: the model builds its
layers and the loader its plan from it, and the config rejects any other name.

A layer's cache is an object whose tensors have the batch row as dim 0, with ``rows(start, stop)``
(a view of some rows, no copy) and ``prompt_state(row, length)`` (the tensors that hold a prompt
of ``length`` tokens in that row, which ``modeling.model.Cache.copy_prompt_`` copies).

Shapes: B batch, T new tokens, hidden = config.hidden_size, Hq/Hk query/key-value heads,
D head_dim, I intermediate_size, L the cache length.
"""

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

import qwen_ops  # noqa: F401  (registers torch.ops.qwen)

from .config import QwenConfig

ops = torch.ops.qwen

Shape = Tuple[int, ...]
# parameter name -> the checkpoint tensors (name, shape) concatenated along dim 0 to make it
LoadPlan = Dict[str, List[Tuple[str, Shape]]]


class KVCache:
    """An attention layer's cache: keys and values ``k``, ``v`` [B, L, Hk, D]."""

    def __init__(self, k: Tensor, v: Tensor):
        self.k, self.v = k, v

    def rows(self, start: int, stop: int) -> "KVCache":
        return KVCache(self.k[start:stop], self.v[start:stop])

    def prompt_state(self, row: int, length: int) -> List[Tensor]:
        return [self.k[row, :length], self.v[row, :length]]


class DecoderLayer(nn.Module):
    """What every layer kind shares: the two RMSNorms, the SwiGLU MLP and the residual stream.

    forward, in op order (B*T rows, residual kept in the model dtype):
    ``h = rms_norm(x)`` in the first layer, ``h, residual = add_rms_norm(x, residual)`` after;
    ``o = mix(h)``; ``h, residual = add_rms_norm(o, residual)``;
    ``x = linear(silu_mul(linear(h, gate_up_weight)), down_weight)``.
    """

    def __init__(self, config: QwenConfig):
        super().__init__()
        c = self.config = config
        self.input_norm = nn.Parameter(torch.empty(c.hidden_size))
        self.init_mixer(c)  # the kind's parameters, between the norms as in the checkpoint
        self.post_norm = nn.Parameter(torch.empty(c.hidden_size))
        self.gate_up_weight = nn.Parameter(torch.empty(2 * c.intermediate_size, c.hidden_size))
        self.down_weight = nn.Parameter(torch.empty(c.hidden_size, c.intermediate_size))

    @classmethod
    def load_plan(cls, config: QwenConfig, hf: str) -> LoadPlan:
        """Every parameter of the layer, in checkpoint order (the mixer's between the norms)."""
        hidden, inter = config.hidden_size, config.intermediate_size
        return {
            "input_norm": [(hf + "input_layernorm.weight", (hidden,))],
            **cls.mixer_plan(config, hf),
            "post_norm": [(hf + "post_attention_layernorm.weight", (hidden,))],
            "gate_up_weight": [(hf + "mlp.gate_proj.weight", (inter, hidden)),
                               (hf + "mlp.up_proj.weight", (inter, hidden))],
            "down_weight": [(hf + "mlp.down_proj.weight", (hidden, inter))],
        }

    def forward(
        self, x: Tensor, residual: Optional[Tensor], positions: Tensor, cache, cache_seqlens: Optional[Tensor]
    ) -> Tuple[Tensor, Tensor]:
        """x: [B, T, hidden], the previous layer's output not yet added to ``residual`` (None in
        the first layer, where x is the embedding); ``cache``: this layer's cache (``new_cache``).
        Returns (mlp output, residual), both [B, T, hidden]."""
        eps = self.config.rms_norm_eps
        if residual is None:
            h, residual = ops.rms_norm(x, self.input_norm, eps), x
        else:
            h, residual = ops.add_rms_norm(x, residual, self.input_norm, eps)
        o = self.mix(h, positions, cache, cache_seqlens)
        h, residual = ops.add_rms_norm(o, residual, self.post_norm, eps)
        gate_up = ops.linear(h, self.gate_up_weight)  # [B, T, 2I]
        return ops.linear(ops.silu_mul(gate_up), self.down_weight), residual


class AttentionLayer(DecoderLayer):
    """Full (causal, GQA) attention with RoPE, fused QKV; q/k RMSNorm per head on qwen3, a qkv
    bias on qwen2. Cache: ``KVCache``.

    mix: ``qkv = linear(h, qkv_weight, qkv_bias)``, q, k, v = views of qkv; ``q, k = rope(q, k,
    positions, ..., q_norm, k_norm)``; ``kv_cache_store(k, v, cache.k, cache.v, positions)``;
    ``attention(q, k, v)`` in prefill (``cache_seqlens`` None) or ``decode_attention(q, cache.k,
    cache.v, cache_seqlens)``; ``linear(o, o_weight)``.
    """

    def init_mixer(self, c: QwenConfig) -> None:
        self.qkv_weight = nn.Parameter(torch.empty(c.qkv_size, c.hidden_size))
        self.qkv_bias = nn.Parameter(torch.empty(c.qkv_size)) if c.qkv_bias else None
        self.q_norm = nn.Parameter(torch.empty(c.head_dim)) if c.qk_norm else None
        self.k_norm = nn.Parameter(torch.empty(c.head_dim)) if c.qk_norm else None
        self.o_weight = nn.Parameter(torch.empty(c.hidden_size, c.num_attention_heads * c.head_dim))

    @staticmethod
    def mixer_plan(config: QwenConfig, hf: str) -> LoadPlan:
        c, attn = config, hf + "self_attn."
        hidden, d = c.hidden_size, c.head_dim
        q_rows, kv_rows = c.num_attention_heads * d, c.num_key_value_heads * d
        plan: LoadPlan = {"qkv_weight": [(attn + "q_proj.weight", (q_rows, hidden)),
                                         (attn + "k_proj.weight", (kv_rows, hidden)),
                                         (attn + "v_proj.weight", (kv_rows, hidden))]}
        if c.qkv_bias:
            plan["qkv_bias"] = [(attn + "q_proj.bias", (q_rows,)), (attn + "k_proj.bias", (kv_rows,)),
                                (attn + "v_proj.bias", (kv_rows,))]
        if c.qk_norm:
            plan["q_norm"] = [(attn + "q_norm.weight", (d,))]
            plan["k_norm"] = [(attn + "k_norm.weight", (d,))]
        plan["o_weight"] = [(attn + "o_proj.weight", (hidden, q_rows))]
        return plan

    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype, device) -> KVCache:
        c = self.config
        shape = (batch_size, max_len, c.num_key_value_heads, c.head_dim)
        return KVCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def mix(self, h: Tensor, positions: Tensor, cache: KVCache, cache_seqlens: Optional[Tensor]) -> Tensor:
        c = self.config
        B, T, _ = h.shape
        Hq, Hk, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qkv = ops.linear(h, self.qkv_weight, self.qkv_bias)  # [B, T, (Hq + 2Hk) * D]
        q = qkv[..., : Hq * D].view(B, T, Hq, D)
        k = qkv[..., Hq * D : (Hq + Hk) * D].view(B, T, Hk, D)
        v = qkv[..., (Hq + Hk) * D :].view(B, T, Hk, D)
        q, k = ops.rope(q, k, positions, c.rope_theta, c.rotary_dim, self.q_norm, self.k_norm, c.rms_norm_eps)
        ops.kv_cache_store(k, v, cache.k, cache.v, positions)
        scale = D**-0.5
        if cache_seqlens is None:
            o = ops.attention(q, k, v, scale, True)
        else:
            o = ops.decode_attention(q, cache.k, cache.v, cache_seqlens, scale)
        return ops.linear(o.view(B, T, Hq * D), self.o_weight)


LAYER_TYPES = {"full_attention": AttentionLayer}
"""``config.layer_types`` name -> layer class."""
