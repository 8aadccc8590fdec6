"""What PerSampleGradNorms keeps of a forward pass: its micro-batches (samples, the calls of each layer
waiting for their gradients, the squared norms summed so far) and the state the hooks share."""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .. import _torch_compat
from ..utils import check_int, first_input
from .batch_provenance import BatchTracker, Merged, batch_tracker
from .rules import Call


@dataclass
class LayerCalls:
    """The calls of one layer in one micro-batch, waiting for their output gradients."""

    calls: list[Call] = field(default_factory=list)
    grads: list[torch.Tensor | None] = field(default_factory=list)  # each call's output gradient, batch first
    dims: list[int] = field(default_factory=list)  # each call's batch dim
    in_forward: int = 0  # calls recorded in the forward pass (not recomputed by checkpointing)

    def add(self, call: Call, dim: int) -> int:
        """Records a call; returns its index."""
        self.calls.append(call)
        self.grads.append(None)
        self.dims.append(dim)
        return len(self.calls) - 1

    def complete(self) -> bool:
        return all(g is not None for g in self.grads)


def _sum_of(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The float64 sum of same-shaped tensors, in list order: one stack, widening and sum where they share a device
    (the stack widened once where they share a dtype too, not each layer's part: on a GPU each is a launch), else
    widened and added in turn (layers on several devices). Widening is exact: the bits are those of widening each
    part first."""
    if len(tensors) == 1:
        return tensors[0].double()
    if len({t.device for t in tensors}) == 1:
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1:  # (each part cast alone: a layer's norms in another dtype than the rest)
            common = functools.reduce(torch.promote_types, dtypes)
            tensors = [t if t.dtype == common else t.to(common) for t in tensors]
        return torch.stack(tensors).double().sum(0)
    return functools.reduce(lambda a, b: a + b.to(a.device, torch.float64), tensors[1:], tensors[0].double())


# Forward passes run without gradients kept set aside (the latest), for backward to take back the one it runs again
# (reentrant checkpointing of the whole model): per_sample's micro-batches, the monitor's StepForwards.
SET_ASIDE_KEPT = 8


@dataclass
class MicroBatch:
    """What one forward pass of the model collected."""

    batch: int  # its number of samples
    inputs: set[int]  # storages of the model's own tensor inputs
    buffers: set[int] = field(default_factory=set)  # storages of the model's buffers: tables no sample's data is in
    # each layer call's per-sample squared norms (as the layer formed them) with its layer's name, per layer type
    # ("Linear"): widened to float64 and summed when read (sq, sq_by_type), not layer by layer (ops per layer in
    # backward); a layer found wrong when the norms are read is dropped from them (drop)
    parts: dict[str, list[tuple[str, torch.Tensor]]] = field(default_factory=dict)
    _sums: tuple | None = field(default=None, init=False, repr=False)  # (sq, sq_by_type) of the parts; None: to sum
    dtype: torch.dtype | None = None  # the widest dtype the norms were summed in
    layers: dict[int, LayerCalls] = field(default_factory=dict)  # layer index -> its calls
    # What mixed the samples: {module: (what it did, how to avoid it)} (BatchNorm, a MoE's load-balancing loss)
    mixing: dict[str, tuple[str, str]] = field(default_factory=dict)
    provenance: dict[int, set[tuple[int, str | None]]] = field(default_factory=dict)  # layer -> (batch dim, why not)
    weights: torch.Tensor | None = None  # float64 [batch]: the loss is sum_i weights[i] * loss_i (set_loss_weights)
    used: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer -> the parameters its forward used
    # layer -> its functional form (shared_input.functional_form) for its call on a followed tensor every sample shares,
    # made before the forward (under FSDP2 from the unsharded parameters), for the call's input gradient (take_back)
    shared_forms: dict[int, Any] = field(default_factory=dict)
    positions: dict[int, tuple] = field(default_factory=dict)  # layer -> its calls' positions (kept for gram())
    position_versions: dict[int, tuple] = field(default_factory=dict)  # their in-place versions when kept
    tied: dict[Any, Any] = field(default_factory=dict)  # tie group -> what its members left (tied_embedding)
    finished: set[int] = field(default_factory=set)  # layers whose squared norms were added
    free: dict[str, Any] = field(default_factory=dict)  # free parameter -> its uses (free_parameters.ParameterUses)
    # (layer index, "weight" / "bias") -> the uses of a Linear's parameter outside its forward (functional_layers)
    functional: dict[tuple[int, str], Any] = field(default_factory=dict)
    without_grad: bool = False  # its forward ran with gradients off (evaluation, or reentrant checkpointing's first pass)
    second_backward: bool = False  # backward ran through its forward pass twice (its norms cannot be formed)
    input_gradient_pass: bool = False  # a backward pass through it reached no parameter (parameter_passes)

    def keep_positions(self, index: int, pos: tuple) -> None:
        """Keeps layer `index`'s positions for gram() and per_sample_gradients(), with their in-place versions."""
        self.positions[index] = pos
        self.position_versions[index] = tuple(_torch_compat.version_counter(t) if isinstance(t, torch.Tensor) else None
                                              for t in pos)

    def kept_positions(self) -> dict[int, tuple]:
        """The kept positions; RuntimeError if one was changed in place since (an input buffer the loop refilled):
        the Gram or gradients read from it would be another batch's."""
        for index, pos in self.positions.items():
            now = tuple(_torch_compat.version_counter(t) if isinstance(t, torch.Tensor) else None for t in pos)
            if now != self.position_versions[index]:
                raise RuntimeError("PerSampleGradNorms: a layer's input or output gradient kept for gram() / "
                                   "per_sample_gradients() was changed in place after backward (a reused input "
                                   "buffer?); read them before refilling the buffers, or pass a copy to the model")
        return self.positions

    def add(self, sq: torch.Tensor, acc: torch.dtype, layer_type: str, layer: str) -> None:
        """Adds layer `layer`'s squared norms (summed in `acc`, in any float dtype: widened to float64 when the parts
        are summed), to the total and to its layer type's."""
        self.parts.setdefault(layer_type, []).append((layer, sq))
        self._sums = None
        self.dtype = acc if self.dtype is None or self.dtype is acc else torch.promote_types(self.dtype, acc)

    def drop(self, layers: set[str]) -> None:
        """Takes the norms of these layers back out (found wrong when the norms were read: a parameter also used where
        no rule saw it): the sums are formed again from the other layers' parts, the same bits as without them."""
        if not any(n in layers for parts in self.parts.values() for n, _ in parts):
            return  # (the usual case: the sums, if formed, stand)
        kept = {t: [(n, sq) for n, sq in parts if n not in layers] for t, parts in self.parts.items()}
        self.parts = {t: parts for t, parts in kept.items() if parts}
        self._sums = None

    @property
    def sq(self) -> torch.Tensor | None:
        """The per-sample squared norms of every layer so far, float64 (None: no layer yet): the sum of sq_by_type's."""
        return self._summed()[0]

    @property
    def sq_by_type(self) -> dict[str, torch.Tensor]:
        """The per-sample squared norms so far per layer type ({"Linear": [batch], ...}), float64."""
        return self._summed()[1]

    def _summed(self) -> tuple:
        if self._sums is None:
            by_type = {t: _sum_of([sq for _, sq in parts]) for t, parts in self.parts.items()}
            self._sums = (_sum_of([by_type[t] for t in sorted(by_type)]) if by_type else None, by_type)
        return self._sums

    def declare_weights(self, weights: float | torch.Tensor) -> None:
        """Keeps a copy of the weights of the samples' losses (a scalar: the same for every sample), checked."""
        w = torch.as_tensor(weights, dtype=torch.float64).detach().clone()  # a later in-place change is not ours
        if w.dim() == 0:
            w = w.expand(self.batch)
        w = w.reshape(-1)
        if w.numel() != self.batch:
            raise ValueError(f"PerSampleGradNorms.set_loss_weights: {w.numel()} weights for a micro-batch of {self.batch} samples")
        if not bool(torch.isfinite(w).all()):
            raise ValueError("PerSampleGradNorms.set_loss_weights: the weights must be finite")
        self.weights = w

    def weights_or(self, loss_reduction: str) -> torch.Tensor:
        """float64 [batch]: each sample's weight w_i in the loss L = sum_i w_i loss_i its backward ran on (the
        declared ones, else 1/batch for loss_reduction "mean" and 1 for "sum")."""
        if self.weights is not None:
            return self.weights
        return torch.full((self.batch,), 1.0 / self.batch if loss_reduction == "mean" else 1.0, dtype=torch.float64)

    def own_loss_norms(self, sq: torch.Tensor | None, loss_reduction: str, dtype: torch.dtype) -> torch.Tensor:
        """||grad loss_i|| of each sample from `sq`, the squared norms of grad (w_i loss_i) (None: 0 each)."""
        if sq is None:  # no covered layer was per-sample (all excluded or frozen): one 0 per sample
            return torch.zeros(self.batch, dtype=dtype)
        if self.weights is not None:
            w = self.weights.to(sq.device).abs()
            norms = torch.where(w > 0, sq.sqrt() / w.clamp(min=torch.finfo(torch.float64).tiny), 0.0)
        else:
            norms = (sq * (self.batch ** 2 if loss_reduction == "mean" else 1)).sqrt()
        return norms.to(self.dtype)


@functools.lru_cache(maxsize=64)
def _positional_names(forward: Any, bound: bool) -> tuple[str, ...]:
    """Names of a forward's positional parameters (without self for a method), read once per function."""
    names = tuple(n for n, p in inspect.signature(forward).parameters.items()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    return names[1:] if bound else names


def named_input(module: nn.Module, args: tuple, kwargs: dict, key: int | str) -> Any:
    """The root forward's argument `key`: a position, or a name (passed by keyword or by position)."""
    if isinstance(key, int):
        return args[key] if key < len(args) else None
    if key in kwargs:
        return kwargs[key]
    forward = module.forward
    names = _positional_names(getattr(forward, "__func__", forward), hasattr(forward, "__func__"))
    return args[names.index(key)] if key in names and names.index(key) < len(args) else None


def sample_first(t: torch.Tensor, dim: int | Merged, batch: int) -> torch.Tensor:
    """t with its batch on dim 0: moved from `dim`, or split out of a dim where it is merged with the dims after it
    (Merged: [B·T, d] -> [B, T, d])."""
    if type(dim) is Merged:
        return t.unflatten(dim.dim, (batch, dim.inner)).movedim(dim.dim, 0)
    return t.movedim(dim, 0) if dim else t


def batch_first(call: Call, dim: int | Merged, batch: int = 0) -> Call:
    """The call with the batch of its first input on dim 0 (sample_first; `batch`: the samples, for a merged one)."""
    if not dim:
        return call
    if call.args:
        return Call((sample_first(call.args[0], dim, batch), *call.args[1:]), call.kwargs, call.autocast)
    return Call(call.args, {**call.kwargs, "input": sample_first(call.kwargs["input"], dim, batch)}, call.autocast)


class Collection:
    """The state the hooks share: whether they collect (off between pause() and start()), the micro-batches
    since the last reset, the batch tracker of the forward pass running now, and whether the norms were read
    (the next forward pass then starts over)."""

    def __init__(self) -> None:
        self.collecting = True
        self.micro: list[MicroBatch] = []
        self.tracking: BatchTracker | None = None  # active during the model's forward pass
        self.read = False
        self.collected = False  # the micro-batches were finished and checked (PerSampleGradNorms._collect)
        # Forward passes run with gradients off, set aside when they end: an evaluation's has no samples of the step;
        # one that backward runs again (the whole model under reentrant checkpointing) is taken back then (take_back).
        self.without_grad: list[MicroBatch] = []
        self.opened: MicroBatch | None = None  # the micro-batch the forward pass running now opened

    def open(self, mb: MicroBatch, tracker: BatchTracker) -> None:
        """Starts micro-batch `mb`, its batch followed by `tracker`."""
        self.stop_tracking()  # a forward pass that raised before its end hook could run
        self.tracking = tracker.__enter__()
        self.micro.append(mb)
        self.opened, self.collected = mb, False

    def end_forward(self, raised: bool) -> None:
        """The model's forward pass ended (`raised`: by an exception). One that raised leaves its micro-batch out (none
        of its samples reaches backward: a batch skipped after an out-of-memory error); one run with gradients off
        sets it aside (until backward runs it again)."""
        self.stop_tracking()
        if _torch_compat.in_backward():
            return
        opened, self.opened = self.opened, None
        if raised and opened is not None and self.micro and self.micro[-1] is opened:
            self.micro.pop()
        elif self.micro and self.micro[-1].without_grad:
            self.without_grad = [*self.without_grad[1 - SET_ASIDE_KEPT:], self.micro.pop()]

    def take_back(self, storages: set[int]) -> MicroBatch | None:
        """The micro-batch set aside whose forward pass ran on the inputs of `storages`, if any: backward runs that
        forward again (reentrant checkpointing of the whole model), so its samples are the step's after all."""
        for mb in reversed(self.without_grad):
            if storages and storages <= mb.inputs:
                self.without_grad.remove(mb)
                mb.without_grad = False
                return mb
        return None

    def stop_tracking(self) -> None:
        if self.tracking is not None:
            self.tracking.__exit__(None, None, None)
            self.tracking = None


def batched_inputs(module: nn.Module, args: tuple, kwargs: dict, named: list[tuple[int | str, int]],
                   batch_dim: int) -> list[tuple[torch.Tensor, int]]:
    """The tensors of a root forward call that hold the batch, each with the dim that holds it: those of its first
    argument that holds a tensor (on `batch_dim`), or of those `named` names (positions or argument names, each with
    its dim). An argument that is a container (a dict batch, `model(batch)`) holds its tensors with the first one's
    size on that dim, as a collated batch does. ValueError naming what is missing."""
    if not named:
        found = next((held for held in (batched_in(v, batch_dim) for v in (*args, *kwargs.values())) if held), [])
        if not found and first_input(args, kwargs) is not None:  # a tensor without the dim: said below
            found = [(first_input(args, kwargs), batch_dim)]
    else:
        held = [batched_in(named_input(module, args, kwargs, key), dim) for key, dim in named]
        missing = [k for (k, _), h in zip(named, held) if not h]
        if missing:
            raise ValueError(f"PerSampleGradNorms: batch_inputs {missing} are not tensor arguments of this "
                             "forward call (nor containers of tensors with that dim); name the forward's arguments "
                             "that hold per-sample data")
        found = [pair for h in held for pair in h]
    if not found or found[0][0].dim() <= found[0][1]:
        dim = found[0][1] if found else batch_dim
        raise ValueError(f"PerSampleGradNorms: the model's first batched input gives the batch size (dim "
                         f"{dim}), but this forward call has no tensor input with that dim")
    return found


def batched_in(value: Any, dim: int) -> list[tuple[torch.Tensor, int]]:
    """The tensors of a forward argument that hold the batch on `dim`: the tensor itself, or the tensors of a
    container (nested dicts, lists, tuples) with its first one's size on that dim (every tensor of a collated
    batch is per-sample)."""
    if isinstance(value, torch.Tensor):
        return [(value, dim)]
    leaves = [t for t in _torch_compat.tensor_leaves(value) if t.dim() > dim] if value is not None else []
    return [(t, dim) for t in leaves if t.shape[dim] == leaves[0].shape[dim]]


def given_batched(batched: tuple, dims: Any, batch_dim: int) -> list[tuple[torch.Tensor, int]]:
    """begin_forward's tensors, each with the dim that holds its samples (`dims`, else batch_dim); ValueError when
    none holds one."""
    dims = [batch_dim] * len(batched) if dims is None else [
        check_int(d, "PerSampleGradNorms.begin_forward", "dims", 0) for d in dims]
    if len(dims) != len(batched):
        raise ValueError(f"PerSampleGradNorms.begin_forward: {len(dims)} dims for {len(batched)} tensors")
    pairs = [(t, d) for t, d in zip(batched, dims) if isinstance(t, torch.Tensor)]
    if not pairs or pairs[0][0].dim() <= pairs[0][1]:
        raise ValueError(f"PerSampleGradNorms.begin_forward: give the micro-batch's batched tensors (samples on dim "
                         f"{batch_dim}); got {[type(t).__name__ for t in batched]}")
    return pairs


def tracker_of(batched: list[tuple[torch.Tensor, int]]) -> tuple[int, BatchTracker]:
    """The micro-batch's number of samples (the first input's) and a batch tracker with each input marked on its dim;
    ValueError naming an input that does not hold as many samples there."""
    batch = batched[0][0].shape[batched[0][1]]
    tracker = batch_tracker(batch)
    for t, dim in batched:
        if t.dim() <= dim or t.shape[dim] != batch:
            raise ValueError(
                f"PerSampleGradNorms: the batched inputs disagree: {list(t.shape)} has no dim {dim} of size "
                f"{batch} (the first one's); an input that holds its samples on another dim is named with it in "
                "batch_inputs, e.g. ('x', ('h0', 1)) for a recurrent layer's initial state [layers, batch, hidden]")
        tracker.mark(t, dim)
    return batch, tracker


def mark_more(tracking: BatchTracker, tensors: tuple, dim: int, batch: int) -> None:
    """Marks more tensors of the running forward pass as holding its `batch` samples on `dim` (mark_batched);
    ValueError naming one that does not."""
    for t in tensors:
        if t.dim() <= dim or t.shape[dim] != batch:
            raise ValueError(f"PerSampleGradNorms.mark_batched: {list(t.shape)} has no dim {dim} of "
                             f"the micro-batch's {batch} samples")
        if tracking.status(t) is None:
            tracking.mark(t, dim)


def without_input_gradient_only(micro: list[MicroBatch]) -> list[MicroBatch]:
    """The micro-batches but those whose forward served an input's gradient alone (torch.autograd.grad(loss, x) of
    adversarial training's first pass): a backward pass reached no parameter through them, and none else came."""
    return [mb for mb in micro if not (mb.input_gradient_pass and not mb.finished and not any(
        g is not None for calls in mb.layers.values() for g in calls.grads))]


def refuse_second_backward(micro: list[MicroBatch]) -> None:
    """RuntimeError when backward ran through a micro-batch's forward pass twice: the per-sample gradients of the two
    passes add, and a gradient taken through the model (create_graph=True) has terms no layer's rule forms."""
    twice = [mb for mb in micro if mb.second_backward]
    if twice:
        raise RuntimeError(
            f"PerSampleGradNorms: backward ran twice through the forward pass of {len(twice)} micro-batch(es) "
            "(loss.backward(retain_graph=True) called again, or torch.autograd.grad taken through the model before "
            "loss.backward(), as a gradient penalty does): their per-sample norms cannot be formed, and none are given "
            "for this step (your gradients are unaffected). Sum the losses and call backward once; a loss that holds "
            "a gradient of the model (create_graph=True) has no per-sample norms here.")


def refuse_before_backward(micro: list[MicroBatch]) -> None:
    """RuntimeError when a micro-batch's recorded calls have no gradient yet: backward has not run through it."""
    waiting = [mb for mb in micro if mb.sq is None and mb.layers
               and not any(g is not None for calls in mb.layers.values() for g in calls.grads)]
    if waiting:
        raise RuntimeError(
            f"PerSampleGradNorms.local_norms: {len(waiting)} micro-batch(es) of {sum(mb.batch for mb in waiting)} "
            "samples have had no backward pass yet; call it after loss.backward()")


def concatenated(parts: list[torch.Tensor], default: torch.dtype) -> torch.Tensor:
    """The micro-batches' norms as one vector, in the widest of their dtypes, on the device they are on."""
    if not parts:
        return torch.empty(0, dtype=default)
    dtype = functools.reduce(torch.promote_types, [p.dtype for p in parts])
    device = next((p.device for p in parts if p.numel()), parts[0].device)
    return torch.cat([p.to(device, dtype) for p in parts])
