"""Per-sample norms of nn.Embedding and nn.EmbeddingBag: per-position gradients paired by equal id
(padding_idx excluded; scale_grad_by_freq and bag weights as coefficients).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...stats import _backend
from .base import NormRule, Sketch, register_norm_rule, register_norm_rule_by_name, trainable


def _ids_sketch(ids: torch.Tensor, g: torch.Tensor, r: torch.Tensor, rows: int,
                scale: torch.Tensor | None = None) -> torch.Tensor:
    """sketch of an embedding table's gradient: row ids[t] gets g_t (times scale[t])."""
    ids = ids.reshape(-1)
    vals = g.reshape(ids.shape[0], -1).to(r.dtype) @ r
    if scale is not None:
        vals = vals * scale
    return torch.zeros(rows, dtype=r.dtype, device=vals.device).index_add_(0, ids, vals).double()


def _rows_per_sample(ids: torch.Tensor, g: torch.Tensor, rows: int) -> torch.Tensor:
    """[B, rows, dim] float64: each sample's table gradient, row ids[b, t] getting g[b, t]."""
    b, dim = ids.shape[0], g.shape[-1]
    flat = (ids.reshape(b, -1) + rows * torch.arange(b, device=ids.device)[:, None]).reshape(-1)
    return torch.zeros(b * rows, dim, dtype=torch.float64, device=g.device).index_add_(
        0, flat, g.reshape(-1, dim).double()).reshape(b, rows, dim)


def _repeats(ids: torch.Tensor, table: torch.Tensor) -> int:
    """How often the most frequent id occurs, where a 16-bit table's gradient rounds each add (one
    host read); 1 otherwise."""
    if table.dtype not in (torch.float16, torch.bfloat16) or not ids.numel():
        return 1
    return int(torch.unique(ids.reshape(-1), return_counts=True)[1].max())


