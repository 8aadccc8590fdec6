"""PerSampleGradNorms: the hooks that collect per-sample gradient norms.

A forward hook on every layer that a rule covers (gapmon.per_sample.rules) keeps the call's inputs A, and
a tensor hook on the output receives G = dL/d(output) during backward. Once every call of the
layer in the micro-batch has its G, the rule turns the calls into per-sample squared norms of
the layer's trainable parameters (calls concatenated, so that a module applied twice is exact),
they are added to a per-sample accumulator, and A is released.

Which samples: by provenance, not by size (gapmon.batch_provenance). The model's batched inputs
(its first tensor input, or those named by `batch_inputs`) carry the batch on `batch_dim`; during
the forward pass a TorchFunctionMode follows it through every op. A layer whose input does not
come from the batch (position ids arange(T), even with T == B), whose batch was lost on the way
(a reduction or reshape over it, an op without a rule), or sits on a dim the layer's rule cannot
take (Linear, LayerNorm and Embedding take any: sequence-first activations are exact) is not
per-sample: it is excluded, with a warning naming it and why (strict=True raises). Parameters of layers
without a rule are reported by coverage() as uncovered. A rule holds for its layer type and for
subclasses that do not override forward, and only for the parameters its math is about (no
weight_norm, no parametrization). A rule may cover its module's submodules (nn.MultiheadAttention's
out_proj, which it never calls). A parameter shared by several modules (tied weights) is refused;
one module reused under several names is fine. Every layer a rule holds for is watched, frozen or
not: coverage follows requires_grad at each step. A layer that mixes the samples of a batch
(BatchNorm using batch statistics) leaves no layer with per-sample gradients: norms are refused.

Uses of a parameter outside its layer's forward (`F.linear(h, self.tok.weight)`, a layer's weight
read by another module): a hook on every covered parameter sketches the gradient autograd
accumulates for it, and each rule sketches the sum of the per-sample gradients it saw (the same
random probe, NormRule.grad_sketch). Norms are refused when the two differ by more than
the gradient's rounding (USE_CHECK_RTOL): the parameter got contributions no rule saw.
"""
from __future__ import annotations

import functools
import inspect
import math
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _torch_compat
from ..config import PerSampleConfig
from ..utils import ParameterWatch, clean_named, first_input, first_tensor, is_dtensor, name_cleaner
from .batch_provenance import BatchTracker
from .rules import Call, NormRule, rule_for, sketch, sketch_rows, why_no_rule

_SKIPPED = "layer is not per-sample (see skipped_layers)"  # coverage()'s reason for a skipped layer's parameters

# Relative difference between a parameter's accumulated gradient and the sum of the per-sample
# gradients the rules saw (both sketched) above which the parameter had uses no rule saw; by the
# least precise dtype involved (bf16 autocast rounds the weight-gradient GEMM to 2^-9, whose
# sketches then differ by ~2e-3). A missed contribution smaller than this passes unseen.
USE_CHECK_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


class _UseCheck:
    """Sketches of one parameter's gradient: accumulated by autograd, and explained by the rules."""

    def __init__(self, name: str, layer: str, rows: int, device: torch.device):
        self.name, self.layer = name, layer
        self.total = torch.zeros(rows, dtype=torch.float64, device=device)
        self.explained = torch.zeros(rows, dtype=torch.float64, device=device)
        self.rtol = USE_CHECK_RTOL[torch.float64]
        self.repeats = 1
        self.unchecked: str | None = None  # why it cannot be checked (a rule without a sketch, a DTensor gradient)

    def widen(self, dtype: torch.dtype, repeats: int = 1) -> None:
        """Allows the rounding of `dtype`; a 16-bit gradient that adds `repeats` terms into one
        element outside a GEMM (an embedding row) rounds each add: its error grows as sqrt(repeats)."""
        rtol = USE_CHECK_RTOL.get(dtype, USE_CHECK_RTOL[torch.float32])
        if dtype in (torch.float16, torch.bfloat16):
            rtol *= max(1.0, math.sqrt(repeats))
        self.rtol = max(self.rtol, rtol)
        self.repeats = max(self.repeats, repeats)


@dataclass
class _LayerCalls:
    """The calls of one layer in one micro-batch, waiting for their output gradients."""

    calls: list[Call] = field(default_factory=list)
    grads: list[torch.Tensor | None] = field(default_factory=list)  # each call's output gradient, batch first
    dims: list[int] = field(default_factory=list)  # each call's batch dim
    in_forward: int = 0  # calls recorded in the forward pass (not recomputed by checkpointing)

    def add(self, call: Call, dim: int) -> int:
        """Records a call; returns its index."""
        self.calls.append(call)
        self.grads.append(None)
        self.dims.append(dim)
        return len(self.calls) - 1

    def complete(self) -> bool:
        return all(g is not None for g in self.grads)


@dataclass
class _MicroBatch:
    """What one forward pass of the model collected."""

    batch: int  # its number of samples
    inputs: set[int]  # storages of the model's own tensor inputs
    sq: torch.Tensor | None = None  # accumulated per-sample squared norms, float64
    dtype: torch.dtype | None = None  # the widest dtype the norms were summed in
    layers: dict[int, _LayerCalls] = field(default_factory=dict)  # layer index -> its calls
    mixing: set[str] = field(default_factory=set)  # layers that mixed the samples (BatchNorm)
    provenance: dict[int, set[tuple[int, str | None]]] = field(default_factory=dict)  # layer -> (batch dim, why not)
    weights: torch.Tensor | None = None  # float64 [batch]: the loss is sum_i weights[i] * loss_i (set_loss_weights)
    used: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer -> the parameters its forward used

    def add(self, sq: torch.Tensor, acc: torch.dtype) -> None:
        """Adds a layer's squared norms (float64, summed in `acc`)."""
        self.sq = sq if self.sq is None else self.sq + sq
        self.dtype = acc if self.dtype is None else torch.promote_types(self.dtype, acc)


