"""qwen::linear_cross_entropy: the lm_head GEMM fused with the mean cross-entropy loss.

    linear_cross_entropy(hidden [N, H], weight [V, H], targets [N], ignore_index=-100) -> loss []
    loss = mean over i with targets[i] != ignore_index of  logsumexp(l_i) - l_i[targets[i]],
    l = hidden @ weight^T                               (fp32 math; loss is fp32, float64 for float64)

The [N, V] logits are never materialized (csrc_free_ops/cross_entropy.py works in token
chunks and finishes the gradients in the forward). Two ops:

- `qwen::linear_cross_entropy_fwd(hidden, weight, targets, ignore_index, compute_grad)
  -> (loss, dhidden, dweight)`: a custom op with autograd; dhidden / dweight are the
  gradients of the loss (empty when compute_grad is False), and its backward just scales
  them by the loss's incoming gradient (a device scalar: no host sync).
- `qwen::linear_cross_entropy(hidden, weight, targets, ignore_index=-100) -> loss`: a
  CompositeImplicitAutograd op calling the first with compute_grad = grad mode on and
  hidden or weight requiring grad, so evaluation skips the gradient work. Under
  torch.compile it decomposes into the first op during tracing.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from csrc_free_ops import cross_entropy as kernels

from .checks import INDEX_DTYPES, check_float, check_same, fail
from .dispatch import acc_dtype, use_triton


def linear_cross_entropy_reference(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    dt = acc_dtype(hidden)
    return F.cross_entropy(hidden.to(dt) @ weight.to(dt).t(), targets.long(), ignore_index=ignore_index)


def _reference_with_grads(hidden, weight, targets, ignore_index, compute_grad):
    """Explicit math (the op body runs below autograd, so no autograd.grad here)."""
    dt = acc_dtype(hidden)
    h, w = hidden.to(dt), weight.to(dt)
    logits = h @ w.t()
    loss = F.cross_entropy(logits, targets.long(), ignore_index=ignore_index)
    if not compute_grad:
        return loss, hidden.new_empty((0,)), weight.new_empty((0,))
    valid = targets != ignore_index
    onehot = F.one_hot(torch.where(valid, targets, 0).long(), weight.shape[0]).to(dt)
    g = (torch.softmax(logits, dim=-1) - onehot) * (valid.to(dt) / valid.sum().clamp_min(1).to(dt))[:, None]
    return loss, (g @ w).to(hidden.dtype), (g.t() @ h).to(weight.dtype)


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


@torch.library.custom_op("qwen::linear_cross_entropy_fwd", mutates_args=())
def linear_cross_entropy_fwd(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100,
                             compute_grad: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    _check(hidden, weight, targets)
    if use_triton(hidden):
        loss, dh, dw = kernels.linear_cross_entropy(hidden, weight, targets, ignore_index, compute_grad)
        if not compute_grad:
            dh, dw = hidden.new_empty((0,)), weight.new_empty((0,))
        return loss, dh, dw
    return _reference_with_grads(hidden, weight, targets, ignore_index, compute_grad)


@linear_cross_entropy_fwd.register_fake
def _(hidden, weight, targets, ignore_index=-100, compute_grad=True):
    _check(hidden, weight, targets)
    loss = hidden.new_empty((), dtype=acc_dtype(hidden))
    if not compute_grad:
        return loss, hidden.new_empty((0,)), weight.new_empty((0,))
    return loss, hidden.new_empty(hidden.shape), weight.new_empty(weight.shape)


def _fwd_setup(ctx, inputs, output):
    ctx.compute_grad = inputs[4]
    ctx.save_for_backward(output[1], output[2])


def _fwd_bwd(ctx, grad_loss, _dh, _dw):
    if not ctx.compute_grad:
        fail("linear_cross_entropy", "gradients were not computed in the forward (compute_grad=False)")
    dh, dw = ctx.saved_tensors
    g = grad_loss.to(torch.float32) if dh.dtype != torch.float64 else grad_loss
    return (dh * g).to(dh.dtype), (dw * g).to(dw.dtype), None, None, None


torch.library.register_autograd("qwen::linear_cross_entropy_fwd", _fwd_bwd, setup_context=_fwd_setup)

_lib = torch.library.Library("qwen", "FRAGMENT")
_lib.define("linear_cross_entropy(Tensor hidden, Tensor weight, Tensor targets, int ignore_index=-100) -> Tensor")


def _linear_cross_entropy_composite(hidden, weight, targets, ignore_index=-100):
    compute_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return torch.ops.qwen.linear_cross_entropy_fwd(hidden, weight, targets, ignore_index, compute_grad)[0]


_lib.impl("linear_cross_entropy", _linear_cross_entropy_composite, "CompositeImplicitAutograd")


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy of hidden @ weight^T against targets; hidden may have leading batch dims."""
    return torch.ops.qwen.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                               ignore_index)
