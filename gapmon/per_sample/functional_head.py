"""An embedding's table used as a Linear head's weight by its model's own forward: `F.linear(h, self.wte.weight)` (the
original OLMo's weight tying), `h @ self.wte.weight.T`, `torch.einsum("btd,vd->btv", h, self.wte.weight)`.

From the end of each covered embedding's forward in a collected pass, its table carries a Shared status in the batch
tracking whose owner (HeadUse) knows one use: a contraction of the whole table, in the Linear layout, with a batched
tensor. That use is recorded as a call of a layer of its own, TableAsHead (a Linear whose weight is the table; never
called by the model), tied to the embedding on its first use (tied_embedding: the head's part, the embedding's part and
their cross term, exact). Any other use of the table there (a product of another form, a reduction, a lookup outside
the embedding) is not followed: the table is left out, named. A module tie (`lm_head.weight = wte.weight`) is found
from the modules and needs none of this.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .. import _torch_compat
from ..utils import is_dtensor
from .batch_provenance import Shared
from .rules import EmbeddingRule, LinearRule


class TableAsHead(nn.Module):
    """A Linear layer whose weight is an embedding's table (its parameter registry is the embedding's: under FSDP2 the
    objects it swaps in are this layer's too) and that has no bias. Not a submodule of the model."""

    bias = None

    def __init__(self, embedding: nn.Module):
        super().__init__()
        self._parameters = _torch_compat.module_registries(embedding)[0]  # one table, two layers


def linear_form(equation: str, transposed: bool) -> bool:
    """Whether a per-sample gradient equation `x,g->bt` (the tracking's, batch_provenance._contraction_equation) is a
    Linear head's: x and g share every dim but their last, the batch is one of them, and t's dims are (out features,
    in features), or the reverse for the table's transpose. Then the table's per-sample gradient is Σ_t g_t x_tᵀ, the
    Linear rule's."""
    inputs, _, result = equation.partition("->")
    x, _, g = inputs.partition(",")
    return (len(x) == len(g) >= 2 and x[:-1] == g[:-1] and len(result) == 3 and result[0] in x[:-1]
            and result[1:] == (x[-1] + g[-1] if transposed else g[-1] + x[-1]))


