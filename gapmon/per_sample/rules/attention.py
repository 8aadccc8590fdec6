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
    Then each projection is a Linear product: the q, k and v weights (rows of in_proj_weight, or
    q/k/v_proj_weight with kdim/vdim) by ghost/direct form against the query/key/value inputs,
    out_proj against c, biases as sums over positions. The rows of q, k and v are disjoint, so their
    squared norms add. add_bias_kv appends bias_k and bias_v to every sample's keys and values: a sample's
    gradient of each is that of its appended row. add_zero_attn appends a zero key and value (no parameter)."""

    owns_submodules = True
    param_names = None

    def not_per_sample(self, module, call, output, batch, model_inputs):
        q = call.arg(0, "query")
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            return "its query is unbatched"
        dim = 0 if module.batch_first else 1
        if q.shape[dim] != batch:
            return f"its query {list(q.shape)} has no batch dim of size {batch}"
        if module.training and module.dropout > 0:
            return f"attention dropout {module.dropout} in training mode (the recomputed attention would draw another mask)"
        return None

    def batch_operands(self, module, call):
        dim = 0 if module.batch_first else 1
        return [(call.arg(i, n), dim) for i, n in enumerate(("query", "key", "value"))]

    @staticmethod
    def _projections(module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The (weight, bias) of the q, k and v projections: rows of the packed in_proj_weight, or the separate
        q/k/v_proj_weight (kdim/vdim); the bias is always three slices of in_proj_bias."""
        e, bias = module.embed_dim, module.in_proj_bias
        slices = [None if bias is None else bias[i * e:(i + 1) * e] for i in range(3)]
        if _torch_compat.mha_same_embed_dim(module):
            w = module.in_proj_weight
            return [(w[i * e:(i + 1) * e], slices[i]) for i in range(3)]
        return list(zip((module.q_proj_weight, module.k_proj_weight, module.v_proj_weight), slices))

    def positions(self, module, call, g, acc):
        query, key, value = call.arg(0, "query"), call.arg(1, "key"), call.arg(2, "value")
        key_padding_mask, need_weights = call.arg(3, "key_padding_mask"), call.arg(4, "need_weights", True)
        attn_mask, is_causal = call.arg(5, "attn_mask"), call.arg(7, "is_causal", False)
        if not module.batch_first:  # [T, B, E] -> [B, T, E]; the output gradient comes batch-first too
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
            g = g.transpose(0, 1)
        x = [t.to(acc) for t in (query, key, value)]
        e, h = module.embed_dim, module.num_heads
        with torch.enable_grad():
            proj = [F.linear(x[i], w.detach().to(acc), None if bias is None else bias.detach().to(acc)).requires_grad_()
                    for i, (w, bias) in enumerate(self._projections(module))]
            b, t = proj[0].shape[0], proj[0].shape[1]
            keys, values, appended = proj[1], proj[2], []
            if module.bias_k is not None:  # each sample's own copy of the appended row: its gradient is the sample's
                appended = [p.detach().to(acc).reshape(1, 1, e).expand(b, 1, e).clone().requires_grad_()
                            for p in (module.bias_k, module.bias_v)]
                keys, values = torch.cat((keys, appended[0]), 1), torch.cat((values, appended[1]), 1)
            if module.add_zero_attn:
                keys, values = (torch.cat((y, y.new_zeros(b, 1, e)), 1) for y in (keys, values))
            s, extra = keys.shape[1], keys.shape[1] - proj[1].shape[1]
            heads = [y.reshape(b, y.shape[1], h, e // h).transpose(1, 2) for y in (proj[0], keys, values)]
            if is_causal and key_padding_mask is None and not need_weights:  # torch's SDPA hint path: causal
                attn_mask = torch.ones(t, s, dtype=torch.bool, device=query.device).triu(1)
                extra = 0
            mask = _attention_mask(key_padding_mask, attn_mask, b, h, t, s, extra, acc, query.device)
            ctx = F.scaled_dot_product_attention(*heads, attn_mask=mask).transpose(1, 2).reshape(b, t, e)
            g = g.to(acc)
            g_ctx = g.matmul(module.out_proj.weight.detach().to(acc))  # out = ctx W_oᵀ + b_o
            grads = torch.autograd.grad(ctx, proj + appended, g_ctx, allow_unused=True)
        grads = [torch.zeros_like(y) if d is None else d for y, d in zip(proj + appended, grads)]
        return (*x, *grads[:3], ctx.detach(), g, *grads[3:])

    def norm_sq(self, module, pos):
        xq, xk, xv, gq, gk, gv, ctx, g = pos[:8]
        # (The weights only say which parameters train: in_proj_weight for all three when packed.)
        weights = ((module.in_proj_weight,) * 3 if _torch_compat.mha_same_embed_dim(module)
                   else (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight))
        terms = [t for (a, gr), w in zip(((xq, gq), (xk, gk), (xv, gv)), weights)
                 for t in weight_and_bias_terms(a, gr, w, module.in_proj_bias)]
        terms += weight_and_bias_terms(ctx, g, module.out_proj.weight, module.out_proj.bias)
        for param, grad in zip((module.bias_k, module.bias_v), pos[8:]):  # [B, 1, E] per sample
            if trainable(param):
                terms.append(grad.square().sum((1, 2)))
        return sum_of_terms(terms, g.shape[0], g.dtype, g.device)

    def grad_sketch(self, module, pos, probe):
        xq, xk, xv, gq, gk, gv, ctx, g = pos[:8]
        out = []
        if _torch_compat.mha_same_embed_dim(module):
            w = module.in_proj_weight
            if trainable(w):  # rows [q; k; v]
                r = probe(w)
                out.append(Sketch(w, torch.cat([product_sketch(x, gx, r) for x, gx in ((xq, gq), (xk, gk), (xv, gv))])))
        else:
            for (x, gx), (w, _) in zip(((xq, gq), (xk, gk), (xv, gv)), self._projections(module)):
                if trainable(w):
                    out.append(Sketch(w, product_sketch(x, gx, probe(w))))
        bias = module.in_proj_bias
        if trainable(bias):
            out.append(Sketch(bias, sketch(torch.cat([gx.sum((0, 1)) for gx in (gq, gk, gv)]), probe(bias))))
        for param, grad in zip((module.bias_k, module.bias_v), pos[8:]):
            if trainable(param):
                out.append(Sketch(param, sketch(grad.sum(0), probe(param))))
        return out + weight_and_bias_sketches(ctx, g, module.out_proj.weight, module.out_proj.bias, probe)


def _attention_mask(key_padding_mask, attn_mask, b, h, t, s, extra, dtype, device):
    """nn.MultiheadAttention's masks (True = masked out, or additive floats) as one additive SDPA mask over s keys, of
    which the last `extra` (add_bias_kv's and add_zero_attn's) were appended after the masks were given: torch pads
    the masks with columns that mask nothing there."""
    if attn_mask is None and key_padding_mask is None:
        return None
    mask = torch.zeros(b, h, t, s, dtype=dtype, device=device)
    for m, shape in ((attn_mask, None), (key_padding_mask, (b, 1, 1, s - extra))):
        if m is None:
            continue
        add = torch.zeros_like(m, dtype=dtype).masked_fill(m, float("-inf")) if m.dtype == torch.bool else m.to(dtype)
        if shape is not None:
            add = add.reshape(shape)
        elif add.dim() == 3:  # [B·heads, T, S]
            add = add.reshape(b, h, t, s - extra)
        mask[..., :s - extra] += add
    return mask
