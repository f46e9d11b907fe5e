"""The kinds of decoder layer, each declared in one class: parameters, load plan, cache, forward.

Every layer is a pre-norm block, token mixer then SwiGLU MLP (``DecoderLayer``); a kind is a
subclass that declares its mixer:

- ``init_mixer(config)``: creates the mixer's parameters;
- ``mixer_plan(config, hf)``: for each mixer parameter, the Hugging Face tensors under the prefix
  ``hf`` (e.g. ``"model.layers.3."``) that are concatenated along dim 0 to make it, with shapes;
- ``new_cache(batch_size, max_len, dtype, device)``: the layer's per-sequence state;
- ``mix(h, positions, cache, cache_seqlens)``: the mixer's forward;
- ``mix_decode(x, positions, cache, cache_seqlens)``: ``x + mix(rms_norm(x))`` for a decode step
  through the fused ops (the input norm inside the first projection, the residual add inside
  the last), used by ``DecoderLayer.decode``.

``LAYER_TYPES`` maps the names of ``config.layer_types`` to these classes: the model builds its
layers and the loader its plan from it, and the config rejects any other name.

A layer's cache is an object whose tensors have the batch row as dim 0, with ``rows(start, stop)``
(a view of some rows, no copy) and ``prompt_state(row, length)`` (the tensors that hold a prompt
of ``length`` tokens in that row, which ``modeling.model.causal_lm.Cache.copy_prompt_`` copies).

A cache also says whether a prompt may be prefilled right-padded (``supports_padded_prefill``):
true for attention, whose causal mask keeps padding after a prompt from touching it; false for a
recurrent state, which would absorb the padding tokens.

Kinds: ``full_attention`` (``AttentionLayer``: qwen3, qwen2, and Qwen3.5's gated attention) and
``linear_attention`` (``GatedDeltaNetLayer``: Qwen3.5's Gated DeltaNet).

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

    supports_padded_prefill = True  # causal attention: right-padding never reaches the prompt

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
    ``x = linear(silu_mul(linear(h, gate_up_weight)), down_weight)``. The norms use
    ``config.norm_offset`` (1.0 on Qwen3.5: zero-centred weights).
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
        return self._block(x, residual, lambda h: self.mix(h, positions, cache, cache_seqlens))

    def step(self, x: Tensor, residual: Optional[Tensor], batch, pool_entry) -> Tuple[Tensor, Tensor]:
        """``forward`` over an engine step's flat tokens: x [N, hidden]; the mixer reads the batch
        (``modeling.engine.step.StepBatch``) and this layer's entry of the engine's cache pool."""
        return self._block(x, residual, lambda h: self.mix_step(h, batch, pool_entry))

    def _block(self, x: Tensor, residual: Optional[Tensor], mix) -> Tuple[Tensor, Tensor]:
        eps, offset = self.config.rms_norm_eps, self.config.norm_offset
        if residual is None:
            h, residual = ops.rms_norm(x, self.input_norm, eps, offset), x
        else:
            h, residual = ops.add_rms_norm(x, residual, self.input_norm, eps, offset)
        h, residual = ops.add_rms_norm(mix(h), residual, self.post_norm, eps, offset)
        gate_up = ops.linear(h, self.gate_up_weight)  # [..., 2I]
        return ops.linear(ops.silu_mul(gate_up), self.down_weight), residual

    def decode(self, x: Tensor, positions: Tensor, cache, cache_seqlens: Tensor) -> Tensor:
        """The fused decode step (inference only: the fused ops have no autograd). x [B, T, hidden]
        is the residual stream with the previous layer's output already added; returns it after
        this layer. The same math as ``forward``: the input norm runs inside the mixer's first
        projection (``mix_decode``), the post norm inside ``norm_gate_up_silu``, and each residual
        add inside the projection before it (``linear_residual``)."""
        c = self.config
        x = self.mix_decode(x, positions, cache, cache_seqlens)
        h = ops.norm_gate_up_silu(x, self.post_norm, self.gate_up_weight, c.rms_norm_eps, c.norm_offset)
        return ops.linear_residual(h, self.down_weight, x)


class AttentionLayer(DecoderLayer):
    """Full (causal, GQA) attention with RoPE, fused QKV; q/k RMSNorm per head on qwen3 and
    Qwen3.5, a qkv bias on qwen2. Cache: ``KVCache``.

    mix: ``qkv = linear(h, qkv_weight, qkv_bias)``, q, k, v = views of qkv; ``q, k = rope(q, k,
    positions, ..., q_norm, k_norm)``; ``kv_cache_store(k, v, cache.k, cache.v, positions)``;
    ``attention(q, k, v)`` in prefill (``cache_seqlens`` None) or ``decode_attention(q, cache.k,
    cache.v, cache_seqlens)``; ``linear(o, o_weight)``.

    Qwen3.5's gated attention (``config.attn_output_gate``): q_proj's rows hold per head
    ``[query (D) | gate (D)]``, so q and the gate are strided views of qkv [B, T, Hq, 2D]; the q/k
    norms are zero-centred (``norm_offset`` 1.0), RoPE covers the first ``rotary_dim`` dims, and
    ``o = sigmoid_mul(o, gate)`` before o_proj.
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
        q_rows, kv_rows = c.q_size, c.num_key_value_heads * d
        plan: LoadPlan = {"qkv_weight": [(attn + "q_proj.weight", (q_rows, hidden)),
                                         (attn + "k_proj.weight", (kv_rows, hidden)),
                                         (attn + "v_proj.weight", (kv_rows, hidden))]}
        if c.qkv_bias:
            plan["qkv_bias"] = [(attn + "q_proj.bias", (q_rows,)), (attn + "k_proj.bias", (kv_rows,)),
                                (attn + "v_proj.bias", (kv_rows,))]
        if c.qk_norm:
            plan["q_norm"] = [(attn + "q_norm.weight", (d,))]
            plan["k_norm"] = [(attn + "k_norm.weight", (d,))]
        plan["o_weight"] = [(attn + "o_proj.weight", (hidden, c.num_attention_heads * d))]
        return plan

    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype, device) -> KVCache:
        c = self.config
        shape = (batch_size, max_len, c.num_key_value_heads, c.head_dim)
        return KVCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def _qkv(self, h: Tensor, positions: Tensor) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        """h [B, T, hidden] -> q [B, T, Hq, D] and k [B, T, Hk, D] (normed, rotated), v, and the
        output gate (None without one): views of the fused QKV projection."""
        c = self.config
        B, T, _ = h.shape
        Hq, Hk, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        Q = c.q_size  # Hq * D, or Hq * 2D with the output gate
        qkv = ops.linear(h, self.qkv_weight, self.qkv_bias)  # [B, T, Q + 2Hk * D]
        gate = None
        if c.attn_output_gate:
            qg = qkv[..., :Q].view(B, T, Hq, 2 * D)  # per head [query | gate]
            q, gate = qg[..., :D], qg[..., D:]
        else:
            q = qkv[..., :Q].view(B, T, Hq, D)
        k = qkv[..., Q : Q + Hk * D].view(B, T, Hk, D)
        v = qkv[..., Q + Hk * D :].view(B, T, Hk, D)
        q, k = ops.rope(q, k, positions, c.rope_theta, c.rotary_dim, self.q_norm, self.k_norm, c.rms_norm_eps,
                        c.norm_offset)
        return q, k, v, gate

    def mix(self, h: Tensor, positions: Tensor, cache: KVCache, cache_seqlens: Optional[Tensor]) -> Tensor:
        D = self.config.head_dim
        q, k, v, gate = self._qkv(h, positions)
        ops.kv_cache_store(k, v, cache.k, cache.v, positions)
        if cache_seqlens is None:
            o = ops.attention(q, k, v, D**-0.5, True)
        else:
            o = ops.decode_attention(q, cache.k, cache.v, cache_seqlens, D**-0.5)
        return ops.linear(self._gated(o, gate), self.o_weight)

    def mix_step(self, h: Tensor, batch, pool_entry: Tuple[Tensor, Tensor]) -> Tensor:
        """The mixer over an engine step's flat tokens h [N, hidden]: k/v written to their slots of
        the paged pool (k, v [num_blocks, block_size, Hk, D]), attention over each sequence's cached
        positions through its block table."""
        k_pool, v_pool = pool_entry
        q, k, v, gate = self._qkv(h[None], batch.positions[None])
        ops.kv_cache_store_slots(k[0], v[0], k_pool, v_pool, batch.slot_mapping)
        o = ops.paged_attention(q[0], k_pool, v_pool, batch.cu_seqlens_q, batch.seq_lens, batch.block_table,
                                self.config.head_dim**-0.5, batch.max_query_len)
        return ops.linear(self._gated(o[None], gate), self.o_weight)[0]

    def mix_decode(self, x: Tensor, positions: Tensor, cache: KVCache, cache_seqlens: Tensor) -> Tensor:
        """``x + mix(rms_norm(x))`` for a decode step, in three ops: ``norm_qkv_rope_store``,
        ``decode_attention``, ``linear_residual`` (plus ``sigmoid_mul`` with the output gate)."""
        c = self.config
        D = c.head_dim
        qg = ops.norm_qkv_rope_store(x, self.input_norm, self.qkv_weight, self.qkv_bias, self.q_norm, self.k_norm,
                                     cache.k, cache.v, positions, c.rms_norm_eps, c.norm_offset, c.rope_theta,
                                     c.rotary_dim, c.num_attention_heads, c.attn_output_gate)
        o = ops.decode_attention(qg[..., :D], cache.k, cache.v, cache_seqlens, D**-0.5)
        return ops.linear_residual(self._gated(o, qg[..., D:] if c.attn_output_gate else None), self.o_weight, x)

    @staticmethod
    def _gated(o: Tensor, gate: Optional[Tensor]) -> Tensor:
        """Attention output o [B, T, Hq, D] (times sigmoid(gate) with the output gate) -> [B, T, Hq * D]."""
        if gate is not None:
            o = ops.sigmoid_mul(o, gate)
        return o.reshape(*o.shape[:2], -1)


