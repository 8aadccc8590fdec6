"""Per-sample gradients of a parameter the model uses directly, outside any layer: a learned position embedding
added to the batch (`x + self.pos_embed`), a class token expanded over the batch and concatenated to it
(`torch.cat([self.cls_token.expand(B, -1, -1), x], 1)`).

Such a parameter, registered on a module that has submodules (the model, an embeddings block) and covered by no
rule, is followed in every collected forward pass (batch_provenance.Shared, as a shared input's output is): its
copies and casts, reshapes (the same elements in the same order), slices (`self.pos_embed[:, :T]`: basic indexing,
each sample's gradient placed back where the elements sit), expansions, products with a number, sums with unbatched
tensors and with each other (`self.cls_token + self.pos_embed[:, :1]`) stay followed; where one of them is
added to a tensor batched on a dim it is broadcast along, multiplies one (a layer scale, `x * self.gamma`), or is
concatenated to one along another dim, a hook on the result reads each sample's gradient there (summed over the dims
it was broadcast along). Any other use leaves the
parameter out, named. Its norms are those of its per-sample gradient summed over every such use; the use check
compares the sum over the samples with what autograd accumulated for it, so a use no hook saw is refused.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from .. import _torch_compat
from ..utils import is_dtensor
from .batch_provenance import Shared
from .grad_hooks import hook_gradient
from .row_lookup import RowLookup
from .rules.base import overrides_ruled_forward, why_no_rule

# The most elements of a free parameter's per-sample gradients formed at once (batch · numel): a contraction's, a use's.
_MAX_FORMED = 1 << 26
# Why a free parameter is left out when the use check finds a gradient no followed use explains.
FREE_UNSEEN = ("it got a gradient where no use of it was followed: outside the forward pass, or in one run without "
               "grad (reentrant activation checkpointing)")


def free_parameters(model: nn.Module, ruled: set[int], clean_name) -> dict[str, tuple[nn.Module, str]]:
    """{parameter name: (the module that registers it, its attribute)} of the parameters a module registers itself
    and no rule covers (`ruled`: ids of the parameters a layer with a rule holds): a model's position table or class
    token, a layer scale (DINOv2's, a leaf module of its own), ConvNeXt V2's response normalisation, and the parameters
    of a subclass of a layer with a rule that overrides its forward (timm's LayerNorm, a LoRA Linear): followed through
    whatever ops that forward runs, as any free parameter (a ParameterDict's or ParameterList's too: PEFT's LoRA on an
    embedding; an Embedding subclass's table, looked up by id: OPT's and BART's learned positions). Left out when the
    model is built: torch's own layers without a rule (BatchNorm: its parameters go into one fused op)."""
    found: dict[str, tuple[nn.Module, str]] = {}
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        leaf = next(module.children(), None) is None
        overrides = overrides_ruled_forward(module)
        if leaf and type(module).__module__.startswith("torch.nn.") and not overrides and not isinstance(
                module, (nn.ParameterDict, nn.ParameterList)):
            continue
        for attr, p in module.named_parameters(recurse=False):
            if id(p) not in ruled and id(p) not in seen:
                seen.add(id(p))
                found[clean_name(f"{prefix}.{attr}" if prefix else attr)] = (module, attr)
    return found


class FreeParameterNorms:
    """The free parameters of a PerSampleGradNorms (its LayerCoverage's `free`, its UseChecker): followed in each
    micro-batch's forward pass, their per-sample norms added to it when the norms are read.

    Under FSDP2 a module holds its sharded parameters (DTensors) outside its forward and unsharded ones (plain
    tensors, always the same objects) inside it, swapped in by FSDP2's pre-forward hook, which FSDP2 puts before every
    other: a hook on each module that registers free parameters follows the objects its forward uses (those the
    gradients reach), whenever PerSampleGradNorms was made. Where a parameter is still a DTensor there (a wrapper whose
    hook runs after gapmon's), it is left out, named."""

    def __init__(self, coverage: Any, checker: Any, state: Any, functional: Any = None):
        self.coverage, self.checker, self.state = coverage, checker, state
        self._held: dict[int, list[tuple[str, str]]] = {}  # id(module) -> (name, attribute) of the free parameters it holds
        owners = {}
        for name, (owner, attr) in coverage.free.items():
            self._held.setdefault(id(owner), []).append((name, attr))
            owners[id(owner)] = owner
            if overrides_ruled_forward(owner):  # its parameters' differences scaled as one layer's (UseChecker)
                checker.scale_groups[name] = name[:-len(attr)].rstrip(".")
        self._handles = [owner.register_forward_pre_hook(self._owner_forward) for owner in owners.values()]
        # The covered Linear layers' parameters used outside their own forward (functional_layers), followed with these
        self.functional = functional

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.functional is not None:
            self.functional.close()

    def follow(self, mb: Any, tracker: Any) -> None:
        """Starts micro-batch `mb`'s uses of each free parameter that trains (and was not left out), following the
        plain tensors the modules hold now (the others when their module's forward begins)."""
        for name, p, _ in self.coverage.free_now():
            if name not in self.coverage.skipped:
                mb.free[name] = uses = ParameterUses(mb.batch)
                if not is_dtensor(p):
                    uses.follow(p, tracker, self.checker, name)
        if self.functional is not None:
            self.functional.follow(mb, tracker)

    def _owner_forward(self, owner: nn.Module, args) -> None:
        tracking = self.state.tracking
        if not self.state.collecting or tracking is None or not self.state.micro:
            return
        free = self.state.micro[-1].free
        for name, attr in self._held.get(id(owner), ()):
            uses = free.get(name)
            if uses is not None:
                p = getattr(owner, attr, None)
                if is_dtensor(p):
                    uses.on_escape(f"{type(owner).__name__}'s forward while it is still sharded (a DTensor: unsharded "
                                   "by no hook that ran before gapmon's)")
                elif isinstance(p, torch.Tensor):
                    uses.follow(p, tracking, self.checker, name)

    def finish(self, micro: list) -> None:
        """Each micro-batch's free parameters' squared norms from their per-sample gradients (and their sum over the
        samples to the use check, on the objects the forward used); a parameter one of whose uses was not followed is
        left out, named."""
        if self.functional is not None:
            self.functional.finish(micro)
        escaped = {name: uses.escaped for mb in micro for name, uses in mb.free.items() if uses.escaped}
        for name, what in escaped.items():
            owner = self.coverage.free[name][0]
            context = f"{why_no_rule(owner)}; " if overrides_ruled_forward(owner) else ""
            self.coverage.skip(name, f"{context}the model uses this parameter in {what}, not only by adding it to the "
                                     "batch, multiplying it, contracting it with the batch, normalising the batch with it "
                                     "or concatenating it (expanded over the batch) to a batched tensor")
        with torch.no_grad():
            for mb in micro:
                for name, uses in mb.free.items():
                    if not uses.used() or name in self.coverage.skipped or name not in self.coverage.free:
                        continue
                    owner = self.coverage.free[name][0]
                    sq, total = uses.norm_sq_and_sum()  # (float32 or float64: 16-bit gradients are widened)
                    mb.add(sq, sq.dtype, self.coverage.type_of(name, owner), name)
                    self.checker.explain_gradient(uses.param, name, total, uses.rounding)
                mb.free = {}


class ParameterUses:
    """One micro-batch's uses of a free parameter: the per-sample gradient [B, numel] they add up to, or why a use
    is not one gapmon can follow."""

    def __init__(self, batch: int):
        self.batch = batch
        self.per_sample: torch.Tensor | None = None
        self.escaped: str | None = None
        self.param: torch.Tensor | None = None  # the object the forward uses (under FSDP2 the unsharded one)
        self.rounding = torch.float64  # the least precise dtype autograd formed a use's gradient in
        self.rows: list[TableRows] = []  # lookups of the parameter as a table (F.embedding), by id

    def follow(self, p: torch.Tensor, tracker: Any, checker: Any, name: str) -> None:
        """Follows `p`, the object the forward pass uses now, in the batch tracking, its gradient watched by the
        use check."""
        if self.param is not p:
            self.param = p
            tracker.mark(p, Shared(self.piece(p)))
            checker.watch(p, name)

    def piece(self, t: torch.Tensor) -> "Piece":
        """The owner of the parameter's own Shared status."""
        return Piece(self, tuple(t.shape))

    def on_escape(self, what: str) -> None:
        self.escaped = self.escaped or what

    def add(self, g: torch.Tensor, rounding: torch.dtype) -> None:
        """Adds one use's per-sample gradient, read from a gradient of dtype `rounding` (the use check allows for the
        least precise of them)."""
        self.per_sample = g if self.per_sample is None else self.per_sample + g
        self.rounding = coarser(self.rounding, rounding)

    def add_rows(self, rows: "TableRows", rounding: torch.dtype) -> None:
        """Adds one lookup's per-sample gradient of the parameter as a table, by id (kept so: see TableRows)."""
        self.rows.append(rows)
        self.rounding = coarser(self.rounding, rounding)

    def used(self) -> bool:
        return self.per_sample is not None or bool(self.rows)

    def norm_sq_and_sum(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sample's squared norm [B] of the parameter's gradient and its sum over the samples (the parameter's
        shape). Lookups alone (one table layout) by id, never forming a per-sample gradient; with other uses too, the
        lookups' per-sample gradients are formed and added to theirs."""
        numel, shape = self.param.numel(), self.param.shape
        if (self.rows and self.per_sample is None and all(r.same_table(self.rows[0]) for r in self.rows)
                and self.rows[0].permutation(numel)):
            return TableRows.joined(self.rows).norm_sq_and_sum(numel, shape)
        g = self.per_sample
        for r in self.rows:
            g = r.dense(numel) if g is None else g + r.dense(numel)
        self.per_sample, self.rows = g, []
        return g.square().sum(1), g.sum(0).reshape(shape)


class TableRows:
    """One lookup of a table t (a free parameter in some order: LoRA's A.T) by ids: each sample's output gradient rows
    g [B, N, width] at ids [B, N] (`padding`: an id whose row gets no gradient, or -1), and where t's elements sit in the
    parameter (`positions`, t's shape; None: in order; `holes`: some sit nowhere, as Piece's). Where t holds every
    element of the parameter once (permutation), its per-sample gradients (B x its size) are not formed for the norm:
    Σ over pairs of positions with equal ids of g_t·g_s (embedding_norm_sq), whatever the order."""

    def __init__(self, ids: torch.Tensor, g: torch.Tensor, rows: int, padding: int, positions: torch.Tensor | None,
                 holes: bool):
        self.ids, self.g, self.rows, self.padding = ids, g, rows, padding
        self.positions, self.holes = positions, holes

    def permutation(self, numel: int) -> bool:
        """Whether the table holds each of the parameter's `numel` elements once (read when the norms are: one host
        read, after backward, not in the forward pass)."""
        return self.positions is None or (not self.holes and self.positions.numel() == numel and bool(
            torch.bincount(self.positions.reshape(-1), minlength=numel).eq(1).all()))

    def same_table(self, other: "TableRows") -> bool:
        """Whether both looked up the same layout of the parameter (their ids index the same rows)."""
        return self.padding == other.padding and self.rows == other.rows and (
            self.positions is other.positions or self.positions is not None and other.positions is not None
            and torch.equal(self.positions, other.positions))

    @staticmethod
    def joined(parts: list["TableRows"]) -> "TableRows":
        """Lookups of one table as one (their positions side by side: the per-sample gradients add)."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        return TableRows(torch.cat([p.ids for p in parts], 1), torch.cat([p.g for p in parts], 1), first.rows,
                         first.padding, first.positions, first.holes)

    def _in_parameter_order(self, table: torch.Tensor, numel: int) -> torch.Tensor:
        """[B, numel]: tables [B, rows, width] put where their elements sit in the parameter."""
        flat = table.reshape(table.shape[0], -1)
        return flat if self.positions is None else scattered(flat, self.positions, numel, self.holes)

    def norm_sq_and_sum(self, numel: int, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-sample squared norms [B] (by id) and the gradient summed over the samples (the parameter's shape)."""
        from ..stats import _backend

        ids, g = self.ids.reshape(-1), self.g.reshape(-1, self.g.shape[-1])
        if self.padding >= 0:
            keep = ids != self.padding
            ids, g = ids[keep], g[keep]
        table = g.new_zeros(1, self.rows, g.shape[1]).index_add_(1, ids, g.unsqueeze(0))
        return _backend.embedding_norm_sq(self.ids, self.g, self.padding), self._in_parameter_order(table, numel).reshape(shape)

    def dense(self, numel: int) -> torch.Tensor:
        """[B, numel]: each sample's gradient of the parameter, formed (the parameter has other uses as well, or the
        table is not each of its elements once)."""
        b, n, width = self.g.shape
        ids = self.ids if self.padding < 0 else self.ids.masked_fill(self.ids == self.padding, self.rows)
        table = self.g.new_zeros(b, self.rows + 1, width).scatter_add_(1, ids.unsqueeze(2).expand(b, n, width), self.g)
        return self._in_parameter_order(table[:, :self.rows], numel)


class Piece:
    """A tensor holding parameter elements (times `factor`) as `base` shape: all of them in the parameter's order, or
    (`positions`, of `base` shape) those at these flat positions of the parameter (a slice of it); where it is
    broadcast (an expansion) `base` has size 1 along the broadcast dims, aligned to the tensor's rank."""

    def __init__(self, uses: ParameterUses, base: tuple[int, ...], positions: torch.Tensor | None = None,
                 factor: float = 1.0, rounding: torch.dtype = torch.float64, holes: bool = False):
        self.uses, self.base, self.positions, self.factor = uses, base, positions, factor
        self.rounding = rounding  # the least precise dtype on the way from the parameter (a cast rounds its gradient)
        self.holes = holes  # some positions are the parameter's numel: elements a `where` replaced (no gradient back)

    def _like(self, base: tuple[int, ...], positions: torch.Tensor | None, factor: float = 1.0,
              holes: bool = False) -> "Piece":
        return Piece(self.uses, base, positions, self.factor * factor, self.rounding, self.holes or holes)

    def on_escape(self, what: str) -> None:
        self.uses.on_escape(what)

    def copied(self, out: torch.Tensor) -> "Piece":
        """A copy or cast: the same elements, its gradient rounded to out's dtype on the way back."""
        rounding = coarser(self.rounding, out.dtype) if out.is_floating_point() else self.rounding
        return self if rounding == self.rounding else Piece(self.uses, self.base, self.positions, self.factor, rounding,
                                                            self.holes)

    def reshaped(self, out: torch.Tensor) -> "Piece | None":
        """A view or reshape of a tensor that is not broadcast: the same elements in the same order (None: broadcast,
        its elements repeat)."""
        return self.viewed(tuple(out.shape))

    def viewed(self, shape: tuple[int, ...]) -> "Piece | None":
        """This piece's elements, in their order, as `shape` (None: not its number of elements)."""
        if _numel(shape) != _numel(self.base):
            return None
        positions = None if self.positions is None else self.positions.reshape(shape)
        return self._like(tuple(shape), positions)

    def scaled(self, out: torch.Tensor, factor: float) -> "Piece":
        """This piece times a number (1 for an expansion; negated, `0.5 * p`, `p / 4`), or added to an unbatched tensor,
        giving `out`: broadcast where `out` is larger."""
        base = (1,) * (out.dim() - len(self.base)) + self.base
        positions = None if self.positions is None else self.positions.reshape(base)
        return self._like(base, positions, factor)

    def plus(self, others: list) -> "PieceSum":
        return PieceSum([self, *others])

    def sliced(self, t: torch.Tensor, index: Any, out: torch.Tensor) -> "Piece | None":
        """`out = t[index]` of a tensor that is not broadcast, by ints, slices, None, Ellipsis and index tensors every
        sample shares (Swin's `table[relative_position_index]`): the elements at the indexed positions, an element
        picked twice twice (its gradients add where they are scattered back); a table indexed by ids with a row per
        sample is a lookup (looked_up_rows). None: another index, or a broadcast tensor."""
        if isinstance(index, torch.Tensor) and index.dtype in (torch.int64, torch.int32) and index.dim() >= 2 \
                and index.shape[0] == self.uses.batch:  # a row of ids per sample (Whisper's table[position_ids])
            return self.looked_up_rows(t, out, index, -1)
        if not picks_elements(index):
            return None
        return self.rearranged(t, out, lambda every: every[index])

    def rearranged(self, t: torch.Tensor, out: torch.Tensor, how: Callable[[torch.Tensor], torch.Tensor]) -> "Piece | None":
        """`out = how(t)`, an op that only picks and moves elements of a tensor that is not broadcast (indexing, permute,
        transpose, flip): the same op on the elements' positions in the parameter says where out's are."""
        every = self.positions if self.positions is not None else element_positions(self.base, t.device)
        moved = rearranged_positions(every, t, out, how)
        return None if moved is None else self._like(tuple(out.shape), moved)

    def masked(self, t: torch.Tensor, out: torch.Tensor, keep: torch.Tensor) -> "Piece | None":
        """`out = torch.where(keep, t, c)` (or its mirror) with `keep` and c unbatched (T5's bias under the causal mask
        before fused attention): t's elements where `keep` holds, none elsewhere (holes: no gradient goes back)."""
        every = self.positions if self.positions is not None else element_positions(self.base, t.device)
        holed = masked_positions(every, t, out, keep, self.uses.param.numel())
        return None if holed is None else self._like(tuple(out.shape), holed, holes=True)

    def looked_up(self, t: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, dim: int, padding: int) -> bool:
        """out = F.embedding(ids, t), t this piece, ids batched on `dim`: each sample's gradient of t is its rows of
        out's gradient summed by id, kept so (TableRows). False: t is broadcast."""
        if tuple(t.shape) != self.base or t.dim() != 2:
            return False
        if not out.requires_grad:
            return True
        batch = self.uses.batch
        ids = ids.detach().movedim(dim, 0).reshape(batch, -1)
        out.register_hook(lambda g: self.add_table_rows(ids, g.movedim(dim, 0), padding))
        return True

    def looked_up_rows(self, t: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, padding: int) -> Any:
        """out = F.embedding(ids, t), t this piece, ids no sample's data flows into: followed by a RowLookup (None: t
        is broadcast)."""
        if tuple(t.shape) != self.base or t.dim() != 2:
            return None
        return RowLookup(self, ids, padding)

    def add_table_rows(self, ids: torch.Tensor, g: torch.Tensor, padding: int, sign: int = 1) -> None:
        """Adds one lookup of this piece (a table) by ids [B, N]: g, the batch first, holds each sample's gradient of
        the looked-up rows (kept by id: TableRows), read from a gradient of g's dtype."""
        rounding = coarser(self.rounding, g.dtype)
        g = g.detach() if g.dtype in (torch.float32, torch.float64) else g.detach().float()
        g = g.reshape(ids.shape[0], ids.shape[1], -1)
        factor = self.factor * sign
        self.uses.add_rows(TableRows(ids, g * factor if factor != 1.0 else g, self.base[0], padding, self.positions,
                                     self.holes), rounding)

    def placed(self, t: torch.Tensor, out: torch.Tensor, cat_dim: int, start: int) -> "Piece | None":
        """t (this piece, not broadcast) as rows [start, start + t.shape[cat_dim]) of `out` along `cat_dim`, whose other
        rows are not this parameter's (holes): a concatenation of parameters and constants (BEiT's
        `torch.cat((self.q_bias, self.k_bias, self.v_bias))`, k_bias a buffer of zeros). None: t is broadcast."""
        every = self.positions if self.positions is not None else element_positions(self.base, t.device)
        if tuple(every.shape) != tuple(t.shape):
            return None
        holed = torch.full(tuple(out.shape), self.uses.param.numel(), dtype=every.dtype, device=every.device)
        holed.narrow(cat_dim, start, t.shape[cat_dim]).copy_(every)
        return self._like(tuple(out.shape), holed, holes=True)

    def mapped(self, t: torch.Tensor, out: torch.Tensor, slope: torch.Tensor) -> "Piece | None":
        """out = f(t), f elementwise with slope f'(t) (gapmon.per_sample.elementwise), t this piece, not broadcast: out
        is followed as a parameter of its own whose per-sample gradients reach this piece times the slope. None: a
        broadcast piece."""
        if tuple(t.shape) != self.base:
            return None
        return Piece(MappedUses(self, out, slope), tuple(out.shape))

    def contracted_with(self, t: torch.Tensor, out: torch.Tensor, const: torch.Tensor, back: str) -> "Piece | None":
        """out = einsum(..., t, const) of this piece (not broadcast) and a constant (Funnel's `einsum("td,dnh->tnh", r,
        r_kernel)` over its relative positions): out is followed as a parameter of its own whose per-sample gradients
        reach this piece through `back` (einsum of the constant and one sample's gradient of out: the chain rule of a
        linear map, exact). None: a broadcast piece."""
        if tuple(t.shape) != self.base:
            return None
        return Piece(ContractedUses(self, out, const.detach(), back), tuple(out.shape))

    def add_per_sample(self, g: torch.Tensor, rounding: torch.dtype) -> None:
        """Adds one use's per-sample gradient, [batch, numel of base], where its elements sit in the parameter (read
        from a gradient of dtype `rounding`). Left out, named, where the parameter's per-sample gradients would be
        more than _MAX_FORMED elements (a slice of a large table: only lookups by id keep them small)."""
        numel = self.uses.param.numel()
        if self.uses.batch * numel > _MAX_FORMED:
            self.on_escape(f"a use whose per-sample gradients (batch x {numel}) are more than {_MAX_FORMED} elements")
            return
        if self.factor != 1.0:
            g = g * self.factor
        if self.positions is not None:
            g = scattered(g, self.positions, numel, self.holes)
        self.uses.add(g, coarser(self.rounding, rounding))

    def take_per_sample(self, t: torch.Tensor, g: torch.Tensor, rounding: torch.dtype) -> None:
        """g [batch, *t.shape]: each sample's gradient of t, this piece (followed_through: taken back from an op no rule
        follows)."""
        flat = sum_to(g.detach(), self.base)
        if flat is None:
            self.on_escape("an op whose per-sample gradients do not fit the parameter's layout")
            return
        self.add_per_sample(flat, rounding)

    def _broadcast(self, shape: torch.Size, dim: int, inner: int = 1) -> list[int] | None:
        """broadcast_dims of this piece in a result of `shape` (Swin's windows: `inner` rows of each sample on dim)."""
        return broadcast_dims(shape, self.base, dim, self.uses.batch, inner)

    def on_add(self, total: torch.Tensor, t: torch.Tensor, dim: int, sign: int, inner: int = 1) -> None:
        """t (this piece) was added (sign 1) or subtracted (-1) to a tensor batched on `dim` (merged with `inner` rows
        of each sample there, inner > 1), giving `total`."""
        broadcast = self._broadcast(total.shape, dim, inner)
        if broadcast is None:
            self.on_escape("an add that does not broadcast it over the batch")
            return
        if not total.requires_grad:  # a forward pass without grad (reentrant checkpointing): the use check decides
            return
        batch = self.uses.batch

        def hook(g: torch.Tensor) -> None:
            g = g if inner == 1 else g.unflatten(dim, (batch, inner))
            self.add_per_sample(_per_sample(g, dim, broadcast, batch, sign), g.dtype)

        total.register_hook(hook)

    def on_mul(self, out: torch.Tensor, other: torch.Tensor, dim: int, inner: int = 1) -> None:
        """This piece times `other`, batched on `dim` (merged with `inner` rows of each sample there, inner > 1: Swin V2's
        scores over windows) and of out's shape (a layer scale: x * gamma): each sample's gradient is g ⊙ other, summed
        over the dims the piece was broadcast along."""
        broadcast = self._broadcast(out.shape, dim, inner)
        if broadcast is None:
            self.on_escape("a product that does not broadcast it over the batch")
            return
        batch = self.uses.batch

        def per_sample(g: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
            product = g.to(torch.promote_types(g.dtype, torch.float32)) * o
            return _per_sample(product if inner == 1 else product.unflatten(dim, (batch, inner)), dim, broadcast, batch, 1)

        self._on_product(out, other, per_sample)

    def on_normalised(self, out: torch.Tensor, x: torch.Tensor, dim: int,
                      normalise: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """This piece scales a normalisation's x̂ = normalise(x), x batched on `dim` and x̂ of out's shape (a
        LayerNorm's weight in the F.layer_norm of a forward that overrides the layer's): each sample's gradient is
        g ⊙ x̂ summed over the dims the piece was broadcast along, x̂ formed again in backward from x."""
        broadcast = self._broadcast(out.shape, dim)
        if broadcast is None:
            self.on_escape("a normalisation that does not broadcast it over the batch")
            return

        def per_sample(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            wide = torch.promote_types(g.dtype, torch.float32)
            return _per_sample(g.to(wide) * normalise(x.to(torch.promote_types(x.dtype, wide))), dim, broadcast,
                               self.uses.batch, 1)

        self._on_product(out, x, per_sample)

    def on_contract(self, out: torch.Tensor, other: torch.Tensor, equation: str,
                    merged: tuple[int, int] | None = None) -> None:
        """This piece contracted with `other`, batched, into `out` (a weight in F.linear, `x @ W`, an einsum: MoE
        routers, XLNet's projections): each sample's gradient is einsum(equation, other, g), [batch, *piece shape],
        formed whole (none where batch · numel exceeds _MAX_FORMED elements: left out, named). `merged` (dim, inner):
        other's and out's dim holds the batch merged with `inner` rows each, split in two for the equation."""
        if self.uses.batch * _numel(self.base) > _MAX_FORMED:
            self.on_escape(f"a matrix product, its per-sample gradients more than {_MAX_FORMED} elements")
            return

        ran_in = out.dtype  # under autocast a 16-bit product of `other` cast to it (the exact operand of its gradient)

        def per_sample(g: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
            if ran_in in (torch.float16, torch.bfloat16) and other.is_floating_point():
                other = other.to(ran_in)
            wide = torch.promote_types(torch.promote_types(g.dtype, other.dtype), torch.float32)
            a, g = other.to(wide), g.detach().to(wide)
            if merged is not None:
                a, g = (u.unflatten(merged[0], (self.uses.batch, merged[1])) for u in (a, g))
            return torch.einsum(equation, a, g).reshape(self.uses.batch, -1)

        self._on_product(out, other, per_sample)

    def on_conv(self, out: torch.Tensor, x: torch.Tensor, stride: Any, padding: Any, dilation: Any, groups: int) -> None:
        """This piece, whole, the weight of `F.conv1d/conv2d(x, piece, ...)` of x batched on dim 0 (Mamba's causal
        depthwise convolution, its Conv1d's weight passed by its parent): each sample's gradient, every sample's at once
        as the weight gradient of one convolution of batch · groups groups, formed whole (none where batch · numel
        exceeds _MAX_FORMED elements: left out, named)."""
        if self.uses.batch * _numel(self.base) > _MAX_FORMED:
            self.on_escape(f"a convolution, its per-sample gradients more than {_MAX_FORMED} elements")
            return
        batch, shape, ran_in = self.uses.batch, self.base, out.dtype
        weight_grad = torch.nn.grad.conv1d_weight if x.dim() == 3 else torch.nn.grad.conv2d_weight

        def per_sample(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            if ran_in in (torch.float16, torch.bfloat16):  # autocast ran the convolution on x cast to it
                x = x.to(ran_in)
            wide = torch.promote_types(torch.promote_types(g.dtype, x.dtype), torch.float32)
            xs = x.to(wide).reshape(1, batch * x.shape[1], *x.shape[2:])
            gs = g.detach().to(wide).reshape(1, batch * g.shape[1], *g.shape[2:])
            grads = weight_grad(xs, (batch * shape[0], *shape[1:]), gs, stride, padding, dilation, batch * groups)
            return grads.reshape(batch, -1)

        self._on_product(out, x, per_sample)

    def on_bias(self, out: torch.Tensor) -> None:
        """This piece, whole, the bias of a convolution whose output `out` is batched on dim 0 (its channels on dim 1):
        each sample's gradient is its output gradient summed over the positions."""
        if not out.requires_grad:
            return

        def hook(g: torch.Tensor) -> None:
            rounding = g.dtype  # a 16-bit gradient (autocast) is summed in float32, its rounding allowed for
            g = g.detach() if rounding in (torch.float32, torch.float64) else g.detach().float()
            self.add_per_sample(g.sum(tuple(range(2, g.dim()))) if g.dim() > 2 else g, rounding)

        hook_gradient(out, hook)

    def _on_product(self, out: torch.Tensor, other: torch.Tensor,
                    per_sample: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """A hook on out's gradient g adds per_sample(g, other) ([batch, numel]) to this piece's uses. `other` is read in
        backward (autograd keeps it for the product's own gradient): changed in place before then, the parameter is left
        out."""
        if not out.requires_grad:  # (as on_add)
            return
        other, version, out_dtype = other.detach(), _torch_compat.version_counter(other), out.dtype

        def hook(g: torch.Tensor) -> None:
            if _torch_compat.version_counter(other) != version:
                self.on_escape("a product with a tensor changed in place afterwards")
                return
            rounding = torch.promote_types(g.dtype, other.dtype)
            self.add_per_sample(per_sample(g, other),
                                coarser(rounding, out_dtype) if out_dtype.is_floating_point else rounding)

        hook_gradient(out, hook, (other,))

    def on_cat(self, out: torch.Tensor, t: torch.Tensor, cat_dim: int, start: int, dim: int) -> None:
        """t (this piece, expanded over the batch on `dim`) is rows [start, start + t.shape[cat_dim]) of `out` along
        `cat_dim`."""
        broadcast = self._broadcast(t.shape, dim)
        if broadcast is None or t.shape[dim] != self.uses.batch:
            self.on_escape("a concatenation that does not expand it over the batch")
            return
        if not out.requires_grad:  # (as on_add)
            return
        length = t.shape[cat_dim]
        out.register_hook(lambda g: self.add_per_sample(
            _per_sample(g.narrow(cat_dim, start, length), dim, broadcast, self.uses.batch, 1), g.dtype))


class MappedUses:
    """The uses of y = f(x), f an elementwise function of a piece x of a free parameter (Swin V2's
    `clamp(logit_scale, max).exp()`): y is followed as a parameter of its own (its pieces' `uses`), each of its
    per-sample gradients reaching x times f'(x) (the chain rule, element by element: exact)."""

    def __init__(self, piece: Piece, out: torch.Tensor, slope: torch.Tensor):
        self.piece, self.param, self.batch = piece, out, piece.uses.batch
        self.slope = slope.reshape(1, -1)

    def on_escape(self, what: str) -> None:
        self.piece.on_escape(what)

    def add(self, g: torch.Tensor, rounding: torch.dtype) -> None:
        self.piece.add_per_sample(g * self.slope, coarser(rounding, self.slope.dtype))


class ContractedUses:
    """The uses of y = einsum(x, c), x a piece of a free parameter and c a constant (see Piece.contracted_with): y is
    followed as a parameter of its own, each of its per-sample gradients reaching x through `back`."""

    def __init__(self, piece: Piece, out: torch.Tensor, const: torch.Tensor, back: str):
        self.piece, self.param, self.batch = piece, out, piece.uses.batch
        self.const, self.back, self.shape = const, back, tuple(out.shape)

    def on_escape(self, what: str) -> None:
        self.piece.on_escape(what)

    def add(self, g: torch.Tensor, rounding: torch.dtype) -> None:
        wide = torch.promote_types(g.dtype, self.const.dtype)
        g = torch.einsum(self.back, self.const.to(wide), g.to(wide).reshape(self.batch, *self.shape))
        self.piece.add_per_sample(g.reshape(self.batch, -1), coarser(rounding, self.const.dtype))


class PieceSum:
    """Pieces of free parameters added together (`self.cls_token + self.pos_embed[:, :1]`): each use of the sum is a
    use of every piece, which reads its own per-sample gradient there."""

    def __init__(self, pieces: list):
        self.pieces = [q for p in pieces for q in (p.pieces if isinstance(p, PieceSum) else [p])]

    def on_escape(self, what: str) -> None:
        for p in self.pieces:
            p.on_escape(what)

    def _each(self, make) -> "PieceSum | None":
        pieces = [make(p) for p in self.pieces]
        return None if any(p is None for p in pieces) else PieceSum(pieces)

    def copied(self, out: torch.Tensor) -> "PieceSum":
        return self._each(lambda p: p.copied(out))

    def reshaped(self, out: torch.Tensor) -> "PieceSum | None":
        return self._each(lambda p: p.reshaped(out))

    def scaled(self, out: torch.Tensor, factor: float) -> "PieceSum":
        return self._each(lambda p: p.scaled(out, factor))

    def sliced(self, t: torch.Tensor, index: Any, out: torch.Tensor) -> "PieceSum | None":
        return self._each(lambda p: p.sliced(t, index, out))

    def rearranged(self, t: torch.Tensor, out: torch.Tensor, how: Callable[[torch.Tensor], torch.Tensor]) -> "PieceSum | None":
        return self._each(lambda p: p.rearranged(t, out, how))

    def plus(self, others: list) -> "PieceSum":
        return PieceSum([self, *others])

    def placed(self, t: torch.Tensor, out: torch.Tensor, cat_dim: int, start: int) -> "PieceSum | None":
        return self._each(lambda p: p.placed(t, out, cat_dim, start))

    def on_add(self, total: torch.Tensor, t: torch.Tensor, dim: int, sign: int, inner: int = 1) -> None:
        for p in self.pieces:
            p.on_add(total, t, dim, sign, inner)

    def viewed(self, shape: tuple[int, ...]) -> "PieceSum | None":
        return self._each(lambda p: p.viewed(shape))

    def on_mul(self, out: torch.Tensor, other: torch.Tensor, dim: int, inner: int = 1) -> None:
        for p in self.pieces:
            p.on_mul(out, other, dim, inner)

    def on_normalised(self, out: torch.Tensor, x: torch.Tensor, dim: int,
                      normalise: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for p in self.pieces:
            p.on_normalised(out, x, dim, normalise)

    def on_contract(self, out: torch.Tensor, other: torch.Tensor, equation: str,
                    merged: tuple[int, int] | None = None) -> None:
        for p in self.pieces:
            p.on_contract(out, other, equation, merged)

    def take_per_sample(self, t: torch.Tensor, g: torch.Tensor, rounding: torch.dtype) -> None:
        for p in self.pieces:
            p.take_per_sample(t, g, rounding)

    def on_cat(self, out: torch.Tensor, t: torch.Tensor, cat_dim: int, start: int, dim: int) -> None:
        for p in self.pieces:
            p.on_cat(out, t, cat_dim, start, dim)


def joined_where_expanded(tracker: Any, args: tuple, batch: int) -> tuple | None:
    """A covered layer's input x (args[0]) that is a free parameter expanded (or repeated) over the batch (Perceiver's latents,
    BLIP-2's query tokens: `self.latents.expand(B, -1, -1)`): each sample's copy goes through the layer as that sample's
    input, so it joins the batch there, on the one dim x was broadcast along that has the batch's size. Returned: the
    layer's args with, in x's place, a view of x batched on that dim whose gradient (this layer's use alone: x's other uses
    are followed as they are) gives the parameter each sample's gradient of its copy (on_add of the view to itself).
    From there the tracking follows it as any batched tensor (an op mixing the copies refuses the norms). None: x is no
    such piece, or that dim is not one."""
    x = args[0] if args else None
    status = tracker.status(x) if tracker is not None and isinstance(x, torch.Tensor) else None
    if type(status) is not Shared or type(status.owner) is not Piece or len(status.owner.base) > x.dim():
        return None
    aligned = (1,) * (x.dim() - len(status.owner.base)) + status.owner.base
    dims = [d for d in range(x.dim()) if aligned[d] == 1 and x.shape[d] == batch]
    if len(dims) != 1:
        return None
    joined = x.view_as(x)
    tracker.mark(joined, dims[0])
    status.owner.on_add(joined, joined, dims[0], 1)
    return (joined, *args[1:])


def picks_elements(index: Any) -> bool:
    """Whether `t[index]` only picks elements of t, the same ones whatever t holds: ints, slices of int bounds, None,
    Ellipsis and index tensors (unbatched: the caller's to know)."""
    parts = index if isinstance(index, tuple) else (index,)
    if not all(i is None or i is Ellipsis or isinstance(i, (slice, torch.Tensor)) or type(i) is int for i in parts):
        return False
    return not any(isinstance(i, slice) and not all(type(v) in (int, type(None)) for v in (i.start, i.stop, i.step))
                   for i in parts)


def element_positions(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The flat positions of a tensor of `shape`'s elements, in its shape: what views and picks of it move."""
    return torch.arange(_numel(shape), device=device).reshape(shape)


def rearranged_positions(positions: torch.Tensor, t: torch.Tensor, out: torch.Tensor,
                         how: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """The positions of `out = how(t)`'s elements, `positions` those of t's (t not broadcast: of their shape); None
    where the op does not give out's shape from them (it broadcasts, or reads something else)."""
    if tuple(t.shape) != tuple(positions.shape):
        return None
    moved = how(positions)
    return moved if tuple(moved.shape) == tuple(out.shape) else None


def broadcast_dims(shape: tuple[int, ...], piece: tuple[int, ...], dim: int, batch: int = 0,
                   inner: int = 1) -> list[int] | None:
    """The dims (but the batch's, `dim`) of a result of `shape` along which a tensor of shape `piece` (aligned to its
    rank) was broadcast; None when it is not broadcast along the batch (no per-sample use then). `inner` > 1: dim holds
    the batch (`batch` samples) merged with `inner` rows each (Swin's windows), split out as dim + 1 in the dims
    returned."""
    aligned = (1,) * (len(shape) - len(piece)) + tuple(piece)
    if aligned[dim] != 1:
        return None
    if inner != 1:
        shape = (*shape[:dim], batch, inner, *shape[dim + 1:])
        aligned = (*aligned[:dim], 1, 1, *aligned[dim + 1:])
    return [k for k in range(len(shape)) if k != dim and aligned[k] == 1 and shape[k] != 1]


def scattered(g: torch.Tensor, positions: torch.Tensor, numel: int, holes: bool = False) -> torch.Tensor:
    """[batch, numel]: per-sample gradients g ([batch, positions' numel]) added where `positions` say their elements
    sit (an element picked twice gets both); `holes`: positions equal to numel take nothing back (masked_positions)."""
    out = g.new_zeros(g.shape[0], numel + holes).index_add_(1, positions.reshape(-1), g)
    return out[:, :numel] if holes else out


def masked_positions(positions: torch.Tensor, t: torch.Tensor, out: torch.Tensor, keep: torch.Tensor,
                     numel: int) -> torch.Tensor | None:
    """The positions of `out = torch.where(keep, t, c)`'s elements (t's where `keep` holds, `numel`, a hole,
    elsewhere), `positions` those of t's (of its shape); None where t is broadcast or out is not where's shape."""
    if tuple(t.shape) != tuple(positions.shape):
        return None
    try:
        shape = torch.broadcast_shapes(t.shape, keep.shape)
    except RuntimeError:
        return None
    if tuple(shape) != tuple(out.shape):
        return None
    return torch.where(keep.to(positions.device), positions.expand(shape), numel)


def coarser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The less precise of two floating dtypes (the one whose rounding the use check must allow)."""
    return b if torch.finfo(b).eps > torch.finfo(a).eps else a


def sum_to(g: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """g [batch, *t's shape], each sample's gradient of a tensor t, as [batch, numel of `shape`]: reshaped where the two
    hold as many elements, else summed over the dims of t along which a tensor of `shape` (aligned to t's rank) was
    broadcast. None: neither."""
    batch, full = g.shape[0], tuple(g.shape[1:])
    if _numel(full) == _numel(shape):
        return g.reshape(batch, -1)
    if len(shape) > len(full):
        return None
    aligned = (1,) * (len(full) - len(shape)) + tuple(shape)
    if any(a not in (1, f) for a, f in zip(aligned, full)):
        return None
    dims = [k + 1 for k, (a, f) in enumerate(zip(aligned, full)) if a == 1 and f != 1]
    return (g.sum(dims) if dims else g).reshape(batch, -1)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _per_sample(g: torch.Tensor, dim: int, broadcast: list[int], batch: int, sign: int) -> torch.Tensor:
    """[batch, numel]: g summed over the dims the parameter was broadcast along, the batch first (a 16-bit g in float32,
    as the layers' products are summed)."""
    g = g.detach() if g.dtype in (torch.float32, torch.float64) else g.detach().float()
    if broadcast:
        g = g.sum(broadcast, keepdim=True)
    g = g.movedim(dim, 0).reshape(batch, -1)
    return -g if sign < 0 else g
