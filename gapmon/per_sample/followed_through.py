"""Per-sample gradients through any computation every sample shares.

A followed tensor that no sample's data flows into (a piece of a free parameter, a shared layer call's output: both
batch_provenance.Shared) may go through ops no rule of its own follows before it meets the batch: BEiT interpolates its
relative position table (bilinear), Swin V2 maps a table of coordinates through an MLP and a sigmoid, a model
normalises its parameters or multiplies them together. Every input of such an op is unbatched, so its output y is the
same for every sample: y is followed as a parameter of its own (ThroughUses), and where it meets the batch the rules
that read each sample's gradient of a parameter read y's. Each of those per-sample gradients is then taken back to
the op's followed inputs by a vector-Jacobian product of the op, formed again from its recorded arguments
(`torch.func.vjp`, batched over the samples with `torch.vmap`): exact, whatever the op.

Formed again, not through autograd's graph of the forward: a gradient asked of that graph for a tensor runs the hooks
on it (the use check's on a parameter, a shared call's own check on its output), with batched gradients. An argument
changed in place between the op and backward, or an op that draws random numbers (dropout on a shared tensor), would
form another y: the first is found (version counters) and leaves the inputs out, named; the second gives sums that
differ from autograd's, which the use check (or a shared call's own check) refuses.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable

import torch

from .. import _torch_compat
from . import elementwise
from .batch_provenance import Shared
from .free_parameters import Piece, coarser

# The most elements of per-sample gradients one product forms (batch · numel of an input or of the output).
_MAX_FORMED = 1 << 26


class RecordedOp:
    """An op as the forward ran it: its function, its arguments (their tensors' version counters kept) and the autocast
    it ran under, to be formed again in backward with some of its tensor arguments replaced."""

    def __init__(self, func: Callable, args: tuple, kwargs: dict, device_type: str):
        self.func, self.args, self.kwargs = func, args, kwargs
        self.name = _name(func)
        self.tensors = _torch_compat.tensor_leaves((args, kwargs))
        self.versions = [_torch_compat.version_counter(t) for t in self.tensors]
        self.autocast = (device_type, _torch_compat.autocast_dtype(device_type))

    def changed(self) -> bool:
        """Whether a tensor argument was written in place since the op ran (formed again, it would give another
        output)."""
        return any(_torch_compat.version_counter(t) != v for t, v in zip(self.tensors, self.versions))

    def places(self, t: torch.Tensor) -> list[int]:
        """The places of tensor t among the op's tensor arguments (twice for x @ x)."""
        return [i for i, u in enumerate(self.tensors) if u is t]

    def former(self) -> tuple[Callable[[dict[int, torch.Tensor]], torch.Tensor], list[torch.Tensor]]:
        """(formed, the detached tensor arguments): formed({place: tensor}) runs the op again, under its autocast, on
        its arguments detached with those places replaced."""
        detached = _torch_compat.tree_map_tensors(torch.Tensor.detach, (self.args, self.kwargs))
        leaves = _torch_compat.tensor_leaves(detached)  # (in the order of self.tensors)
        device_type, autocast_dtype = self.autocast

        def formed(replaced: dict[int, torch.Tensor]) -> torch.Tensor:
            current = iter([replaced.get(i, t) for i, t in enumerate(leaves)])
            a, k = _torch_compat.tree_map_tensors(lambda _: next(current), detached)
            with torch.autocast(device_type, autocast_dtype) if autocast_dtype else contextlib.nullcontext():
                return self.func(*a, **k)

        return formed, leaves


class ThroughUses:
    """The uses of y = op(...), any differentiable op (RecordedOp) of followed unbatched tensors (`parents`: (owner,
    tensor) each) and constants: y followed as a parameter of its own (Piece), its per-sample gradients taken back to
    each parent by the op's vector-Jacobian product (or, for an elementwise function of one parent, its slope)."""

    def __init__(self, op: RecordedOp, parents: list[tuple[Any, torch.Tensor]], out: torch.Tensor, batch: int,
                 slope: torch.Tensor | None = None):
        self.op, self.parents, self.param, self.batch = op, parents, out, batch
        self.slope = slope  # f'(x) of an elementwise function of one parent: its product is g ⊙ f'(x), not formed again

    def on_escape(self, what: str) -> None:
        for owner, _ in self.parents:
            owner.on_escape(what)

    def add(self, g: torch.Tensor, rounding: torch.dtype) -> None:
        """Takes one use's per-sample gradients of y, [batch, numel], back to the parents (in backward: an op that cannot
        be formed again so, a batching rule torch lacks, leaves them out, named, and never breaks the user's backward)."""
        try:
            self._take_back(g, rounding)
        except Exception as error:  # any failure of the product is a use gapmon cannot follow
            self.on_escape(f"{self.op.name} (its per-sample gradient could not be formed: {type(error).__name__})")

    def _take_back(self, g: torch.Tensor, rounding: torch.dtype) -> None:
        if self.slope is not None:  # (its inputs as autograd saved them: its slope was formed in the forward)
            (owner, x), = self.parents
            owner.take_per_sample(x, g.reshape(self.batch, *x.shape) * self.slope, coarser(rounding, self.slope.dtype))
            return
        if self.op.changed():
            self.on_escape(f"{self.op.name} of a tensor changed in place afterwards")
            return
        formed, leaves = self.op.former()
        places = [i for _, x in self.parents for i in self.op.places(x)]
        with torch.enable_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*performance drop.*")  # no batching rule: a loop, exact
            y, vjp = torch.func.vjp(lambda *primals: formed(dict(zip(places, primals))), *(leaves[i] for i in places))
            grads = dict(zip(places, torch.vmap(vjp)(g.reshape(self.batch, *y.shape).to(y.dtype))))
        for owner, x in self.parents:  # (a tensor passed twice, x @ x: its two gradients added)
            owner.take_per_sample(x, sum(grads[i] for i in self.op.places(x)), coarser(rounding, y.dtype))


def _name(func: Callable) -> str:
    return getattr(func, "__name__", type(func).__name__)


def _in_place(name: str, kwargs: dict) -> bool:
    """Whether op `name` writes its first argument (`relu_`, `__iadd__`, F.relu(x, inplace=True))."""
    return name.endswith("_") and not name.startswith("__") or name.startswith("__i") or kwargs.get("inplace") is True


def followed_through(batch: int, func: Callable, args: tuple, kwargs: dict, shared: list[tuple[torch.Tensor, Shared]],
                     out: Any) -> Shared | None:
    """The status of `out` = func(*args, **kwargs), an op whose followed inputs are `shared` ((tensor, Shared) each) and
    whose other inputs are all unbatched: followed as a parameter of its own (ThroughUses); an op that returned its
    input as it is keeps its status; None where it cannot be followed (an in-place op whose slope needs its input, an
    output that is not one tensor with a gradient, an input whose owner cannot take per-sample gradients or that does
    not require one, per-sample gradients too large to form): the caller leaves it out then."""
    if not isinstance(out, torch.Tensor) or not out.requires_grad or not out.is_floating_point():
        return None
    name = _name(func)
    if any(not hasattr(st.owner, "take_per_sample") or not t.requires_grad for t, st in shared):
        return None
    if not torch.is_grad_enabled():
        return None
    op = RecordedOp(func, args, kwargs, out.device.type)
    if not _in_place(name, kwargs):
        for t, st in shared:
            if t is out:  # an op that returned its input as it is (a no-op dropout, a cast to its own dtype)
                return st
    else:
        # In place: its input is gone; followed only where its output gives its slope (nn.ReLU(inplace=True))
        slope = elementwise.in_place_slope(name, kwargs, out) if len(shared) == 1 and shared[0][0] is out else None
        owner = shared[0][1].owner
        if slope is None or not isinstance(owner, Piece) and not hasattr(owner, "moved_in_place"):
            return None
        if hasattr(owner, "moved_in_place"):  # (a shared call's own check reads its output's gradient: moved too)
            owner.moved_in_place(out, slope)
        return Shared(Piece(ThroughUses(op, [(owner, out)], out, batch, slope), tuple(out.shape)))
    if batch * max([out.numel()] + [t.numel() for t, _ in shared]) > _MAX_FORMED:
        return None
    parents, seen = [], set()
    for t, st in shared:
        if id(t) not in seen:  # (x * x: one input, its gradient taken once)
            seen.add(id(t))
            parents.append((st.owner, t))
    slope = elementwise.slope(name, args, kwargs, parents[0][1], out) if len(parents) == 1 else None
    return Shared(Piece(ThroughUses(op, parents, out, batch, slope), tuple(out.shape)))


def met_in_pointwise(batch: int, func: Callable, args: tuple, kwargs: dict, shared: tuple[torch.Tensor, Shared],
                     out: Any, dim: int) -> bool:
    """`out` = func(*args, **kwargs), a pointwise op (aten's tag) with no rule of its own for the followed tensor t
    (`shared`: (t, its Shared)) that meets there a tensor batched on `dim` of out (timm's GeM pooling, `x.pow(self.p)`;
    `torch.atan2(x, p)`): each element of out depends on t's element it was broadcast from alone, so each sample's
    gradient of t is the op's vector-Jacobian product with t expanded to out's shape, summed over the dims t was
    broadcast along within the sample. A hook on out's gradient forms it (the op formed again) and hands it to t's
    owner. False where it does not apply (t not broadcast over the batch, no gradient, an in-place op)."""
    t, st = shared
    if not isinstance(out, torch.Tensor) or not out.requires_grad or not out.is_floating_point() or not t.requires_grad:
        return False
    name = _name(func)
    if not torch.is_grad_enabled() or _in_place(name, kwargs):
        return False
    if not hasattr(st.owner, "take_per_sample") or t.dim() > out.dim():
        return False
    # t's shape aligned to out's, a dim it is expanded along (stride 0: `p.expand_as(x)`) counted as broadcast
    lead = out.dim() - t.dim()
    aligned = [1] * lead + [1 if t.stride(k) == 0 else n for k, n in enumerate(t.shape)]
    if aligned[dim] != 1 or any(a not in (1, o) for a, o in zip(aligned, out.shape)) or out.shape[dim] != batch:
        return False
    summed = [k for k in range(out.dim()) if k != dim and aligned[k] == 1 and out.shape[k] != 1]
    op, owner = RecordedOp(func, args, kwargs, out.device.type), st.owner
    (place,) = op.places(t)[:1]

    def hook(g: torch.Tensor) -> None:
        try:
            take_back(g)
        except Exception as error:  # (as ThroughUses.add: never the user's backward)
            owner.on_escape(f"{name} (its per-sample gradient could not be formed: {type(error).__name__})")

    def take_back(g: torch.Tensor) -> None:
        if op.changed():
            owner.on_escape(f"{name} of a tensor changed in place afterwards")
            return
        formed, leaves = op.former()
        with torch.enable_grad():
            y, vjp = torch.func.vjp(lambda full: formed({place: full}), leaves[place].expand(out.shape).contiguous())
            (full,) = vjp(g.detach().to(y.dtype))
        if summed:
            full = full.sum(summed, keepdim=True)
        # [batch, *aligned]: each sample's gradient of t's elements (an expanded t's, once each)
        owner.take_per_sample(t, full.movedim(dim, 0).unsqueeze(dim + 1), coarser(g.dtype, y.dtype))

    out.register_hook(hook)
    return True
