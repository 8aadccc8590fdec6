"""Per-sample norms of nn.Linear, and the Linear-like products other rules reuse: the ghost norm
sum((A Aᵀ) ⊙ (G Gᵀ)) or the direct ||Gᵀ A||², whichever costs less (FLOPs and stored elements). The Linear rule also
owns book-keeping (gapmon.per_sample.bookkeeping): whether a call forms its weight gradient from
its per-sample gradients.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...stats import _backend
from .. import bookkeeping
from .base import NormRule, Sketch, bias_norm_sq, operand, register_norm_rule, register_norm_rule_by_name, sketch, sum_of_terms, trainable


def product_sketch(a: torch.Tensor, g: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """sketch(Σ_{b,t} g_bt a_btᵀ, r) = Gᵀ(A r) for a [..., d], g [..., p]: no [p, d] product formed (r's dtype)."""
    return _backend.linear_grad_sketch(a, g, r)[0]


# -------------------------------------------------------------------- Linear-like products
# What storing and reading back one element costs, in multiply-adds: the direct form writes each sample's [p, d]
# gradient and reads it again for its sum of squares; the ghost form two [T, T] Grams. Measured on the 2-core
# AVX-512 VM (B=8, T=128, d=128, p=4096, equal FLOPs: ghost 5.5 ms, direct 6.8 ms; d=128, p=128..512: the
# direct form stays faster, as this cost says); an fp32 GPU's FLOPs per byte of bandwidth give the same order.
# On the CPU the direct form now reads its gradients back a cache-sized tile at a time; re-measured then (ghost
# 5.4 ms, direct 6.7 ms for the head; T=512 and the smaller layers still direct), the choices stand.
_STORED_ELEMENT_COST = 30


def use_ghost(t: int, d: int, p: int) -> bool:
    """Ghost norm (Grams: T²·(d+p) multiply-adds and 2·T² stored elements per sample) when it is cheaper than the
    direct form (T·d·p multiply-adds and d·p stored elements). Both are exact; this only picks the faster."""
    return t * t * (d + p) + 2 * _STORED_ELEMENT_COST * t * t < t * d * p + _STORED_ELEMENT_COST * d * p


def ghost_in_flops(t: int, d: int, p: int) -> bool:
    """Whether the ghost form needs fewer FLOPs than the direct one: book-keeping's choice (a book-kept call forms
    its per-sample gradients in place of autograd's weight-gradient GEMM, so its stored elements are paid anyway)."""
    return t * (d + p) < d * p


def _ghost(a: torch.Tensor, g: torch.Tensor, bias: bool = False) -> torch.Tensor:
    return _backend.ghost_norm_sq(a, g, bias)


def _direct(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return _backend.direct_norm_sq(a, g)


def _direct_and_grad(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _backend.direct_norm_sq_and_grad(a, g)


def direct_form(t: int, d: int, p: int) -> bool:
    """Whether a product of T positions takes the direct form (T > 1 and not cheaper as ghost Grams)."""
    return t > 1 and not use_ghost(t, d, p)


def product_norm_sq(a: torch.Tensor, g: torch.Tensor, bias: bool = False) -> torch.Tensor:
    """||Σ_t g_t a_tᵀ||²_F per sample for a [B, T, d] and g [B, T, p]; `bias`: plus ||Σ_t g_t||², the bias's (in the
    ghost form one Gram op, not a reduction of g of its own)."""
    t, d, p = a.shape[1], a.shape[2], g.shape[2]
    if t == 1:
        a, g = a.to(_backend.product_dtype(a)), g.to(_backend.product_dtype(g))
        a_sq = a.square().sum((1, 2))
        return (a_sq + 1 if bias else a_sq) * g.square().sum((1, 2))
    if not direct_form(t, d, p):
        return _ghost(a, g, bias)
    return _direct(a, g) + bias_norm_sq(g) if bias else _direct(a, g)


def weight_and_bias_terms(a: torch.Tensor, g: torch.Tensor, weight: torch.Tensor | None,
                          bias: torch.Tensor | None) -> list[torch.Tensor]:
    """The [B] norm terms of a Linear-like pair (weight gradient Σ_t g_t a_tᵀ, bias gradient Σ_t g_t) for whichever
    of the two trains: the bias's with the weight's in one product_norm_sq when both do."""
    if trainable(weight):
        return [product_norm_sq(a, g, bias=trainable(bias))]
    return [bias_norm_sq(g)] if trainable(bias) else []


def bias_sketch(g: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """sketch(Σ g, r) for a bias whose gradient sums g [..., p] over its leading dims."""
    return sketch(g.reshape(-1, g.shape[-1]).sum(0, dtype=_backend.product_dtype(g)), r)


def weight_and_bias_sketches(a: torch.Tensor, g: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                             probe) -> list[Sketch]:
    """The use check's sketches of a Linear-like pair (weight gradient Σ g aᵀ, bias gradient Σ g) for whichever of the two
    trains, from positions a [..., d], g [..., p]: both from one op when the weight trains."""
    if not trainable(weight):
        return [Sketch(bias, bias_sketch(g, probe(bias)))] if trainable(bias) else []
    with_bias = trainable(bias)
    w_sketch, b_sketch = _backend.linear_grad_sketch(a, g, probe(weight), probe(bias) if with_bias else None)
    return [Sketch(weight, w_sketch)] + ([Sketch(bias, b_sketch)] if with_bias else [])


def product_gram(a1: torch.Tensor, g1: torch.Tensor, a2: torch.Tensor, g2: torch.Tensor,
                 budget: int = 1 << 24) -> torch.Tensor:
    """[B1, B2] float64 <Σ_t g1_it a1_itᵀ, Σ_s g2_js a2_jsᵀ> for a [B, T, d] and g [B, T, p]: the ghost form
    Σ_{t,s} (a1_it·a2_js)(g1_it·g2_js) (two GEMMs over all positions) or the per-sample products W_i = G_iᵀ A_i
    multiplied, whichever needs fewer FLOPs, in chunks of about `budget` elements. The products run in the
    norms' dtype (float32 for 16-bit and float32 positions, float64 for float64) and are summed in float64."""
    dt = torch.promote_types(_backend.product_dtype(a1), _backend.product_dtype(g1))
    (b1, t1, d), (b2, t2, p) = a1.shape, g2.shape
    out = torch.empty(b1, b2, dtype=torch.float64, device=a1.device)
    if b1 == 0 or b2 == 0:
        return out
    if b1 * b2 * t1 * t2 * (d + p) <= (b1 * t1 + b2 * t2) * d * p + b1 * b2 * d * p:  # ghost
        a2f, g2f = a2.reshape(b2 * t2, d).to(dt), g2.reshape(b2 * t2, p).to(dt)
        chunk = max(1, budget // max(1, b2 * t1 * t2))
        for s in range(0, b1, chunk):
            c = min(chunk, b1 - s)
            aa = a1[s:s + c].reshape(c * t1, d).to(dt) @ a2f.T  # [c·T1, B2·T2]
            gg = g1[s:s + c].reshape(c * t1, p).to(dt) @ g2f.T
            out[s:s + c] = (aa * gg).reshape(c, t1, b2, t2).sum((1, 3), dtype=torch.float64)
        return out
    w2 = torch.einsum("jsp,jsd->jpd", g2.to(dt), a2.to(dt)).reshape(b2, -1)
    chunk = max(1, budget // max(1, d * p))
    for s in range(0, b1, chunk):
        w1 = torch.einsum("itp,itd->ipd", g1[s:s + chunk].to(dt), a1[s:s + chunk].to(dt)).reshape(-1, d * p)
        out[s:s + chunk] = (w1 @ w2.T).double()
    return out


@register_norm_rule(nn.Linear)
@register_norm_rule_by_name("transformers.models.falcon.modeling_falcon.FalconLinear")  # input @ weight.T + bias
class LinearRule(NormRule):
    moves_batch = True
    reads_shared_rows = True  # a call on rows every sample shares: followed where they join the batch (shared_input)

    def positions(self, module, call, g, acc):
        a, b = call.arg(0, "input"), g.shape[0]
        if g.dtype in (torch.float16, torch.bfloat16) and a.dtype != g.dtype:
            # Autocast ran F.linear on this 16-bit cast of the input: the exact operand of the weight
            # gradient (and a 16-bit pair keeps the products on tensor cores, with float32 sums).
            a = a.to(g.dtype)
        return operand(a, acc).reshape(b, -1, a.shape[-1]), operand(g, acc).reshape(b, -1, g.shape[-1])

    def norm_sq(self, module, pos):
        a, g = pos
        dtype = torch.promote_types(_backend.product_dtype(a), _backend.product_dtype(g))
        return sum_of_terms(weight_and_bias_terms(a, g, module.weight, module.bias), g.shape[0], dtype, g.device)

    def norm_sq_and_grads(self, module, pos):
        """In the direct form the per-sample gradients are formed anyway: their sum over samples comes with the
        norms (one read of them, in tiles), and each sample's bias gradient gives both its norm and the bias
        gradient (one read of G)."""
        a, g = pos
        if not trainable(module.weight) or not direct_form(a.shape[1], a.shape[2], g.shape[2]):
            return self.norm_sq(module, pos), None
        if trainable(module.bias):
            out, weight_grad, bias_grad = _backend.linear_norm_sq_and_grads(a, g)
            return out, [(module.weight, weight_grad), (module.bias, bias_grad)]
        out, weight_grad = _direct_and_grad(a, g)
        return out, [(module.weight, weight_grad)]

    def per_sample_grads(self, module, pos, batch):
        a, g = (t.double() for t in pos)
        out = []
        if trainable(module.weight):
            out.append((module.weight, torch.einsum("btp,btd->bpd", g, a)))
        if trainable(module.bias):
            out.append((module.bias, g.sum(1)))
        return out

    def reference_dots(self, module, pos, batch, reference):
        """<Σ_t g_t a_tᵀ, R> = Σ_t g_tᵀ R a_t, without forming the per-sample products."""
        a, g = (t.double() for t in pos)
        out = torch.zeros(batch, dtype=torch.float64, device=g.device)
        r = reference.get(id(module.weight)) if trainable(module.weight) else None
        if r is not None:
            out = out + ((a @ r.to(a.device, torch.float64).T) * g).sum((1, 2))
        rb = reference.get(id(module.bias)) if trainable(module.bias) else None
        if rb is not None:
            out = out + g.sum(1) @ rb.to(g.device, torch.float64)
        return out

    def gram_block(self, module, pa, pb):
        (a1, g1), (a2, g2) = pa, pb
        out = torch.zeros(g1.shape[0], g2.shape[0], dtype=torch.float64, device=g1.device)
        if trainable(module.weight):
            out = out + product_gram(a1, g1, a2, g2)
        if trainable(module.bias):
            out = out + g1.double().sum(1) @ g2.double().sum(1).T
        return out

    def grad_sketch(self, module, pos, probe):
        a, g = pos
        return weight_and_bias_sketches(a, g, module.weight, module.bias, probe)

    def bookkeep(self, module, x, output, report):
        """Book-keeps calls whose norms take the direct form (which forms every per-sample gradient
        anyway); ghost-form calls keep autograd's backward."""
        if bookkeeping.can_bookkeep(module, x, output) and not ghost_in_flops(
                x.numel() // (x.shape[0] * x.shape[-1]), x.shape[-1], output.shape[-1]):
            return bookkeeping.bookkeep(output, x, module, report)
        return None


@register_norm_rule_by_name("transformers.pytorch_utils.Conv1D")
class TransposedLinearRule(LinearRule):
    """Hugging Face's Conv1D (GPT-2, GPT-J's ancestors): `addmm(bias, x.view(-1, nx), weight)` with weight [nx, nf], a
    Linear whose weight is stored transposed. Its per-sample gradients are the Linear's, transposed (the same norms);
    the sketch and the gradients take the stored layout. Not book-kept (BookkeepingLinear is nn.Linear's)."""

    def unsupported(self, module):
        w, b = module.weight, getattr(module, "bias", None)
        if w.dim() != 2 or (b is not None and b.shape != (w.shape[1],)):
            return f"a weight {list(w.shape)} and bias {None if b is None else list(b.shape)} that are not [nx, nf], [nf]"
        return None

    def norm_sq_and_grads(self, module, pos):
        out, grads = super().norm_sq_and_grads(module, pos)
        if grads is not None:
            grads = [(p, grad.T if p is module.weight else grad) for p, grad in grads]
        return out, grads

    def per_sample_grads(self, module, pos, batch):
        return [(p, grad.transpose(1, 2) if p is module.weight else grad) for p, grad in super().per_sample_grads(module, pos, batch)]

    def reference_dots(self, module, pos, batch, reference):
        if trainable(module.weight) and id(module.weight) in reference:
            reference = {**reference, id(module.weight): reference[id(module.weight)].T}
        return super().reference_dots(module, pos, batch, reference)

    def grad_sketch(self, module, pos, probe):
        """Weight rows are the input features: sketch(Σ_t a_t g_tᵀ, r) = Aᵀ(G r)."""
        a, g = pos
        out = [Sketch(module.weight, product_sketch(g, a, probe(module.weight)))] if trainable(module.weight) else []
        return out + ([Sketch(module.bias, bias_sketch(g, probe(module.bias)))] if trainable(module.bias) else [])

    def bookkeep(self, module, x, output, report):
        return None


@register_norm_rule(nn.Bilinear)
class BilinearRule(NormRule):
    """nn.Bilinear: y_o = x1ᵀ W_o x2 + b_o is a Linear over the outer products z = x1 ⊗ x2 (W as [O, I1·I2]), so a
    sample's gradient is Σ_t g_t z_tᵀ and its norms take the Linear forms. Inputs [B, I] or [B, ..., I], the batch on
    dim 0 of both."""

    def batch_operands(self, module, call):
        return [(call.arg(0, "input1"), 0), (call.arg(1, "input2"), 0)]

    def not_per_sample(self, module, call, output, batch, model_inputs):
        x1, x2 = call.arg(0, "input1"), call.arg(1, "input2")
        if not (isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor)) or x1.dim() < 2:
            return "its inputs are unbatched"
        return super().not_per_sample(module, call, output, batch, model_inputs)

    def positions(self, module, call, g, acc):
        """(z [B, T, I1·I2], g [B, T, O]), T the positions between the batch and the features (1 for [B, I])."""
        x1, x2 = call.arg(0, "input1").to(acc), call.arg(1, "input2").to(acc)
        b = x1.shape[0]
        z = (x1.unsqueeze(-1) * x2.unsqueeze(-2)).reshape(b, -1, x1.shape[-1] * x2.shape[-1])
        return z, g.to(acc).reshape(b, -1, g.shape[-1])

    def norm_sq(self, module, pos):
        z, g = pos
        return sum_of_terms(weight_and_bias_terms(z, g, module.weight, module.bias), g.shape[0], g.dtype, g.device)

    def grad_sketch(self, module, pos, probe):
        return weight_and_bias_sketches(*pos, module.weight, module.bias, probe)
