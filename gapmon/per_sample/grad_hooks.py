"""A gradient hook that survives an in-place change of a view.

torch drops the hooks of a view when the view, or another view of the same tensor, is changed in place (autograd gives
it a new history): Longformer's `q /= sqrt(d)` on F.linear's output for a 3-D input (a view of its 2-D product),
Funnel's `positional_attn *= cls_mask` on a view of an einsum's output. A hook on the tensor viewed still gets the
gradient from before the change, so where a tensor is a view of a whole contiguous tensor made in the forward pass, the
hook goes there and reads the view's elements out of its gradient.
"""
from __future__ import annotations

from typing import Callable

import torch

from .. import _torch_compat


def hook_gradient(t: torch.Tensor, hook: Callable[[torch.Tensor], None], inputs: tuple = ()) -> None:
    """Registers hook(g) for t's gradient, on the tensor t views where t is a view of all of a contiguous tensor with a
    history that is none of `inputs` (the call's own arguments: a view of an input is not the call's output)."""
    base = _torch_compat.view_base(t)
    if (base is None or _torch_compat.view_base(base) is not None or base.grad_fn is None or not base.is_contiguous()
            or base.numel() != t.numel() or any(base is a for a in inputs)):
        t.register_hook(hook)
        return
    size, stride, offset = t.size(), t.stride(), t.storage_offset() - base.storage_offset()
    base.register_hook(lambda g: hook(g.contiguous().as_strided(size, stride, offset)))