class GatedDeltaNetCache:
    """A Gated DeltaNet layer's state: ``conv`` [B, C, K-1] (the last K-1 inputs of the conv1d, in
    the cache dtype) and ``state`` [B, Hv, Dk, Dv] (the delta rule's recurrent state, fp32; float64
    for a float64 cache). Both are per sequence, independent of its length."""

    supports_padded_prefill = False  # the recurrent state would absorb padding tokens

    def __init__(self, conv: Tensor, state: Tensor):
        self.conv, self.state = conv, state

    def rows(self, start: int, stop: int) -> "GatedDeltaNetCache":
        return GatedDeltaNetCache(self.conv[start:stop], self.state[start:stop])

    def prompt_state(self, row: int, length: int) -> List[Tensor]:
        """The whole state of the row: it holds the prompt only if the prompt ran exactly ``length``
        tokens (no padding; see ``supports_padded_prefill``)."""
        return [self.conv[row], self.state[row]]


class GatedDeltaNetLayer(DecoderLayer):
    """Qwen3.5's Gated DeltaNet (``linear_attention``; transformers' Qwen3_5GatedDeltaNet).
    Cache: ``GatedDeltaNetCache``.

    Sizes: Hk key heads of Dk, Hv value heads of Dv (value head h reads key head h // (Hv / Hk)),
    Kd = Hk * Dk, Vd = Hv * Dv, C = 2 * Kd + Vd conv channels, K the conv kernel size.

    mix: ``proj = linear(h, in_proj_weight)`` (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a fused:
    [B, T, C + Vd + 2Hv]); x, z, b, a = views of proj; the depthwise causal conv + SiLU over x
    (prefill: ``causal_conv1d``, its final state copied into ``cache.conv``; decode:
    ``causal_conv1d_update`` on ``cache.conv`` in place); q, k, v = views of its output;
    prefill: ``g, beta = gated_delta_gates(a, b, A_log, dt_bias)``, ``o, S = chunk_gated_delta_rule(q,
    k, v, g, beta, Dk^-0.5, use_qk_l2norm=True)``, S copied into ``cache.state``; decode:
    ``o = recurrent_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, cache.state, Dk^-0.5)`` (gates
    inside, state in place); ``o = gated_rms_norm(o, z, norm_weight)``; ``linear(o, out_weight)``.
    Prefill starts each sequence from a zero state, like attention's prefill; positions are unused.
    """

    def init_mixer(self, c: QwenConfig) -> None:
        C, Vd, Hv = c.linear_conv_dim, c.linear_value_dim, c.linear_num_value_heads
        self.in_proj_weight = nn.Parameter(torch.empty(C + Vd + 2 * Hv, c.hidden_size))
        self.conv_weight = nn.Parameter(torch.empty(C, 1, c.linear_conv_kernel_dim))  # nn.Conv1d's layout
        self.dt_bias = nn.Parameter(torch.empty(Hv))
        self.A_log = nn.Parameter(torch.empty(Hv))
        self.norm_weight = nn.Parameter(torch.empty(c.linear_value_head_dim))
        self.out_weight = nn.Parameter(torch.empty(c.hidden_size, Vd))

    @staticmethod
    def mixer_plan(config: QwenConfig, hf: str) -> LoadPlan:
        c, la = config, hf + "linear_attn."
        hidden, C, Vd, Hv = c.hidden_size, c.linear_conv_dim, c.linear_value_dim, c.linear_num_value_heads
        return {
            "in_proj_weight": [(la + "in_proj_qkv.weight", (C, hidden)), (la + "in_proj_z.weight", (Vd, hidden)),
                               (la + "in_proj_b.weight", (Hv, hidden)), (la + "in_proj_a.weight", (Hv, hidden))],
            "conv_weight": [(la + "conv1d.weight", (C, 1, c.linear_conv_kernel_dim))],
            "dt_bias": [(la + "dt_bias", (Hv,))],
            "A_log": [(la + "A_log", (Hv,))],
            "norm_weight": [(la + "norm.weight", (c.linear_value_head_dim,))],
            "out_weight": [(la + "out_proj.weight", (hidden, Vd))],
        }

    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype, device) -> GatedDeltaNetCache:
        c = self.config
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        conv = torch.zeros(batch_size, c.linear_conv_dim, c.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
        state = torch.zeros(batch_size, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                            dtype=state_dtype, device=device)
        return GatedDeltaNetCache(conv, state)

    def mix(self, h: Tensor, positions: Tensor, cache: GatedDeltaNetCache, cache_seqlens: Optional[Tensor]) -> Tensor:
        o = self._delta_rule(ops.linear(h, self.in_proj_weight), cache, cache_seqlens)
        return ops.linear(o, self.out_weight)

    def mix_decode(self, x: Tensor, positions: Tensor, cache: GatedDeltaNetCache, cache_seqlens: Tensor) -> Tensor:
        """``x + mix(rms_norm(x))`` for a decode step: the input norm inside ``norm_linear``, the
        residual add inside ``linear_residual``."""
        c = self.config
        proj = ops.norm_linear(x, self.input_norm, self.in_proj_weight, None, c.rms_norm_eps, c.norm_offset)
        return ops.linear_residual(self._delta_rule(proj, cache, cache_seqlens), self.out_weight, x)

    def mix_step(self, h: Tensor, batch, pool_entry: Tuple[Tensor, Tensor]) -> Tensor:
        """The mixer over an engine step's flat tokens h [N, hidden]: every sequence of the step (prefill
        chunks and decode tokens alike) in one packed call per op, each starting from its slot of the
        pool (conv [slots, C, K-1], state [slots, Hv, Dk, Dv]) where ``batch.continues`` (its first
        position > 0), else from zeros, and leaving its state there in place. Steps whose sequences
        hold at most one token each (``max_query_len <= 1``: decode) take the recurrent rule (gates
        inside); others the chunked one. Grids depend on shapes only: padded step graphs capture it."""
        c = self.config
        conv_pool, state_pool = pool_entry
        Hk, Hv = c.linear_num_key_heads, c.linear_num_value_heads
        Dk, Dv, Kd, Vd, C = (c.linear_key_head_dim, c.linear_value_head_dim, c.linear_key_dim, c.linear_value_dim,
                             c.linear_conv_dim)
        proj = ops.linear(h, self.in_proj_weight)  # [N, C + Vd + 2Hv]
        N = proj.shape[0]
        packed = (batch.cu_seqlens_q, batch.state_slots, batch.continues)
        y = ops.causal_conv1d_varlen(proj[:, :C], self.conv_weight[:, 0], conv_pool, *packed)
        q = y[:, :Kd].view(N, Hk, Dk)
        k = y[:, Kd : 2 * Kd].view(N, Hk, Dk)
        v = y[:, 2 * Kd :].view(N, Hv, Dv)
        b = proj[:, C + Vd : C + Vd + Hv]
        a = proj[:, C + Vd + Hv :]
        scale = Dk**-0.5
        if batch.max_query_len <= 1:
            o = ops.recurrent_gated_delta_rule_varlen(q, k, v, a, b, self.A_log, self.dt_bias, state_pool, *packed,
                                                      scale, True)
        else:
            g, beta = ops.gated_delta_gates(a, b, self.A_log, self.dt_bias)
            o = ops.chunk_gated_delta_rule_varlen(q, k, v, g, beta, state_pool, *packed, scale, True)
        o = ops.gated_rms_norm(o, proj[:, C : C + Vd].view(N, Hv, Dv), self.norm_weight, c.rms_norm_eps)
        return ops.linear(o.view(N, Vd), self.out_weight)

    def _delta_rule(self, proj: Tensor, cache: GatedDeltaNetCache, cache_seqlens: Optional[Tensor],
                    continues: bool = False) -> Tensor:
        """The mixer between its two projections: proj [B, T, C + Vd + 2Hv] -> o [B, T, Vd]. Decode
        (``cache_seqlens`` given) continues the cached state in place; prefill starts from a zero
        state, or with ``continues`` from the cached one (a later chunk of a prompt), and leaves its
        final state in the cache."""
        c = self.config
        B, T, _ = proj.shape
        Hk, Hv = c.linear_num_key_heads, c.linear_num_value_heads
        Dk, Dv, Kd, Vd, C = (c.linear_key_head_dim, c.linear_value_head_dim, c.linear_key_dim, c.linear_value_dim,
                             c.linear_conv_dim)
        x = proj[..., :C]
        z = proj[..., C : C + Vd].view(B, T, Hv, Dv)
        b = proj[..., C + Vd : C + Vd + Hv]
        a = proj[..., C + Vd + Hv :]
        weight = self.conv_weight[:, 0]  # [C, K]
        if cache_seqlens is None:
            y, conv_state = ops.causal_conv1d(x, weight, cache.conv if continues else None)
            cache.conv.copy_(conv_state)
        else:
            y = ops.causal_conv1d_update(x, cache.conv, weight)
        q = y[..., :Kd].view(B, T, Hk, Dk)
        k = y[..., Kd : 2 * Kd].view(B, T, Hk, Dk)
        v = y[..., 2 * Kd :].view(B, T, Hv, Dv)
        scale = Dk**-0.5
        if cache_seqlens is None:
            g, beta = ops.gated_delta_gates(a, b, self.A_log, self.dt_bias)
            o, state = ops.chunk_gated_delta_rule(q, k, v, g, beta, scale, cache.state if continues else None, True)
            cache.state.copy_(state)
        else:
            o = ops.recurrent_gated_delta_rule(q, k, v, a, b, self.A_log, self.dt_bias, cache.state, scale, True)
        o = ops.gated_rms_norm(o, z, self.norm_weight, c.rms_norm_eps)  # [B, T, Hv, Dv]
        return o.view(B, T, Vd)


LAYER_TYPES = {"full_attention": AttentionLayer, "linear_attention": GatedDeltaNetLayer}
"""``config.layer_types`` name -> layer class."""
