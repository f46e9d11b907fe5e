"""The kinds of decoder layer, each declared in one class: parameters, load plan, the state it keeps
in the engine's cache pool, and one forward (docs/modeling.md, "Layer kinds": a kind is a
``DecoderLayer`` subclass declaring ``init_mixer``, ``mixer_plan``, ``mixer_splits``, ``cache_spec``
and ``mix``).

``forward(x, residual, positions, context)``: ``context`` None for a training or scoring pass (x
[B, T, hidden], each row a sequence from position 0, no cache), else a
``modeling.model.context.LayerContext`` in an engine step (x [N, hidden], the step's flat tokens;
the layer reads the step's batch and writes its pool entry). With ``context.fused`` the norms run
inside the projections after them and the residual adds inside the projections before them.

The residual stream is a pair (x, residual) whose value is x + residual: op by op, a block's
output x waits to be added into the next norm (``add_rms_norm``); fused, x is the whole stream
and residual is None. The first layer gets (embedding, None). Under tensor parallelism a layer is
built from its rank's ``TensorParallel.local_config`` and holds its shards; the output projections
are followed by ``parallel.all_reduce``.

Shapes: hidden = config.hidden_size, Hq/Hk query/key-value heads, D head_dim, I intermediate_size.
"""

from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

import qwen_ops  # noqa: F401  (registers torch.ops.qwen)

from .config import QwenConfig
from . import fp8
from .context import LayerContext
from .moe import SparseMoeBlock
from .tensor_parallel import SINGLE, Split, TensorParallel

ops = torch.ops.qwen

Shape = Tuple[int, ...]
# parameter name -> the checkpoint tensors (name, shape) concatenated along dim 0 to make it
LoadPlan = Dict[str, List[Tuple[str, Shape]]]
# checkpoint tensor name -> how it splits over tensor-parallel ranks (absent: replicated)
SplitPlan = Dict[str, Split]
Stream = Tuple[Tensor, Optional[Tensor]]


class CacheSpec(NamedTuple):
    """What a layer keeps in the engine's pool, as (shape, dtype) pairs: ``per_position`` tensors,
    each [num_blocks, block_size, *shape] (addressed through a sequence's block table), and
    ``per_sequence`` ones, each [num_state_slots + 1, *shape] (one slot a sequence)."""

    per_position: Tuple[Tuple[Shape, torch.dtype], ...] = ()
    per_sequence: Tuple[Tuple[Shape, torch.dtype], ...] = ()


