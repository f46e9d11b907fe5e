"""torch.library layer: `import qwen_ops` registers every torch.ops.qwen.* op.

One module per op family, each holding its ops' plain-PyTorch references (`*_reference`,
the test oracle and the CPU path), input checks, fake kernels, the `registry.define` calls
that register them, and their autograd formulas (backward ops are ops too). The Triton
kernels live in the family's module of `csrc_free_ops`. See docs/ops.md, docs/training.md
and docs/architecture.md.
"""
from .activation import (sigmoid_mul, sigmoid_mul_reference, silu_mul, silu_mul_backward, silu_mul_backward_reference,
                         silu_mul_reference, silu_mul_split, silu_mul_split_backward, silu_mul_split_backward_reference,
                         silu_mul_split_reference)
from .attention import (attention, attention_backward, attention_backward_reference, attention_reference,
                        attention_with_lse, attention_with_lse_reference)
from .causal_conv1d import causal_conv1d, causal_conv1d_reference
from .checks import QwenOpError
from .cross_entropy import (linear_cross_entropy, linear_cross_entropy_backward,
                            linear_cross_entropy_backward_reference, linear_cross_entropy_reference,
                            linear_cross_entropy_with_lse, linear_cross_entropy_with_lse_reference)
from .decode_layers import MAX_ROWS as DECODE_LAYERS_MAX_ROWS
from .decode_layers import decode_layers, decode_layers_reference, decode_layers_splits, reserve_decode_buffers
from .decode_hybrid_layers import ATTENTION as DECODE_HYBRID_ATTENTION
from .decode_hybrid_layers import GATED_DELTANET as DECODE_HYBRID_GATED_DELTANET
from .decode_hybrid_layers import decode_hybrid_layers, decode_hybrid_layers_reference
from .fp8 import (dequantize_weight_fp8_block, fp8_block_linear, fp8_block_linear_reference,
                  fp8_quantize_per_token_group, fp8_quantize_per_token_group_reference, fp8_supported,
                  quantize_weight_fp8_block)
from .fused_decode import (linear_residual, linear_residual_reference, norm_gate_up_silu,
                           norm_gate_up_silu_reference, norm_linear, norm_linear_reference, norm_qkv_rope_store,
                           norm_qkv_rope_store_reference, reserve_semaphores)
from .gated_delta_rule import (chunk_gated_delta_rule, chunk_gated_delta_rule_reference, chunked_delta_rule,
                               gated_delta_gates,
                               gated_delta_gates_reference, gated_rms_norm,
                               gated_rms_norm_reference, recurrent_gated_delta_rule_varlen,
                               recurrent_gated_delta_rule_varlen_reference)
from .linear import (linear, linear_backward, linear_backward_reference, linear_reference, linear_silu_mul,
                     linear_silu_mul_reference)
from .moe import (fused_moe, fused_moe_reference, moe_align_block_size, moe_align_block_size_reference,
                  moe_topk_softmax, moe_topk_softmax_reference)
from .norm import (add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_backward, rms_norm_backward_reference,
                   rms_norm_reference)
from .paged_attention import (kv_cache_store_slots, kv_cache_store_slots_reference, paged_attention,
                              paged_attention_reference)
from .registry import kernel_calls
from .rope import rope, rope_backward, rope_backward_reference, rope_reference
from .token_bitmask import apply_token_bitmask, apply_token_bitmask_reference

__all__ = [
    "QwenOpError", "add_rms_norm", "add_rms_norm_reference", "apply_token_bitmask", "apply_token_bitmask_reference",
    "attention", "attention_backward",
    "attention_backward_reference", "attention_reference", "attention_with_lse", "attention_with_lse_reference",
    "causal_conv1d", "causal_conv1d_reference",
    "chunk_gated_delta_rule", "chunk_gated_delta_rule_reference",
    "chunked_delta_rule", "gated_rms_norm", "gated_rms_norm_reference",
    "recurrent_gated_delta_rule_varlen",
    "recurrent_gated_delta_rule_varlen_reference",
    "dequantize_weight_fp8_block", "fp8_block_linear", "fp8_block_linear_reference", "fp8_quantize_per_token_group",
    "fp8_quantize_per_token_group_reference", "fp8_supported", "quantize_weight_fp8_block",
    "DECODE_LAYERS_MAX_ROWS", "DECODE_HYBRID_ATTENTION", "DECODE_HYBRID_GATED_DELTANET", "decode_hybrid_layers", "decode_hybrid_layers_reference", "decode_layers", "decode_layers_reference", "decode_layers_splits", "reserve_decode_buffers", "kernel_calls",
    "linear", "linear_backward", "linear_backward_reference", "linear_cross_entropy", "linear_cross_entropy_backward",
    "linear_cross_entropy_backward_reference", "linear_cross_entropy_reference", "linear_cross_entropy_with_lse",
    "linear_cross_entropy_with_lse_reference", "linear_reference", "linear_silu_mul",
    "linear_silu_mul_reference", "rms_norm", "rms_norm_backward",
    "rms_norm_backward_reference", "rms_norm_reference", "rope", "rope_backward", "rope_backward_reference",
    "rope_reference", "silu_mul", "silu_mul_backward", "silu_mul_backward_reference", "silu_mul_reference",
    "silu_mul_split", "silu_mul_split_backward", "silu_mul_split_backward_reference", "silu_mul_split_reference",
    "sigmoid_mul", "sigmoid_mul_reference", "gated_delta_gates", "gated_delta_gates_reference",
    "linear_residual", "linear_residual_reference", "norm_gate_up_silu", "norm_gate_up_silu_reference",
    "norm_linear", "norm_linear_reference", "norm_qkv_rope_store", "norm_qkv_rope_store_reference",
    "reserve_semaphores", "kv_cache_store_slots", "kv_cache_store_slots_reference", "paged_attention",
    "paged_attention_reference", "fused_moe", "fused_moe_reference", "moe_align_block_size",
    "moe_align_block_size_reference", "moe_topk_softmax", "moe_topk_softmax_reference",
]
