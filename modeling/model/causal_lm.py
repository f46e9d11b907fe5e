"""The Qwen decoder (qwen3, qwen2, and the Qwen3.5 hybrid of Gated DeltaNet and gated attention
layers) built only from ``torch.ops.qwen.*`` and an embedding lookup: an embedding, the layers of
``config.layer_types`` (``modeling.model.layers``), a final norm and the lm_head; ``Cache`` holds every
layer's cache.

Shapes: B batch, T new tokens, hidden = config.hidden_size, V vocab_size.
"""

import os
from pathlib import Path
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import qwen_ops
from csrc_free_ops.decode_layers import MAX_ROWS as DECODE_LAYERS_MAX_ROWS
from csrc_free_ops.decode_layers import default_splits as decode_splits
from csrc_free_ops.decode_layers import error_flag as decode_layers_error_flag

from .config import QwenConfig
from .layers import LAYER_TYPES, AttentionLayer, KVCache
from .loader import load_state_dict

ops = torch.ops.qwen

PERSISTENT_DECODE = os.environ.get("QWEN_PERSISTENT_DECODE", "1") != "0"
"""``QwenForCausalLM.persistent_decode``'s default (QWEN_PERSISTENT_DECODE=0: off): on for one
sequence in a cache of at most PERSISTENT_DECODE_MAX_LEN positions (the Generator's default 4096;
for the engine, its max_model_len), where the H200 measures it faster than the fused ops (ms per
Qwen3-0.6B token: 0.757 against 0.941 at context 256; 0.954 against 1.055 at 2048;
bench/results/2026-12-03-h200-decode-persistent.json); not at batch 8 (3.46 against 1.28 ms per step)."""
PERSISTENT_DECODE_MAX_LEN = 4096


class Cache:
    """The state of a batch of sequences for every layer: ``layers[i]`` is layer i's cache (a
    ``KVCache`` for an attention layer, a ``GatedDeltaNetCache`` for a Gated DeltaNet layer). Build
    it with ``QwenForCausalLM.new_cache``; the caller owns it and reuses it (its tensors never
    move, as CUDA graph replay needs).

    ``stacked``: for a model of attention layers only, (k, v) [NL, B, L, Hk, D], the layers' caches
    as one tensor each (``layers[i]`` are views of them), and ``block_table`` [B, 1] int32 (row m's
    positions are "block" m of length L): the layout ``ops.decode_layers`` reads; else None."""

    def __init__(self, layers: Sequence, stacked: Optional[Tuple[Tensor, Tensor]] = None,
                 block_table: Optional[Tensor] = None):
        self.layers = tuple(layers)
        self.stacked, self.block_table = stacked, block_table

    def rows(self, start: int, stop: int) -> "Cache":
        """Batch rows [start, stop) of every layer's cache: views, no copy."""
        stacked = None if self.stacked is None else tuple(t[:, start:stop] for t in self.stacked)
        table = None if self.block_table is None else self.block_table[:stop - start]
        return Cache((c.rows(start, stop) for c in self.layers), stacked, table)

    @property
    def supports_padded_prefill(self) -> bool:
        """Whether a prompt may be prefilled right-padded to a longer length (then its first
        ``length`` positions copied with ``copy_prompt_``): true when every layer's cache says so
        (attention: yes; a recurrent state: no, it would absorb the padding)."""
        return all(c.supports_padded_prefill for c in self.layers)

    def copy_prompt_(self, row: int, src: "Cache", src_row: int, length: int) -> None:
        """Copy the state of a ``length``-token prompt from ``src``'s row ``src_row`` into ``row``."""
        dst = [t for c in self.layers for t in c.prompt_state(row, length)]
        torch._foreach_copy_(dst, [t for c in src.layers for t in c.prompt_state(src_row, length)])