class DecoderLayer(nn.Module):
    """What every layer kind shares: the two RMSNorms, the MLP and the residual stream.

    forward: ``mix``, then ``h = rms_norm(stream)``, the MLP of h added to the stream: the SwiGLU
    ``linear(silu_mul(linear(h, gate_up_weight)), down_weight)``, or with ``sparse`` (a layer of
    ``config.moe_layers``) the routed experts ``mlp(h)``, a ``modeling.model.moe.SparseMoeBlock``.

    ``LINEAR_WEIGHTS``: the weights that may be FP8 (``modeling.model.fp8``), each with its
    ``<name>_scale_inv`` and ``<name>_tail`` (None unless the loader sets them); a sparse MLP's
    are its own (``SparseMoeBlock``). ``FUSED_TAILS``: those whose tail the fused decode step takes
    (``fp8.norm_linear``).
    """

    LINEAR_WEIGHTS = ("gate_up_weight", "down_weight")
    MIXER_LINEAR_WEIGHTS: Tuple[str, ...] = ()
    FUSED_TAILS: Tuple[str, ...] = ()

    def __init__(self, config: QwenConfig, sparse: bool = False, parallel: TensorParallel = SINGLE):
        super().__init__()
        c = self.config = config
        self.parallel = parallel
        self.input_norm = nn.Parameter(torch.empty(c.hidden_size))
        self.init_mixer(c)  # the kind's parameters, between the norms as in the checkpoint
        self.post_norm = nn.Parameter(torch.empty(c.hidden_size))
        if sparse:
            self.mlp = SparseMoeBlock(c)
        else:
            self.mlp = None
            self.gate_up_weight = nn.Parameter(torch.empty(2 * c.intermediate_size, c.hidden_size))
            self.down_weight = nn.Parameter(torch.empty(c.hidden_size, c.intermediate_size))
        fp8.register_parts(self, self.linear_weights(sparse))

    @classmethod
    def linear_weights(cls, sparse: bool) -> Tuple[str, ...]:
        """The layer's weights that may be FP8: the mixer's projections, and the dense MLP's."""
        return cls.MIXER_LINEAR_WEIGHTS + (() if sparse else DecoderLayer.LINEAR_WEIGHTS)

    @property
    def holds_fp8(self) -> bool:
        """Whether any of the layer's weights (its sparse MLP's included) is FP8."""
        return any(p.dtype == torch.float8_e4m3fn for p in self.parameters())

    @property
    def supports_fused_decode(self) -> bool:
        """Whether the fused decode ops take this layer: a dense MLP, and no FP8 weight with a tail
        outside ``FUSED_TAILS``."""
        return self.mlp is None and all(getattr(self, name + "_tail") is None for name in self.linear_weights(False)
                                        if name not in self.FUSED_TAILS)

    @classmethod
    def load_plan(cls, config: QwenConfig, hf: str, sparse: bool = False, fused_experts: bool = False) -> LoadPlan:
        """Every parameter of the layer, in checkpoint order (the mixer's between the norms); a
        sparse layer's experts one by one, or fused (``fused_experts``)."""
        hidden, inter = config.hidden_size, config.intermediate_size
        plan = {
            "input_norm": [(hf + "input_layernorm.weight", (hidden,))],
            **cls.mixer_plan(config, hf),
            "post_norm": [(hf + "post_attention_layernorm.weight", (hidden,))],
        }
        if sparse:
            return plan | SparseMoeBlock.plan(config, hf, fused_experts)
        return plan | {"gate_up_weight": [(hf + "mlp.gate_proj.weight", (inter, hidden)),
                                          (hf + "mlp.up_proj.weight", (inter, hidden))],
                       "down_weight": [(hf + "mlp.down_proj.weight", (hidden, inter))]}

    @classmethod
    def split_plan(cls, config: QwenConfig, hf: str) -> SplitPlan:
        """How the layer's checkpoint tensors split over tensor-parallel ranks (a dense layer's:
        mixture-of-experts layers are not split): the mixer's, then gate_proj and up_proj by rows
        and down_proj by columns, in intermediate rows."""
        rows = ((config.intermediate_size, 1),)
        return cls.mixer_splits(config, hf) | {hf + "mlp.gate_proj.weight": Split(0, rows),
                                               hf + "mlp.up_proj.weight": Split(0, rows),
                                               hf + "mlp.down_proj.weight": Split(1, rows)}

    def forward(self, x: Tensor, residual: Optional[Tensor], positions: Tensor,
                context: Optional[LayerContext] = None) -> Stream:
        """The stream (x, residual) after this layer (see the module doc); positions: x's
        positions ([B, T] or [N])."""
        c = self.config
        x, residual = self.mix(x, residual, positions, context)
        if context is not None and context.fused:
            h = ops.norm_gate_up_silu(x, self.post_norm, self.gate_up_weight, c.rms_norm_eps, c.norm_offset,
                                      self.gate_up_weight_scale_inv)
            return ops.linear_residual(h, self.down_weight, x, self.down_weight_scale_inv), None
        h, residual = ops.add_rms_norm(x, residual, self.post_norm, c.rms_norm_eps, c.norm_offset)
        if self.mlp is not None:
            return self.mlp(h), residual
        down = fp8.module_linear(self, fp8.module_gate_up_silu(self, h), "down_weight")
        return self.parallel.all_reduce(down), residual

    def _project_in(self, x: Tensor, residual: Optional[Tensor], name: str, bias: Optional[Tensor],
                    fused: bool) -> Stream:
        """``linear(rms_norm(stream, input_norm), <name>, bias)`` and the stream's residual after
        the norm (the first layer's: its x)."""
        c = self.config
        if fused:
            return fp8.norm_linear(x, self.input_norm, getattr(self, name), bias, c.rms_norm_eps, c.norm_offset,
                                   getattr(self, name + "_scale_inv"), getattr(self, name + "_tail")), None
        if residual is None:
            h, residual = ops.rms_norm(x, self.input_norm, c.rms_norm_eps, c.norm_offset), x
        else:
            h, residual = ops.add_rms_norm(x, residual, self.input_norm, c.rms_norm_eps, c.norm_offset)
        return fp8.module_linear(self, h, name, bias), residual

    def _project_out(self, o: Tensor, name: str, x: Tensor, residual: Optional[Tensor], fused: bool) -> Stream:
        """The stream after the mixer's output projection ``linear(o, <name>)`` (row-parallel:
        summed over the ranks): added to the layer's input stream x in the projection (fused), else
        left for the next norm to add."""
        if fused:
            return ops.linear_residual(o, getattr(self, name), x, getattr(self, name + "_scale_inv")), None
        return self.parallel.all_reduce(fp8.module_linear(self, o, name)), residual