# -------------------------------------------------------------------- embeddings
@register_norm_rule(nn.Embedding)
class EmbeddingRule(NormRule):
    param_names = ("weight",)
    moves_batch = True
    # Ids every sample shares (position ids [1, T]) are followed to where the output joins the batch (shared_input).
    reads_shared_ids = True

    def positions(self, module, call, g, acc):
        b = g.shape[0]
        ids = call.arg(0, "input").reshape(b, -1)
        g = g.to(acc).reshape(b, ids.shape[1], -1)
        return ids, g

    def gram_block(self, module, pa, pb, budget: int = 1 << 24):
        """Σ over positions t of sample i and s of sample j with the same id (not the padding id) of g_it·g_js,
        each g divided by its id's count in its own sample under scale_grad_by_freq."""
        (ids1, g1), (ids2, g2) = pa, pb
        out = torch.zeros(g1.shape[0], g2.shape[0], dtype=torch.float64, device=g1.device)
        if not trainable(module.weight) or out.numel() == 0:
            return out
        g1, g2 = self._scaled(module, ids1, g1.double()), self._scaled(module, ids2, g2.double())
        padding = -1 if module.padding_idx is None else module.padding_idx
        g1 = g1 * (ids1 != padding).unsqueeze(2)
        chunk = max(1, budget // max(1, ids1.shape[1] * ids2.numel()))
        for s in range(0, g1.shape[0], chunk):
            same = ids1[s:s + chunk, :, None, None] == ids2[None, None]  # [c, T1, B2, T2]
            dots = torch.einsum("itp,jsp->itjs", g1[s:s + chunk], g2)
            out[s:s + chunk] = (dots * same).sum((1, 3))
        return out

    def per_sample_grads(self, module, pos, batch):
        ids, g = pos
        if not trainable(module.weight):
            return []
        return [(module.weight, _rows_per_sample(ids, self.row_gradients(module, ids, g.double()), module.num_embeddings))]

    def row_gradients(self, module, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """[B, T, dim]: what each position adds to row ids[b, t] of sample b's table gradient (g divided by the id's
        count in its sample under scale_grad_by_freq, zero at the padding id)."""
        g = self._scaled(module, ids, g)
        if module.padding_idx is not None:
            g = g * (ids != module.padding_idx % module.num_embeddings).unsqueeze(2)
        return g

    @staticmethod
    def _scaled(module, ids, g):
        if not module.scale_grad_by_freq:
            return g
        counts = (ids.unsqueeze(2) == ids.unsqueeze(1)).sum(2)
        return g / counts.unsqueeze(2).to(g.dtype)

    def norm_sq(self, module, pos):
        ids, g = pos
        if not trainable(module.weight):
            return torch.zeros(g.shape[0], dtype=g.dtype, device=g.device)
        if module.scale_grad_by_freq:
            # Each position's gradient is divided by how often its id occurs in the sample.
            counts = (ids.unsqueeze(2) == ids.unsqueeze(1)).sum(2)
            g = g / counts.unsqueeze(2).to(g.dtype)
        padding = -1 if module.padding_idx is None else module.padding_idx
        return _backend.embedding_norm_sq(ids, g, padding)

    def grad_sketch(self, module, pos, probe):
        if not trainable(module.weight):
            return []
        ids, g = pos
        flat = ids.reshape(-1)
        scale = torch.ones(flat.shape, dtype=torch.float64, device=g.device)
        if module.padding_idx is not None:  # autograd leaves the padding row's gradient alone
            scale = scale.masked_fill(flat == module.padding_idx % module.num_embeddings, 0.0)
        if module.scale_grad_by_freq:  # autograd divides by the id's count in the whole call, not per sample
            scale = scale / torch.bincount(flat, minlength=module.num_embeddings)[flat].double()
        r = probe(module.weight)
        return [Sketch(module.weight, _ids_sketch(flat, g, r, module.num_embeddings, scale.to(r.dtype)), _repeats(flat, module.weight))]


@register_norm_rule_by_name("transformers.models.gemma.modeling_gemma.GemmaTextScaledWordEmbedding",
                            "transformers.models.gemma2.modeling_gemma2.Gemma2TextScaledWordEmbedding",
                            "transformers.models.gemma3.modeling_gemma3.Gemma3TextScaledWordEmbedding")
class ScaledEmbeddingRule(EmbeddingRule):
    """Gemma's embedding: `Embedding.forward(ids) * embed_scale.to(weight.dtype)`. A row's gradient is the output
    gradient times the scale (in the table's dtype, as autograd forms it)."""

    def unsupported(self, module):
        scale = getattr(module, "embed_scale", None)
        if not isinstance(scale, (torch.Tensor, float, int)) or (isinstance(scale, torch.Tensor) and scale.numel() != 1):
            return "it has no scalar embed_scale"
        return None

    def positions(self, module, call, g, acc):
        scale = torch.as_tensor(module.embed_scale, device=g.device).to(module.weight.dtype)
        return super().positions(module, call, g * scale, acc)


_SCALED_BY_A_NUMBER = ("bart.modeling_bart.BartScaledWordEmbedding",
                       "bigbird_pegasus.modeling_bigbird_pegasus.BigBirdPegasusScaledWordEmbedding",
                       "biogpt.modeling_biogpt.BioGptScaledWordEmbedding",
                       "blenderbot.modeling_blenderbot.BlenderbotScaledWordEmbedding",
                       "m2m_100.modeling_m2m_100.M2M100ScaledWordEmbedding", "mbart.modeling_mbart.MBartScaledWordEmbedding",
                       "nllb_moe.modeling_nllb_moe.NllbMoeScaledWordEmbedding",
                       "pegasus_x.modeling_pegasus_x.PegasusXScaledWordEmbedding",
                       "plbart.modeling_plbart.PLBartScaledWordEmbedding",
                       "seamless_m4t.modeling_seamless_m4t.SeamlessM4TScaledWordEmbedding",
                       "seamless_m4t_v2.modeling_seamless_m4t_v2.SeamlessM4Tv2ScaledWordEmbedding",
                       "trocr.modeling_trocr.TrOCRScaledWordEmbedding", "xglm.modeling_xglm.XGLMScaledWordEmbedding")


@register_norm_rule_by_name(*(f"transformers.models.{name}" for name in _SCALED_BY_A_NUMBER))
class NumberScaledEmbeddingRule(ScaledEmbeddingRule):
    """BART's embedding and its descendants': `Embedding.forward(ids) * embed_scale`, a Python number (1.0 unless the
    config scales embeddings). A row's gradient is the output gradient times that number, as autograd multiplies it."""

    def unsupported(self, module):
        if not isinstance(getattr(module, "embed_scale", None), (float, int)):
            return "its embed_scale is not a number"
        return None

    def positions(self, module, call, g, acc):
        return EmbeddingRule.positions(self, module, call, g * module.embed_scale, acc)


# -------------------------------------------------------------------- bags
@register_norm_rule(nn.EmbeddingBag)
class EmbeddingBagRule(NormRule):
    """Sample b's bag adds c_t·g_b to row id_t for each entry t of the bag (c_t: its per-sample weight
    in "sum" mode, 1 / the bag's size in "mean" mode; 0 for padding_idx). As positions: ids [B, L] and
    per-entry gradients c_t·g_b, which the Embedding product then pairs by equal id."""

    param_names = ("weight",)

    def unsupported(self, module):
        if module.mode == "max":
            return "mode='max' (its gradient follows the arg max of each dimension)"
        if module.scale_grad_by_freq:
            # On torch 2.13 CPU the scaled gradient of a row is not 1 / its own count in the bag
            # ([1, 2, 2, 5, 2]: row 5 gets g / 3), so no per-id rule reproduces it.
            return "scale_grad_by_freq=True (its gradient follows no per-id frequency rule here)"
        return None

    def batch_operands(self, module, call):
        ids = call.arg(0, "input")  # 1-D ids with offsets: one bag per sample, the ids from the batch
        return [(ids, 0 if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None)]

    def not_per_sample(self, module, call, output, batch, model_inputs):
        ids = call.arg(0, "input")
        if not isinstance(ids, torch.Tensor) or ids.dim() not in (1, 2):
            return "its input is not a 1-D or 2-D tensor of ids"
        if output.dim() != 2 or output.shape[0] != batch:
            return f"it makes {output.shape[0] if output.dim() else 0} bags for a batch of {batch}"
        return None

    def positions(self, module, call, g, acc):
        ids, offsets = call.arg(0, "input"), call.arg(1, "offsets")
        weights = call.arg(2, "per_sample_weights")
        if ids.dim() == 1:  # bags are segments of ids, starting at offsets
            n = ids.shape[0]
            starts = offsets[:-1] if module.include_last_offset else offsets
            ends = offsets[1:] if module.include_last_offset else torch.cat((offsets[1:], offsets.new_tensor([n])))
            width = int((ends - starts).max()) if starts.numel() else 0
            index = starts.unsqueeze(1) + torch.arange(width, device=ids.device)
            valid = index < ends.unsqueeze(1)
            index = index.clamp(max=max(n - 1, 0))
            ids = ids[index] if n else ids.new_zeros(index.shape)
            weights = weights[index] if weights is not None else None
        else:
            valid = torch.ones_like(ids, dtype=torch.bool)
        if module.padding_idx is not None:
            valid &= ids != module.padding_idx
        coef = valid.to(acc) if weights is None else weights.to(acc) * valid
        if module.mode == "mean":
            coef = coef / valid.sum(1, keepdim=True).clamp(min=1).to(acc)
        return ids.masked_fill(~valid, 0), g.to(acc).unsqueeze(1) * coef.unsqueeze(2)

    def norm_sq(self, module, pos):
        ids, g = pos
        if not trainable(module.weight):
            return torch.zeros(g.shape[0], dtype=g.dtype, device=g.device)
        return _backend.embedding_norm_sq(ids, g, -1)  # padding entries already have zero coefficients

    def per_sample_grads(self, module, pos, batch):
        ids, g = pos
        return [(module.weight, _rows_per_sample(ids, g, module.num_embeddings))] if trainable(module.weight) else []

    def grad_sketch(self, module, pos, probe):
        if not trainable(module.weight):
            return []
        ids, g = pos
        return [Sketch(module.weight, _ids_sketch(ids, g, probe(module.weight), module.num_embeddings), _repeats(ids, module.weight))]
