"""Mixtures of experts that route each token on its own (top-k of its own router scores, no capacity, no token
dropped or reweighted for another's sake).

- The blocks (TokenWiseBlockRule): whatever their routing does inside (rows gathered per expert, grouped matrix
  products, an index_add back), each row of their output is a function of the same row of their input alone. Their
  rule covers no parameter of its own; the hooks put the batch back on their output, so that the layers after them
  (the next block's attention and norms, the head) stay covered. The router is a product over the rows merged with
  the batch (a free parameter, followed).
- The experts (ExpertsRule): transformers' experts modules, whose forward its mixture-of-experts integration
  dispatches (eager loop, batched or grouped matrix products: one math). Each (token, slot) pair routed to expert e
  is a Linear-like pair of that expert's up projection (input x, the gradient of its output) and of its down
  projection (the gated hidden h, the routing weight times the output gradient), so a sample's gradient of expert e
  sums the pairs of that sample routed to e: the Linear forms per (sample, expert) group.

Switch Transformers' block is not one of these: its experts have a capacity, so a token may be dropped for the
tokens routed before it.
"""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn as nn

from ... import _torch_compat
from .base import (
    NormRule,
    Sketch,
    register_norm_rule_by_name,
    register_norm_rule_by_test,
    sum_of_terms,
    trainable,
)
from .linear import weight_and_bias_terms

_TOKEN_WISE = ("mixtral.modeling_mixtral.MixtralSparseMoeBlock", "qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
               "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock", "olmoe.modeling_olmoe.OlmoeSparseMoeBlock",
               "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE", "gpt_oss.modeling_gpt_oss.GptOssMLP",
               "granitemoe.modeling_granitemoe.GraniteMoeMoE")


@register_norm_rule_by_name(*(f"transformers.models.{name}" for name in _TOKEN_WISE))
class TokenWiseBlockRule(NormRule):
    """A block whose output rows are its input rows' alone (see the module's docstring): no parameter of its own."""

    keeps_rows_only = True
    moves_batch = True
    param_names = ()

    def params(self, module):
        return []


def load_balancing_loss(module: nn.Module, kwargs: dict) -> str | None:
    """What a transformers mixture-of-experts model's forward adds to its loss that mixes the samples (None: nothing):
    with output_router_logits (its config's, or the call's) a load-balancing loss of the whole batch's routing, the
    share of tokens each expert got times its mean router probability, times router_aux_loss_coef. No sample's own
    loss has it: the gradient it adds to the routers, and to every layer before them, is not a sum of per-sample
    gradients."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "output_router_logits"):
        return None
    on = kwargs.get("output_router_logits")
    coefficient = getattr(module, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", None))  # (its own copy)
    if not (config.output_router_logits if on is None else on) or coefficient == 0:
        return None
    return (f"adds a load-balancing loss of the whole batch's routing (output_router_logits=True, router_aux_loss_coef="
            f"{coefficient})")


def is_transformers_experts(kind: type) -> bool:
    """Whether `kind` is a transformers experts module: its forward is the dispatcher of transformers'
    mixture-of-experts integration (`use_experts_implementation`), which runs one math whatever the implementation."""
    code = getattr(getattr(kind, "forward", None), "__code__", None)
    return (code is not None and code.co_filename.replace("\\", "/").endswith("transformers/integrations/moe.py")
            and hasattr(kind, "_apply_gate"))


@functools.lru_cache(maxsize=None)
def _argument_names(kind: type) -> tuple[str, str, str]:
    """The names of an experts forward's three arguments (tokens, expert ids, routing weights): gpt-oss calls them
    router_indices and routing_weights."""
    try:
        names = [n for n in inspect.signature(kind.forward).parameters if n != "self"]
    except (TypeError, ValueError):
        names = []
    return tuple(names[:3]) if len(names) >= 3 else ("hidden_states", "top_k_index", "top_k_weights")


def _call_tensors(module: nn.Module, call) -> tuple:
    """(tokens, expert ids, routing weights) of a call, by position or by name."""
    return tuple(call.arg(i, name) for i, name in enumerate(_argument_names(type(module))))


def _up(module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The up projection's (weight, bias): gate and up together, or up alone (experts without a gate)."""
    name = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    has_bias = getattr(module, "has_bias", False)
    return getattr(module, name, None), getattr(module, f"{name}_bias", None) if has_bias else None