class QwenForCausalLM(nn.Module):
    """Qwen3 / Qwen2 / Qwen3.5 causal LM. Parameters are created uninitialized; use ``from_pretrained``."""

    fused_decode: Optional[bool] = None
    """Whether decode steps (``cache_seqlens`` given) run the fused decode ops
    (``DecoderLayer.decode``: six kernels per attention layer instead of thirteen, the same math)
    or the op-by-op path of prefill. None (the default): fused for a step of one token of one
    sequence, where the H200 measures it at least as fast (docs/performance.md), op by op for
    batched or multi-token steps, where the fused kernels are not tuned yet. True or False
    forces one path."""

    def __init__(self, config: QwenConfig):
        super().__init__()
        c = config
        self.config = c
        self.embed_tokens = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))
        self.layers = nn.ModuleList(LAYER_TYPES[kind](c) for kind in c.layer_types)
        self.norm = nn.Parameter(torch.empty(c.hidden_size))
        self.lm_head = None if c.tie_word_embeddings else nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))

    persistent_decode: Optional[bool] = None
    """Whether decode steps of one new token for each of at most 8 sequences run every layer in
    one persistent kernel (``ops.decode_layers``, csrc_free_ops/decode_layers.py) instead of six
    kernels a layer. Only models of attention layers without an output gate (Qwen3, Qwen2), with a
    cache from ``new_cache`` or, in the engine's decode-only steps, over its pool (``forward_step``;
    a padding row of the step's graph writes nothing). None (the default): on CUDA where
    ``PERSISTENT_DECODE`` says so, unless ``fused_decode`` is False (the op-by-op path stays op by
    op); True or False forces it (True still needs such a model and cache; on the CPU the op runs
    its reference, or the kernel under the interpreter)."""

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    def new_cache(self, batch_size: int, max_len: int, dtype: Optional[torch.dtype] = None,
                  device: Union[str, torch.device, None] = None) -> Cache:
        """A zeroed cache for ``batch_size`` sequences of up to ``max_len`` positions, one per layer
        (default dtype and device: the model's)."""
        dtype, device = dtype or self.dtype, device or self.device
        self.prepare_for_graphs(device)
        c = self.config
        if any(kind != "full_attention" for kind in c.layer_types):
            return Cache(layer.new_cache(batch_size, max_len, dtype, device) for layer in self.layers)
        shape = (len(self.layers), batch_size, max_len, c.num_key_value_heads, c.head_dim)
        k, v = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
        table = torch.arange(batch_size, dtype=torch.int32, device=device).view(batch_size, 1)
        return Cache((KVCache(k[i], v[i]) for i in range(len(self.layers))), (k, v), table)

    def prepare_for_graphs(self, device: Union[str, torch.device]) -> None:
        """What must exist before any CUDA graph capture of a step (``new_cache`` and the engine's
        pool call it): the decode kernels' per-device buffers (split-K arrival counters, the
        persistent kernel's watchdog flag), and, for an inference model the persistent decode
        kernel will run (attention layers without an output gate, no parameter requiring grad,
        ``persistent_decode`` on for its device), its layer weights stacked (``_stacked_weights``). Stacked later, at the first decode step,
        the per-layer weight tensors would be freed under the graphs captured before it (a
        prefill's), which read them by address."""
        qwen_ops.reserve_semaphores(device)
        decode_layers_error_flag(torch.device(device))
        if (self._persistent_on(self.device.type == "cuda") and not self.config.attn_output_gate
                and all(isinstance(layer, AttentionLayer) for layer in self.layers)
                and not any(p.requires_grad for p in self.parameters())):
            self._stacked_weights()

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        cache: Cache,
        cache_seqlens: Optional[Tensor] = None,
        all_logits: bool = False,
        logits_at: Optional[Tensor] = None,
    ) -> Tensor:
        """input_ids, positions: [B, T] (int64; positions int32 or int64).

        Prefill (``cache_seqlens`` None): the T tokens start each sequence (positions 0..T-1);
        attention runs causally over them and their k/v are stored into ``cache``.
        Decode (``cache_seqlens`` [B] int32, the valid cache length including these T tokens):
        k/v are stored at ``positions``, then attention reads the cache; recurrent layers continue
        their state in place.
        ``cache``: from ``new_cache`` (or some of its rows, ``cache.rows``).
        Returns logits [B, V] of the last position, or [B, T, V] with ``all_logits``, or [B, V] of
        position ``logits_at[b]`` of each row with ``logits_at`` ([B] int64, on the device: a padded
        prefill's last real token; the final norm and the lm_head then run on those rows only).
        """
        c = self.config
        if (cache_seqlens is not None and input_ids.dim() == 2 and input_ids.shape[1] == 1
                and self._runs_decode_layers(input_ids.shape[0], input_ids.is_cuda, cache.stacked,
                                             cache.stacked[0].shape[2] if cache.stacked else 0)):
            b = input_ids.shape[0]
            x = self._decode_layers(input_ids.reshape(b), positions.reshape(b), cache_seqlens, cache.block_table,
                                    cache.stacked, cache.stacked[0].shape[2])
            return ops.norm_linear(x[:, None] if all_logits else x, self.norm, self._head(), None, c.rms_norm_eps,
                                   c.norm_offset)
        fused = self.fused_decode if self.fused_decode is not None else input_ids.numel() == 1
        if cache_seqlens is not None and fused:
            x = F.embedding(input_ids, self.embed_tokens)  # the residual stream
            for layer, layer_cache in zip(self.layers, cache.layers):
                x = layer.decode(x, positions, layer_cache, cache_seqlens)
            return ops.norm_linear(x if all_logits else x[:, -1], self.norm, self._head(), None, c.rms_norm_eps,
                                   c.norm_offset)
        if logits_at is not None and (all_logits or logits_at.shape != input_ids.shape[:1]):
            raise ValueError(f"logits_at must be one index per row, shape [{input_ids.shape[0]}], and excludes "
                             f"all_logits; got shape {list(logits_at.shape)}")
        select = logits_at if logits_at is not None else None if all_logits else input_ids.shape[1] - 1
        h = self._final_hidden(input_ids, positions, cache, cache_seqlens, select)
        return ops.linear(h, self._head())

    def forward_step(self, batch, pool) -> Tensor:
        """One engine step over flat tokens: ``batch`` a ``modeling.engine.step.StepBatch`` (input_ids,
        positions [N], the sequences' offsets, lengths, KV slots, block tables, state slots),
        ``pool`` the engine's ``CachePool``. Every layer reads and writes its pool entry; returns the
        logits [Ss, V] of the rows ``batch.logits_rows`` (each sampling sequence's last token). A
        decode-only step (``batch.key``: a decode graph's, every row one token and sampling) runs
        the persistent kernel where ``persistent_decode`` says so."""
        c = self.config
        rows = batch.input_ids.shape[0]
        capacity = batch.block_table.shape[1] * pool.size.block_size
        if batch.key[:1] == ("decode",) and self._runs_decode_layers(rows, batch.input_ids.is_cuda, pool.kv, capacity):
            x = self._decode_layers(batch.input_ids, batch.positions, batch.seq_lens, batch.block_table, pool.kv,
                                    capacity)
            return ops.norm_linear(x, self.norm, self._head(), None, c.rms_norm_eps, c.norm_offset)
        x, residual = F.embedding(batch.input_ids, self.embed_tokens), None
        for layer, entry in zip(self.layers, pool.layers):
            x, residual = layer.step(x, residual, batch, entry)
        rows = batch.logits_rows
        h = ops.add_rms_norm(x[rows], residual[rows], self.norm, c.rms_norm_eps, c.norm_offset)[0]
        return ops.linear(h, self._head())

    def loss(self, input_ids: Tensor, cache: Cache, labels: Optional[Tensor] = None,
             ignore_index: int = -100) -> Tensor:
        """Mean next-token cross-entropy of a prefill of input_ids [B, T] (positions 0..T-1):
        position t predicts labels[:, t + 1] (labels default to input_ids; ignore_index entries
        count for nothing). The lm_head and the loss run fused (``qwen::linear_cross_entropy``):
        the [B, T, V] logits are never built. For training, with ``requires_grad_(True)``."""
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        h = self._final_hidden(input_ids, positions, cache, None, None)
        targets = (input_ids if labels is None else labels)[:, 1:]
        return ops.linear_cross_entropy(h[:, :-1].reshape(-1, h.shape[-1]), self._head(), targets.reshape(-1),
                                        ignore_index)

    def _runs_decode_layers(self, rows: int, cuda: bool, kv: Optional[Tuple[Tensor, Tensor]], capacity: int) -> bool:
        """Whether a decode step of one new token for each of ``rows`` sequences, over the stacked
        caches ``kv`` [NL, NB, BS, Hk, D] of ``capacity`` positions a sequence, runs through
        ``ops.decode_layers`` (see ``persistent_decode``)."""
        on = self.persistent_decode
        if on is None:  # where the H200 measured it faster than the fused ops (docs/performance.md)
            on = self._persistent_on(cuda) and rows == 1 and capacity <= PERSISTENT_DECODE_MAX_LEN
        return (on and kv is not None and kv[0].shape[0] == len(self.layers) and 0 < rows <= DECODE_LAYERS_MAX_ROWS
                and not self.config.attn_output_gate and kv[0].dtype == self.dtype)

    def _persistent_on(self, cuda: bool) -> bool:
        """Whether ``persistent_decode`` lets the persistent kernel run at all (the shape rules aside)."""
        if self.persistent_decode is not None:
            return self.persistent_decode
        return PERSISTENT_DECODE and self.fused_decode is not False and cuda

    def _decode_layers(self, input_ids: Tensor, positions: Tensor, seq_lens: Tensor, block_table: Tensor,
                       kv: Tuple[Tensor, Tensor], capacity: int) -> Tensor:
        """The hidden states [M, H] after every layer for input_ids [M] at ``positions`` [M], through
        the persistent kernel over the paged caches ``kv`` (``block_table`` [M, W])."""
        c = self.config
        return ops.decode_layers(F.embedding(input_ids, self.embed_tokens), positions, seq_lens, block_table,
                                 *self._stacked_weights(), *kv, c.rms_norm_eps, c.norm_offset, c.rope_theta,
                                 c.rotary_dim, c.num_attention_heads, decode_splits(capacity, input_ids.shape[0]))

    def _stacked_weights(self) -> Tuple:
        """The layers' weights as ``ops.decode_layers`` takes them, each kind stacked [NL, ...]. Made
        by ``prepare_for_graphs`` (or on first use): the stacks replace the layers' parameters, which
        become views of them (no second copy of the weights); made again if a parameter was replaced
        since."""
        names = ("input_norm", "qkv_weight", "qkv_bias", "q_norm", "k_norm", "o_weight", "post_norm",
                 "gate_up_weight", "down_weight")
        stacks = getattr(self, "_stacks", None)
        if stacks is None or any(t is not None and getattr(self.layers[-1], n).data_ptr() !=
                                 t[-1].data_ptr() for n, t in zip(names, stacks)):
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the persistent decode step stacks the layers' weights on first use: make the "
                                   "cache (new_cache) before capturing a step in a CUDA graph")
            stacks = []
            for name in names:
                params = [getattr(layer, name) for layer in self.layers]
                if params[0] is None:
                    stacks.append(None)
                    continue
                stack = torch.stack([p.detach() for p in params])
                for layer, view in zip(self.layers, stack):
                    setattr(layer, name, nn.Parameter(view, requires_grad=False))
                stacks.append(stack)
            self._stacks = tuple(stacks)
        return self._stacks

    def _head(self) -> Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def _final_hidden(self, input_ids, positions, cache, cache_seqlens, select) -> Tensor:
        """The normed final hidden states [B, T, H]; with ``select`` (an int, or a [B] index tensor)
        only that position of each row, [B, H]."""
        x, residual = F.embedding(input_ids, self.embed_tokens), None
        for layer, layer_cache in zip(self.layers, cache.layers):
            x, residual = layer(x, residual, positions, layer_cache, cache_seqlens)
        if isinstance(select, int):
            x, residual = x[:, select], residual[:, select]
        elif select is not None:
            index = select.view(-1, 1, 1).expand(-1, 1, x.shape[-1])
            x, residual = x.gather(1, index)[:, 0], residual.gather(1, index)[:, 0]
        return ops.add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps, self.config.norm_offset)[0]

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
