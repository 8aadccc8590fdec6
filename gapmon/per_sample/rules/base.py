"""What a per-sample norm rule is, and the registry of rules by layer type (as Opacus registers its
grad samplers). Each layer family's rule lives in its own module of this package and registers
itself with @register_norm_rule.

A rule turns one call of a layer (its input `a` and the gradient `g` of its output) into
*positions*: tensors of shape [B, T, ...] such that the per-sample gradient of every trainable
parameter is a sum over positions. Calls of the same module in one forward pass (a shared block
applied in a loop) then concatenate along T, which keeps the cross terms between calls exact.
`norm_sq` maps the (concatenated) positions to the squared per-sample norm, [B], of the layer's
trainable parameters only: frozen parameters have no gradient and add nothing.

Rules never materialise per-sample gradients where a cheaper exact form exists:
- Linear / Conv (unfolded): weight by the ghost norm sum((A Aᵀ) ⊙ (G Gᵀ)) or the direct
  ||Gᵀ A||², whichever needs fewer FLOPs; bias ||Σ_t G_t||².
- Embedding: Σ over positions with equal ids of G_t·G_s (padding_idx excluded; with
  scale_grad_by_freq each position is scaled by 1 / the count of its id in the sample).
- LayerNorm / RMSNorm / GroupNorm / InstanceNorm: weight ||Σ_t G_t ⊙ x̂_t||², bias ||Σ_t G_t||².
- EmbeddingBag: the entries of each bag, weighted, paired by id as for Embedding.
- MultiheadAttention: its projections as Linear products, from a recomputed attention.

Each rule also gives `grad_sketch`: the sum over samples of its per-sample gradients (what autograd
accumulates from the calls the rule saw), projected on a random probe per parameter. A parameter
whose accumulated gradient differs from it got contributions no rule saw (PerSampleGradNorms
refuses it): a Freivalds check that costs a matrix-vector product, not a gradient.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import re
import sys
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.nn as nn

from ... import _torch_compat
from ...stats import _backend
from ...utils import first_tensor

_RULES: dict[type, "NormRule"] = {}
_RULES_BY_NAME: dict[str, "NormRule"] = {}  # "module.QualName" -> rule: layers of libraries gapmon does not import
_COPIES: dict[type, "NormRule | None"] = {}  # transformers types without a rule -> the rule of the layer they copy
# (test, rule): a family of another library's layers known by how they are built, not by name (transformers' experts)
_RULES_BY_TEST: list[tuple[Callable[[type], bool], "NormRule"]] = []


def _registrar(table: dict, keys: tuple) -> Callable[[type], type]:
    def register(cls: type) -> type:
        rule = cls()
        for key in keys:
            table[key] = rule
        _COPIES.clear()
        return cls

    return register


def register_norm_rule(*module_types: type) -> Callable[[type], type]:
    """Class decorator: the decorated NormRule handles these module types, and their subclasses that
    do not override `forward`. A subclass whose forward computes what its base's does (gapmon cannot
    tell) is registered by its user: ``register_norm_rule(MyLinear)(gapmon.norm_rules.LinearRule)``."""
    return _registrar(_RULES, module_types)


def register_norm_rule_by_name(*qualified_names: str) -> Callable[[type], type]:
    """Class decorator: the decorated NormRule handles the module types of these names ("module.QualName"), exactly
    those types (not subclasses): layers of another library, which gapmon does not import."""
    return _registrar(_RULES_BY_NAME, qualified_names)


def register_norm_rule_by_test(test: Callable[[type], bool]) -> Callable[[type], type]:
    """Class decorator: the decorated NormRule handles every module type without another rule for which test(type)
    holds (a family of another library's layers known by how they are built: transformers' experts, whose forward
    its mixture-of-experts integration dispatches, in dozens of model families)."""
    def register(cls: type) -> type:
        _RULES_BY_TEST.append((test, cls()))
        _COPIES.clear()
        return cls

    return register


def rule_for(module: nn.Module) -> "NormRule | None":
    """The rule registered for `module`'s type (or its qualified name); for a subclass of a registered type, that
    type's rule only if the subclass does not override `forward` (else its math may differ: a LoRA Linear, a
    scaled Embedding), as a rule wrapper may change it for this module (reparametrized: a weight_norm'd or spectral_norm'd
    Linear's rule taken back to its parameters). None when no rule holds."""
    rule = _rule_of_type(module)
    for wrap in _RULE_WRAPPERS:
        rule = wrap(rule, module)
    return rule


# fn(rule of the module's type or None, module) -> the module's rule: rules of reparametrised layers (reparametrized)
_RULE_WRAPPERS: list[Callable[["NormRule | None", nn.Module], "NormRule | None"]] = []


def register_rule_wrapper(wrap: Callable[["NormRule | None", nn.Module], "NormRule | None"]) -> Callable:
    """Registers wrap(rule, module) -> rule, applied by rule_for to every module's rule (a reparametrised weight's)."""
    _RULE_WRAPPERS.append(wrap)
    return wrap


def _rule_of_type(module: nn.Module) -> "NormRule | None":
    kind = type(module)
    if kind in _RULES:
        return _RULES[kind]
    by_name = _RULES_BY_NAME.get(f"{kind.__module__}.{kind.__qualname__}")
    if by_name is not None:  # exactly that type (Gemma's scaled Embedding subclass overrides forward: its own rule)
        return by_name
    base = _registered_base(kind)
    if base is not None:
        return _RULES[base] if kind.forward is base.forward else None
    return _copied_rule(kind) or next((rule for test, rule in _RULES_BY_TEST if test(kind)), None)


# The layer kinds transformers copies from family to family (`# Copied from ...LlamaRMSNorm`), by the end of their names.
_COPIED_KINDS = ("RMSNorm", "LayerNorm", "ScaledWordEmbedding")


def _copied_rule(kind: type) -> "NormRule | None":
    """The rule of a layer registered by name whose code a transformers type without a rule copies: the same source
    once comments, docstrings and the two class names are set aside. Transformers keeps its `# Copied from` layers in
    sync with the original, so Qwen2.5-VL's RMSNorm is Llama's and Gemma 2's is Gemma's, in the version installed."""
    suffix = next((end for end in _COPIED_KINDS if kind.__name__.endswith(end)), None)
    if suffix is None or not kind.__module__.startswith("transformers."):
        return None
    if kind not in _COPIES:
        own = _layer_source(kind)
        _COPIES[kind] = None
        for name, rule in _RULES_BY_NAME.items():
            original = _named_type(name) if own is not None and name.endswith(suffix) else None
            if original is not None and original is not kind and _layer_source(original) == own:
                _COPIES[kind] = rule
                break
    return _COPIES[kind]


@functools.lru_cache(maxsize=None)
def _layer_source(kind: type) -> str | None:
    """A class's source without comments, docstrings, decorators, blank lines and its own name (None: none to read)."""
    try:
        source = inspect.getsource(kind)
    except (OSError, TypeError):
        return None
    source = re.sub(r'(\"\"\"|\'\'\')(.|\n)*?\1', "", source)
    lines = [re.sub(r"\s+#.*$|^\s*#.*$", "", line).rstrip() for line in source.splitlines()]
    lines = [line for line in lines if line.strip() and not line.lstrip().startswith("@")]
    return re.sub(rf"\b{re.escape(kind.__name__)}\b", "<layer>", "\n".join(lines))


def _named_type(qualified: str) -> type | None:
    """The type "module.QualName" names, importing its module when transformers is loaded (None if it cannot)."""
    module, _, name = qualified.rpartition(".")
    if "transformers" not in sys.modules:
        return None
    try:
        found = importlib.import_module(module)
    except Exception:  # noqa: BLE001 (a model family that cannot load here: an optional dependency missing)
        return None
    kind = getattr(found, name, None)
    return kind if isinstance(kind, type) else None


def registered_rules() -> dict[type | str, "NormRule"]:
    """Every registered layer type (or qualified name) and its rule (a copy)."""
    return {**_RULES, **_RULES_BY_NAME}


def _registered_base(kind: type) -> type | None:
    return next((t for t in kind.__mro__[1:] if t in _RULES), None)


def overrides_ruled_forward(module: nn.Module) -> bool:
    """Whether `module` subclasses a layer type with a rule but has no rule itself (it overrides forward): it uses its
    parameters as its base type does, in math no rule follows."""
    return rule_for(module) is None and _registered_base(type(module)) is not None


def why_no_rule(module: nn.Module) -> str:
    """Why `module` has no rule (rule_for gave None), for coverage() and the warnings."""
    kind = type(module)
    base = _registered_base(kind)
    if base is not None:
        return (f"{kind.__name__} subclasses {base.__name__} but overrides forward, so {base.__name__}'s rule may not "
                f"hold; if its math is {base.__name__}'s, register it: register_norm_rule({kind.__name__})(...)")
    return f"no per-sample rule for {kind.__name__}"


class Call(NamedTuple):
    """The arguments of one call of a layer (tensors detached), as its forward hook saw them, and the dtype autocast
    ran the call's matrix products in (None: autocast was off)."""

    args: tuple
    kwargs: dict
    autocast: torch.dtype | None = None

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """Argument `index` of forward(), passed by position or by keyword `name`."""
        return self.args[index] if len(self.args) > index else self.kwargs.get(name, default)


class NormRule:
    """How one layer family turns (call arguments, output gradient) into per-sample squared norms."""

    # True: the rule covers the parameters of the module's submodules too (they are not called).
    owns_submodules = False
    # The module's own parameters the rule's math is about (None: not checked).
    param_names: tuple[str, ...] | None = ("weight", "bias")
    # True: the layer works row by row over the leading dims of its first input (Linear, LayerNorm,
    # Embedding), so a batch on any of them is moved to dim 0 (sequence-first activations).
    moves_batch = False
    # True: the layer runs each row of its batch dim on its own (an RNN's sequences), so a batch merged with other rows
    # there (Sequencer's LSTMs over [B·W, H, C]) is more rows of the same samples: the call is given with the batch
    # split out of them (sample_first: one more dim) and the rule groups each sample's rows itself.
    merged_rows = False
    # True: a block whose output rows are its input rows' alone, with no parameter of its own for the rule (a
    # mixture of experts routing each token on its own): the hooks only put the batch back on its output.
    keeps_rows_only = False
    # The dtype the layer forms its parameters' gradient in where that is coarser than its output gradient's (Gemma's
    # RMSNorm multiplies by the weight in float32 in a float64 model): the use check allows its rounding.
    compute_dtype: torch.dtype | None = None
    # True: the use check draws the probe of each of its 3-D parameters ([rows, out, in]) as an outer product u ⊗ v of
    # its last two dims, which grad_sketch reads through probe.factors(p): Σ gᵀ R a becomes (g·u)(a·v) (the experts').
    factored_probe = False

    def per_sample_grads(self, module: nn.Module, pos: tuple, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, [batch, *its shape] float64 per-sample gradients) of the positions `pos` of `batch`
        samples. Default: each sample's grad_sketch against identity probes (the sketch of a gradient against
        the identity is the gradient), one sample at a time."""
        out: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        for i in range(batch):
            one = tuple(t[i * (t.shape[0] // batch):(i + 1) * (t.shape[0] // batch)] if isinstance(t, torch.Tensor) else t
                        for t in pos)
            sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            probe = _identity_probe(one)
            for sk in self.grad_sketch(module, one, probe):
                value = sk.value.reshape(sk.param.shape)
                kept = sums.get(id(sk.param))
                sums[id(sk.param)] = (sk.param, value if kept is None else kept[1] + value)
            for key, (param, value) in sums.items():
                out.setdefault(key, (param, []))[1].append(value)
        return [(param, torch.stack(values)) for param, values in out.values()]

    def reference_dots(self, module: nn.Module, pos: tuple, batch: int,
                       reference: dict[int, torch.Tensor]) -> torch.Tensor:
        """[batch] float64 <g_i, r> of the per-sample gradients of `pos` with a reference gradient (`reference`:
        id(parameter) -> tensor of its shape; parameters without one add nothing). Default: from per_sample_grads."""
        out = torch.zeros(batch, dtype=torch.float64, device=next(t.device for t in pos if isinstance(t, torch.Tensor)))
        for param, g in self.per_sample_grads(module, pos, batch):
            r = reference.get(id(param))
            if r is not None:
                out = out + (g.reshape(batch, -1) @ r.to(g.device, torch.float64).reshape(-1))
        return out

    def gram_block(self, module: nn.Module, pa: tuple, pb: tuple) -> torch.Tensor:
        """[Ba, Bb] inner products <g_i, g_j> of the per-sample gradients of the positions `pa` (Ba samples) and
        `pb` (Bb samples) over this rule's parameters. Default: by polarisation of norm_sq, exact for any rule
        whose positions of two calls concatenate along T (the contract above)."""
        return polarized_gram(self.norm_sq, module, pa, pb)

    def why_not(self, module: nn.Module) -> str | None:
        """Why this module's per-sample norms cannot be computed exactly (None: they can): its
        parameters are not the ones the rule's math is about, or `unsupported` says why."""
        if self.param_names is not None:
            own = dict(module.named_parameters(recurse=False))
            extra = sorted(set(own) - set(self.param_names))
            computed = [n for n in self.param_names if n not in own and isinstance(getattr(module, n, None), torch.Tensor)]
            if computed:
                return (f"its {', '.join(computed)} is computed from other parameters (weight_norm or a parametrization), "
                        f"not a parameter of its own")
            if extra:
                return f"it has parameters {extra} that {type(module).__name__}'s rule does not know"
        return self.unsupported(module)

    def unsupported(self, module: nn.Module) -> str | None:
        """Why this module's per-sample norms cannot be computed exactly, for a layer family's own
        reasons (None: they can)."""
        return None

    def params(self, module: nn.Module) -> list[nn.Parameter]:
        """The trainable parameters whose norms this rule covers. Read at every call of the layer (FSDP2 swaps the
        parameter objects, requires_grad may change)."""
        if self.owns_submodules:
            return [p for p in module.parameters() if p.requires_grad]
        return [p for p in _torch_compat.own_parameters(module) if p.requires_grad]

    def not_per_sample(self, module: nn.Module, call: Call, output: torch.Tensor, batch: int,
                       model_inputs: set[int]) -> str | None:
        """Why this call is not per-sample for a batch of `batch` samples (None: it is). Default:
        dim 0 of the input and of the output is the batch. `model_inputs` holds the storages of the
        model's own inputs."""
        a = call.arg(0, "input")
        if not isinstance(a, torch.Tensor):
            return "its input is not a tensor"
        if a.dim() == 0 or a.shape[0] != batch or output.dim() == 0 or output.shape[0] != batch:
            return f"its input {list(a.shape)} / output {list(output.shape)} has no batch dim of size {batch}"
        return None

    def graded_outputs(self, module: nn.Module, output: Any) -> list[torch.Tensor]:
        """The outputs whose gradients `positions` needs. Default: the first tensor output alone (g is its
        gradient); a rule naming several gets g as a tuple of their gradients, None where the loss does not
        use one, in the layout they have (it moves no batch dim)."""
        return [first_tensor(output)]

    def batch_operands(self, module: nn.Module, call: Call) -> list[tuple[Any, int | None]]:
        """The call's inputs that must carry the batch, each with the dim it must be on (None: any
        dim, or none the provenance can follow, as long as the input comes from the batch). Default:
        the first input, batch on dim 0."""
        return [(call.arg(0, "input"), 0)]

    def positions(self, module: nn.Module, call: Call, g: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def rounding_dtype(self, module: nn.Module, call: Call, g: torch.Tensor | tuple) -> torch.dtype:
        """The dtype whose rounding the use check allows in the gradients of one call: its output gradient's (the
        widest of several outputs'), or `compute_dtype` where that is coarser."""
        return gradient_dtype(g)

    def bookkeep(self, module: nn.Module, x: torch.Tensor, output: torch.Tensor,
                 report: Callable[..., None]) -> torch.Tensor | None:
        """With book-keeping on, the output that replaces `output` so that this call's backward forms
        its weight gradient from its per-sample gradients and reports (g, the call's squared norms, the gradients
        it returns) to `report`; None when this call keeps autograd's backward (default: every rule but
        Linear's)."""
        return None

    def norm_sq(self, module: nn.Module, pos: Sequence[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def norm_sq_and_grads(self, module: nn.Module, pos: Sequence[torch.Tensor]
                          ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """norm_sq, and (parameter, sum over samples of its per-sample gradients) for every trainable parameter when
        the norms formed those sums on the way (the use check then sketches them instead of reading the positions
        again: for a Linear's direct form the [p, d] weight gradient, not Gᵀ(A r) over the whole output gradient);
        None otherwise (the use check calls grad_sketch)."""
        return self.norm_sq(module, pos), None

    def grad_sketch(self, module: nn.Module, pos: Sequence[torch.Tensor],
                    probe: Callable[[torch.Tensor], torch.Tensor]) -> list["Sketch"] | None:
        """A Sketch per trainable parameter: the sum over samples of the per-sample gradients of one
        call's positions, as a [rows, -1] matrix times `probe(parameter)` ([rows], in the probe's dtype or wider;
        see `sketch`). None: the rule cannot say (its parameters go unchecked)."""
        return None


class Sketch(NamedTuple):
    """A parameter's gradient sketch from one call. `repeats`: the most terms autograd adds into one
    gradient element outside a GEMM (an embedding row looked up n times), whose rounding in a 16-bit
    gradient grows with it."""

    param: torch.Tensor
    value: torch.Tensor
    repeats: int = 1


def gradient_dtype(g: torch.Tensor | tuple) -> torch.dtype:
    """The dtype of an output gradient, or the widest of several (a rule of several outputs)."""
    if isinstance(g, torch.Tensor):
        return g.dtype
    return functools.reduce(torch.promote_types, [t.dtype for t in g if t is not None], torch.float16)


def sketch_rows(p: torch.Tensor) -> int:
    """Rows of a parameter's gradient as the sketch sees it: dim 0 (1 for a 0-dim parameter)."""
    return p.shape[0] if p.dim() else 1


def sketch(grad: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """A gradient (any shape, its parameter's) as a [rows, -1] matrix times the probe r, in r's dtype (the use check
    sums the sketches in it)."""
    rows = grad.shape[0] if grad.dim() else 1
    return grad.reshape(rows, -1).to(r.dtype) @ r


def add_sketch(acc: torch.Tensor, grad: torch.Tensor, r: torch.Tensor) -> None:
    """acc += sketch(grad, r), summed in acc's dtype (the probe's): one matrix-vector op into the accumulator."""
    # No view where none is needed (every op costs host time; on a GPU that is what a step waits for): a matrix as it
    # is, and a vector (a bias, its probe of one value) times that value.
    if grad.dim() == 1 and r.shape[0] == 1:
        acc.addcmul_(grad if grad.dtype == acc.dtype else grad.to(acc.dtype), r)
        return
    matrix = grad if grad.dim() == 2 else grad.reshape(grad.shape[0] if grad.dim() else 1, -1)
    acc.addmv_(matrix if matrix.dtype == acc.dtype else matrix.to(acc.dtype), r)


def trainable(p: torch.Tensor | None) -> bool:
    return p is not None and p.requires_grad


def sum_of_terms(terms: Sequence[torch.Tensor], batch: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The sum of a layer's [B] norm terms in `dtype` or the terms' wider one, added in order as from zeros of `dtype`
    (the same bits), without the zeros and their add when there are terms: on a GPU each op is a launch."""
    if not terms:
        return torch.zeros(batch, dtype=dtype, device=device)
    want = dtype
    for t in terms:
        want = torch.promote_types(want, t.dtype)
    out = terms[0].to(want)
    for t in terms[1:]:
        out = out + t
    return out


def bias_norm_sq(g: torch.Tensor) -> torch.Tensor:
    return g.sum(1, dtype=_backend.product_dtype(g)).square().sum(1)


def operand(x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """x as an operand of the norm products: kept as it is when the products sum it in `acc`
    anyway (16-bit tensors with float32 sums: no float32 copy of an activation), else cast."""
    return x if _backend.product_dtype(x) == acc else x.to(acc)


def _wide(pos: tuple) -> tuple:
    return tuple(t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in pos)


def polarized_gram(norm_sq: Callable, module: nn.Module, pa: tuple, pb: tuple, budget: int = 1 << 24) -> torch.Tensor:
    """[Ba, Bb] <g_i, g_j> = (|g_i + g_j|^2 - |g_i|^2 - |g_j|^2) / 2 in float64, |g_i + g_j|^2 being norm_sq of
    sample i's and sample j's positions concatenated along T (a position tensor may hold k rows per sample, as
    a grouped convolution's). Pairs are formed in chunks of about `budget` elements."""
    pa, pb = _wide(pa), _wide(pb)
    sa, sb = norm_sq(module, pa).double(), norm_sq(module, pb).double()
    ba, bb = sa.shape[0], sb.shape[0]
    out = torch.empty(ba, bb, dtype=torch.float64, device=sa.device)
    if ba == 0 or bb == 0:
        return out
    per_pair = sum(ta[0].numel() * (ta.shape[0] // ba) + tb[0].numel() * (tb.shape[0] // bb) for ta, tb in zip(pa, pb))
    chunk = max(1, budget // max(1, bb * per_pair))
    for start in range(0, ba, chunk):
        c = min(chunk, ba - start)
        pairs = []
        for ta, tb in zip(pa, pb):
            k = ta.shape[0] // ba
            xa = ta.reshape(ba, k, *ta.shape[1:])[start:start + c].unsqueeze(1)  # [c, 1, k, Ta, ...]
            xb = tb.reshape(bb, k, *tb.shape[1:]).unsqueeze(0)  # [1, bb, k, Tb, ...]
            pair = torch.cat((xa.expand(c, bb, *xa.shape[2:]), xb.expand(c, bb, *xb.shape[2:])), dim=3)
            pairs.append(pair.reshape(c * bb * k, *pair.shape[3:]))
        both = norm_sq(module, tuple(pairs)).double().reshape(c, bb)
        out[start:start + c] = (both - sa[start:start + c, None] - sb[None, :]) / 2
    return out


def _identity_probe(pos: tuple) -> Callable[[torch.Tensor], torch.Tensor]:
    """A grad_sketch probe that returns the identity of each parameter's columns (float64, on the positions'
    device): the sketch of a gradient is then the gradient."""
    device = next((t.device for t in pos if isinstance(t, torch.Tensor)), torch.device("cpu"))
    return lambda p: torch.eye(p.numel() // sketch_rows(p), dtype=torch.float64, device=device)
