"""The Qwen decoder (qwen3, qwen2, and the Qwen3.5 hybrid of Gated DeltaNet and gated attention
layers) built only from ``torch.ops.qwen.*`` and an embedding lookup: an embedding, the layers of
``config.layer_types`` (``modeling.model.layers``), a final norm and the lm_head.

One forward: without a context over [B, T] tokens (training, scoring), or over an engine step's
flat tokens with its ``modeling.model.context.StepContext``.

With ``parallel`` (``modeling.model.tensor_parallel.TensorParallel``, world size W > 1) each rank
holds its shards: the layers of its ``local_config``, the embedding's and the lm_head's vocabulary
slices [V/W, hidden] (the lookup summed over the ranks, the logits gathered), and every rank
returns the full logits. Such a model runs op by op (no fused or persistent decode).

Shapes: B batch, T tokens, N a step's tokens, hidden = config.hidden_size, V vocab_size.
"""

from pathlib import Path
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import qwen_ops

from . import fp8
from .config import QwenConfig
from .context import StepContext
from .layers import LAYER_TYPES, AttentionLayer, GatedDeltaNetLayer
from .loader import load_state_dict
from .tensor_parallel import SINGLE, TensorParallel

ops = torch.ops.qwen

STACKED = ((None, ("input_norm", "qkv_weight", "qkv_bias", "q_norm", "k_norm", "o_weight", "post_norm",
                   "gate_up_weight", "down_weight", "qkv_weight_scale_inv", "o_weight_scale_inv",
                   "gate_up_weight_scale_inv", "down_weight_scale_inv")),)
"""The layer weights the persistent decode kernel reads (``ops.decode_layers``), in its arguments'
order (the FP8 scales, None without them, last: after num_splits), each stacked over the layers
[NL, ...] (the format of ``HYBRID_STACKED``)."""

HYBRID_STACKED = ((None, ("input_norm", "post_norm", "gate_up_weight", "down_weight")),
                  (AttentionLayer, ("qkv_weight", "q_norm", "k_norm", "o_weight")),
                  (GatedDeltaNetLayer, ("in_proj_weight", "conv_weight", "A_log", "dt_bias", "norm_weight",
                                        "out_weight")))
"""The layer weights the hybrid persistent decode kernel reads (``ops.decode_hybrid_layers``), in its
arguments' order: each stacked over every layer (None) or over the layers of one kind."""


