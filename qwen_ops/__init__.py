"""torch.library layer: `import qwen_ops` registers every torch.ops.qwen.* op.

Each op has a schema (custom_op), a fake kernel, the Triton path and a plain-PyTorch
reference (`*_reference`, the test oracle and the CPU path); see docs/ops.md.
"""
from .activation import silu_mul, silu_mul_reference
from .attention import attention, attention_reference, decode_attention, decode_attention_reference
from .checks import QwenOpError
from .kv_cache import kv_cache_store, kv_cache_store_reference
from .linear import linear, linear_reference
from .norm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from .rope import rope, rope_reference

__all__ = [
    "QwenOpError", "add_rms_norm", "add_rms_norm_reference", "attention", "attention_reference",
    "decode_attention", "decode_attention_reference", "kv_cache_store", "kv_cache_store_reference",
    "linear", "linear_reference", "rms_norm", "rms_norm_reference", "rope", "rope_reference",
    "silu_mul", "silu_mul_reference",
]
