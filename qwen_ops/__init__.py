"""torch.library layer: `import qwen_ops` registers every torch.ops.qwen.* op.

Each op has a schema (custom_op), a fake kernel, the Triton path and a plain-PyTorch
reference (`*_reference`, the test oracle and the CPU path); see docs/ops.md. Training
(backward ops and their autograd registration, the fused linear + cross-entropy loss and
the transformers patch) is in autograd.py, cross_entropy.py and patch.py; see docs/training.md.
"""
from .activation import silu_mul, silu_mul_reference
from .attention import attention, attention_reference, decode_attention, decode_attention_reference
from .checks import QwenOpError
from .cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from .kv_cache import kv_cache_store, kv_cache_store_reference
from .linear import linear, linear_reference
from .norm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from .patch import patch_transformers
from .rope import rope, rope_reference

from . import autograd  # noqa: E402,F401,I001  (after the forward ops: registers their backward)

__all__ = [
    "QwenOpError", "add_rms_norm", "add_rms_norm_reference", "attention", "attention_reference",
    "decode_attention", "decode_attention_reference", "kv_cache_store", "kv_cache_store_reference",
    "linear", "linear_cross_entropy", "linear_cross_entropy_reference", "linear_reference",
    "patch_transformers", "rms_norm", "rms_norm_reference", "rope", "rope_reference",
    "silu_mul", "silu_mul_reference",
]
