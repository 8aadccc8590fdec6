"""Per-sample norms of a table tied across layers: embeddings (an Embedding rule's layers) and at most one Linear head
whose weight W [V, d] is their table (a language model's tie_word_embeddings; T5's encoder and decoder embeddings).

Sample i's gradient of W is the sum of its layers' parts: E_a,i per embedding a (row ids_t gets e_t), H_i = Σ_t g_t a_tᵀ
the head's. Its squared norm is each part's own square (each layer's rule gives it) plus twice every pair's dot:
<E_a, H> = Σ_t' e_t' · H[ids_t'] = Σ_t' Σ_t g_t[ids_t'] (a_t · e_t'), the head's gradient read only at the rows the
sample's ids name ([B, T', d]; no [V, d] product is formed); <E_a, E_b> = Σ over positions with equal ids of
e_a,t · e_b,s. Whichever layers' backward comes first leave what the later ones need in the micro-batch (the head
its rows at each pending embedding's ids, an embedding its ids and row gradients).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .rules import EmbeddingRule


def head_rows(ids: torch.Tensor, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """[B, T', d]: H_i[ids_it'] = Σ_t g_it[ids_it'] a_it for ids [B, T'], a [B, T, d], g [B, T, V] (g's dtype)."""
    b, t = g.shape[0], g.shape[1]
    picked = torch.gather(g, 2, ids.long().unsqueeze(1).expand(b, t, ids.shape[1]))  # [B, T, T']: g_it[ids_it']
    return picked.transpose(1, 2) @ a.to(g.dtype)


def cross_term(embedding_rows: torch.Tensor, at_ids: torch.Tensor) -> torch.Tensor:
    """[B] 2<E_i, H_i> from the embedding's row gradients e [B, T', d] and head_rows at the same ids."""
    return 2 * (embedding_rows.to(at_ids.dtype) * at_ids).sum((1, 2))


def embedding_dots(ids1: torch.Tensor, rows1: torch.Tensor, ids2: torch.Tensor, rows2: torch.Tensor) -> torch.Tensor:
    """[B] <E1_i, E2_i> of two embeddings of one table: Σ over positions t, s with ids1_t == ids2_s of rows1_t · rows2_s."""
    same = ids1.unsqueeze(2) == ids2.unsqueeze(1)  # [B, T1, T2]
    return (same * (rows1 @ rows2.to(rows1.dtype).transpose(1, 2))).sum((1, 2))


class TiedTables:
    """The tie groups among the covered `layers` ((name, module, rule) each; `ties`: a member's name -> the others')
    and the cross terms of their per-sample gradients, added by each member as it finishes."""

    def __init__(self, layers: list[tuple[str, nn.Module, Any]], ties: dict[str, tuple[str, ...]]):
        self.layers = layers
        index_of = {name: i for i, (name, _, _) in enumerate(layers)}
        self.members: dict[int, tuple[int, ...]] = {}  # layer index -> every member's index (the group's key)
        for name, others in ties.items():
            if name in index_of and all(o in index_of for o in others):
                self.members[index_of[name]] = tuple(sorted(index_of[n] for n in (name, *others)))

    def tie(self, indices: list[int]) -> None:
        """Layers found at run time to share one table (an embedding and its table used as a head: functional_head)."""
        group = tuple(sorted(indices))
        for index in group:
            self.members[index] = group

    def __contains__(self, index: int) -> bool:
        return index in self.members

    def cross(self, index: int, mb: Any, pos: tuple, calls: Any, acc: torch.dtype) -> torch.Tensor | float:
        """Twice the dots of layer `index`'s per-sample gradients (positions `pos` of its `calls` that got a gradient)
        with those of the members that finished before it; leaves in mb.tied what later members need."""
        members = self.members[index]
        _, module, rule = self.layers[index]
        if not module.weight.requires_grad:  # frozen: the tie adds nothing
            return 0.0
        state = mb.tied.setdefault(members, {"rows": {}, "at_ids": {}})
        out: torch.Tensor | float = 0.0
        if isinstance(rule, EmbeddingRule):
            ids, g = pos
            rows = rule.row_gradients(module, ids, g.to(acc))
            waiting = state["at_ids"].pop(index, None)
            if waiting is not None:  # the head's rows at every call's ids; this pass has the calls with a gradient
                at_ids, lengths = waiting
                kept = [seg for seg, grad in zip(at_ids.split(lengths, dim=1), calls.grads) if grad is not None]
                out = out + cross_term(rows, torch.cat(kept, dim=1))
            for ids2, rows2 in state["rows"].values():
                out = out + 2 * embedding_dots(ids, rows, ids2, rows2)
            state["rows"][index] = (ids, rows)
            return out
        a, g = pos  # the head
        g = g.to(acc)
        for other in members:
            if other == index:
                continue
            done = state["rows"].get(other)
            if done is not None:  # an embedding that finished first
                out = out + cross_term(done[1], head_rows(done[0], a, g))
                continue
            pending = mb.layers.get(other)  # its calls, waiting for their gradients
            if pending is not None:
                b = g.shape[0]
                ids = [call.arg(0, "input").reshape(b, -1) for call in pending.calls]
                state["at_ids"][other] = (head_rows(torch.cat(ids, dim=1), a, g), [i.shape[1] for i in ids])
        return out
