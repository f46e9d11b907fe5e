"""qwen::linear_cross_entropy: the lm_head GEMM fused with the mean cross-entropy loss.

    linear_cross_entropy(hidden [N, H], weight [V, H], targets [N], ignore_index=-100) -> loss []
    loss = mean over i with targets[i] != ignore_index of  logsumexp(l_i) - l_i[targets[i]],
    l = hidden @ weight^T                               (fp32 math; loss is fp32, float64 for float64)

The [N, V] logits are never materialized (csrc_free_ops/cross_entropy.py: the forward keeps
only the row log-sum-exp, the backward recomputes the logits in vocabulary slices). Ops:

- `qwen::linear_cross_entropy_with_lse(hidden, weight, targets, ignore_index) -> (loss, lse [N])`:
  a custom op with autograd; lse (fp32) is what its backward needs, and may be used (and
  differentiated) by the caller too.
- `qwen::linear_cross_entropy_backward(grad_loss, grad_lse, hidden, weight, targets, lse,
  ignore_index, need_dhidden, need_dweight) -> (dhidden, dweight)`: its backward, a custom op
  with a fake kernel (an empty tensor for a gradient not asked for).
- `qwen::linear_cross_entropy(hidden, weight, targets, ignore_index=-100) -> loss`: a
  CompositeImplicitAutograd op returning the first op's loss; under torch.compile it
  decomposes into that op during tracing.

Every target is ignore_index or a vocabulary row in [0, V). For CPU tensors any other target
raises (a value check, free there); on CUDA checking would cost a host sync, so such a target makes
the loss and both gradients NaN instead (the reference does the same). No host sync anywhere:
n_valid and the loss's incoming gradient stay on the device.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from csrc_free_ops import cross_entropy as kernels

from .checks import INDEX_DTYPES, check_float, check_same, fail
from .registry import acc_dtype, define, register_autograd


def _outside_vocab(targets: Tensor, ignore_index: int, vocab: int) -> Tensor:
    """[N] bool: the targets that are neither ignore_index nor a vocabulary row in [0, vocab)."""
    return (targets != ignore_index) & ((targets < 0) | (targets >= vocab))


def linear_cross_entropy_reference(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    return linear_cross_entropy_with_lse_reference(hidden, weight, targets, ignore_index)[0]


def linear_cross_entropy_with_lse_reference(hidden: Tensor, weight: Tensor, targets: Tensor,
                                            ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """A target outside the vocabulary (not ignore_index) makes the loss NaN, as the kernel does."""
    dt = acc_dtype(hidden)
    logits = hidden.to(dt) @ weight.to(dt).t()
    outside = _outside_vocab(targets, ignore_index, weight.shape[0])
    loss = F.cross_entropy(logits, targets.long().masked_fill(outside, ignore_index), ignore_index=ignore_index)
    return loss.masked_fill(outside.any(), float("nan")), torch.logsumexp(logits, dim=-1)


def linear_cross_entropy_backward_reference(grad_loss: Tensor, grad_lse: Optional[Tensor], hidden: Tensor,
                                            weight: Tensor, targets: Tensor, lse: Tensor, ignore_index: int,
                                            need_dhidden: bool, need_dweight: bool) -> tuple[Tensor, Tensor]:
    """Gradients of grad_loss * loss + sum_i grad_lse_i * lse_i with respect to (hidden, weight):
    G = softmax * (row_scale + grad_lse) - onehot * row_scale, row_scale = grad_loss / n_valid on
    valid rows (0 on ignored ones, NaN on targets outside the vocabulary, as in the kernel);
    dhidden = G @ W, dweight = G^T @ hidden."""
    dt = acc_dtype(hidden)
    h, w = hidden.to(dt), weight.to(dt)
    valid = targets != ignore_index
    outside = _outside_vocab(targets, ignore_index, weight.shape[0])
    onehot = F.one_hot(torch.where(valid & ~outside, targets, 0).long(), weight.shape[0]).to(dt)
    row_scale = (valid.to(dt) * (grad_loss.to(dt) / valid.sum().clamp_min(1).to(dt)))[:, None]
    row_scale = row_scale.masked_fill(outside[:, None], float("nan"))
    coef = row_scale if grad_lse is None else row_scale + grad_lse.to(dt)[:, None]
    g = torch.exp(h @ w.t() - lse.to(dt)[:, None]) * coef - onehot * row_scale
    return ((g @ w).to(hidden.dtype) if need_dhidden else hidden.new_empty((0,)),
            (g.t() @ h).to(weight.dtype) if need_dweight else weight.new_empty((0,)))


def _check(hidden, weight, targets):
    op = "linear_cross_entropy"
    check_float(op, "hidden", hidden, ndim=2)
    check_float(op, "weight", weight, ndim=2)
    check_same(op, "hidden", hidden, weight=weight)
    if weight.shape[1] != hidden.shape[1]:
        fail(op, f"weight is {tuple(weight.shape)} ([V, H]) but hidden's last dim is {hidden.shape[1]}")
    if weight.shape[0] == 0:
        fail(op, "weight must have at least one row (vocab size V > 0)")
    if targets.dtype not in INDEX_DTYPES:
        fail(op, f"targets must be int32 or int64, got {targets.dtype}")
    if tuple(targets.shape) != (hidden.shape[0],):
        fail(op, f"targets must have shape ({hidden.shape[0]},), got {tuple(targets.shape)}")
    if targets.device != hidden.device:
        fail(op, f"targets is on {targets.device} but hidden is on {hidden.device}")


def _check_backward(grad_loss, grad_lse, hidden, weight, targets, lse, ignore_index, need_dhidden, need_dweight):
    """The forward's checks, and the gradients and lse: grad_loss one value, grad_lse (or None) and lse
    [N], floating, on hidden's device."""
    op = "linear_cross_entropy_backward"
    _check(hidden, weight, targets)
    n = hidden.shape[0]
    for name, t, shape in (("grad_loss", grad_loss, None), ("grad_lse", grad_lse, (n,)), ("lse", lse, (n,))):
        if t is None:
            continue
        if not t.is_floating_point() or (t.numel() != 1 if shape is None else tuple(t.shape) != shape):
            what = "one value (the loss's gradient)" if shape is None else f"shape {shape} (a value a row)"
            fail(op, f"{name} must be a float tensor of {what}, got {t.dtype} of shape {tuple(t.shape)}")
        if t.device != hidden.device:
            fail(op, f"{name} is on {t.device} but hidden is on {hidden.device}")