class AttentionLayer(DecoderLayer):
    """Full (causal, GQA) attention with RoPE, fused QKV; q/k RMSNorm per head on qwen3 and
    Qwen3.5, a qkv bias on qwen2. Pool entry: keys and values (k, v) [num_blocks, block_size, Hk, D],
    stored at ``batch.slot_mapping``; ``paged_attention`` reads each sequence's cached positions.

    Qwen3.5's gated attention (``config.attn_output_gate``): q_proj's rows hold per head
    ``[query (D) | gate (D)]``, so q and the gate are strided views of qkv [..., Hq, 2D]; the q/k
    norms are zero-centred (``norm_offset`` 1.0), RoPE covers the first ``rotary_dim`` dims, and
    ``o = sigmoid_mul(o, gate)`` before o_proj.
    """

    MIXER_LINEAR_WEIGHTS = ("qkv_weight", "o_weight")

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

    @staticmethod
    def mixer_splits(config: QwenConfig, hf: str) -> SplitPlan:
        """q_proj's rows by query heads (with the output gate, each head's [query | gate]), k_proj's
        and v_proj's by key-value heads (replicated where there are fewer than ranks), their biases
        alike; o_proj's columns by query heads."""
        c, attn = config, hf + "self_attn."
        q = Split(0, ((c.num_attention_heads, c.q_size // c.num_attention_heads),))
        kv = Split(0, ((c.num_key_value_heads, c.head_dim),))
        splits = {attn + "q_proj.weight": q, attn + "k_proj.weight": kv, attn + "v_proj.weight": kv,
                  attn + "o_proj.weight": Split(1, ((c.num_attention_heads, c.head_dim),))}
        if c.qkv_bias:
            splits |= {attn + "q_proj.bias": q, attn + "k_proj.bias": kv, attn + "v_proj.bias": kv}
        return splits

    @staticmethod
    def cache_spec(config: QwenConfig, dtype: torch.dtype) -> CacheSpec:
        kv = ((config.num_key_value_heads, config.head_dim), dtype)
        return CacheSpec(per_position=(kv, kv))

    def mix(self, x: Tensor, residual: Optional[Tensor], positions: Tensor,
            context: Optional[LayerContext]) -> Stream:
        c = self.config
        lead, Hq, Hk, D = x.shape[:-1], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        fused = context is not None and context.fused
        gate = None
        if fused:
            k_pool, v_pool = context.entry
            qg = ops.norm_qkv_rope_store(x, self.input_norm, self.qkv_weight, self.qkv_bias, self.q_norm, self.k_norm,
                                         k_pool, v_pool, positions, context.batch.slot_mapping, c.rms_norm_eps,
                                         c.norm_offset, c.rope_theta, c.rotary_dim, Hq, c.attn_output_gate,
                                         self.qkv_weight_scale_inv)
            q = qg[..., :D]
            gate = qg[..., D:] if c.attn_output_gate else None
        else:
            qkv, residual = self._project_in(x, residual, "qkv_weight", self.qkv_bias, False)
            Q = c.q_size  # Hq * D, or Hq * 2D with the output gate
            if c.attn_output_gate:
                qg = qkv[..., :Q].view(*lead, Hq, 2 * D)  # per head [query | gate]
                q, gate = qg[..., :D], qg[..., D:]
            else:
                q = qkv[..., :Q].view(*lead, Hq, D)
            k = qkv[..., Q : Q + Hk * D].view(*lead, Hk, D)
            v = qkv[..., Q + Hk * D :].view(*lead, Hk, D)
            q, k = ops.rope(q, k, positions, c.rope_theta, c.rotary_dim, self.q_norm, self.k_norm, c.rms_norm_eps,
                            c.norm_offset)
            if context is None:
                o = ops.attention(q, k, v, D**-0.5, True)
            else:
                ops.kv_cache_store_slots(k, v, *context.entry, context.batch.slot_mapping)
        if context is not None:
            b = context.batch
            o = ops.paged_attention(q, *context.entry, b.cu_seqlens_q, b.seq_lens, b.block_table, D**-0.5,
                                    b.max_query_len)
        if gate is not None:
            o = ops.sigmoid_mul(o, gate)
        return self._project_out(o.reshape(*lead, Hq * D), "o_weight", x, residual, fused)


class GatedDeltaNetLayer(DecoderLayer):
    """Qwen3.5's Gated DeltaNet (``linear_attention``; transformers' Qwen3_5GatedDeltaNet). Pool
    entry: ``conv`` [slots, C, K-1] (the last K-1 inputs of the conv1d, model dtype) and ``state``
    [slots, Hv, Dk, Dv] (the delta rule's recurrent state, fp32; float64 for float64 models).

    Sizes: Hk key heads of Dk, Hv value heads of Dv (value head h reads key head h // (Hv / Hk)),
    Kd = Hk * Dk, Vd = Hv * Dv, C = 2 * Kd + Vd conv channels, K the conv kernel size.

    mix: in_proj (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a fused: [..., C + Vd + 2Hv]), the
    depthwise causal conv + SiLU over its qkv channels, the gated delta rule (gates from a, b, A_log
    and dt_bias; q and k L2-normed), ``gated_rms_norm(o, z, norm_weight)``, out_proj. In a step
    every sequence runs in one packed call per op, continuing its slot's state where it has cached
    positions (``batch.continues``), else from zeros (as every row without a context), and leaving
    its state there. Positions are unused.
    """

    MIXER_LINEAR_WEIGHTS = ("in_proj_weight", "out_weight")
    FUSED_TAILS = ("in_proj_weight",)  # in_proj_b and in_proj_a, unquantised in Qwen's FP8 checkpoints

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

    @staticmethod
    def mixer_splits(config: QwenConfig, hf: str) -> SplitPlan:
        """By heads: in_proj_qkv's and conv1d's channels in their q, k (key heads, replicated where
        there are fewer than ranks) and v (value heads) sections; in_proj_z's rows, in_proj_b's,
        in_proj_a's, dt_bias and A_log by value heads; out_proj's columns by value heads."""
        c, la = config, hf + "linear_attn."
        Hk, Hv = c.linear_num_key_heads, c.linear_num_value_heads
        keys, values = (Hk, c.linear_key_head_dim), (Hv, c.linear_value_head_dim)
        channels, per_head = Split(0, (keys, keys, values)), Split(0, ((Hv, 1),))
        return {la + "in_proj_qkv.weight": channels, la + "conv1d.weight": channels,
                la + "in_proj_z.weight": Split(0, (values,)), la + "in_proj_b.weight": per_head,
                la + "in_proj_a.weight": per_head, la + "dt_bias": per_head, la + "A_log": per_head,
                la + "out_proj.weight": Split(1, (values,))}

    @staticmethod
    def cache_spec(config: QwenConfig, dtype: torch.dtype) -> CacheSpec:
        c = config
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        return CacheSpec(per_sequence=(((c.linear_conv_dim, c.linear_conv_kernel_dim - 1), dtype),
                                       ((c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
                                        state_dtype)))

    def mix(self, x: Tensor, residual: Optional[Tensor], positions: Tensor,
            context: Optional[LayerContext]) -> Stream:
        c = self.config
        fused = context is not None and context.fused
        lead = x.shape[:-1]
        Hk, Hv = c.linear_num_key_heads, c.linear_num_value_heads
        Dk, Dv, Kd, Vd, C = (c.linear_key_head_dim, c.linear_value_head_dim, c.linear_key_dim, c.linear_value_dim,
                             c.linear_conv_dim)
        proj, residual = self._project_in(x, residual, "in_proj_weight", None, fused)  # [..., C + Vd + 2Hv]
        b = proj[..., C + Vd : C + Vd + Hv]
        a = proj[..., C + Vd + Hv :]
        conv_pool = state_pool = None  # no context: each row from a zero state, nothing kept
        packed = (None, None, None)
        if context is not None:
            conv_pool, state_pool = context.entry
            packed = (context.batch.cu_seqlens_q, context.batch.state_slots, context.batch.continues)
        y = ops.causal_conv1d(proj[..., :C], self.conv_weight[:, 0], conv_pool, *packed)  # weight [C, K]
        q = y[..., :Kd].view(*lead, Hk, Dk)
        k = y[..., Kd : 2 * Kd].view(*lead, Hk, Dk)
        v = y[..., 2 * Kd :].view(*lead, Hv, Dv)
        scale = Dk**-0.5
        if context is not None and context.batch.max_query_len <= 1:
            o = ops.recurrent_gated_delta_rule_varlen(q, k, v, a, b, self.A_log, self.dt_bias, state_pool, *packed,
                                                      scale, True)
        else:
            g, beta = ops.gated_delta_gates(a, b, self.A_log, self.dt_bias)
            o = ops.chunk_gated_delta_rule(q, k, v, g, beta, scale, state_pool, *packed, True)
        o = ops.gated_rms_norm(o, proj[..., C : C + Vd].view(*lead, Hv, Dv), self.norm_weight, c.rms_norm_eps)
        return self._project_out(o.reshape(*lead, Vd), "out_weight", x, residual, fused)


LAYER_TYPES = {"full_attention": AttentionLayer, "linear_attention": GatedDeltaNetLayer}
"""``config.layer_types`` name -> layer class."""