class QwenForCausalLM(nn.Module):
    """Qwen3 / Qwen2 / Qwen3.5 causal LM. Parameters are created uninitialized; use ``from_pretrained``.
    ``config`` is the whole model's; ``parallel`` this rank's place in a tensor-parallel group."""

    def __init__(self, config: QwenConfig, parallel: TensorParallel = SINGLE):
        super().__init__()
        c = config
        self.config, self.parallel = c, parallel
        local = parallel.local_config(c)
        vocab = c.vocab_size // parallel.world_size
        self.embed_tokens = nn.Parameter(torch.empty(vocab, c.hidden_size))
        self.layers = nn.ModuleList(LAYER_TYPES[kind](local, i in c.moe_layers, parallel)
                                    for i, kind in enumerate(c.layer_types))
        self.norm = nn.Parameter(torch.empty(c.hidden_size))
        self.lm_head = None if c.tie_word_embeddings else nn.Parameter(torch.empty(vocab, c.hidden_size))
        self._stacks: Optional[Tuple] = None
        self._kinds: Optional[list] = None  # the hybrid kernel's layer_kinds, once stacked for it

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def supports_persistent_decode(self) -> bool:
        """Whether decode steps may run every layer in the persistent kernel (``ops.decode_layers``):
        attention layers only, without an output gate, with dense MLPs (Qwen3, Qwen2), every weight
        in the model's dtype or every layer's four linear weights FP8, on one device (not
        tensor-parallel)."""
        if not (all(isinstance(layer, AttentionLayer) for layer in self.layers) and not self.config.attn_output_gate
                and self.supports_fused_decode):
            return False
        scaled = [getattr(layer, name + "_scale_inv") is not None
                  for layer in self.layers for name in layer.linear_weights(False)]
        return all(scaled) or not self.holds_fp8

    @property
    def supports_hybrid_persistent_decode(self) -> bool:
        """Whether decode steps may run every layer in the hybrid persistent kernel
        (``ops.decode_hybrid_layers``): Gated DeltaNet and gated attention layers, both (Qwen3.5),
        with per-head q/k norms and no qkv bias, dense MLPs, every weight in the model's dtype, on
        one device."""
        c = self.config
        return ({type(layer) for layer in self.layers} == {AttentionLayer, GatedDeltaNetLayer} and c.attn_output_gate
                and c.qk_norm and not c.qkv_bias and not self.holds_fp8 and self.supports_fused_decode)

    @property
    def supports_fused_decode(self) -> bool:
        """Whether decode steps may take the fused decode ops (``kernels="fused"``): every layer's
        ``DecoderLayer.supports_fused_decode``, and the model on one device."""
        return self.parallel.world_size == 1 and all(layer.supports_fused_decode for layer in self.layers)

    @property
    def holds_fp8(self) -> bool:
        """Whether any layer weight is FP8 (``modeling.model.fp8``)."""
        return any(layer.holds_fp8 for layer in self.layers)

    def forward(self, input_ids: Tensor, context: Optional[StepContext] = None) -> Tensor:
        """Without ``context``: input_ids [B, T] (int64), each row a sequence from position 0,
        attention causal within it and no cache; returns logits [B, T, V].

        With ``context`` (an engine step): input_ids [N], the step's flat tokens; every layer reads
        the step's batch and writes its pool entry; returns the logits [Ss, V] of the rows
        ``context.batch.logits_rows`` (each sampling sequence's last token)."""
        c = self.config
        if context is None:
            return self._logits(self._final_hidden(input_ids))
        batch = context.batch
        if context.kernels == "persistent":
            x, pool = F.embedding(input_ids, self.embed_tokens), context.pool
            splits = qwen_ops.decode_layers_splits(batch.block_table.shape[1] * pool.kv[0].shape[2], input_ids.shape[0])
            s = self._stacks
            if self._kinds is None:
                x = ops.decode_layers(x, batch.positions, batch.seq_lens, batch.block_table, *s[:9], *pool.kv,
                                      c.rms_norm_eps, c.norm_offset, c.rope_theta, c.rotary_dim, c.num_attention_heads,
                                      splits, *s[9:])
            else:
                x = ops.decode_hybrid_layers(x, batch.positions, batch.seq_lens, batch.block_table, batch.state_slots,
                                             self._kinds, *s[:8], *pool.kv, *s[8:], *pool.states, c.rms_norm_eps,
                                             c.norm_offset, c.rope_theta, c.rotary_dim, c.num_attention_heads, splits)
            return ops.norm_linear(x, self.norm, self._head(), None, c.rms_norm_eps, c.norm_offset)
        x, residual = self.parallel.embedding(input_ids, self.embed_tokens), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, batch.positions, context.layer(i))
        rows = batch.logits_rows
        if residual is None:  # fused: x is the whole stream
            return ops.norm_linear(x[rows], self.norm, self._head(), None, c.rms_norm_eps, c.norm_offset)
        h = ops.add_rms_norm(x[rows], residual[rows], self.norm, c.rms_norm_eps, c.norm_offset)[0]
        return self._logits(h)

    def loss(self, input_ids: Tensor, labels: Optional[Tensor] = None, ignore_index: int = -100) -> Tensor:
        """Mean next-token cross-entropy over input_ids [B, T] (each row from position 0): position
        t predicts labels[:, t + 1] (labels default to input_ids; ignore_index entries count for
        nothing). The lm_head and the loss run fused (``qwen::linear_cross_entropy``): the
        [B, T, V] logits are never built. For training, with ``requires_grad_(True)``, on one device."""
        if self.parallel.world_size > 1:
            raise ValueError("loss takes a model on one device, not a tensor-parallel one")
        if input_ids.dim() != 2 or (labels is not None and labels.shape != input_ids.shape):
            raise ValueError(f"loss takes input_ids [B, T] (and labels of its shape), got input_ids "
                             f"{tuple(input_ids.shape)}" + ("" if labels is None else f", labels {tuple(labels.shape)}"))
        h = self._final_hidden(input_ids)
        targets = (input_ids if labels is None else labels)[:, 1:]
        return ops.linear_cross_entropy(h[:, :-1].reshape(-1, h.shape[-1]), self._head(), targets.reshape(-1),
                                        ignore_index)

    def stack_layer_weights(self) -> None:
        """Stack each weight the persistent decode kernel reads (``STACKED``, or ``HYBRID_STACKED``
        for a hybrid model; the conv weights [NG, C, K]); the layers' parameters become views of the
        stacks (no second copy). For an inference model that supports a kernel; the engine calls it
        before it captures any step (a captured step reads the weights by address). Made again if
        the parameters were replaced since (``model.to(dtype)``)."""
        table = STACKED if self.supports_persistent_decode else HYBRID_STACKED
        groups = [([layer for layer in self.layers if kind is None or isinstance(layer, kind)], name)
                  for kind, names in table for name in names]
        if not (self.supports_persistent_decode or self.supports_hybrid_persistent_decode):
            raise ValueError("the persistent decode kernels take attention layers without an output gate (Qwen3, "
                             "Qwen2; FP8 weights too) or Qwen3.5's Gated DeltaNet and gated attention layers (weights "
                             "in the model's dtype), with dense MLPs")
        if any(p.requires_grad for p in self.parameters()):
            raise ValueError("stack_layer_weights is for inference models: a parameter requires grad")
        if self._stacks is not None and all(t is None or getattr(layers[-1], name).data_ptr() == t[-1].data_ptr()
                                            for (layers, name), t in zip(groups, self._stacks)):
            return
        stacks = []
        for layers, name in groups:
            params = [getattr(layer, name) for layer in layers]
            if params[0] is None:
                stacks.append(None)
                continue
            stack = torch.stack([p.detach() for p in params])
            for layer, view in zip(layers, stack):
                setattr(layer, name, nn.Parameter(view, requires_grad=False))
            stacks.append(stack.flatten(2) if name == "conv_weight" else stack)  # [NG, C, 1, K] as [NG, C, K]
        self._stacks = tuple(stacks)
        self._kinds = None if self.supports_persistent_decode else [
            qwen_ops.DECODE_HYBRID_GATED_DELTANET if isinstance(layer, GatedDeltaNetLayer) else
            qwen_ops.DECODE_HYBRID_ATTENTION for layer in self.layers]

    def _head(self) -> Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def _logits(self, h: Tensor) -> Tensor:
        """The logits [..., V] of normed hidden states h [..., hidden]: ``linear(h, lm_head)``, each
        rank's vocabulary slice gathered where the model is split."""
        return self.parallel.gather_logits(ops.linear(h, self._head()))

    def _final_hidden(self, input_ids: Tensor) -> Tensor:
        """The normed final hidden states [B, T, hidden] of a pass without a cache over input_ids
        [B, T], each row from position 0."""
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        x, residual = self.parallel.embedding(input_ids, self.embed_tokens), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions)
        return ops.add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps, self.config.norm_offset)[0]

    @classmethod
    def from_pretrained(
        cls,
        path: Union[str, Path],
        device: Union[str, torch.device] = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        quantization: Optional[str] = None,
        parallel: TensorParallel = SINGLE,
    ) -> "QwenForCausalLM":
        """Build the model from ``path``'s config.json and safetensors weights, for inference
        (parameters do not require grad). ``quantization="fp8"`` quantises the layers' linear
        weights and experts as they load (``modeling.model.fp8``); an FP8 checkpoint loads as it is
        without it. ``parallel``: this rank's shards only, each read as its slices of the checkpoint
        tensors."""
        config = QwenConfig.from_pretrained(path)
        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
        if quantization and parallel.world_size > 1:
            raise ValueError("quantization='fp8' takes a model on one device, not a tensor-parallel one")
        if quantization and not fp8.keeps_fp8(torch.device(device), dtype):
            raise ValueError(f"quantization='fp8' needs the FP8 kernels: a GPU of compute capability 8.9 or newer (or "
                             f"the Triton interpreter) and a float dtype other than float64, got "
                             f"{str(dtype).replace('torch.', '')} on {device}")
        state = load_state_dict(path, config, device=device, dtype=dtype, quantize=quantization == "fp8",
                                parallel=parallel)
        return cls.from_state(config, state, parallel)

    @classmethod
    def from_state(cls, config: QwenConfig, state: dict, parallel: TensorParallel = SINGLE) -> "QwenForCausalLM":
        """The model of ``config`` holding ``state``'s tensors as they are, for inference: the
        loader's fused tensors (``load_state_dict``), FP8 weights with their ``*_scale_inv`` (and
        ``*_tail``) in place of the parameters they stand for."""
        with torch.device("meta"):
            model = cls(config, parallel)
        # the loader stacks rows; a parameter of more dims (the experts [E, 2I, H]) is a view of them
        shapes = {name: p.shape for name, p in model.named_parameters()}
        # FP8 weights (their rows without the tail), scales and tails replace the parameters as they are
        fp8_names = [n for n in state if n.endswith(("_scale_inv", "_tail")) or n + "_scale_inv" in state]
        fp8_parts = {name: state.pop(name) for name in fp8_names}
        state = {name: t.view(shapes.get(name, t.shape)) for name, t in state.items()}
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if unexpected or set(missing) - set(fp8_parts):
            raise RuntimeError(f"the loaded tensors do not match the model: missing {sorted(set(missing) - set(fp8_parts))}"
                               f", unexpected {unexpected}")
        for name, t in fp8_parts.items():
            owner, attr = name.rsplit(".", 1)
            setattr(model.get_submodule(owner), attr, nn.Parameter(t, requires_grad=False))
        return model.requires_grad_(False)
