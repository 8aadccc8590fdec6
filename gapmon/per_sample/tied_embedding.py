"""Per-sample norms of a tied input embedding and output head: an nn.Embedding's table used as an nn.Linear's weight
W [V, d] (a language model's tie_word_embeddings).

Sample i's gradient of W is E_i + H_i: E_i the embedding's (row ids_t' gets e_t'), H_i = Σ_t g_t a_tᵀ the head's. So
||E_i + H_i||² = ||E_i||² + ||H_i||² + 2<E_i, H_i>: each layer's rule gives its own square, and
<E_i, H_i> = Σ_t' e_t' · H_i[ids_t'] = Σ_t' Σ_t g_t[ids_t'] (a_t · e_t'): the head's gradient read only at the rows the
sample's ids name ([B, T', d]; no [V, d] product is formed). Whichever layer's backward comes first leaves what the
other needs (the head its rows at the ids, [B, T', d]; the embedding its row gradients and ids).
"""
from __future__ import annotations

import torch


def head_rows(ids: torch.Tensor, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """[B, T', d]: H_i[ids_it'] = Σ_t g_it[ids_it'] a_it for ids [B, T'], a [B, T, d], g [B, T, V] (g's dtype)."""
    b, t = g.shape[0], g.shape[1]
    picked = torch.gather(g, 2, ids.long().unsqueeze(1).expand(b, t, ids.shape[1]))  # [B, T, T']: g_it[ids_it']
    return picked.transpose(1, 2) @ a.to(g.dtype)


def cross_term(embedding_rows: torch.Tensor, at_ids: torch.Tensor) -> torch.Tensor:
    """[B] 2<E_i, H_i> from the embedding's row gradients e [B, T', d] and head_rows at the same ids."""
    return 2 * (embedding_rows.to(at_ids.dtype) * at_ids).sum((1, 2))