def _down(module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return module.down_proj, getattr(module, "down_proj_bias", None) if getattr(module, "has_bias", False) else None


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """One expert's product: x Wᵀ + b, W [out, in] (x W for a transposed [in, out] weight)."""
    out = x @ weight if transposed else x @ weight.T
    return out if bias is None else out + bias


def _rows_by_expert(order: torch.Tensor, counts: list[int]):
    """(expert, the indices of its pairs) for every expert some pair is routed to: `order` sorts the pairs by expert,
    `counts` their number per expert."""
    start = 0
    for e, count in enumerate(counts):
        if count:
            yield e, order[start:start + count]
        start += count


def _groups(experts: torch.Tensor, n_experts: int):
    """The (sample, expert) groups of the pairs `experts` [B, L] (an expert id per pair, -1: none), a few at a time:
    (the groups' samples [G], [G, n] indices of their pairs in the flattened [B·L] positions, B·L where a group has
    fewer than n: padding). Groups of similar sizes go together (sizes up to 2^j padded to their largest), so that
    padding at most doubles what is read."""
    b, length = experts.shape
    flat = experts.reshape(-1)
    sample = torch.arange(b * length, device=flat.device) // length
    key = torch.where(flat >= 0, sample * n_experts + flat, b * n_experts)
    order = torch.argsort(key, stable=True)
    sizes = torch.bincount(key, minlength=b * n_experts + 1)[:-1]
    starts = torch.cumsum(sizes, 0) - sizes
    buckets: dict[int, list[int]] = {}  # size rounded up to a power of two -> its groups (one read of the sizes)
    largest: dict[int, int] = {}
    for group, size in enumerate(sizes.tolist()):
        if size:
            j = (size - 1).bit_length()
            buckets.setdefault(j, []).append(group)
            largest[j] = max(largest.get(j, 0), size)
    for j, members in buckets.items():
        groups = torch.tensor(members, device=flat.device)
        at = torch.arange(largest[j], device=flat.device)
        inside = at < sizes[groups, None]
        index = torch.where(inside, order[(starts[groups, None] + at).clamp(max=b * length - 1)], b * length)
        yield groups // n_experts, index


def _padded(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t [B, L, d] gathered at `index` [G, n] of its flattened rows, zeros where the index is B·L (padding)."""
    flat = t.reshape(-1, t.shape[-1])
    out = flat[index.clamp(max=flat.shape[0] - 1)]
    return out.masked_fill_((index == flat.shape[0]).unsqueeze(-1), 0)


@register_norm_rule_by_test(is_transformers_experts)
class ExpertsRule(NormRule):
    """transformers' experts (see the module's docstring): called with the tokens' rows [N, hidden] (the batch merged
    with the positions) and their routing (top_k_index, top_k_weights [N, k]). Positions: per (token, slot) pair,
    the up projection's input x and output gradient, the gated hidden h and the down projection's output gradient
    (routing weight times the experts' output gradient), and the pair's expert. The hidden and the up projection's
    gradient are recomputed in backward (each expert's products on its pairs, then the module's own gate and its
    gradient by autograd over all pairs at once): the implementation the model ran does not matter. Under autocast
    the products run in its dtype on casts of their operands, as the model's did."""

    moves_batch = True
    factored_probe = True
    param_names = ("gate_up_proj", "gate_up_proj_bias", "up_proj", "up_proj_bias", "down_proj", "down_proj_bias")

    def unsupported(self, module):
        if getattr(module, "has_post_expert_norm", False):
            return "a norm follows each expert's down projection, which its rule does not follow"
        if getattr(module, "_is_expert_parallel", False):
            return "its experts are split over ranks (expert parallelism)"
        (up, _), (down, _) = _up(module), _down(module)
        if not isinstance(up, torch.Tensor) or not isinstance(down, torch.Tensor) or up.dim() != 3 or down.dim() != 3:
            return "its experts' weights are not [experts, out, in] tensors"
        return None

    def params(self, module):
        return [p for p in (*_up(module), *_down(module)) if p is not None and p.requires_grad]

    def batch_operands(self, module, call):
        return [(_call_tensors(module, call)[0], 0)]

    def not_per_sample(self, module, call, output, batch, model_inputs):
        x, index, weights = _call_tensors(module, call)
        if not all(isinstance(t, torch.Tensor) for t in (x, index, weights)):
            return "its tokens or their routing are not tensors passed by position"
        if x.dim() < 2 or x.shape[0] != batch or output.shape[0] != batch:
            return f"its input {list(x.shape)} / output {list(output.shape)} has no batch dim of size {batch}"
        rows = x.numel() // max(x.shape[-1], 1)
        if index.dim() != 2 or index.shape[0] != rows or weights.shape != index.shape:
            return f"its routing {list(index.shape)} does not give each of its {rows} token rows their experts"
        return None

    def positions(self, module, call, g, acc):
        x, index, weights = _call_tensors(module, call)
        b, hidden, k = x.shape[0], x.shape[-1], index.shape[-1]
        (up_w, up_b), (down_w, _) = _up(module), _down(module)
        transposed = getattr(module, "is_transposed", False)
        products = call.autocast or x.dtype  # what the experts' matrix products ran in (autocast casts both operands)
        n_experts = down_w.shape[0]
        experts = index.reshape(-1)
        experts = torch.where((experts >= 0) & (experts < n_experts), experts, -1)
        pair_tokens = torch.arange(experts.numel(), device=x.device) // k
        xs = x.reshape(-1, hidden)[pair_tokens].to(products)
        xs[experts < 0] = 0
        gs, w = g.reshape(-1, hidden)[pair_tokens], weights.reshape(-1, 1)
        wide = torch.promote_types(gs.dtype, w.dtype)
        dy = (gs.to(wide) * w.to(wide)).to(products)  # the down projection's output gradient, as autograd forms it
        dy[experts < 0] = 0
        # Each expert's products on its pairs; the gate (elementwise) and its gradient over all pairs at once.
        order = torch.argsort(torch.where(experts >= 0, experts, n_experts), stable=True)
        counts = torch.bincount(experts[experts >= 0], minlength=n_experts).tolist()
        up, d_gated = None, None
        for e, rows in _rows_by_expert(order, counts):
            up_e = _linear(xs[rows], up_w[e].detach().to(products), None if up_b is None else up_b[e].detach(),
                           transposed)
            down = down_w[e].detach().to(products)
            d_gated_e = dy[rows] @ (down.T if transposed else down)
            if up is None:
                up = up_e.new_zeros(xs.shape[0], up_e.shape[1])
                d_gated = d_gated_e.new_zeros(xs.shape[0], d_gated_e.shape[1])
            up[rows], d_gated[rows] = up_e, d_gated_e
        if up is None:  # no pair routed to any expert
            up = xs.new_zeros(xs.shape[0], up_w.shape[2 if transposed else 1])
            d_gated = xs.new_zeros(xs.shape[0], down_w.shape[1 if transposed else 2])
        with torch.enable_grad():
            up.requires_grad_(True)
            gated = _torch_compat.experts_gate(module, up)
            d_up = torch.autograd.grad(gated, up, d_gated.to(gated.dtype))[0] if trainable(up_w) or trainable(up_b) \
                else None
        pos = [xs, gated.detach(), dy] + ([] if d_up is None else [d_up])
        return (*(t.to(acc).reshape(b, -1, t.shape[-1]) for t in pos), experts.reshape(b, -1))

    def rounding_dtype(self, module, call, g):
        """The coarsest of the output gradient's dtype, autocast's and the routing weights' (routers weigh in float32,
        and some implementations add the experts' outputs in that dtype: Nemotron-H's eager loop)."""
        weights = _call_tensors(module, call)[2]
        found = (super().rounding_dtype(module, call, g), call.autocast, getattr(weights, "dtype", None))
        return max((d for d in found if d is not None and d.is_floating_point), key=lambda d: torch.finfo(d).eps)

    def norm_sq(self, module, pos):
        """The [B] terms of the up and down projections (weights and biases that train), per (sample, expert) group."""
        xs, h, dy, *rest = pos[:-1]
        experts = pos[-1]
        (up_w, up_b), (down_w, down_b) = _up(module), _down(module)
        out = torch.zeros(experts.shape[0], dtype=xs.dtype, device=xs.device)
        for samples, index in _groups(experts, down_w.shape[0]):
            terms = weight_and_bias_terms(_padded(h, index), _padded(dy, index), down_w, down_b)
            if rest:
                terms += weight_and_bias_terms(_padded(xs, index), _padded(rest[0], index), up_w, up_b)
            if terms:
                out = out.index_add(0, samples, sum_of_terms(terms, samples.shape[0], out.dtype, out.device).to(out.dtype))
        return out

    def per_sample_grads(self, module, pos, batch):
        xs, h, dy, *rest = (t.double() for t in pos[:-1])
        experts = pos[-1]
        (up_w, up_b), (down_w, down_b) = _up(module), _down(module)
        transposed = getattr(module, "is_transposed", False)
        route = torch.nn.functional.one_hot(experts.clamp(min=0), down_w.shape[0]).double() * (experts >= 0)[..., None]
        out = []
        for (weight, bias), a, grad in (((down_w, down_b), h, dy), ((up_w, up_b), xs, rest[0] if rest else None)):
            if grad is None:
                continue
            if trainable(weight):
                out.append((weight, torch.einsum("ble,bli,blo->beio" if transposed else "ble,bli,blo->beoi",
                                                 route, a, grad)))
            if trainable(bias):
                out.append((bias, torch.einsum("ble,blo->beo", route, grad)))
        return out

    def grad_sketch(self, module, pos, probe):
        """Per expert (the gradient's rows): Σ over its pairs of gᵀ R a, R the probe as the expert's [out, in] matrix."""
        xs, h, dy, *rest = pos[:-1]
        experts = pos[-1].reshape(-1)
        picked = experts.clamp(min=0)
        (up_w, up_b), (down_w, down_b) = _up(module), _down(module)
        transposed = getattr(module, "is_transposed", False)
        out = []
        for (weight, bias), a, grad in (((down_w, down_b), h, dy), ((up_w, up_b), xs, rest[0] if rest else None)):
            if grad is None:
                continue
            a, grad = a.reshape(-1, a.shape[-1]), grad.reshape(-1, grad.shape[-1])
            if trainable(weight):
                r = probe(weight)
                a_r, g_r = a.to(r.dtype), grad.to(r.dtype)
                factors = probe.factors(weight) if hasattr(probe, "factors") else None
                if factors is not None:  # R = u ⊗ v: (a·u)(g·v) stored [in, out], (g·u)(a·v) stored [out, in]
                    u, v = factors
                    per_pair = (a_r @ u) * (g_r @ v) if transposed else (g_r @ u) * (a_r @ v)
                else:
                    per_pair = ((a_r @ r.view(a.shape[1], -1)) * g_r if transposed
                                else (g_r @ r.view(grad.shape[1], -1)) * a_r).sum(1)
                out.append(Sketch(weight, per_pair.new_zeros(weight.shape[0]).index_add_(0, picked, per_pair)))
            if trainable(bias):
                r = probe(bias)
                per_pair = grad.to(r.dtype) @ r
                out.append(Sketch(bias, per_pair.new_zeros(bias.shape[0]).index_add_(0, picked, per_pair)))
        return out