@functools.lru_cache(maxsize=64)
def _positional_names(forward: Any, bound: bool) -> tuple[str, ...]:
    """Names of a forward's positional parameters (without self for a method), read once per function."""
    names = tuple(n for n, p in inspect.signature(forward).parameters.items()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    return names[1:] if bound else names


def _named_input(module: nn.Module, args: tuple, kwargs: dict, key: int | str) -> Any:
    """The root forward's argument `key`: a position, or a name (passed by keyword or by position)."""
    if isinstance(key, int):
        return args[key] if key < len(args) else None
    if key in kwargs:
        return kwargs[key]
    forward = module.forward
    names = _positional_names(getattr(forward, "__func__", forward), hasattr(forward, "__func__"))
    return args[names.index(key)] if key in names and names.index(key) < len(args) else None


def _batch_first(call: Call, dim: int) -> Call:
    """The call with the batch of its first input moved from `dim` to dim 0."""
    if not dim:
        return call
    if call.args:
        return Call((call.args[0].movedim(dim, 0), *call.args[1:]), call.kwargs)
    return Call(call.args, {**call.kwargs, "input": call.kwargs["input"].movedim(dim, 0)})


class PerSampleGradNorms:
    """Norms of per-sample gradients of the covered parameters, computed during backward.

    `local_norms()` returns ||∇θ loss_i|| for this rank's samples, in the order the forward passes
    saw them (micro-batches concatenated), where loss_i is sample i's own loss. The samples are
    along `batch_dim` of the model's first tensor input, or of each input `batch_inputs` names
    (positions or argument names: every input that holds per-sample data used by covered layers,
    e.g. ("input_ids", "timesteps")); the batch is followed from there by provenance. With
    loss_reduction="mean" the loss is taken to be the mean of per-sample losses over each
    micro-batch (so the gradients are rescaled by the micro-batch size); with "sum", their sum.
    The accumulator restarts at the first forward pass after the norms were read, or on reset().
    The options are validated once, into `self.config` (a gapmon.PerSampleConfig);
    `PerSampleGradNorms.from_config(model, config)` takes one directly.
    """

    def __init__(self, model: nn.Module, loss_reduction: str = "mean", strict: bool = False,
                 process_group: dist.ProcessGroup | None = None, bookkeeping: bool = False,
                 batch_dim: int = 0, batch_inputs: Sequence[int | str] | None = None):
        self._setup(model, PerSampleConfig(loss_reduction=loss_reduction, strict=strict, process_group=process_group,
                                           bookkeeping=bookkeeping, batch_dim=batch_dim, batch_inputs=batch_inputs))

    @classmethod
    def from_config(cls, model: nn.Module, config: PerSampleConfig) -> "PerSampleGradNorms":
        """Per-sample norms of `model` with the options of `config` (a gapmon.PerSampleConfig)."""
        if not isinstance(config, PerSampleConfig):
            raise TypeError(f"PerSampleGradNorms.from_config: config must be a gapmon.PerSampleConfig, "
                            f"got {type(config).__name__}")
        norms = cls.__new__(cls)
        cls._setup(norms, model, config)
        return norms

    def _setup(self, model: nn.Module, config: PerSampleConfig) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"PerSampleGradNorms: model must be a torch.nn.Module, got {type(model).__name__}")
        self.config = config
        self.batch_dim, self.batch_inputs = config.batch_dim, config.batch_inputs
        self.loss_reduction, self.bookkeeping, self.strict = config.loss_reduction, config.bookkeeping, config.strict
        self._group = config.process_group
        clean_name = name_cleaner(model)
        self.model = model
        self._derive_params()
        names = self._param_names
        owned: set[int] = set()  # submodules whose parameters their parent's rule covers (MHA's out_proj)
        for module in model.modules():
            rule = rule_for(module)
            if rule is not None and rule.owns_submodules:
                owned.update(id(sub) for sub in module.modules() if sub is not module)
        self._layers: list[tuple[str, nn.Module, Any]] = []  # (name, module, rule)
        reasons: dict[str, str] = {}  # uncovered parameter -> why
        for name, module in model.named_modules():
            if id(module) in owned:
                continue
            rule = rule_for(module)
            # Every parameter, trainable or not: a layer frozen now may be unfrozen later.
            params = list(module.parameters(recurse=rule is not None and rule.owns_submodules))
            if not params:
                continue
            why = why_no_rule(module) if rule is None else rule.why_not(module)
            if why is None:
                self._layers.append((clean_name(name), module, rule))
            else:
                reasons.update({names[id(p)]: why for p in params})
        self._reasons = reasons  # parameter -> why no rule holds for it
        self._warned: set[str] = set()  # uncovered parameters already warned about
        self.skipped: set[str] = set()  # layers found not to be per-sample at run time
        self._warn_uncovered(ValueError, stacklevel=3)
        # Layers that mix the samples of a batch when they use batch statistics.
        self._mixing = [m.register_forward_pre_hook(functools.partial(self._mixing_hook, clean_name(n)))
                        for n, m in model.named_modules() if isinstance(m, _torch_compat.BatchNormBase)]
        # Book-keeping replaces a Linear layer's output: its hook runs before every other forward hook,
        # so that they (a GAPMonitor's among them) see the output that gets the gradient.
        # The parameters each call uses, read before the forward: FSDP2 unshards them in its pre-forward
        # hook (always first) and may reshard them in a post-forward hook that runs before the hook below
        # (a layer wrapped as its own FSDP unit), after which the module holds its sharded parameters.
        self._pre_handles = [m.register_forward_pre_hook(functools.partial(self._pre_forward_hook, i))
                             for i, (_, m, _) in enumerate(self._layers)]
        self._handles = [m.register_forward_hook(functools.partial(self._forward_hook, i), with_kwargs=True,
                                                 prepend=config.bookkeeping)
                         for i, (_, m, _) in enumerate(self._layers)]
        self._root = model.register_forward_pre_hook(self._new_micro_batch, with_kwargs=True)
        self._root_end = model.register_forward_hook(self._end_forward, always_call=True)
        self._tracking: BatchTracker | None = None  # active during the model's forward pass
        self._explicit = False  # a micro-batch opened by begin_forward (the root hooks leave it alone)
        self._micro: list[_MicroBatch] = []
        self._read = False
        self._collecting = True  # off between pause() and start(): the hooks return at once
        self._hook_covered()

    def _derive_params(self) -> None:
        """Names of the model's parameters (by identity), refusing tied ones. Re-derived when the
        parameters were replaced (meta-device init then to_empty, load_state_dict(assign=True),
        assignment): what was keyed by the old objects (probes, use checks, gradient hooks) is dropped."""
        model = self.model
        clean_name = name_cleaner(model)
        names: dict[int, str] = {}  # a parameter reachable under several names keeps its first, as named_parameters()
        for n, p in clean_named(model, model.named_parameters(remove_duplicate=False), "parameters"):
            names.setdefault(id(p), n)
        # Tied weights: a parameter of several *different* modules. One module registered under
        # several names (a block reused in a ModuleList) is a module called several times: exact.
        owners: dict[int, dict[int, str]] = {}  # id(parameter) -> {id(module): module name}
        for name, module in model.named_modules(remove_duplicate=False):
            for p in module.parameters(recurse=False):
                owners.setdefault(id(p), {}).setdefault(id(module), clean_name(name) or "<root>")
        tied = {names[i]: list(mods.values()) for i, mods in owners.items() if len(mods) > 1}
        if tied:
            raise ValueError(
                "PerSampleGradNorms: tied parameters (shared by several modules) are not supported, their per-sample "
                f"gradient norms would be wrong: {tied}. Untie them or monitor a model without weight sharing."
            )
        self._param_names = {**getattr(self, "_param_names", {}), **names}
        self._params = [(names[id(p)], p) for p in model.parameters()]
        for handle in getattr(self, "_grad_hooks", {}).values():
            handle.remove()
        self._grad_hooks: dict[int, Any] = {}  # id(parameter) -> handle of its gradient hook
        self._probes: dict[int, torch.Tensor] = {}  # id(parameter) -> its random probe
        self._checks: dict[int, _UseCheck] = {}  # id(parameter) -> sketches since the last reset
        self._hooked_state: tuple | None = None
        self._checked_state: tuple | None = None  # what _warn_uncovered last looked at
        self._watch = ParameterWatch(model)

    # ------------------------------------------------------------------ hooks
    def _new_micro_batch(self, module, args, kwargs) -> None:
        # A skipped step, activation-checkpoint recomputation, or the model run under torch.func.
        if not self._collecting or _torch_compat.in_backward() or _torch_compat.functorch_transforms_active():
            return
        if self._explicit:  # begin_forward named this micro-batch's inputs already (the model runs inside it)
            return
        storages = {t.untyped_storage().data_ptr() for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)}
        self._open_micro_batch(self._batched_inputs(module, args, kwargs), storages)

    def _open_micro_batch(self, batched: list[torch.Tensor], storages: set[int]) -> None:
        """Starts following a micro-batch whose samples lie along batch_dim of every tensor of `batched`."""
        if self._read:
            self.reset()
        if not self._micro and self._watch.changed():  # the first micro-batch of a step: parameters replaced?
            self._derive_params()
        self._hook_covered()
        batch = batched[0].shape[self.batch_dim]
        tracker = BatchTracker(batch)
        for t in batched:
            if t.dim() <= self.batch_dim or t.shape[self.batch_dim] != batch:
                raise ValueError(f"PerSampleGradNorms: the batched inputs disagree: {list(t.shape)} has no dim "
                                 f"{self.batch_dim} of size {batch} (the first one's)")
            tracker.mark(t, self.batch_dim)
        if self._tracking is not None:  # a forward pass that raised before its end hook could run
            self._tracking.__exit__(None, None, None)
        self._tracking = tracker.__enter__()
        self._micro.append(_MicroBatch(batch, storages))

    def begin_forward(self, *batched: torch.Tensor) -> None:
        """Starts a micro-batch whose samples lie along `batch_dim` of each tensor of `batched`, for loops
        in which the watched module's own forward is not what runs the batch (a LightningModule whose
        training_step calls `self.model(...)`): the layers that run until end_forward() are followed
        from these tensors. The watched module's forward calls in between are part of this micro-batch."""
        tensors = [t for t in batched if isinstance(t, torch.Tensor)]
        if not tensors or tensors[0].dim() <= self.batch_dim:
            raise ValueError(f"PerSampleGradNorms.begin_forward: give the micro-batch's batched tensors (samples on dim "
                             f"{self.batch_dim}); got {[type(t).__name__ for t in batched]}")
        self.end_forward()
        if not self._collecting:
            return
        self._open_micro_batch(tensors, {t.untyped_storage().data_ptr() for t in tensors})
        self._explicit = True

    def end_forward(self) -> None:
        """Ends the micro-batch begin_forward started (call it after the forward pass, before backward)."""
        self._explicit = False
        self._end_forward(None, None, None)

    def set_loss_weights(self, weights: float | torch.Tensor) -> None:
        """Declares the loss of the latest micro-batch: the loss its backward() is called on is
        L = sum_i weights[i] * loss_i, where loss_i is sample i's own loss (a scalar weight: the same for
        every sample). Its per-sample norms are then ||grad L_i|| / |weights[i]| = ||grad loss_i||
        (0 for a sample of weight 0, which has no loss). Without it, loss_reduction says the weights:
        1 / (micro-batch size) for "mean", 1 for "sum". Call it after the micro-batch's forward pass and
        before local_norms() (the trainer integrations call it with the scaling their trainer applies:
        gradient accumulation, token-count normalisation)."""
        if not self._collecting:
            return
        if not self._micro:
            raise RuntimeError("PerSampleGradNorms.set_loss_weights: no micro-batch yet; call it after the forward pass")
        mb = self._micro[-1]
        w = torch.as_tensor(weights, dtype=torch.float64).detach().clone()  # a later in-place change is not ours
        if w.dim() == 0:
            w = w.expand(mb.batch)
        w = w.reshape(-1)
        if w.numel() != mb.batch:
            raise ValueError(f"PerSampleGradNorms.set_loss_weights: {w.numel()} weights for a micro-batch of {mb.batch} samples")
        if not bool(torch.isfinite(w).all()):
            raise ValueError("PerSampleGradNorms.set_loss_weights: the weights must be finite")
        mb.weights = w

    def _batched_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        if self.batch_inputs is None:
            x = first_input(args, kwargs)
            found = [] if x is None else [x]
        else:
            found = [_named_input(module, args, kwargs, key) for key in self.batch_inputs]
            missing = [k for k, t in zip(self.batch_inputs, found) if not isinstance(t, torch.Tensor)]
            if missing:
                raise ValueError(f"PerSampleGradNorms: batch_inputs {missing} are not tensor arguments of this "
                                 "forward call; name the forward's arguments that hold per-sample data")
        if not found or found[0].dim() <= self.batch_dim:
            raise ValueError(f"PerSampleGradNorms: the model's first tensor input gives the batch size (dim "
                             f"{self.batch_dim}), but this forward call has no tensor input with that dim")
        return found

    def _end_forward(self, module, args, output) -> None:
        if module is not None and self._explicit:  # the model ran inside a begin_forward micro-batch: not its end
            return
        if self._tracking is not None:
            self._tracking.__exit__(None, None, None)
            self._tracking = None

    def _batch_dim(self, index: int, mb: _MicroBatch, module: nn.Module, rule: NormRule, args: tuple,
                   kwargs: dict) -> tuple[int, str | None]:
        """(dim of the call's batch, None) or (0, why it is not per-sample), by the inputs' provenance."""
        if self._tracking is None:  # outside the model's forward pass: activation checkpointing recomputes
            seen = mb.provenance.get(index, set())
            if len(seen) == 1:
                return next(iter(seen))
            return 0, ("its batch dim could not be followed: the layer ran outside the model's forward pass"
                       if not seen else "its calls have their batch on different dims")
        found = None
        for t, want in rule.batch_operands(module, Call(tuple(args), dict(kwargs))):
            if not isinstance(t, torch.Tensor):
                continue
            status = self._tracking.status(t)
            if want is None and status is not None:  # from the batch, on a dim the rule finds itself
                found = found or (0, None)
            elif isinstance(status, str):
                found = (0, f"the batch dim of its input was lost at {status}")
            elif status is None:
                found = (0, f"its input {list(t.shape)} does not come from the model's batched inputs (e.g. position "
                            "ids shared by every sample); name per-sample model inputs in batch_inputs=")
            elif want is not None and status != want and not (rule.moves_batch and want == 0):
                found = (0, f"its input {list(t.shape)} has the batch on dim {status}, not {want}")
            elif found is None:  # a rule that moves the batch takes it on any dim; the others where they want it
                found = (status if rule.moves_batch and want == 0 else 0, None)
            if found[1] is not None:
                break
        found = found or (0, None)
        mb.provenance.setdefault(index, set()).add(found)
        return found

    def _mixing_hook(self, name: str, module: nn.Module, args) -> None:
        # As F.batch_norm decides: batch statistics in training mode, or without running statistics.
        uses_batch = module.training or (module.running_mean is None and module.running_var is None)
        if uses_batch and self._collecting and self._micro and not _torch_compat.functorch_transforms_active():
            self._micro[-1].mixing.add(f"{name} ({type(module).__name__})")

    def _pre_forward_hook(self, index: int, module: nn.Module, args) -> None:
        if self._collecting and self._micro and not _torch_compat.functorch_transforms_active():
            self._micro[-1].used[index] = self._layers[index][2].params(module)

    def _forward_hook(self, index: int, module: nn.Module, args, kwargs, output) -> torch.Tensor | None:
        outputs = output
        output = first_tensor(output)  # nn.MultiheadAttention returns (output, weights)
        if not self._collecting or not self._micro:
            return
        if _torch_compat.functorch_transforms_active():  # e.g. the model run under torch.func.vmap
            return
        if output is None:  # nothing to hook: a layer that still trains is left out, saying why
            name, _, rule = self._layers[index]
            if rule.params(module):
                packed = isinstance(outputs, nn.utils.rnn.PackedSequence) or (
                    isinstance(outputs, tuple) and any(isinstance(o, nn.utils.rnn.PackedSequence) for o in outputs))
                self._skip(name, "its output is a packed sequence (its time steps interleave the samples); pad it instead"
                           if packed else "its output holds no tensor gapmon can follow")
            return
        if not output.requires_grad:  # reentrant checkpointing's no-grad pass: the provenance is needed later
            self._batch_dim(index, self._micro[-1], module, self._layers[index][2], args, kwargs)
            return
        name, _, rule = self._layers[index]
        mb = self._micro[-1]
        if mb.batch == 0:  # an empty micro-batch: no sample, nothing to follow (local_norms gives none)
            return
        dim, why = self._batch_dim(index, mb, module, rule, args, kwargs)
        params = mb.used.get(index)
        if params is None:
            params = mb.used[index] = rule.params(module)
        if not params:  # frozen now: nothing to measure (watched in case it is unfrozen)
            return
        for p in params:  # under FSDP2, the unsharded parameters the forward uses
            if id(p) not in self._grad_hooks:
                self._hook(p, name)
        if why is not None:
            self._skip(name, why)
            return
        call = _batch_first(Call(*_torch_compat.tree_map_tensors(torch.Tensor.detach, (tuple(args), dict(kwargs)))), dim)
        why = rule.not_per_sample(module, call, output.movedim(dim, 0), mb.batch, mb.inputs)
        if why is not None:
            self._skip(name, why)
            return
        calls = mb.layers.setdefault(index, _LayerCalls())
        # A forward inside backward is activation checkpointing recomputing the layer. Non-reentrant
        # checkpointing recorded the calls in the forward pass already (their outputs get the
        # gradients); reentrant checkpointing ran that pass without grad, so the recomputed calls
        # are the ones whose outputs get gradients.
        # (Inside a torch.compile'd region this is the forward pass: Dynamo cannot trace the check, and
        # the compiled region is not recomputed by checkpointing.)
        if torch.compiler.is_compiling() or not _torch_compat.in_backward():
            calls.in_forward += 1
        elif calls.in_forward:
            return
        at = calls.add(call, dim)
        if self.bookkeeping and not dim:
            replaced = rule.bookkeep(module, args[0] if args else kwargs.get("input"), output,
                                     functools.partial(self._bookkept, index, mb, at))
            if replaced is not None:
                return replaced
        graded = rule.graded_outputs(module, outputs)
        if len(graded) == 1:
            output.register_hook(functools.partial(self._backward_hook, index, mb, at))
            return None
        # Several outputs carry the loss (an RNN's sequence and its final states): one hook gets all their
        # gradients at once (None for an output the loss does not use).
        live = [i for i, t in enumerate(graded) if t.requires_grad]

        def all_grads(grads, index=index, mb=mb, at=at, live=live, n=len(graded)):
            full = [None] * n
            for i, g in zip(live, grads):
                full[i] = g
            self._backward_hook(index, mb, at, tuple(full))

        torch.autograd.graph.register_multi_grad_hook([graded[i] for i in live], all_grads, mode="all")
        return None

    def _backward_hook(self, index: int, mb: _MicroBatch, call: int, g: torch.Tensor) -> None:
        calls = mb.layers.get(index)
        if calls is None or calls.grads[call] is not None:
            raise RuntimeError(
                "PerSampleGradNorms: a second backward pass through the same forward pass (retain_graph=True) "
                "is not supported: the per-sample gradients of the two passes add, so their norms cannot be "
                "combined. Sum the losses and call backward once."
            )
        if isinstance(g, tuple):  # a rule of several outputs (graded_outputs) reads its layout itself
            calls.grads[call] = tuple(None if t is None else t.detach() for t in g)
        else:
            calls.grads[call] = g.detach().movedim(calls.dims[call], 0)
        if calls.complete():
            self._finish(index, mb)

    def _bookkept(self, index: int, mb: _MicroBatch, call: int, g: torch.Tensor, weight_sq: torch.Tensor | None,
                  weight_grad: torch.Tensor | None = None) -> None:
        """BookkeepingLinear's backward of call `call` of layer `index`: g is the output gradient
        [B, T, p], weight_sq the weight part of the squared norms and weight_grad the weight gradient
        (the sum of the per-sample gradients it formed: the use check sketches it, not them again)."""
        calls = mb.layers.get(index)
        if calls is not None and len(calls.calls) > 1:
            # The layer ran several times: its per-sample gradient is the sum over the calls, whose
            # norm needs all their gradients together (the weight gradient itself is exact).
            self._backward_hook(index, mb, call, g)
            return
        if calls is None or calls.grads[call] is not None:
            self._backward_hook(index, mb, call, g)  # raises: a second backward through this call
        record = mb.layers.pop(index)
        _, module, rule = self._layers[index]
        acc = torch.float64 if g.dtype == torch.float64 else torch.float32
        with torch.no_grad():
            sq = rule.bookkept_norm_sq(module, g, weight_sq).double()
            self._explain(index, mb, rule.positions(module, record.calls[call], g, acc), g.dtype, weight_grad)
        mb.add(sq, acc)

    def _finish(self, index: int, mb: _MicroBatch) -> None:
        """Squared norms of layer `index` from the calls that got a gradient; releases the inputs."""
        calls = mb.layers.pop(index)
        _, module, rule = self._layers[index]
        pairs = [(call, g) for call, g in zip(calls.calls, calls.grads) if g is not None]
        if not pairs:
            return
        with torch.no_grad():
            acc = torch.float64 if any(_dtype_of(g) == torch.float64 for _, g in pairs) else torch.float32
            pieces = [rule.positions(module, call, g, acc) for call, g in pairs]
            for piece, (_, g) in zip(pieces, pairs):  # per call: autograd sums each call's gradient as it is
                self._explain(index, mb, piece, _dtype_of(g))
            pos = pieces[0] if len(pieces) == 1 else tuple(torch.cat(parts, dim=1) for parts in zip(*pieces))
            sq = rule.norm_sq(module, pos).double()
        mb.add(sq, acc)

    # ------------------------------------------------------------------ uses outside the rules
    def _hook_covered(self) -> None:
        """Hooks the gradient of every covered trainable parameter, so that a use the rules never see
        (its layer's forward never ran) is counted too. Looked at again only when requires_grad changed."""
        state = self._trainable_state()
        if state == self._hooked_state:
            return
        self._hooked_state = state
        for name, module, rule in self._layers:
            for p in rule.params(module):
                if id(p) not in self._grad_hooks:
                    self._hook(p, name)

    def _hook(self, p: torch.Tensor, layer: str) -> None:
        # A weak reference: the hook lives on the parameter and must not keep it alive.
        self._grad_hooks[id(p)] = p.register_hook(functools.partial(self._accumulated, weakref.ref(p), layer))

    def _probe(self, p: torch.Tensor) -> torch.Tensor:
        """The fixed random probe of parameter p (one per parameter, drawn once, seeded)."""
        r = self._probes.get(id(p))
        if r is None:
            dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
            gen = torch.Generator(device=p.device).manual_seed(0x9E3779B9 + len(self._probes))
            width = p.numel() // max(sketch_rows(p), 1) if p.numel() else 0
            r = self._probes[id(p)] = torch.randn(width, generator=gen, dtype=dtype, device=p.device)
        return r

    def _check(self, p: torch.Tensor, layer: str) -> _UseCheck:
        check = self._checks.get(id(p))
        if check is None:
            name = self._param_names.get(id(p), f"{layer} parameter {list(p.shape)}")  # FSDP2: unsharded parameters
            check = self._checks[id(p)] = _UseCheck(name, layer, sketch_rows(p), p.device)
            check.widen(p.dtype)
        return check

    def _accumulated(self, ref: weakref.ref, layer: str, grad: torch.Tensor) -> None:
        """Gradient hook of a covered parameter: sketches what autograd accumulates for it."""
        p = ref()
        if (not self._collecting or grad is None or p is None or p.numel() == 0
                or _torch_compat.functorch_transforms_active()):
            return
        check = self._check(p, layer)
        if is_dtensor(grad):
            check.unchecked = "its gradient is a DTensor"
            return
        with torch.no_grad():
            if grad.layout == torch.sparse_coo:  # Embedding(sparse=True)
                grad = grad.coalesce()
                r = self._probe(p)
                vals = grad.values().reshape(grad.values().shape[0], -1).to(r.dtype) @ r
                check.total += torch.zeros_like(check.total).index_add_(0, grad.indices()[0], vals.double())
            else:
                check.total += sketch(grad, self._probe(p))
        check.widen(grad.dtype, check.repeats)

    def _explain(self, index: int, mb: _MicroBatch, piece: tuple, dtype: torch.dtype,
                 weight_grad: torch.Tensor | None = None) -> None:
        """Adds the sum over samples of one call's per-sample gradients (sketched) to its parameters: to
        the parameter objects the forward used (under FSDP2 the module may hold other ones by now)."""
        name, module, rule = self._layers[index]
        now = rule.params(module)
        used = mb.used.get(index, now)
        as_used = {id(p): u for p, u in zip(now, used)} if len(used) == len(now) else {}
        probe = lambda p: self._probe(as_used.get(id(p), p))  # noqa: E731
        sketches = (rule.grad_sketch(module, piece, probe) if weight_grad is None
                    else rule.bookkept_sketch(module, piece, weight_grad, probe))
        if sketches is None:
            for p in used:
                self._check(p, name).unchecked = f"{type(rule).__name__} gives no grad_sketch"
            return
        for p, s, repeats in sketches:
            check = self._check(as_used.get(id(p), p), name)
            check.explained += s
            check.widen(dtype, repeats)

    def _refuse_unseen_uses(self) -> None:
        """Raises RuntimeError naming the covered parameters whose gradient got contributions that no
        rule saw (the parameter was used outside its layer's forward): their norms would be wrong."""
        # Parameters of layers found not to be per-sample are out of the norms already.
        checks = [c for c in self._checks.values() if c.unchecked is None and c.layer not in self.skipped]
        if not checks:
            return
        with torch.no_grad():
            diff = torch.stack([(c.total - c.explained).norm() for c in checks])
            size = torch.stack([torch.maximum(c.total.norm(), c.explained.norm()) for c in checks])
            bad = (diff > size * torch.tensor([c.rtol for c in checks], dtype=torch.float64, device=diff.device))
            bad = bad.cpu().tolist()  # one device-to-host read
        if not any(bad):
            return
        rel = (diff / size.clamp(min=torch.finfo(torch.float64).tiny)).cpu().tolist()
        named = [f"{c.name} (relative difference {r:.2g})" for c, r, b in zip(checks, rel, bad) if b]
        raise RuntimeError(
            f"PerSampleGradNorms: the gradient of {', '.join(named)} has contributions that "
            "no per-sample rule saw: the parameter is used outside its layer's forward (e.g. F.linear(h, "
            "self.tok.weight), or a layer's weight read by another module), so its per-sample norms would be wrong "
            "and none are returned. Call the layer itself (tie weights by sharing the module), or freeze the "
            "parameter.")

    def _skip(self, name: str, why: str) -> None:
        message = f"PerSampleGradNorms: layer '{name}' is not per-sample ({why}); excluded from the norms"
        if self.strict:
            raise RuntimeError(message)
        if name not in self.skipped:
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            self.skipped.add(name)

    # ------------------------------------------------------------------ results
    def start(self) -> None:
        """Collects from the next forward pass on, with the samples seen so far forgotten (GAPMonitor
        calls it at the begin_step of a monitored step)."""
        self.reset()
        self._collecting = True

    def pause(self) -> None:
        """Stops collecting: the hooks return at once until start() (GAPMonitor pauses it on the steps
        it skips, so that they cost nothing). What was collected stays readable."""
        self._collecting = False

    @property
    def collecting(self) -> bool:
        """Whether the hooks collect (see start and pause)."""
        return self._collecting

    def reset(self) -> None:
        """Forgets the samples seen so far."""
        self._micro = []
        self._read = False
        self._checks = {}

    def local_norms(self) -> torch.Tensor:
        """[B_local] per-sample gradient norms of this rank's samples since the last reset: float64
        when the layers saw float64 gradients, else float32. Raises RuntimeError when a layer mixed
        the samples of the batch (BatchNorm using batch statistics)."""
        self._read = True
        mixing = sorted({name for mb in self._micro for name in mb.mixing})
        if mixing:
            raise RuntimeError(
                f"PerSampleGradNorms: {', '.join(mixing)} normalises with statistics of the whole batch, which mixes "
                "the samples: no layer has per-sample gradients of the form gapmon computes, so no norms are "
                "returned. Put it in eval mode (running statistics), or replace it (GroupNorm, LayerNorm).")
        self._warn_uncovered(RuntimeError, stacklevel=3)
        waiting = [mb for mb in self._micro if mb.sq is None and mb.layers
                   and not any(g is not None for calls in mb.layers.values() for g in calls.grads)]
        if waiting:  # no recorded call of a micro-batch has its gradient yet: backward has not run through it
            self._read = False
            raise RuntimeError(
                f"PerSampleGradNorms.local_norms: {len(waiting)} micro-batch(es) of {sum(mb.batch for mb in waiting)} "
                "samples have had no backward pass yet; call it after loss.backward()")
        parts = []
        for mb in self._micro:
            for index in list(mb.layers):  # calls whose output got no gradient add nothing
                self._finish(index, mb)
        self._refuse_unseen_uses()
        for mb in self._micro:
            if mb.sq is None:  # no covered layer was per-sample (all excluded or frozen): one 0 per sample
                parts.append(torch.zeros(mb.batch, dtype=self._result_dtype()))
                continue
            if mb.weights is not None:
                w = mb.weights.to(mb.sq.device).abs()
                norms = torch.where(w > 0, mb.sq.sqrt() / w.clamp(min=torch.finfo(torch.float64).tiny), 0.0)
            else:
                norms = (mb.sq * (mb.batch ** 2 if self.loss_reduction == "mean" else 1)).sqrt()
            parts.append(norms.to(mb.dtype))
        if not parts:
            return torch.empty(0, dtype=self._result_dtype())
        dtype = functools.reduce(torch.promote_types, [p.dtype for p in parts])
        device = next((p.device for p in parts if p.numel()), parts[0].device)
        return torch.cat([p.to(device, dtype) for p in parts])

    def _result_dtype(self) -> torch.dtype:
        """The dtype of norms no layer computed: float64 for a float64 model, else float32."""
        floats = [p.dtype for _, p in self._params if p.is_floating_point()]
        return torch.float64 if floats and all(d == torch.float64 for d in floats) else torch.float32

    def global_norms(self, sample_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, norms) of every rank's samples, ordered by global sample id, each sample once.

        `sample_ids` are the global ids of this rank's samples, in local_norms() order. Ranks that saw
        different samples are all-gathered and reordered (never summed: that would inflate norms by
        sqrt(world size)); samples seen by several ranks (replicated data) appear once.
        """
        ids = _sample_ids(sample_ids)
        norms = self.local_norms()
        if ids.numel() != norms.numel():
            raise ValueError(f"PerSampleGradNorms.global_norms: got {ids.numel()} sample ids for {norms.numel()} samples")
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self._group) > 1:
            ids, norms = _all_gather_varlen(ids, norms, self._group)
        order = torch.argsort(ids, stable=True)
        ids, norms = ids[order], norms[order]
        keep = torch.ones_like(ids, dtype=torch.bool)
        keep[1:] = ids[1:] != ids[:-1]
        return ids[keep], norms[keep]

    def coverage(self) -> dict[str, Any]:
        """Covered and uncovered parameters (name -> numel) as of now (requires_grad is read at each
        call), why each uncovered one is, and the layers found not to be per-sample at run time
        (their parameters count as uncovered)."""
        covered: dict[str, int] = {}
        reasons: dict[str, str] = {}
        for name, module, rule in self._layers:
            # By attribute: under FSDP2 the module holds sharded or unsharded parameter objects by turns.
            attrs = {id(p): attr for attr, p in module.named_parameters(recurse=rule.owns_submodules)}
            for p in rule.params(module):
                full = self._param_names.get(id(p)) or (f"{name}.{attrs[id(p)]}" if name else attrs[id(p)])
                if name in self.skipped:
                    reasons[full] = _SKIPPED
                else:
                    covered[full] = p.numel()
        uncovered = {n: p.numel() for n, p in self._params if p.requires_grad and n not in covered}
        reasons = {n: reasons.get(n) or self._reasons.get(n, "not covered") for n in uncovered}
        return {
            "covered": covered,
            "uncovered": uncovered,
            "uncovered_reasons": reasons,
            "covered_numel": sum(covered.values()),
            "uncovered_numel": sum(uncovered.values()),
            "skipped_layers": sorted(self.skipped),
        }

    def _trainable_state(self) -> tuple[bool, ...]:
        """Every parameter's requires_grad: what coverage and the gradient hooks follow between steps."""
        return tuple(p.requires_grad for _, p in self._params)

    def _warn_uncovered(self, error: type, stacklevel: int) -> None:
        """Warns (strict: raises `error`) about trainable parameters left out of the norms that were
        not warned about yet: at construction, and again when unfreezing adds some. Checked again
        only when some parameter's requires_grad (or the set of skipped layers) changed."""
        state = (self._trainable_state(), len(self.skipped))
        if state == self._checked_state:
            return
        self._checked_state = state
        cov = self.coverage()
        # Parameters of layers found not to be per-sample at run time were warned about by _skip.
        new = [n for n in cov["uncovered"] if n not in self._warned and cov["uncovered_reasons"][n] != _SKIPPED]
        if not new:
            return
        self._warned.update(new)
        listed = [f"{n} ({cov['uncovered_reasons'][n]})" for n in new[:8]]
        message = (f"PerSampleGradNorms: {len(new)} parameters ({sum(cov['uncovered'][n] for n in new):,} elements) "
                   f"are excluded from the norms: {listed}{' ...' if len(new) > 8 else ''}")
        if self.strict:
            raise error(message + " (strict=True)")
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)

    def close(self) -> None:
        """Removes the hooks."""
        for h in (*self._handles, *self._pre_handles, *self._mixing, *self._grad_hooks.values(), self._root, self._root_end):
            h.remove()
        self._handles.clear()
        self._pre_handles.clear()
        self._mixing.clear()
        self._grad_hooks.clear()
        if self._tracking is not None:
            self._tracking.__exit__(None, None, None)
            self._tracking = None
        self.reset()


