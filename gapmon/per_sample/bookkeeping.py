"""Book-keeping: per-sample gradients of a Linear layer that also form its weight gradient.

Where a layer's per-sample norms take the direct form they form every per-sample gradient
g_bᵀ a_b, the very products that autograd's weight-gradient GEMM sums. With book-keeping on
(`PerSampleGradNorms(model, bookkeeping=True)`), such a layer's output passes through
`BookkeepingLinear`: its backward computes the input gradient as nn.Linear's backward does, forms
the per-sample gradients once, takes their squared norms and sums them into the weight gradient.
The norms then cost no extra GEMM, only a read of the per-sample gradients.

The weight gradient is summed in float32 or wider: under bf16 autocast it is more precise than
autograd's (a bf16 GEMM result), so its bits differ from a plain step's. The bias gradient is the sum of
the per-sample bias gradients (one read of the output gradient for both), in another order than
autograd's: its last bits may differ too.
"""
from __future__ import annotations

from typing import Callable

import torch

from .. import _torch_compat
from ..stats import _backend


class _Carried:
    """Tensors BookkeepingLinear.forward gets as a non-tensor argument: the layer's output (returned
    from there, it is a fresh output of the Function, not a view of one of its inputs, so that a
    model may still modify it in place: `h = proj(x); h += x`) and the input operand to save."""

    def __init__(self, output: torch.Tensor, operand: torch.Tensor):
        self.output, self.operand = output, operand


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype` (no op called when it is already: each is a dispatch, on a GPU queued from the host)."""
    return t if t.dtype == dtype else t.to(dtype)


class BookkeepingLinear(torch.autograd.Function):
    """Identity on the output of F.linear(x, weight, bias) (carried detached); its backward is
    Linear's, with the weight gradient summed from per-sample gradients whose squared norms, the bias's added
    ([B]: the call's whole per-sample squared norms), go to `report(g, sq, returned)`, g the output gradient as
    [B, T, p] and `returned` the (parameter, gradient) pairs this backward hands to autograd: the very tensor
    objects (the use check knows them again when they reach the parameters' hooks unchanged)."""

    @staticmethod
    def forward(ctx, carried: _Carried, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                report: Callable[..., None]) -> torch.Tensor:
        ctx.save_for_backward(carried.operand, weight)
        ctx.params = (weight, bias)
        ctx.x_dtype = x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.report = report
        return carried.output

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        a, weight = ctx.saved_tensors
        compute = grad_out.dtype  # the dtype F.linear ran in (bfloat16 under bf16 autocast)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_x = _as(grad_out @ _as(weight, compute), ctx.x_dtype)
        b = grad_out.shape[0]
        g = grad_out.reshape(b, -1, grad_out.shape[-1])
        a = a.reshape(b, -1, a.shape[-1])
        wide = _backend.product_dtype(g)
        if ctx.needs_input_grad[2] and ctx.needs_input_grad[3]:  # both in one op, each sample's bias gradient once
            sq, summed, bias_summed = _backend.linear_norm_sq_and_grads(a, g)
            grad_w, grad_b = _as(summed, weight.dtype), _as(bias_summed, ctx.bias_dtype)
        elif ctx.needs_input_grad[2]:
            sq, summed = _backend.direct_norm_sq_and_grad(a, g)
            grad_w = _as(summed, weight.dtype)
        elif ctx.needs_input_grad[3]:
            bias_sums = g.sum(1, dtype=wide)
            sq, grad_b = bias_sums.square().sum(1), _as(bias_sums.sum(0), ctx.bias_dtype)
        else:
            sq = torch.zeros(b, dtype=wide, device=g.device)
        returned = [(p, grad) for p, grad in zip(ctx.params, (grad_w, grad_b)) if grad is not None]
        ctx.report(g, sq, returned)
        return None, grad_x, grad_w, grad_b, None


def bookkeep(output: torch.Tensor, x: torch.Tensor, module: torch.nn.Linear,
             report: Callable[..., None]) -> torch.Tensor:
    """The output of `module`(x) to return from its forward hook: the same values, whose backward
    runs through BookkeepingLinear (the original output's graph is dropped with it). It saves the
    input as F.linear used it: under autocast its 16-bit cast, as autocast itself saves."""
    operand = _as(x.detach(), output.dtype)
    return BookkeepingLinear.apply(_Carried(output.detach(), operand), x, module.weight, module.bias, report)


def can_bookkeep(module: torch.nn.Module, x, output) -> bool:
    """Whether this call of `module` may run through BookkeepingLinear: a plain nn.Linear with a
    trainable, non-distributed weight called on a plain tensor with a batch dim, in an eager
    forward pass (not traced by torch.compile, not recomputed by activation checkpointing, and with
    no saved-tensor hooks, which checkpointing and offloading install)."""
    if type(module) is not torch.nn.Linear:  # checked first: other layers (MultiheadAttention) have no weight
        return False
    weight = module.weight
    return (weight.requires_grad and type(weight) is torch.nn.Parameter
            and type(x) is torch.Tensor and x.dim() >= 2 and type(output) is torch.Tensor
            and not torch.compiler.is_compiling() and not _torch_compat.in_backward()
            and not _torch_compat.saved_tensors_hooks_active())
