"""PerSampleGradNorms: the hooks that collect per-sample gradient norms.

A forward hook on every layer that a rule covers (gapmon.per_sample.rules) keeps the call's inputs A, and
a tensor hook on the output receives G = dL/d(output) during backward. Once every call of the
layer in the micro-batch has its G, the rule turns the calls into per-sample squared norms of
the layer's trainable parameters (calls concatenated, so that a module applied twice is exact),
they are added to a per-sample accumulator, and A is released.

Which samples: by provenance, not by size (gapmon.batch_provenance). The model's batched inputs
(its first tensor input, or those named by `batch_inputs`) carry the batch on `batch_dim`; during
the forward pass a TorchFunctionMode follows it through every op (a batch merged with other dims by a
reshape too). An embedding of ids every sample shares (position ids arange(T), even with T == B) is followed to
where its output joins the batch (shared_input). A layer whose input does not come from the batch otherwise,
whose batch was lost on the way (a reduction over it, an op without a rule), or sits on a dim the layer's rule cannot
take (Linear, LayerNorm and Embedding take any: sequence-first activations are exact) is not
per-sample: it is excluded, with a warning naming it and why (strict=True raises). Parameters of layers
without a rule are reported by coverage() as uncovered. A rule holds for its layer type and for subclasses that do
not override forward, and only for the parameters its math is about (a weight_norm'd or spectral_norm'd Linear or
convolution taken back through its normalisation; no other parametrization). A rule may cover its module's
submodules (nn.MultiheadAttention's out_proj, which it never calls). An embedding's table tied to a Linear head
(tie_word_embeddings, or F.linear(h, table) in the forward: functional_head) is exact, with the cross term of the
two parts (tied_embedding); other parameters shared by several modules are left out, named; one module reused under
several names is fine. Every layer a rule holds for is watched, frozen or not: coverage follows requires_grad at
each step. A layer that mixes the samples of a batch (BatchNorm using batch statistics) leaves no layer with
per-sample gradients: norms are refused.

Uses of a parameter outside its layer's forward (`F.linear(x, self.a.weight)` beside a call of the layer, a layer's
weight read by another module): a hook on every covered parameter sketches the gradient autograd
accumulates for it, and each rule sketches the sum of the per-sample gradients it saw (the same
random probe, NormRule.grad_sketch). When the two differ by more than the gradient's rounding
(USE_CHECK_RTOL) the parameter got contributions no rule saw: its layer (and the layers tied to it) is left out of
the norms, what it added taken back out, with a warning naming it (strict=True refuses); so is a layer none of whose
calls was seen while its parameters got gradients (used only functionally).
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _torch_compat
from ..config import PerSampleConfig
from ..utils import ParameterWatch, input_storages, name_cleaner
from .coverage import LayerCoverage, parameter_names, trainable_state
from .followed_through import followed_through, met_in_pointwise
from .free_parameters import FREE_UNSEEN, FreeParameterNorms
from .functional_head import FunctionalHeads
from .functional_layers import FunctionalLinearUses
from .gram import GradientProducts
from .layer_hooks import LayerHooks
from .lost_batch import refuse_upstream
from .micro_batch import (
    Collection,
    MicroBatch,
    batched_inputs,
    concatenated,
    given_batched,
    mark_more,
    refuse_before_backward,
    refuse_second_backward,
    tracker_of,
    without_input_gradient_only,
)
from .mixing import SampleMixing, refuse_batch_mixing
from .sample_ids import by_global_id
from .sample_ids import sample_ids as checked_sample_ids
from .use_check import UseChecker


class PerSampleGradNorms(GradientProducts):
    """Norms of per-sample gradients of the covered parameters, computed during backward.

    `local_norms()` returns ||∇θ loss_i|| for this rank's samples, in the order the forward passes
    saw them (micro-batches concatenated), where loss_i is sample i's own loss. The samples are
    along `batch_dim` of the model's first tensor input, or of each input `batch_inputs` names
    (positions or argument names: every input that holds per-sample data used by covered layers,
    e.g. ("input_ids", "timesteps"), each alone or paired with the dim that holds its samples:
    ("x", ("h0", 1))); the batch is followed from there by provenance. Only forward passes whose
    backward gives the parameters their gradients count (not an evaluation under no_grad, nor an
    adversarial attack's input gradient). With
    loss_reduction="mean" the loss is taken to be the mean of per-sample losses over each
    micro-batch (so the gradients are rescaled by the micro-batch size); with "sum", their sum.
    The accumulator restarts at the first forward pass after the norms were read, or on reset().
    The options are validated once, into `self.config` (a gapmon.PerSampleConfig);
    `PerSampleGradNorms.from_config(model, config)` takes one directly.
    """

    def __init__(self, model: nn.Module, loss_reduction: str = "mean", strict: bool = False,
                 process_group: dist.ProcessGroup | None = None, bookkeeping: bool = False,
                 batch_dim: int = 0, batch_inputs: Sequence[Any] | dict | None = None, gram: bool = False):
        self._setup(model, PerSampleConfig(loss_reduction=loss_reduction, strict=strict, process_group=process_group,
                                           bookkeeping=bookkeeping, batch_dim=batch_dim, batch_inputs=batch_inputs,
                                           gram=gram))

    @classmethod
    def from_config(cls, model: nn.Module, config: PerSampleConfig) -> "PerSampleGradNorms":
        """Per-sample norms of `model` with the options of `config` (a gapmon.PerSampleConfig)."""
        if not isinstance(config, PerSampleConfig):
            raise TypeError(f"PerSampleGradNorms.from_config: config must be a gapmon.PerSampleConfig, "
                            f"got {type(config).__name__}")
        # Through the constructor, so that a subclass's __init__ runs; the config it rebuilds equals `config`.
        return cls(model, **config.constructor_arguments())

    def _setup(self, model: nn.Module, config: PerSampleConfig) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"PerSampleGradNorms: model must be a torch.nn.Module, got {type(model).__name__}")
        self.config = config  # every option, read from here
        self.model = model
        self._state = Collection()
        self._checker = UseChecker(self._state)
        self._param_names: dict[int, str] = {}
        self._coverage: LayerCoverage | None = None  # needs the parameters' names: made just below
        self._derive_params()
        clean_name = name_cleaner(model)
        # (gram() and per_sample_gradients() are formed from the layers' positions: free parameters are left out there)
        self._coverage = LayerCoverage(model, self._param_names, clean_name, config.strict, follow_free=not config.gram)
        self._coverage.warn_uncovered(ValueError, 3, self._params, self._param_names)
        if config.gram and self._coverage.ties:
            raise ValueError(
                "PerSampleGradNorms(gram=True): the model ties one table across layers "
                f"({self._coverage.ties}); gram() and per_sample_gradients() do not form the products across "
                "them. local_norms() and global_norms() are exact with gram=False.")
        self._mixing = SampleMixing(model, self._state, clean_name)  # BatchNorm using batch statistics
        self._layer_hooks = LayerHooks(self._coverage.layers, self._state, self._checker, self._coverage,
                                       config.bookkeeping, keep_positions=config.gram)
        # A function of self (see keep_out_of_compiled_graphs), not a bound method: a deep copy calls it on its own copy.
        self._starts, self._untraced = PerSampleGradNorms._micro_batch_starts, False
        self.keep_out_of_compiled_graphs()
        self._root = model.register_forward_pre_hook(self._new_micro_batch, with_kwargs=True)
        self._mixing.watch_routing(model, clean_name)  # a MoE's load-balancing loss (after the root's hook)
        # An embedding's table used as a head's weight by the model's forward (F.linear(h, wte.weight)): tied to it then
        self._heads = FunctionalHeads(self._layer_hooks) if not config.gram else None
        functional = FunctionalLinearUses(self._coverage, self._checker, self._state) if not config.gram else None
        self._free = FreeParameterNorms(self._coverage, self._checker, self._state, functional)  # after the root's hook
        self._root_end = model.register_forward_hook(self._end_forward, always_call=True)
        self._explicit = False  # a micro-batch opened by begin_forward (the root hooks leave it alone)
        self._checker.hook_covered(self._coverage.layers, trainable_state(self._params))

    # The options, read from the config (one source of truth).
    loss_reduction = property(lambda self: self.config.loss_reduction, doc="config.loss_reduction")
    strict = property(lambda self: self.config.strict, doc="config.strict")
    bookkeeping = property(lambda self: self.config.bookkeeping, doc="config.bookkeeping")
    batch_dim = property(lambda self: self.config.batch_dim, doc="config.batch_dim")
    batch_inputs = property(lambda self: self.config.batch_inputs, doc="config.batch_inputs")

    @property
    def skipped(self) -> set[str]:
        """The layers found not to be per-sample at run time (excluded from the norms, with a warning)."""
        return self._coverage.skipped

    def _derive_params(self) -> None:
        """Names of the model's parameters (by identity). Re-derived when the
        parameters were replaced (meta-device init then to_empty, load_state_dict(assign=True),
        assignment): what was keyed by the old objects (probes, use checks, gradient hooks) is dropped."""
        model = self.model
        names = parameter_names(model)
        self._param_names.update(names)
        self._params = [(names[id(p)], p) for p in model.parameters()]
        self._checker.forget(self._param_names)
        if self._coverage is not None:  # warn again about what the new parameters leave out
            self._coverage.forget()
        self._watch = ParameterWatch(model)

    # ------------------------------------------------------------------ hooks
    def keep_out_of_compiled_graphs(self) -> None:
        """The hooks test `collecting` first and, traced by Dynamo, call the rest through torch.compiler.disable: on a
        skipped step a torch.compile'd model traces them as nothing (its graph stays whole); on a collected one they
        run eagerly at a graph break (traced, they graph-break inside anyway and recompile for every layer, up to
        Dynamo's limit, with warnings). The untraced forms are made once Dynamo is loaded (gapmon does not import it
        itself: ~1 s), looked at when made, at start() and after each read, outside compiled regions; run eagerly, the
        hooks call the plain forms (the wrapper, in every hook call, cost ~1 ms a step in place)."""
        if not self._untraced and _torch_compat.dynamo_loaded():
            self._untraced = True
            self._starts = _torch_compat.dynamo_disable(PerSampleGradNorms._micro_batch_starts)
        self._layer_hooks.keep_out_of_compiled_graphs()

    def _new_micro_batch(self, module, args, kwargs) -> None:
        if not self._state.collecting:
            return
        if torch.compiler.is_compiling():  # traced: the untraced form (see keep_out_of_compiled_graphs)
            self._starts(self, module, args, kwargs)
        else:  # eager: called directly, without the untraced form's wrapper
            self._micro_batch_starts(module, args, kwargs)

    def _micro_batch_starts(self, module, args, kwargs) -> None:
        # Activation-checkpoint recomputation, or the model run under torch.func.
        if _torch_compat.in_backward():
            # The whole model under reentrant checkpointing, whose first pass had no grad: that pass's micro-batch.
            mb = self._state.take_back(input_storages(args, kwargs)) if self._state.without_grad else None
            if mb is not None:
                if self._state.read:
                    self.reset()
                self._state.micro.append(mb)
            return
        if _torch_compat.functorch_transforms_active():
            return
        if self._explicit:  # begin_forward named this micro-batch's inputs already (the model runs inside it)
            return
        self._open_micro_batch(batched_inputs(module, args, kwargs, self.config.batch_input_dims(), self.batch_dim),
                               input_storages(args, kwargs), without_grad=not torch.is_grad_enabled())

    def _open_micro_batch(self, batched: list[tuple[torch.Tensor, int]], storages: set[int],
                          without_grad: bool = False) -> None:
        """Starts following a micro-batch whose samples lie along the given dim of each tensor of `batched`.
        `without_grad`: its forward runs with gradients off (an evaluation): set aside when it ends, and the norms
        read before stay readable."""
        if self._state.read and not without_grad:
            self.reset()
        if not self._state.micro and self._watch.changed():  # the first micro-batch of a step: parameters replaced?
            self._derive_params()
        self._checker.hook_covered(self._coverage.layers, trainable_state(self._params))
        batch, tracker = tracker_of(batched)
        mb = MicroBatch(batch, storages, {b.untyped_storage().data_ptr() for b in self.model.buffers()},
                        without_grad=without_grad)
        tracker.mixing = mb.mixing  # (a loss over pairs of samples is recorded there)
        tracker.lost_gradient = functools.partial(refuse_upstream, self._layer_hooks, mb)
        tracker.followed_through, tracker.met_in_pointwise = followed_through, met_in_pointwise
        self._free.follow(mb, tracker)
        self._state.open(mb, tracker)

    def begin_forward(self, *batched: torch.Tensor, dims: Sequence[int] | None = None) -> None:
        """Starts a micro-batch whose samples lie along `batch_dim` of each tensor of `batched` (or along the
        dim `dims` gives for each), for loops in which the watched module's own forward is not what runs the
        batch (a LightningModule whose training_step calls `self.model(...)`): the layers that run until
        end_forward() are followed from these tensors. The watched module's forward calls in between are part
        of this micro-batch."""
        pairs = given_batched(batched, dims, self.batch_dim)
        self.end_forward()
        if not self._state.collecting:
            return
        self._open_micro_batch(pairs, {t.untyped_storage().data_ptr() for t, _ in pairs})
        self._explicit = True

    def mark_batched(self, *tensors: torch.Tensor) -> None:
        """Declares more inputs of the forward pass now running as holding its micro-batch's samples on batch_dim: a
        trainer's collated batch, every tensor of which is per-sample (the Hugging Face integration marks them all,
        so that an encoder-decoder's labels, shifted into its decoder's ids, are followed without batch_inputs)."""
        tracking = self._state.tracking
        if tracking is None or not self._state.micro:
            return
        mark_more(tracking, tensors, self.batch_dim, self._state.micro[-1].batch)

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
        if not self._state.collecting:
            return
        if not self._state.micro:
            raise RuntimeError("PerSampleGradNorms.set_loss_weights: no micro-batch yet; call it after the forward pass")
        self._state.micro[-1].declare_weights(weights)

    def _end_forward(self, module, args, output) -> None:
        if module is not None and self._explicit:  # the model ran inside a begin_forward micro-batch: not its end
            return
        # (The forward raised when its always-called hook gets no output while an exception is being handled.)
        self._state.end_forward(module is not None and output is None and sys.exc_info()[1] is not None)

    # ------------------------------------------------------------------ results
    def start(self) -> None:
        """Collects from the next forward pass on, with the samples seen so far forgotten (GAPMonitor
        calls it at the begin_step of a monitored step)."""
        self.reset()
        self._state.collecting = True
        self.keep_out_of_compiled_graphs()

    def pause(self) -> None:
        """Stops collecting: the hooks return at once until start() (GAPMonitor pauses it on the steps
        it skips, so that they cost nothing). What was collected stays readable."""
        self._state.collecting = False

    @property
    def collecting(self) -> bool:
        """Whether the hooks collect (see start and pause)."""
        return self._state.collecting

    def reset(self) -> None:
        """Forgets the samples seen so far."""
        self._state.micro, self._state.without_grad = [], []
        self._state.read = self._state.collected = False
        self._checker.new_step()

    def local_norms(self) -> torch.Tensor:
        """[B_local] per-sample gradient norms of this rank's samples since the last reset: float64
        when the layers saw float64 gradients, else float32. Raises RuntimeError when a layer mixed
        the samples of the batch (BatchNorm using batch statistics)."""
        self._collect()
        return self._per_sample(lambda mb: mb.sq)

    def local_norms_by_layer_type(self) -> dict[str, torch.Tensor]:
        """local_norms() over the covered parameters of each layer type ({"Linear": [B_local], ...}): the
        norms of each sample's own loss restricted to those parameters (their squares add up to local_norms()**2)."""
        self._collect()
        types = sorted({t for mb in self._state.micro for t in mb.sq_by_type})
        return {t: self._per_sample(lambda mb, t=t: mb.sq_by_type.get(t)) for t in types}

    def loss_weights(self) -> torch.Tensor:
        """float64 [B_local]: each sample's weight w_i in the loss L = sum_i w_i loss_i of its micro-batch's backward
        (set_loss_weights, else 1/micro-batch size for loss_reduction "mean", 1 for "sum"), in local_norms() order."""
        parts = [mb.weights_or(self.loss_reduction) for mb in self._state.micro]
        return torch.cat([p.cpu() for p in parts]) if parts else torch.empty(0, dtype=torch.float64)

    def _collect(self) -> None:
        """Finishes what backward left (layers whose output got no gradient) after the checks that refuse
        wrong norms (batch-mixing layers, uncovered parameters under strict, uses no rule saw). Once per read."""
        if self._state.collected:
            return
        self.keep_out_of_compiled_graphs()
        self._state.read = True
        self._state.micro = without_input_gradient_only(self._state.micro)
        refuse_batch_mixing(self._state.micro)
        refuse_second_backward(self._state.micro)
        self._coverage.warn_uncovered(RuntimeError, 4, self._params, self._param_names)
        try:
            refuse_before_backward(self._state.micro)
        except RuntimeError:
            self._state.read = False  # the norms are still to come: the next forward does not start over
            raise
        for mb in self._state.micro:
            for index in list(mb.layers):  # calls whose output got no gradient add nothing
                self._layer_hooks.finish(index, mb)
        self._layer_hooks.shared.flush_refused()
        self._free.finish(self._state.micro)
        for layer, (why, partly) in self._checker.unseen_uses(self._coverage.skipped).items():
            self._coverage.skip(layer, FREE_UNSEEN if layer in self._coverage.free and not partly else why)
        # What the layers left out at run time added (an earlier micro-batch of the step, the layers tied to one found
        # wrong now) is taken back out: the norms are those of the parameters coverage() lists.
        for mb in self._state.micro:
            mb.drop(self._coverage.skipped)
        self._state.collected = True

    def _per_sample(self, squared) -> torch.Tensor:
        """The norms of each sample's own loss from squared(micro-batch), its squared norms, over micro-batches."""
        default = self._result_dtype()
        return concatenated([mb.own_loss_norms(squared(mb), self.loss_reduction, default) for mb in self._state.micro],
                            default)

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
        ids = checked_sample_ids(sample_ids)  # refused before the norms are read
        return by_global_id(ids, self.local_norms(), self.config.process_group)

    def coverage(self) -> dict[str, Any]:
        """Covered and uncovered parameters (name -> numel) as of now (requires_grad is read at each
        call), why each uncovered one is, and the layers found not to be per-sample at run time
        (their parameters count as uncovered)."""
        return self._coverage.report(self._params, self._param_names)

    def covered_gradients(self, names: Iterable[str] | None = None) -> list[tuple[str, torch.Tensor | None]]:
        """(name, .grad) of every covered parameter (as the model holds it: a DTensor under FSDP2), or of those
        of `names` (covered_layer_types()'s keys, when the caller has them already)."""
        covered = set(self._coverage.layer_types(self._param_names, self._params) if names is None else names)
        return [(n, p.grad) for n, p in self._params if n in covered]

    def covered_layer_types(self) -> dict[str, str]:
        """The layer type ("Linear", "Embedding", ...) of each covered parameter, as local_norms_by_layer_type groups them."""
        return self._coverage.layer_types(self._param_names, self._params)

    def close(self) -> None:
        """Removes the hooks."""
        for h in (self._root, self._root_end):
            h.remove()
        self._mixing.close()
        self._layer_hooks.close()
        self._free.close()
        if self._heads is not None:
            self._heads.close()
        self._checker.close()
        self._state.stop_tracking()
        self.reset()
