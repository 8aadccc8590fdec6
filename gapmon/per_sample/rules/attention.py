"""Per-sample norms of nn.MultiheadAttention: its projections as Linear products, from a recomputed
attention.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ... import _torch_compat
from .base import NormRule, Sketch, register_norm_rule, sketch, sum_of_terms, trainable
from .linear import product_sketch, weight_and_bias_sketches, weight_and_bias_terms


# -------------------------------------------------------------------- attention
@register_norm_rule(nn.MultiheadAttention)
class MultiheadAttentionRule(NormRule):
    """nn.MultiheadAttention reads its in/out projection weights directly (out_proj's forward never
    runs), so the rule recomputes the attention from the call's inputs with explicit projection
    outputs q, k, v and context c, and takes their gradients for the output gradient G by autograd.
    Then each projection is a Linear product: in_proj rows [q; k; v] by ghost/direct form against
    the query/key/value inputs, out_proj against c, biases as sums over positions. The in_proj
    rows of q, k and v are disjoint, so their squared norms add."""

    owns_submodules = True
    param_names = None

    def unsupported(self, module):
        if not _torch_compat.mha_same_embed_dim(module):
            return "separate kdim/vdim projections"
        if module.bias_k is not None or module.add_zero_attn:
            return "add_bias_kv / add_zero_attn"
        if module.dropout > 0:
            return f"attention dropout {module.dropout} (the recomputed attention would draw another mask)"
        return None

    def batch_operands(self, module, call):
        dim = 0 if module.batch_first else 1
        return [(call.arg(i, n), dim) for i, n in enumerate(("query", "key", "value"))]

    def not_per_sample(self, module, call, output, batch, model_inputs):
        q = call.arg(0, "query")
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            return "its query is unbatched"
        dim = 0 if module.batch_first else 1
        if q.shape[dim] != batch:
            return f"its query {list(q.shape)} has no batch dim of size {batch}"
        return None

    def positions(self, module, call, g, acc):
        query, key, value = call.arg(0, "query"), call.arg(1, "key"), call.arg(2, "value")
        key_padding_mask, attn_mask = call.arg(3, "key_padding_mask"), call.arg(5, "attn_mask")
        is_causal = call.arg(7, "is_causal", False)
        if not module.batch_first:  # [T, B, E] -> [B, T, E]; the output gradient comes batch-first too
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
            g = g.transpose(0, 1)
        x = [t.to(acc) for t in (query, key, value)]
        e, h = module.embed_dim, module.num_heads
        w = module.in_proj_weight.detach().to(acc)
        bias = module.in_proj_bias.detach().to(acc) if module.in_proj_bias is not None else None
        with torch.enable_grad():
            proj = [F.linear(x[i], w[i * e:(i + 1) * e], None if bias is None else bias[i * e:(i + 1) * e])
                    .requires_grad_() for i in range(3)]
            b, t, s = proj[0].shape[0], proj[0].shape[1], proj[1].shape[1]
            heads = [p.reshape(b, p.shape[1], h, e // h).transpose(1, 2) for p in proj]
            mask = _attention_mask(key_padding_mask, attn_mask, is_causal, b, h, t, s, acc, query.device)
            ctx = F.scaled_dot_product_attention(*heads, attn_mask=mask).transpose(1, 2).reshape(b, t, e)
            g = g.to(acc)
            g_ctx = g.matmul(module.out_proj.weight.detach().to(acc))  # out = ctx W_oᵀ + b_o
            g_proj = torch.autograd.grad(ctx, proj, g_ctx)
        return (*x, *g_proj, ctx.detach(), g)

    def norm_sq(self, module, pos):
        xq, xk, xv, gq, gk, gv, ctx, g = pos
        w, bias, w_out, b_out = module.in_proj_weight, module.in_proj_bias, module.out_proj.weight, module.out_proj.bias
        terms = [t for a, gr in ((xq, gq), (xk, gk), (xv, gv)) for t in weight_and_bias_terms(a, gr, w, bias)]
        terms += weight_and_bias_terms(ctx, g, w_out, b_out)
        return sum_of_terms(terms, g.shape[0], g.dtype, g.device)

    def grad_sketch(self, module, pos, probe):
        xq, xk, xv, gq, gk, gv, ctx, g = pos
        out = []
        w, bias, w_out, b_out = module.in_proj_weight, module.in_proj_bias, module.out_proj.weight, module.out_proj.bias
        if trainable(w):  # rows [q; k; v]
            r = probe(w)
            out.append(Sketch(w, torch.cat([product_sketch(x, gx, r) for x, gx in ((xq, gq), (xk, gk), (xv, gv))])))
        if trainable(bias):
            out.append(Sketch(bias, sketch(torch.cat([gx.sum((0, 1)) for gx in (gq, gk, gv)]), probe(bias))))
        return out + weight_and_bias_sketches(ctx, g, w_out, b_out, probe)


def _attention_mask(key_padding_mask, attn_mask, is_causal, b, h, t, s, dtype, device):
    """nn.MultiheadAttention's masks (True = masked out, or additive floats) as one additive SDPA mask."""
    if attn_mask is None and key_padding_mask is None and not is_causal:
        return None
    mask = torch.zeros(b, h, t, s, dtype=dtype, device=device)
    if is_causal and attn_mask is None:
        attn_mask = torch.ones(t, s, dtype=torch.bool, device=device).triu(1)
    for m, shape in ((attn_mask, None), (key_padding_mask, (b, 1, 1, s))):
        if m is None:
            continue
        add = torch.zeros_like(m, dtype=dtype).masked_fill(m, float("-inf")) if m.dtype == torch.bool else m.to(dtype)
        if shape is not None:
            add = add.reshape(shape)
        elif add.dim() == 3:  # [B·heads, T, S]
            add = add.reshape(b, h, t, s)
        mask = mask + add
    return mask
