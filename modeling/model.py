"""The Qwen decoder (qwen3, qwen2) built only from ``torch.ops.qwen.*`` and an embedding lookup.

Shapes: B batch, T new tokens, hidden = config.hidden_size, Hq/Hk query/key-value heads,
D head_dim, I intermediate_size, V vocab_size, L the KV cache length.
"""

from pathlib import Path
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import qwen_ops  # noqa: F401  (registers torch.ops.qwen)

from .config import QwenConfig
from .loader import load_state_dict

ops = torch.ops.qwen


class KVCache(nn.Module):
    """Preallocated key/value buffers ``k``, ``v``: [num_layers, B, L, Hk, D], owned by the caller.

    Layer ``i`` reads and writes ``k[i]`` / ``v[i]`` (contiguous [B, L, Hk, D] views).
    """

    def __init__(
        self,
        config: QwenConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.bfloat16,
        device: Union[str, torch.device, None] = None,
    ):
        super().__init__()
        shape = (config.num_hidden_layers, batch_size, max_len, config.num_key_value_heads, config.head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)


class DecoderLayer(nn.Module):
    """One pre-norm attention + SwiGLU MLP block with fused QKV and gate/up weights."""

    def __init__(self, config: QwenConfig):
        super().__init__()
        c = config
        self.config = c
        self.input_norm = nn.Parameter(torch.empty(c.hidden_size))
        self.qkv_weight = nn.Parameter(torch.empty(c.qkv_size, c.hidden_size))
        self.qkv_bias = nn.Parameter(torch.empty(c.qkv_size)) if c.qkv_bias else None
        self.q_norm = nn.Parameter(torch.empty(c.head_dim)) if c.qk_norm else None
        self.k_norm = nn.Parameter(torch.empty(c.head_dim)) if c.qk_norm else None
        self.o_weight = nn.Parameter(torch.empty(c.hidden_size, c.num_attention_heads * c.head_dim))
        self.post_norm = nn.Parameter(torch.empty(c.hidden_size))
        self.gate_up_weight = nn.Parameter(torch.empty(2 * c.intermediate_size, c.hidden_size))
        self.down_weight = nn.Parameter(torch.empty(c.hidden_size, c.intermediate_size))

    def forward(
        self,
        x: Tensor,
        residual: Optional[Tensor],
        positions: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        cache_seqlens: Optional[Tensor],
    ) -> Tuple[Tensor, Tensor]:
        """x: [B, T, hidden], the previous layer's output not yet added to ``residual`` (None in
        the first layer, where x is the embedding). Returns (mlp output, residual), both [B, T, hidden]."""
        c = self.config
        B, T, _ = x.shape
        Hq, Hk, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        if residual is None:
            h, residual = ops.rms_norm(x, self.input_norm, c.rms_norm_eps), x
        else:
            h, residual = ops.add_rms_norm(x, residual, self.input_norm, c.rms_norm_eps)
        qkv = ops.linear(h, self.qkv_weight, self.qkv_bias)  # [B, T, (Hq + 2Hk) * D]
        q = qkv[..., : Hq * D].view(B, T, Hq, D)
        k = qkv[..., Hq * D : (Hq + Hk) * D].view(B, T, Hk, D)
        v = qkv[..., (Hq + Hk) * D :].view(B, T, Hk, D)
        q, k = ops.rope(q, k, positions, c.rope_theta, c.rotary_dim, self.q_norm, self.k_norm, c.rms_norm_eps)
        ops.kv_cache_store(k, v, k_cache, v_cache, positions)
        scale = D**-0.5
        if cache_seqlens is None:
            o = ops.attention(q, k, v, scale, True)
        else:
            o = ops.decode_attention(q, k_cache, v_cache, cache_seqlens, scale)
        o = ops.linear(o.view(B, T, Hq * D), self.o_weight)
        h, residual = ops.add_rms_norm(o, residual, self.post_norm, c.rms_norm_eps)
        gate_up = ops.linear(h, self.gate_up_weight)  # [B, T, 2I]
        return ops.linear(ops.silu_mul(gate_up), self.down_weight), residual


class QwenForCausalLM(nn.Module):
    """Qwen3 / Qwen2 causal LM. Parameters are created uninitialized; use ``from_pretrained``."""

    def __init__(self, config: QwenConfig):
        super().__init__()
        c = config
        self.config = c
        self.embed_tokens = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(c.hidden_size))
        self.lm_head = None if c.tie_word_embeddings else nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        cache: KVCache,
        cache_seqlens: Optional[Tensor] = None,
        all_logits: bool = False,
    ) -> Tensor:
        """input_ids, positions: [B, T] (int64; positions int32 or int64).

        Prefill (``cache_seqlens`` None): the T tokens start each sequence (positions 0..T-1);
        attention runs causally over them and their k/v are stored into ``cache``.
        Decode (``cache_seqlens`` [B] int32, the valid cache length including these T tokens):
        k/v are stored at ``positions``, then attention reads the cache.
        Returns logits [B, V] of the last position, or [B, T, V] with ``all_logits``.
        """
        h = self._final_hidden(input_ids, positions, cache, cache_seqlens, last_only=not all_logits)
        return ops.linear(h, self._head())

    def loss(self, input_ids: Tensor, cache: KVCache, labels: Optional[Tensor] = None,
             ignore_index: int = -100) -> Tensor:
        """Mean next-token cross-entropy of a prefill of input_ids [B, T] (positions 0..T-1):
        position t predicts labels[:, t + 1] (labels default to input_ids; ignore_index entries
        count for nothing). The lm_head and the loss run fused (``qwen::linear_cross_entropy``):
        the [B, T, V] logits are never built. For training, with ``requires_grad_(True)``."""
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        h = self._final_hidden(input_ids, positions, cache, None, last_only=False)
        targets = (input_ids if labels is None else labels)[:, 1:]
        return ops.linear_cross_entropy(h[:, :-1].reshape(-1, h.shape[-1]), self._head(), targets.reshape(-1),
                                        ignore_index)

    def _head(self) -> Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def _final_hidden(self, input_ids, positions, cache, cache_seqlens, last_only: bool) -> Tensor:
        x, residual = F.embedding(input_ids, self.embed_tokens), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, cache.k[i], cache.v[i], cache_seqlens)
        if last_only:
            x, residual = x[:, -1], residual[:, -1]
        return ops.add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps)[0]

    @classmethod
    def from_pretrained(
        cls,
        path: Union[str, Path],
        device: Union[str, torch.device] = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> "QwenForCausalLM":
        """Build the model from ``path``'s config.json and safetensors weights, for inference
        (parameters do not require grad)."""
        config = QwenConfig.from_pretrained(path)
        state = load_state_dict(path, config, device=device, dtype=dtype)
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(state, strict=True, assign=True)
        return model.requires_grad_(False)
