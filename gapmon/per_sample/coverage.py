"""Which layers PerSampleGradNorms covers (a rule holds for them), why each other parameter is not covered,
and the layers found not to be per-sample at run time: what coverage() reports and what is warned about
(or, with strict=True, refused)."""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.nn as nn

from ..utils import clean_named, layer_type_name, name_cleaner
from .free_parameters import free_parameters
from .rules import EmbeddingRule, LinearRule, NormRule, overrides_ruled_forward, rule_for, why_no_rule

SKIPPED = "layer is not per-sample (see skipped_layers)"  # coverage()'s reason for a skipped layer's parameters


def parameter_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name (a parameter reachable under several names keeps its first, as named_parameters())."""
    names: dict[int, str] = {}
    for n, p in clean_named(model, model.named_parameters(remove_duplicate=False), "parameters"):
        names.setdefault(id(p), n)
    return names


def tied_parameters(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """id(parameter) -> [(module name, module)] of the parameters that several *different* layers with a rule hold
    (tied weights). One module registered under several names (a block reused in a ModuleList) is a module called
    several times: not a tie. A module without a rule that also registers the parameter (BERT's prediction head holds
    its decoder's bias) is not counted: were it to use the parameter in its own forward, the use check would see it."""
    clean_name = name_cleaner(model)
    owners: dict[int, dict[int, tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), {}).setdefault(id(module), (clean_name(name), module))
    ruled = {key: [(n, m) for n, m in mods.values() if rule_for(m) is not None] for key, mods in owners.items()}
    return {key: mods for key, mods in ruled.items() if len(mods) > 1}


def _tie_group(owners: list[tuple[str, nn.Module]]) -> list[str] | None:
    """The members' names when a tie is one table shared by embeddings (layers an Embedding rule covers) and at most
    one Linear head (a language model's input and output embeddings, T5's encoder and decoder embeddings): the
    per-sample norm of their summed gradient is exact (tied_embedding). None for any other tie."""
    weights = {id(getattr(m, "weight", None)) for _, m in owners}
    embeddings = [n for n, m in owners if isinstance(rule_for(m), EmbeddingRule)]
    heads = [n for n, m in owners if type(rule_for(m)) is LinearRule]
    if len(weights) != 1 or not embeddings or len(heads) > 1 or len(embeddings) + len(heads) != len(owners):
        return None
    return [n for n, _ in owners]


def trainable_state(params: list[tuple[str, torch.Tensor]]) -> tuple[bool, ...]:
    """Every parameter's requires_grad: what coverage and the gradient hooks follow between steps."""
    return tuple(p.requires_grad for _, p in params)


class LayerCoverage:
    """The covered layers of `model` ((name, module, rule) each) and the reasons of the uncovered parameters
    (named by `names`, id(parameter) -> name)."""

    def __init__(self, model: nn.Module, names: dict[int, str], clean_name: Callable[[str], str], strict: bool,
                 follow_free: bool = True):
        self.strict = strict
        ties = tied_parameters(model)
        groups = {key: _tie_group(owners) for key, owners in ties.items()}
        untied = {id(m): (names[key], [n or "<root>" for n, _ in owners]) for key, owners in ties.items()
                  if groups[key] is None for _, m in owners}
        # Parameters a layer without a rule uses as its base type would (an Embedding subclass that overrides forward,
        # tied to covered layers: BART's scaled embeddings before they had a rule): those layers are left out with it.
        unruled_users = {id(p): (clean_name(name), why_no_rule(module)) for name, module in model.named_modules()
                         if overrides_ruled_forward(module) for p in module.parameters(recurse=False)}
        owned: set[int] = set()  # submodules whose parameters their parent's rule covers (MHA's out_proj)
        for module in model.modules():
            rule = rule_for(module)
            if rule is not None and rule.owns_submodules:
                owned.update(id(sub) for sub in module.modules() if sub is not module)
        self.layers: list[tuple[str, nn.Module, NormRule]] = []  # (name, module, rule)
        self.row_keeping: list[tuple[str, nn.Module]] = []  # blocks whose output rows are their input's (keeps_rows_only)
        reasons: dict[str, str] = {}  # uncovered parameter -> why
        ruled: set[int] = set()  # parameters a module with a rule holds (its submodules' too)
        for name, module in model.named_modules():
            if id(module) in owned:
                continue
            rule = rule_for(module)
            if rule is not None and rule.keeps_rows_only:
                self.row_keeping.append((clean_name(name), module))
                continue
            if rule is not None:
                ruled.update(id(p) for p in module.parameters())
            # Every parameter, trainable or not: a layer frozen now may be unfrozen later.
            params = list(module.parameters(recurse=rule is not None and rule.owns_submodules))
            if not params:
                continue
            why = why_no_rule(module) if rule is None else rule.why_not(module)
            if why is None and id(module) in untied:
                tied_name, holders = untied[id(module)]
                why = (f"{tied_name} is tied (shared by {holders}): only embeddings tied with each other and with "
                       "one Linear head are covered")
            if why is None:
                shared = next((unruled_users[id(p)] for p in params if id(p) in unruled_users), None)
                if shared is not None:
                    why = f"its parameters are also {shared[0]}'s, which no rule covers ({shared[1]})"
            if why is None:
                self.layers.append((clean_name(name), module, rule))
            else:
                reasons.update({names[id(p)]: why for p in params})
        self.reasons = reasons  # parameter -> why no rule holds for it
        # Parameters a module with submodules uses itself (free_parameters): covered where each use is one the batch
        # tracking follows (found at run time, as a layer's provenance is); their "layer" is the parameter's name.
        self.free = free_parameters(model, ruled, clean_name) if follow_free else {}
        self._added: set[str] = set()  # layers added at run time (add_layer): their parameters are another layer's
        self.warned: set[str] = set()  # uncovered parameters already warned about
        self.skipped: set[str] = set()  # layers found not to be per-sample at run time
        self.checked_state: tuple | None = None  # what warn_uncovered last looked at
        self._types: tuple[tuple, dict[str, str]] | None = None  # (what it was computed for, layer_types())
        # Layers sharing a table exactly (tied_embedding): each member -> the others; other ties are not covered.
        self.ties: dict[str, tuple[str, ...]] = {}
        self._tie_first: dict[str, nn.Module] = {}  # a member -> the group's first covered layer (type_of)
        for group in groups.values():
            if group:
                self.tie(group)

    def add_layer(self, name: str, module: nn.Module, rule: NormRule) -> int:
        """Adds a layer found at run time (an embedding's table used as a head by its model: functional_head) whose
        parameters are a covered layer's; returns its index."""
        self.layers.append((name, module, rule))
        self._added.add(name)
        return len(self.layers) - 1

    def tie(self, names: list[str]) -> None:
        """Layers that share one table exactly (found by their modules, or at run time: an embedding and its table used
        as a head): each member's partners, and the group's first covered layer, whose type every part counts under."""
        for name in names:
            self.ties[name] = tuple(n for n in names if n != name)
        order = {name: (i, module) for i, (name, module, _) in enumerate(self.layers)}
        covered = [order[n] for n in names if n in order]
        if covered:
            first = min(covered, key=lambda im: im[0])[1]
            self._tie_first.update({name: first for name in names if name in order})
        self._types = None

    def skip(self, name: str, why: str) -> None:
        """Leaves layer `name` out of the norms from now on (with a warning; strict: RuntimeError), and the layer
        its weight is tied with: the norm of half a tied weight's gradient is no norm of it."""
        message = f"PerSampleGradNorms: layer '{name}' is not per-sample ({why}); excluded from the norms"
        others = self.ties.get(name, ())
        if others:
            message += f", with {list(others)}, whose weight it shares"
        if self.strict:
            raise RuntimeError(message)
        if name not in self.skipped:
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            self.skipped.add(name)
            self.skipped.update(others)

    def report(self, params: list[tuple[str, torch.Tensor]], param_names: dict[int, str]) -> dict[str, Any]:
        """Covered and uncovered parameters (name -> numel) as of now (requires_grad is read at each
        call), why each uncovered one is, and the layers found not to be per-sample at run time
        (their parameters count as uncovered)."""
        covered: dict[str, int] = {}
        reasons: dict[str, str] = {}
        for full, name, _, p in self._covered_parameters(param_names):
            if name in self.skipped:
                reasons[full] = SKIPPED
            else:
                covered[full] = p.numel()
        uncovered = {n: p.numel() for n, p in params if p.requires_grad and n not in covered}
        reasons = {n: reasons.get(n) or self.reasons.get(n, "not covered") for n in uncovered}
        return {
            "covered": covered,
            "uncovered": uncovered,
            "uncovered_reasons": reasons,
            "covered_numel": sum(covered.values()),
            "uncovered_numel": sum(uncovered.values()),
            "skipped_layers": sorted(self.skipped),
        }

    def layer_types(self, param_names: dict[int, str], params: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
        """The type of the layer whose rule covers each covered parameter (name -> "Linear", ...). Computed again
        only when some requires_grad or the skipped layers changed (or forget() was called): it is read every step."""
        state = (trainable_state(params), len(self.skipped))
        if self._types is None or self._types[0] != state:
            self._types = (state, {full: self.type_of(name, module) for full, name, module, _
                                   in self._covered_parameters(param_names) if name not in self.skipped})
        return dict(self._types[1])

    def type_of(self, name: str, module: nn.Module) -> str:
        """The layer type layer `name` counts under: its own, or for a member of a tied table the type of the group's
        first layer (every part and cross term of the table's gradient goes there: a cross term may be negative)."""
        first = self._tie_first.get(name)
        return layer_type_name(first if first is not None else module)

    def forget(self) -> None:
        """The parameters were replaced: what was derived from them is looked at again (warnings, layer types)."""
        self.checked_state = self._types = None

    def _covered_parameters(self, param_names: dict[int, str]):
        """(parameter name, layer name, layer, parameter) of every parameter a covered layer's rule is about."""
        for name, module, rule in self.layers:
            if name in self._added:
                continue
            attrs = None  # by attribute, when the object is not a named one: under FSDP2 the module holds sharded or
            for p in rule.params(module):  # unsharded parameter objects by turns
                full = param_names.get(id(p))
                if not full:
                    if attrs is None:
                        attrs = {id(q): attr for attr, q in module.named_parameters(recurse=rule.owns_submodules)}
                    full = f"{name}.{attrs[id(p)]}" if name else attrs[id(p)]
                yield full, name, module, p
        for full, p, owner in self.free_now():
            yield full, full, owner, p

    def free_now(self):
        """(name, parameter as its module holds it now, the module) of the free parameters that train now."""
        for full, (owner, attr) in self.free.items():
            p = getattr(owner, attr, None)
            if isinstance(p, torch.Tensor) and p.requires_grad:
                yield full, p, owner

    def warn_uncovered(self, error: type, stacklevel: int, params: list[tuple[str, torch.Tensor]],
                       param_names: dict[int, str]) -> None:
        """Warns (strict: raises `error`) about trainable parameters left out of the norms that were
        not warned about yet: at construction, and again when unfreezing adds some. Checked again
        only when some parameter's requires_grad (or the set of skipped layers) changed."""
        state = (trainable_state(params), len(self.skipped))
        if state == self.checked_state:
            return
        self.checked_state = state
        cov = self.report(params, param_names)
        # Parameters of layers found not to be per-sample at run time were warned about by _skip.
        new = [n for n in cov["uncovered"] if n not in self.warned and cov["uncovered_reasons"][n] != SKIPPED]
        if not new:
            return
        self.warned.update(new)
        listed = [f"{n} ({cov['uncovered_reasons'][n]})" for n in new[:8]]
        message = (f"PerSampleGradNorms: {len(new)} parameters ({sum(cov['uncovered'][n] for n in new):,} elements) "
                   f"are excluded from the norms: {listed}{' ...' if len(new) > 8 else ''}")
        if self.strict:
            raise error(message + " (strict=True)")
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)