def _dtype_of(g: torch.Tensor | tuple) -> torch.dtype:
    """The dtype of an output gradient, or the widest of several (a rule of several outputs)."""
    if isinstance(g, torch.Tensor):
        return g.dtype
    return functools.reduce(torch.promote_types, [t.dtype for t in g if t is not None], torch.float16)


def _sample_ids(sample_ids: Any) -> torch.Tensor:
    """Sample ids as an int64 vector, exact (ids of any size a 64-bit integer holds); ValueError naming
    ids that are not integers, or that repeat (each of this rank's samples has its own id)."""
    ids = torch.as_tensor(sample_ids).detach().reshape(-1).cpu()
    if ids.dtype == torch.bool or ids.is_complex():
        raise TypeError(f"PerSampleGradNorms.global_norms: sample ids must be integers, got {ids.dtype}")
    if ids.is_floating_point():
        fractional = ids[(ids != ids.trunc()) | ~torch.isfinite(ids)]
        if fractional.numel():
            raise ValueError(f"PerSampleGradNorms.global_norms: sample ids must be integers, got {fractional[:8].tolist()}")
        if ids.numel() and ids.abs().max() >= 2.0 ** 53:
            raise ValueError("PerSampleGradNorms.global_norms: float sample ids of 2^53 or more are not exact; pass "
                             "them as an integer tensor (torch.int64) or Python ints")
    ids = ids.to(torch.int64)
    unique, counts = torch.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"PerSampleGradNorms.global_norms: sample ids repeat on this rank: {unique[counts > 1][:8].tolist()} "
                         "(each sample needs its own id; a sample seen twice would be reported once)")
    return ids


def _all_gather_varlen(ids: torch.Tensor, norms: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gathers per-rank vectors of different lengths: ids as int64 (exact), norms as float64, returned
    in the dtype of this rank's norms."""
    device = norms.device if norms.device.type != "cpu" or dist.get_backend(group) == "gloo" else torch.device("cuda")
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([ids.numel()], device=device), group=group)
    counts = torch.cat(sizes).tolist()  # one host read for all ranks
    longest = int(max(counts))
    # One all-gather: int64 ids beside the bits of float64 norms (both exact).
    padded = torch.zeros(2, longest, dtype=torch.int64, device=device)
    padded[0, : ids.numel()] = ids.to(device)
    padded[1, : norms.numel()] = norms.to(device, torch.float64).view(torch.int64)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    gathered = torch.cat([p[:, : int(n)] for p, n in zip(parts, counts)], dim=1).cpu()
    return gathered[0], gathered[1].view(torch.float64).to(norms.dtype)