def _transposed_view(t: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether out is t's 2-D transpose as a view (t.T, t.t(), t.transpose(0, 1), t.permute(1, 0), t.mT)."""
    return (t.dim() == 2 and tuple(out.shape) == tuple(t.shape)[::-1] and tuple(out.stride()) == tuple(t.stride())[::-1]
            and out.data_ptr() == t.data_ptr())


class HeadUse:
    """The owner of an embedding's table's Shared status: the table (`transposed`: its transpose), of shape `shape`. A
    contraction of it in the Linear layout is the head's call; any other use leaves the table out."""

    def __init__(self, heads: "FunctionalHeads", index: int, shape: tuple[int, ...], transposed: bool = False):
        self.heads, self.index, self.shape, self.transposed = heads, index, shape, transposed
        self.base = shape[::-1] if transposed else shape  # (the tracking matches it against the operand's shape)

    def copied(self, out: torch.Tensor) -> "HeadUse":
        """A cast or copy: the same table (the head's rule reads its gradient's rounding from the gradient)."""
        return self

    def rearranged(self, t: torch.Tensor, out: torch.Tensor, how: Any) -> "HeadUse | None":
        """A transpose of the whole table; None (not followed) for any other rearrangement."""
        return HeadUse(self.heads, self.index, self.shape, not self.transposed) if _transposed_view(t, out) else None

    def on_contract(self, out: torch.Tensor, x: torch.Tensor, equation: str, merged: Any = None) -> None:
        """out = the table contracted with x, batched: the head's call when it is x's last dim against the table's
        second (F.linear's form; x's batch may be merged with its rows); any other contraction is not followed."""
        if not linear_form(equation, self.transposed):
            self.on_escape(f"a contraction that is not a Linear head's ({equation})")
            return
        self.heads.follow_head(self.index, x, out)

    def on_escape(self, what: str) -> None:
        """A use no rule follows, once its output gets a gradient. With grad off (a statistic of the table taken under
        torch.no_grad, or a custom Function's forward, whose backward is its own) it is left to the use check, which
        refuses the table only if the use added to its gradient."""
        if not torch.is_grad_enabled() and not _torch_compat.in_backward():
            return
        self.heads.refuse(self.index, f"its table is used in the forward pass outside its layer, by {what}, which the "
                                      "batch tracking does not follow for a table: only its use as a Linear head's "
                                      "weight is (F.linear(h, table), h @ table.T)")


class FunctionalHeads:
    """The covered embeddings of LayerHooks `hooks` whose table is tied to no other layer's: each table followed from
    its embedding's forward on, its uses as a head's weight recorded as calls of a TableAsHead layer tied to it."""

    def __init__(self, hooks: Any):
        self.hooks = hooks
        self.coverage, self.state = hooks.coverage, hooks.state
        self.tables: dict[int, int] = {}  # id(embedding module) -> its layer index
        self.heads: dict[int, int] = {}  # embedding's layer index -> its head's, once the table was used as one
        for index, (name, module, rule) in enumerate(self.coverage.layers):
            if isinstance(rule, EmbeddingRule) and name not in self.coverage.ties:
                self.tables[id(module)] = index
        modules = {id(m): m for _, m, _ in self.coverage.layers if id(m) in self.tables}
        self._handles = [h for m in modules.values()
                         for h in (m.register_forward_pre_hook(self._before_lookup),
                                   m.register_forward_hook(self._after_lookup))]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _following(self) -> Any:
        """The batch tracking of the forward pass being collected now (None: none is)."""
        state = self.state
        if not state.collecting or not state.micro or torch.compiler.is_compiling():
            return None
        return state.tracking

    def _before_lookup(self, module: nn.Module, args: tuple) -> None:
        """The embedding's own lookup is its rule's: its table is not followed while it runs."""
        tracking = self._following()
        if tracking is not None and isinstance(module.weight, torch.Tensor):
            tracking.mark(module.weight, None)

    def _after_lookup(self, module: nn.Module, args: tuple, output: Any) -> None:
        tracking = self._following()
        index = self.tables[id(module)]
        table = module.weight
        if (tracking is None or self.coverage.layers[index][0] in self.coverage.skipped
                or not isinstance(table, torch.Tensor) or not table.requires_grad or is_dtensor(table)):
            return
        tracking.mark(table, Shared(HeadUse(self, index, tuple(table.shape))))

    def follow_head(self, index: int, x: torch.Tensor, out: torch.Tensor) -> None:
        """out = F.linear(x, table of layer `index`) in the forward pass: a call of the table's head layer."""
        mb = self.state.micro[-1]
        if index in mb.used and index not in mb.layers:
            self.refuse(index, "its table is used as a head's weight while the embedding's own call in this forward "
                               "pass was not followed per sample (its ids are shared by every sample)")
            return
        head = self._head(index)
        self.hooks.record_call(head, self.coverage.layers[head][1], (x,), out)

    def _head(self, index: int) -> int:
        """The layer index of the head of embedding `index`'s table, made and tied to it on its first use."""
        head = self.heads.get(index)
        if head is None:
            name, module, _ = self.coverage.layers[index]
            head = self.heads[index] = self.coverage.add_layer(f"{name} (head)", TableAsHead(module), LinearRule())
            self.coverage.tie([name, f"{name} (head)"])
            self.hooks.tied.tie([index, head])
        return head

    def refuse(self, index: int, why: str) -> None:
        """Leaves embedding `index` (and its head) out at the next flush of refusals (never inside the forward or
        backward pass)."""
        self.hooks.shared.refuse_later(self.coverage.layers[index][0], why)
