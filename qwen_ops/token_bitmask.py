"""qwen::apply_token_bitmask: the logits of tokens a row's bitmask excludes set to -inf (the
token mask of constrained sampling: grammars, allowed tokens, banned words).

    apply_token_bitmask(logits [S, V], bitmask [S, W] int32, W >= cdiv(V, 32)) -> [S, V]
    out[s, v] = logits[s, v] if bit (v % 32) of bitmask[s, v // 32] is 1, else -inf
"""
import torch
from torch import Tensor

from csrc_free_ops import token_bitmask as kernels

from .checks import check_float, fail
from .registry import define


def apply_token_bitmask_reference(logits: Tensor, bitmask: Tensor) -> Tensor:
    vocab = logits.shape[-1]
    cols = torch.arange(vocab, device=logits.device)
    allowed = (bitmask[:, cols // 32] >> (cols % 32).to(bitmask.dtype)) & 1
    return logits.masked_fill(allowed == 0, float("-inf"))


def _check(logits: Tensor, bitmask: Tensor):
    op = "apply_token_bitmask"
    check_float(op, "logits", logits, ndim=2)
    if bitmask.dtype != torch.int32:
        fail(op, f"bitmask must be int32, got {bitmask.dtype}")
    if bitmask.device != logits.device:
        fail(op, f"bitmask is on {bitmask.device} but logits is on {logits.device}")
    words = -(-logits.shape[1] // 32)
    if bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0] or bitmask.shape[1] < words:
        fail(op, f"bitmask must have shape [{logits.shape[0]}, >= {words}] for logits {tuple(logits.shape)}, "
                 f"got {tuple(bitmask.shape)}")
    if bitmask.shape[1] > 1 and bitmask.stride(1) != 1:
        fail(op, f"bitmask must be contiguous in its last dim, got strides {bitmask.stride()}")


apply_token_bitmask = define(apply_token_bitmask_reference, kernels.apply_token_bitmask, check=_check,
                             fake=lambda logits, bitmask: logits.new_empty(logits.shape))
