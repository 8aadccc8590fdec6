"""Per-sample gradients of a layer whose input every sample shares: an embedding of position ids [1, T] (GPT-2's wpe,
BERT's, CLIP's position embeddings), whose output is broadcast over the batch where it is added to the token
embeddings. Autograd sums its output's gradient over the samples before any hook on it sees it; the gradient of the
sum it is added to still holds every sample's. So the call's output is followed (batch_provenance.Shared): where it
is added to a batched tensor, a hook on the sum reads that gradient per sample (summed over the dims the output was
broadcast along); when its own gradient arrives (every use of it summed), that must equal the per-sample
gradients summed over the samples, else it had a use the hook did not see, and the layer is left out, named.
Copies and casts of the output are followed, and its reshapes and permutes (T5's relative attention bias, permuted
to [1, heads, T, T] before it is added to the scores: each element's gradient is put back where it sits in the
output); any other use of it leaves the layer out. Exact: nothing is guessed.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .batch_provenance import Shared, graded_tensors
from .free_parameters import broadcast_dims, element_positions, masked_positions, picks_elements, rearranged_positions, scattered, sum_to
from .micro_batch import LayerCalls
from .row_lookup import ModeByFirstUse
from .rules import Call

# Relative agreement of the output's gradient with the per-sample gradients summed (their rounding, by dtype).
_RTOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


class SharedCall(ModeByFirstUse):
    """One call of a layer whose input every sample shares: gathers its output's per-sample gradient from the
    sums it is added to, checks it against the output's own gradient, then hands it to `done(g)` ([B, *output
    shape without its broadcast batch dim]) or reports why not to `refuse(why)`.

    Ids with a row per sample (`rows`: dim 0 of the batch's size; the all-zero token types SqueezeBERT, MobileBERT,
    Longformer and LayoutLM make when none are given) may be each sample's own instead (a run of that sample alone
    makes that one row): where the output is added to a tensor batched on the dim its rows sit on, the sum's gradient
    there is sample b's gradient of row b (`mode` "rows"). Which way the output is used decides; both ways in one call
    leave the layer out."""

    def __init__(self, output: torch.Tensor, batch: int, done: Callable[[torch.Tensor], None],
                 refuse: Callable[[str], None], rows: bool = False):
        self.batch, self.done, self.refuse = batch, done, refuse
        self.shape = tuple(output.shape)
        self.per_sample: torch.Tensor | None = None
        self.escaped: str | None = None
        self.rows = rows
        self.mode: str | None = None  # "rows" or "broadcast", once a use says which
        self._hook = output.register_hook(self._whole)

    def on_add(self, total: torch.Tensor, output: torch.Tensor, dim: int, sign: int,
               positions: torch.Tensor | None = None, holes: bool = False) -> None:
        """`output` (a copy of the call's output, or a view of it whose elements sit at `positions` of the output) was
        added (sign 1) or subtracted (-1) to a tensor batched on `dim` giving `total`: the gradient of `total`, summed
        over the dims `output` was broadcast along, is sample b's gradient of the output at index b of `dim`."""
        lead = total.dim() - output.dim()
        if self.rows and positions is None and dim == lead and tuple(total.shape[lead:]) == tuple(output.shape):
            if self._used_as("rows"):  # each row on its sample's (the dims before the rows: broadcast, summed)
                total.register_hook(lambda g: self._add(g, dim, list(range(lead)), sign, None))
            return
        broadcast = broadcast_dims(tuple(total.shape), tuple(output.shape), dim)
        if broadcast is None:
            self.on_escape("an add that does not broadcast it over the batch")
            return
        if self._used_as("broadcast"):
            total.register_hook(lambda g: self._add(g, dim, broadcast, sign, positions, holes))

    def on_escape(self, what: str) -> None:
        self.escaped = self.escaped or what

    def on_repeat(self, out: torch.Tensor, view_shape: tuple[int, ...], positions: torch.Tensor | None = None,
                  holes: bool = False) -> None:
        """The output (or a view of it of `view_shape`, its elements at `positions`) repeated over the batch along dim
        0, out [batch · n, ...] (DeBERTa's position projections, repeated to meet the queries' batch merged with the
        heads): sample b's gradient of it is rows [b·n, (b+1)·n) of out's."""
        batch = self.batch
        if not self._used_as("broadcast"):
            return
        out.register_hook(lambda g: self._add(g.reshape(batch, *view_shape), 0, [], 1, positions, holes))

    def reshaped(self, out: torch.Tensor) -> "SharedView | None":
        """A view of the output with its elements in order (T5's relative attention bias, unsqueezed)."""
        return SharedView(self, element_positions(self.shape, out.device)).reshaped(out)

    def rearranged(self, t: torch.Tensor, out: torch.Tensor, how: Callable) -> "SharedView | None":
        """A permutation of the output's elements (T5's `bias.permute(2, 0, 1)`)."""
        return SharedView(self, element_positions(self.shape, t.device)).rearranged(t, out, how)

    def sliced(self, t: torch.Tensor, index: Any, out: torch.Tensor) -> "SharedView | None":
        """`out = output[index]`, elements picked by an index every sample shares (Swin V2's position-bias MLP output
        gathered by its relative position index)."""
        return SharedView(self, element_positions(self.shape, t.device)).sliced(t, index, out)

    def expanded(self, out: torch.Tensor) -> "SharedView | None":
        """An expansion of the output (see SharedView.expanded)."""
        return SharedView(self, element_positions(self.shape, out.device)).expanded(out)

    def on_mul(self, out: torch.Tensor, other: torch.Tensor, dim: int) -> None:
        """The output times `other`, batched on `dim` and of out's shape (see multiplied)."""
        self.multiplied(out, self.shape, other, dim)

    def masked(self, t: torch.Tensor, out: torch.Tensor, keep: torch.Tensor) -> "SharedView | None":
        """`out = torch.where(keep, output, c)` with `keep` and c unbatched: the output's elements where keep holds."""
        return SharedView(self, element_positions(self.shape, t.device)).masked(t, out, keep)

    def multiplied(self, out: torch.Tensor, shape: tuple[int, ...], other: torch.Tensor, dim: int,
                   positions: torch.Tensor | None = None, holes: bool = False) -> None:
        """The output (or a view of it of `shape`, its elements at `positions`, as on_add) times `other`, batched on
        `dim` and of out's shape (a `torch.where` keeping it where each sample's mask holds): sample b's gradient of
        the output is (g ⊙ other) at index b."""
        broadcast = broadcast_dims(tuple(out.shape), shape, dim)
        if broadcast is None or tuple(other.shape) != tuple(out.shape):
            self.on_escape("a product that does not broadcast it over the batch")
            return
        if not self._used_as("broadcast"):
            return
        other = other.detach()
        out.register_hook(lambda g: self._add(g * other, dim, broadcast, 1, positions, holes))

    def moved_in_place(self, output: torch.Tensor, slope: torch.Tensor) -> None:
        """The output was overwritten in place by an elementwise function of slope `slope` (`nn.ReLU(inplace=True)`):
        a hook on it before then may no longer fire (the output a view: autograd rebases it), so its own gradient is
        read on the new value instead, times the slope."""
        self._hook.remove()
        self._hook = output.register_hook(lambda g: self._whole(g * slope))

    def take_per_sample(self, t: torch.Tensor, g: torch.Tensor, rounding: torch.dtype,
                        positions: torch.Tensor | None = None, holes: bool = False) -> None:
        """g [batch, *t.shape]: each sample's gradient of t, the output or a copy of it (or a view whose elements sit at
        `positions`), taken back from an op no rule follows (followed_through)."""
        flat = sum_to(g.detach(), self.shape if positions is None else tuple(positions.shape))
        if flat is None:
            self.on_escape("an op whose per-sample gradients do not fit the output's layout")
            return
        if self._used_as("broadcast"):
            self._add(flat, 0, [], 1, positions, holes)

    def _add(self, g: torch.Tensor, dim: int, broadcast: list[int], sign: int, positions: torch.Tensor | None,
             holes: bool = False) -> None:
        g = g.detach()
        if broadcast:
            g = g.sum(broadcast, keepdim=True)
        g = g.movedim(dim, 0).reshape(self.batch, -1)
        if positions is not None:  # a view's elements back where they sit in the output (on its device already)
            g = scattered(g, positions, math.prod(self.shape), holes)
        g = -g if sign < 0 else g
        self.per_sample = g if self.per_sample is None else self.per_sample + g


    def _whole(self, g: torch.Tensor) -> None:
        """The output's own gradient (every use summed): the per-sample gradients must add up to it."""
        if self.escaped is not None:
            self.refuse(f"its output, shared by every sample, is used by {self.escaped}, not only added to a batched "
                        "tensor")
            return
        if self.per_sample is None:
            self.refuse("its output, shared by every sample, got a gradient without being added to a batched tensor")
            return
        whole = g.detach().reshape(-1).to(self.per_sample.dtype)
        summed = self._explained()
        rtol = _RTOL.get(g.dtype, 1e-5)
        finite = whole[torch.isfinite(whole)]  # (a NaN or inf gradient is the model's own: compared as it is)
        scale = float(finite.abs().max()) if finite.numel() else 0.0
        if not torch.allclose(summed, whole, rtol=rtol, atol=rtol * scale, equal_nan=True):
            self.refuse("its output, shared by every sample, has a use besides its adds to batched tensors")
            return
        # In the output gradient's dtype where that is coarser (autocast's 16-bit): the precision autograd formed the
        # layer's own gradient in, which the use check then allows for.
        coarse = g.dtype.is_floating_point and torch.finfo(g.dtype).eps > torch.finfo(self.per_sample.dtype).eps
        self.done(self.per_sample.to(g.dtype) if coarse else self.per_sample)


    def _explained(self) -> torch.Tensor:
        """What the output's own gradient must be, flat: the per-sample gradients summed over the samples, or (rows)
        each sample's gradient of its own row, row by row."""
        return self.per_sample.reshape(-1) if self.mode == "rows" else self.per_sample.sum(0)


class SharedView:
    """A view of a SharedCall's output (reshaped, permuted): its elements' positions in the output, so that where it is
    added to the batch the per-sample gradient is put back in the output's layout."""

    def __init__(self, call: SharedCall, positions: torch.Tensor, holes: bool = False):
        self.call, self.positions, self.holes = call, positions, holes  # (holes: free_parameters.masked_positions)

    def on_add(self, total: torch.Tensor, view: torch.Tensor, dim: int, sign: int) -> None:
        # (the positions' shape, not the view's: an expanded view's positions keep size 1 where it was expanded)
        self.call.on_add(total, self.positions, dim, sign, self.positions, self.holes)

    def on_mul(self, out: torch.Tensor, other: torch.Tensor, dim: int) -> None:
        self.call.multiplied(out, tuple(self.positions.shape), other, dim, self.positions, self.holes)

    def masked(self, t: torch.Tensor, out: torch.Tensor, keep: torch.Tensor) -> "SharedView | None":
        holed = masked_positions(self.positions, t, out, keep, math.prod(self.call.shape))
        return None if holed is None else SharedView(self.call, holed, holes=True)

    def on_escape(self, what: str) -> None:
        self.call.on_escape(what)

    def take_per_sample(self, t: torch.Tensor, g: torch.Tensor, rounding: torch.dtype) -> None:
        self.call.take_per_sample(t, g, rounding, self.positions, self.holes)

    def on_repeat(self, out: torch.Tensor, view_shape: tuple[int, ...]) -> None:
        if tuple(view_shape) != tuple(self.positions.shape):
            self.on_escape("a repeat of an expansion")
            return
        self.call.on_repeat(out, view_shape, self.positions, self.holes)

    def expanded(self, out: torch.Tensor) -> "SharedView | None":
        """An expansion of the view to out's shape (MPNet's relative position bias, expanded over the batch before it is
        added to the scores): the same elements, their positions kept with size 1 along the dims they are copied
        along, so that where it is added to the batch each sample's copy's gradient is that sample's."""
        base = (1,) * (out.dim() - self.positions.dim()) + tuple(self.positions.shape)
        if any(b != o and b != 1 for b, o in zip(base, out.shape)):
            return None
        return SharedView(self.call, self.positions.reshape(base), self.holes)

    def reshaped(self, out: torch.Tensor) -> "SharedView | None":
        if out.numel() != self.positions.numel():
            return None
        return SharedView(self.call, self.positions.reshape(out.shape), self.holes)

    def rearranged(self, t: torch.Tensor, out: torch.Tensor, how: Callable) -> "SharedView | None":
        moved = rearranged_positions(self.positions, t, out, how)
        return None if moved is None else SharedView(self.call, moved, self.holes)

    def sliced(self, t: torch.Tensor, index: Any, out: torch.Tensor) -> "SharedView | None":
        return self.rearranged(t, out, lambda every: every[index]) if picks_elements(index) else None


def shares_input(rule: Any, tracking: Any, x: Any, batch: int, buffers: set[int] = frozenset()) -> bool:
    """Whether a call of a layer (its rule, its input x) takes the shared-input path: a rule that reads such calls,
    and an input nothing in the batch flows into: integer ids (an embedding's), or rows of floats without a dim of the
    batch's size (a Linear's: DeBERTa-v3's projections of its relative-position table), or a followed tensor every
    sample shares (batch_provenance.Shared) whose owner takes per-sample gradients back (take_per_sample).
    Whatever x is (an unnamed per-sample model input too), the output counts as shared only where it is broadcast
    over the batch of what it is added to, or repeated over the batch; anything else leaves the layer out."""
    if batch < 1 or tracking is None or not isinstance(x, torch.Tensor):
        return False
    if tracking.status(x) is not None:  # a followed tensor every sample shares (Swin V2's position MLP after its first
        return on_followed_rows(rule, tracking, (x,))  # layer)
    if not x.is_floating_point():
        return getattr(rule, "reads_shared_ids", False)
    # (a dim of the batch's size may be an unnamed per-sample input's, unless x is one of the model's buffers: Swin V2's
    # coordinate table [1, 2w - 1, 2w - 1, 2] in a batch of 2)
    return getattr(rule, "reads_shared_rows", False) and batch > 1 and x.dim() >= 1 and (
        batch not in x.shape or x.untyped_storage().data_ptr() in buffers)


def on_followed_rows(rule: Any, tracking: Any, args: tuple) -> bool:
    """Whether a layer call (its rule, its args) is one on a followed tensor every sample shares whose input gradient
    goes back to that tensor's owner (take_back): the pre-forward hook keeps the layer's functional form then."""
    x = args[0] if args else None
    if not getattr(rule, "reads_shared_rows", False) or tracking is None or not isinstance(x, torch.Tensor):
        return False
    status = tracking.status(x)
    return type(status) is Shared and hasattr(status.owner, "take_per_sample") and x.is_floating_point() and x.dim() >= 1


class LinearForm:
    """A Linear layer as a function of its input, with copies of its weight and bias: its input's gradient is g W."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def functional_form(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """`module` as a function of its input, with copies of its parameters as they are now (before its forward: under
    FSDP2 the unsharded ones, freed when it ends), in the input's dtype; None for a layer without one here (a
    reparametrised weight, formed at each read; a subclass's own forward)."""
    def kind(base: type) -> bool:  # the layer or a subclass with its forward (FSDP2's FSDPLinear)
        return isinstance(module, base) and type(module).forward is base.forward

    copies = {name: p.detach().clone() for name, p in module.named_parameters(recurse=False)}
    if kind(torch.nn.Linear) and "weight" in copies and set(copies) <= {"weight", "bias"}:
        return LinearForm(copies["weight"], copies.get("bias"))
    if kind(torch.nn.LayerNorm):
        return lambda x: F.layer_norm(x, module.normalized_shape, *(copies[n].to(x.dtype) if n in copies else None
                                                                    for n in ("weight", "bias")), module.eps)
    if kind(torch.nn.RMSNorm):
        weight = copies.get("weight")
        return lambda x: F.rms_norm(x, module.normalized_shape, None if weight is None else weight.to(x.dtype), module.eps)
    return None


def take_back(owner: Any, x: torch.Tensor, g: torch.Tensor, form: Callable | None) -> None:
    """Each sample's gradient of x, the input of a layer call on rows every sample shares (x followed itself: owner),
    from each sample's gradient g [batch, *output shape] of the call's output: the vector-Jacobian product of the
    layer's functional form (its parameters' copies), batched over the samples, in float32 or wider. None: the layer
    has none here, and x's owner is left out, named."""
    if form is None:
        owner.on_escape("a layer whose input's gradient gapmon cannot take back to what made it")
        return
    wide = torch.promote_types(torch.promote_types(g.dtype, x.dtype), torch.float32)
    if isinstance(form, LinearForm):  # g W: no product formed through autograd
        owner.take_per_sample(x, (g.to(wide) @ form.weight.to(wide)).reshape(g.shape[0], *x.shape), g.dtype)
        return
    try:
        _, vjp = torch.func.vjp(form, x.detach().to(wide))
        (dx,) = torch.vmap(vjp)(g.to(wide))
    except Exception as error:  # (in backward: never the user's backward)
        owner.on_escape(f"a layer whose input's per-sample gradient could not be formed ({type(error).__name__})")
        return
    owner.take_per_sample(x, dx, g.dtype)


class SharedInputs:
    """The shared-input calls of LayerHooks `hooks`' layers: each followed by a SharedCall whose gradient, once
    checked, goes to the hooks' backward path as any call's; the layers it finds not per-sample are left out by
    flush_refused (outside backward)."""

    def __init__(self, hooks: Any):
        self.hooks = hooks
        self.refused: list[tuple[str, str]] = []  # (layer, why)

    def follow(self, index: int, mb: Any, module: torch.nn.Module, rule: Any, x: torch.Tensor,
               output: torch.Tensor) -> None:
        """Records a call whose input every sample shares: its positions are its ids for every sample, its output
        gradient the one its SharedCall reads where the output joins the batch."""
        hooks = self.hooks
        name = hooks.layers[index][0]
        if not hooks.watch_params(index, mb, module, rule):
            return
        # ids with a row per sample may be each sample's own (token types the model makes: zeros of the batch's shape)
        rows = not x.is_floating_point() and mb.batch > 1 and x.dim() >= 1 and x.shape[0] == mb.batch
        if x.is_floating_point():  # rows [..., d], the same for every sample
            ids = x.detach().reshape(1, -1, x.shape[-1]).expand(mb.batch, -1, -1)
        else:
            ids = x.detach().reshape(1, -1).expand(mb.batch, -1)
        calls = mb.layers.setdefault(index, LayerCalls())
        calls.in_forward += 1
        at = calls.add(Call((ids,), {}), 0)

        upstream = hooks.state.tracking.status(x)
        upstream = upstream.owner if type(upstream) is Shared else None
        form = mb.shared_forms.pop(index, None)

        def done(g: torch.Tensor) -> None:
            if call.mode == "rows":
                calls.calls[at] = Call((x.detach().reshape(mb.batch, -1),), {})
            hooks.deliver(index, mb, at, g.reshape(mb.batch, calls.calls[at].args[0].shape[1], -1))
            if upstream is not None:  # x is followed too: each sample's gradient of it goes back to its owner
                take_back(upstream, x, g.reshape(mb.batch, *output.shape), form)

        def refuse(why: str) -> None:
            if len(calls.calls) == 1:  # (a layer with other calls too waits for their gradients: finished at the read)
                mb.layers.pop(index, None)
            self.refuse_later(name, why)

        call = SharedCall(output, mb.batch, done, refuse, rows)
        hooks.state.tracking.mark(output, Shared(call))

    def refuse_once_graded(self, name: str, outputs: Any, why: str) -> None:
        """A call of layer `name` whose input does not come from the batch: the layer is refused (at the next
        flush_refused) once any of the call's outputs gets a gradient; if none does, the call added nothing (its output
        detached, or unused) and the layer's other calls are measured as they are."""
        for t in graded_tensors(outputs):
            t.register_hook(lambda _, name=name, why=why: self.refuse_later(name, why))

    def refuse_later(self, name: str, why: str) -> None:
        """Layer `name` found in backward not to be per-sample: skipped at the next flush_refused."""
        self.refused.append((name, why))

    def flush_refused(self) -> None:
        """Skips the layers found in backward not to be per-sample after all (coverage.skip warns, or raises under
        strict: here, outside backward). Norms an earlier micro-batch of the step added for one are taken back out
        with the skipped layers' (PerSampleGradNorms reads the norms without them)."""
        refused, self.refused = self.refused, []
        for name, why in refused:
            self.hooks.coverage.skip(name, why)
