"""A table looked up by ids no sample's data flows into: BART's learned positions (`arange(T).expand(B, -1)`, or
position ids [1, T]), OPT's (`cumsum` of the all-ones mask the model makes when none is given), Whisper's decoder's
(`self.weight[position_ids]`, its ids repeated over the batch).

Ids with a row per sample (dim 0 of the batch's size) hold each sample's own: a run of that sample alone builds that
one row. Ids without one are every sample's. So where the lookup's output is added to a tensor batched on the dim its
rows sit on, or broadcast over that batch (`inputs_embeds + positions`), sample b's gradient of the table is its rows
of the sum's gradient, summed by id (free_parameters.TableRows: never formed whole). Copies and casts of the output
stay followed; any other use of it leaves the parameter out, named.
"""
from __future__ import annotations

import torch


class ModeByFirstUse:
    """An output whose ids hold a row per sample may be each sample's own rows or every sample's (positions [T] with T
    equal to the batch's size): the first use says which (`mode` "rows" or "broadcast"), a use the other way escapes.
    For RowLookup and shared_input.SharedCall, which define `mode` and `on_escape`."""

    mode: str | None

    def on_escape(self, what: str) -> None:
        raise NotImplementedError

    def _used_as(self, mode: str) -> bool:
        """Notes a use as `mode`; False (escaped) after a use the other way."""
        if self.mode not in (None, mode):
            self.on_escape("uses as each sample's own rows and as every sample's")
            return False
        self.mode = mode
        return True


class RowLookup(ModeByFirstUse):
    """The output of `F.embedding(ids, t)` (or `t[ids]`), t a free parameter's Piece, ids no sample's data flows into
    (batch_provenance.Shared)."""

    def __init__(self, piece, ids: torch.Tensor, padding: int):
        self.piece, self.padding, self.ids = piece, padding, ids.detach()
        # ids of a row per sample (on the output's dim 0) may be each sample's own or every sample's (positions [T] with
        # T equal to the batch's size): the first use says which ("rows" or "broadcast"), a use the other way escapes
        self.rows = ids.dim() >= 1 and ids.shape[0] == piece.uses.batch
        self.mode: str | None = None

    def on_escape(self, what: str) -> None:
        self.piece.on_escape(what)

    def copied(self, out: torch.Tensor) -> "RowLookup":
        """A copy or cast of the output (its gradient comes back in out's dtype: add_table_rows notes the rounding)."""
        return self

    def on_add(self, total: torch.Tensor, t: torch.Tensor, dim: int, sign: int, inner: int = 1) -> None:
        """t (the output, or a copy) added (sign 1) or subtracted (-1) to a tensor batched on `dim`, giving `total`: t's
        rows on the batch's dim (ids per sample), or broadcast over it (ids every sample's), its other dims whole."""
        lead = total.dim() - t.dim()
        trailing = tuple(total.shape[lead:])
        if self.rows and dim == lead and trailing == tuple(t.shape):
            mode = "rows"
        elif dim < lead and trailing == tuple(t.shape) or (
                dim == lead and t.shape[0] == 1 and trailing[1:] == tuple(t.shape[1:])):
            mode = "broadcast"
        else:
            mode = None
        if inner != 1 or mode is None:
            self.on_escape("an add that neither puts each of its rows on its sample's nor broadcasts it over the batch")
            return
        if not self._used_as(mode):
            return
        if not total.requires_grad:  # a forward pass without grad (reentrant checkpointing): the use check decides
            return
        batch, padding, piece = self.piece.uses.batch, self.padding, self.piece
        ids = self.ids.reshape(batch, -1) if mode == "rows" else self.ids.reshape(1, -1).expand(batch, -1)
        summed = tuple(k for k in range(max(lead, dim + 1)) if k != dim)  # the dims t was broadcast along, but the batch's

        def hook(g: torch.Tensor) -> None:
            piece.add_table_rows(ids, (g.sum(summed, keepdim=True) if summed else g).movedim(dim, 0), padding, sign)

        total.register_hook(hook)