def _check_targets(targets: Tensor, ignore_index: int, vocab: int):
    """Value check, CPU tensors only (free there; a host sync on CUDA, where such a target makes the loss NaN)."""
    outside = _outside_vocab(targets, ignore_index, vocab).nonzero()
    if outside.numel():
        row = int(outside[0, 0])
        fail("linear_cross_entropy", f"targets must lie in [0, {vocab}) (the vocabulary size) or equal "
                                     f"ignore_index={ignore_index}, got {int(targets[row])} at row {row} "
                                     f"({outside.shape[0]} such targets)")


def _backward_kernel(grad_loss, grad_lse, hidden, weight, targets, lse, ignore_index, need_dhidden, need_dweight):
    dh, dw = kernels.linear_cross_entropy_backward(grad_loss, grad_lse, hidden, weight, targets, lse, ignore_index,
                                                   need_dhidden, need_dweight)
    return (dh if need_dhidden else hidden.new_empty((0,))), (dw if need_dweight else weight.new_empty((0,)))


def _fake_with_lse(hidden, weight, targets, ignore_index):
    dt = acc_dtype(hidden)
    return hidden.new_empty((), dtype=dt), hidden.new_empty((hidden.shape[0],), dtype=dt)


def _fake_backward(grad_loss, grad_lse, hidden, weight, targets, lse, ignore_index, need_dhidden, need_dweight):
    return (hidden.new_empty(hidden.shape if need_dhidden else (0,)),
            weight.new_empty(weight.shape if need_dweight else (0,)))


linear_cross_entropy_with_lse = define(
    linear_cross_entropy_with_lse_reference, kernels.linear_cross_entropy,
    check=lambda hidden, weight, targets, ignore_index: _check(hidden, weight, targets), fake=_fake_with_lse,
    check_values=lambda hidden, weight, targets, ignore_index: _check_targets(targets, ignore_index, weight.shape[0]))

linear_cross_entropy_backward = define(
    linear_cross_entropy_backward_reference, _backward_kernel,
    check=_check_backward, fake=_fake_backward, dispatch_arg=2,
    check_values=lambda grad_loss, grad_lse, hidden, weight, targets, lse, ignore_index, *args:
    _check_targets(targets, ignore_index, weight.shape[0]))


def _setup(ctx, inputs, output):
    hidden, weight, targets, ignore_index = inputs
    ctx.ignore_index = ignore_index
    ctx.save_for_backward(hidden, weight, targets, output[1])


def _backward(ctx, grad_loss, grad_lse):
    hidden, weight, targets, lse = ctx.saved_tensors
    need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dh, dw = linear_cross_entropy_backward(grad_loss, grad_lse, hidden, weight, targets, lse, ctx.ignore_index,
                                           need_dh, need_dw)
    return (dh if need_dh else None), (dw if need_dw else None), None, None


register_autograd(linear_cross_entropy_with_lse, _backward, _setup)

_lib = torch.library.Library("qwen", "FRAGMENT")  # a composite op: no kernel of its own, so not `define`d
_lib.define("linear_cross_entropy(Tensor hidden, Tensor weight, Tensor targets, int ignore_index=-100) -> Tensor")


def _linear_cross_entropy_composite(hidden, weight, targets, ignore_index=-100):
    return torch.ops.qwen.linear_cross_entropy_with_lse(hidden, weight, targets, ignore_index)[0]


_lib.impl("linear_cross_entropy", _linear_cross_entropy_composite, "CompositeImplicitAutograd")


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy of hidden @ weight^T against targets; hidden may have leading batch dims."""
    rows = hidden.shape[:-1].numel()  # not -1: H may be 0
    return torch.ops.qwen.linear_cross_entropy(hidden.reshape(rows, hidden.shape[-1]), weight, targets.reshape(-1),
                                               ignore_index)
