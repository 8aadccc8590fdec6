"""The layer hooks of PerSampleGradNorms: a forward hook on every covered layer keeps each call's inputs
(after checking by provenance that its batch dim is known), a tensor hook on its output receives the
output gradient in backward, and once every call of the layer has its gradient the rule turns them into
per-sample squared norms, added to the micro-batch's accumulator."""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn

from .. import _torch_compat
from ..utils import first_tensor
from . import shared_input, tied_embedding
from .batch_provenance import BatchTracker, Merged, Shared
from .coverage import LayerCoverage
from .free_parameters import joined_where_expanded
from .grad_hooks import hook_gradient
from .lost_batch import enter_ruled, leave_ruled
from .micro_batch import Collection, LayerCalls, MicroBatch, batch_first, sample_first
from .rules import Call, NormRule, gradient_dtype
from .use_check import UseChecker


def rows_kept(tracking, args, kwargs, output: torch.Tensor | None) -> None:
    """A layer whose rule holds works row by row over its input's leading dims (moves_batch): its output has the
    batch where its input has it, whatever the layer did inside. The tracking may have lost it there (Hugging
    Face's Conv1D merges the rows into one dim for addmm and splits them again; a mixture of experts gathers rows
    per expert and adds them back into a new tensor): it is restored, merged with the dims after it where the input's
    is (transformers' experts take the tokens' rows [B·T, d])."""
    if output is None:
        return
    status = tracking.status(output)
    if status is not None and not isinstance(status, str):  # followed already (a dim, merged, shared)
        return
    x = args[0] if args else kwargs.get("input")
    dim = tracking.status(x) if isinstance(x, torch.Tensor) else None
    at = dim.dim if type(dim) is Merged else dim
    if type(at) is int and at < min(x.dim(), output.dim()) and output.shape[:at + 1] == x.shape[:at + 1]:
        tracking.mark(output, dim)


class NotFromBatch(str):
    """Why a call is not per-sample when its input does not come from the batch (a constant the forward makes, an
    unnamed model input): the call adds to its layer's gradients only through its output's gradient, so the layer is
    refused once one arrives (SharedInputs.refuse_once_graded), not at the call. DoRA runs lora_A and lora_B on an
    identity matrix to form the adapted weight's norm and detaches it: that call changes no gradient."""

    @classmethod
    def of(cls, t: torch.Tensor, batch: int) -> "NotFromBatch":
        if batch > 1 and batch not in t.shape:  # the same for every sample: a table, or a transform of a parameter
            return cls(f"its input {list(t.shape)} does not come from the model's batched inputs and has no dim of the "
                       f"batch's size ({batch}): it is the same for every sample (a table of relative positions, a "
                       "parameter's transform), and no rule follows a layer's per-sample gradients from there")
        return cls(f"its input {list(t.shape)} does not come from the model's batched inputs (e.g. position ids shared "
                   "by every sample); name per-sample model inputs in batch_inputs=")


def _takes_as_it_is(rule: NormRule, status: int | Merged, want: int | None) -> bool:
    """Whether the rule takes its operand's batch where it is (the call then given with it on dim 0): a rule that
    moves the batch takes it on any dim (merged with rows too), one of merged rows (an RNN) merged where it wants it."""
    return (rule.moves_batch and want == 0) or (rule.merged_rows and type(status) is Merged and status.dim == want)


def call_batch_dim(tracking: BatchTracker | None, index: int, mb: MicroBatch, module: nn.Module, rule: NormRule,
                   args: tuple, kwargs: dict) -> tuple[int, str | None]:
    """(dim of layer `index`'s call's batch, None) or (0, why it is not per-sample), by the inputs' provenance in
    `tracking` (None: outside the model's forward pass)."""
    if tracking is None:  # outside the model's forward pass: activation checkpointing recomputes
        seen = mb.provenance.get(index, set())
        if len(seen) == 1:
            return next(iter(seen))
        return 0, ("its batch dim could not be followed: the layer ran outside the model's forward pass"
                   if not seen else "its calls have their batch on different dims")
    found = None
    for t, want in rule.batch_operands(module, Call(tuple(args), dict(kwargs))):
        if not isinstance(t, torch.Tensor):
            continue
        status = tracking.status(t)
        if status is None and mb.batch == 1 and t.dim() and t.shape[0] == 1 and want in (0, None):
            status = 0  # one sample: an input shared by every sample (position ids [1, T]) is that sample's
        if type(status) is Shared:  # (refused once the call's output gets a gradient, as any input off the batch)
            found = (0, NotFromBatch("its input is shared by every sample (a parameter of the model, or an embedding of "
                                     "ids every sample shares) and has not joined the batch yet: layers there are not "
                                     "followed"))
        elif type(status) is Merged and not _takes_as_it_is(rule, status, want):
            found = (0, "its input has the batch merged with other dims (x.view(-1, d)): only a layer that works "
                        "row by row follows it there")
        elif want is None and status is not None:  # from the batch, on a dim the rule finds itself
            found = found or (0, None)
        elif isinstance(status, str):
            found = (0, f"the batch dim of its input was lost at {status}")
        elif status is None:
            found = (0, NotFromBatch.of(t, mb.batch))
        elif want is not None and status != want and not _takes_as_it_is(rule, status, want):
            found = (0, f"its input {list(t.shape)} has the batch on dim {status}, not {want}")
        elif found is None:  # a rule that moves the batch takes it on any dim; the others where they want it
            found = (status if _takes_as_it_is(rule, status, want) else 0, None)
        if found[1] is not None:
            break
    found = found or (0, None)
    mb.provenance.setdefault(index, set()).add(found)
    return found


class LayerHooks:
    """The hooks on the covered `layers` ((name, module, rule) each). With `bookkeeping`, a Linear layer's
    output is replaced so that its weight gradient is formed from the per-sample gradients."""

    def __init__(self, layers: list[tuple[str, nn.Module, NormRule]], state: Collection, checker: UseChecker,
                 coverage: LayerCoverage, bookkeeping: bool, keep_positions: bool | set[int] = False):
        self.layers, self.state, self.checker, self.coverage = layers, state, checker, coverage
        self.bookkeeping, self.keep_positions = bookkeeping, keep_positions
        self.tied = tied_embedding.TiedTables(layers, coverage.ties)  # layers sharing one table, and their cross terms
        self.shared = shared_input.SharedInputs(self)  # calls of ids every sample shares, followed to the batch
        # The hooks' collecting parts, called through torch.compiler.disable once Dynamo is loaded: functions of self
        # (not bound methods), so that a deep copy of the model calls them on its own copy.
        self._note, self._follow, self._untraced = LayerHooks._note_params, LayerHooks._collecting_forward_hook, False
        self.keep_out_of_compiled_graphs()
        # Book-keeping replaces a Linear layer's output: its hook runs before every other forward hook,
        # so that they (a GAPMonitor's among them) see the output that gets the gradient.
        # The parameters each call uses, read before the forward: FSDP2 unshards them in its pre-forward
        # hook (always first) and may reshard them in a post-forward hook that runs before the hook below
        # (a layer wrapped as its own FSDP unit), after which the module holds its sharded parameters.
        self._handles = [m.register_forward_pre_hook(functools.partial(self._pre_forward_hook, i))
                         for i, (_, m, _) in enumerate(layers)]
        self._handles += [m.register_forward_hook(functools.partial(self._forward_hook, i), with_kwargs=True,
                                                  prepend=bookkeeping)
                          for i, (_, m, _) in enumerate(layers)]
        self._handles += [m.register_forward_pre_hook(self._enter_row_keeping) for _, m in coverage.row_keeping]
        self._handles += [m.register_forward_hook(self._rows_kept_hook, with_kwargs=True) for _, m in coverage.row_keeping]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def keep_out_of_compiled_graphs(self) -> None:
        """Once Dynamo is loaded, the hooks' collecting parts run through torch.compiler.disable (see
        PerSampleGradNorms.keep_out_of_compiled_graphs)."""
        if not self._untraced and _torch_compat.dynamo_loaded():
            self._untraced = True
            self._note = _torch_compat.dynamo_disable(LayerHooks._note_params)
            self._follow = _torch_compat.dynamo_disable(LayerHooks._collecting_forward_hook)

    def _pre_forward_hook(self, index: int, module: nn.Module, args) -> tuple | None:
        if self.state.collecting:  # (a skipped step: traced by Dynamo as nothing; traced, the rest runs untraced)
            return (self._note if torch.compiler.is_compiling() else LayerHooks._note_params)(self, index, module, args)

    def _note_params(self, index: int, module: nn.Module, args: tuple) -> tuple | None:
        enter_ruled(self.state.tracking)
        if self.state.micro and not _torch_compat.functorch_transforms_active():
            with _torch_compat.ModeSuspended(self.state.tracking):
                mb, rule = self.state.micro[-1], self.layers[index][2]
                mb.used[index] = rule.params(module)
                if shared_input.on_followed_rows(rule, self.state.tracking, args):
                    mb.shared_forms[index] = shared_input.functional_form(module)
                return joined_where_expanded(self.state.tracking, args, mb.batch)

    def _forward_hook(self, index: int, module: nn.Module, args, kwargs, output) -> torch.Tensor | None:
        if not self.state.collecting:  # (as _pre_forward_hook)
            return None
        follow = self._follow if torch.compiler.is_compiling() else LayerHooks._collecting_forward_hook
        return follow(self, index, module, args, kwargs, output)

    def _collecting_forward_hook(self, index: int, module: nn.Module, args, kwargs, output) -> torch.Tensor | None:
        """Outside the batch tracking's mode (the hook's own tensor calls are not the model's); an output it
        replaces (book-keeping) takes the batch dim of the one it replaces."""
        tracking = self.state.tracking
        with _torch_compat.ModeSuspended(tracking):
            replaced = self._follow_call(index, module, args, kwargs, output)
        if replaced is not None and tracking is not None:
            tracking.mark(replaced, tracking.status(first_tensor(output)))
        elif tracking is not None and self.layers[index][2].moves_batch:
            rows_kept(tracking, args, kwargs, first_tensor(output))
        leave_ruled(tracking, args, kwargs, output if replaced is None else replaced)
        return replaced

    def record_call(self, index: int, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        """A call of layer `index` that the model makes without calling its module (an embedding's table used as a head:
        functional_head), inside the forward pass being followed: recorded as the layer's forward hooks record one."""
        self._note_params(index, module, args)
        self._collecting_forward_hook(index, module, args, {}, output)

    def _rows_kept_hook(self, module: nn.Module, args, kwargs, output) -> None:
        """A block whose output rows are its input rows' alone (a rule's keeps_rows_only: a mixture of experts)."""
        tracking = self.state.tracking
        if self.state.collecting and tracking is not None and not torch.compiler.is_compiling():
            rows_kept(tracking, args, kwargs, first_tensor(output))
            leave_ruled(tracking, args, kwargs, output)

    def _enter_row_keeping(self, module: nn.Module, args: tuple) -> None:
        if self.state.collecting and not torch.compiler.is_compiling():
            enter_ruled(self.state.tracking)

    def _follow_call(self, index: int, module: nn.Module, args, kwargs, output) -> torch.Tensor | None:
        outputs = output
        output = first_tensor(output)  # nn.MultiheadAttention returns (output, weights)
        if not self.state.collecting or not self.state.micro:
            return
        if _torch_compat.functorch_transforms_active():  # e.g. the model run under torch.func.vmap
            return
        if output is None:  # nothing to hook: a layer that still trains is left out, saying why
            name, _, rule = self.layers[index]
            if rule.params(module):
                packed = isinstance(outputs, nn.utils.rnn.PackedSequence) or (
                    isinstance(outputs, tuple) and any(isinstance(o, nn.utils.rnn.PackedSequence) for o in outputs))
                self.coverage.skip(name, "its output is a packed sequence (its time steps interleave the samples); pad it instead"
                           if packed else "its output holds no tensor gapmon can follow")
            return
        if not output.requires_grad:  # reentrant checkpointing's no-grad pass: the provenance is needed later
            call_batch_dim(self.state.tracking, index, self.state.micro[-1], module, self.layers[index][2], args, kwargs)
            return
        name, _, rule = self.layers[index]
        mb = self.state.micro[-1]
        if mb.batch == 0:  # an empty micro-batch: no sample, nothing to follow (local_norms gives none)
            return
        recorded = mb.layers.get(index)
        if recorded is not None and recorded.in_forward and _torch_compat.in_backward() \
                and not torch.compiler.is_compiling():
            return None  # non-reentrant checkpointing recomputing a call the forward pass recorded (a shared one too)
        x = args[0] if args else kwargs.get("input")
        # (Not for a tied table: a refusal found in backward would come after its partners added their parts.)
        if (index not in self.tied and shared_input.shares_input(rule, self.state.tracking, x, mb.batch, mb.buffers)
                and not _torch_compat.in_backward() and not torch.compiler.is_compiling()):
            self.shared.follow(index, mb, module, rule, x, output)
            return None
        dim, why = call_batch_dim(self.state.tracking, index, mb, module, rule, args, kwargs)
        if not self.watch_params(index, mb, module, rule):  # frozen now: nothing to measure
            return
        if type(why) is NotFromBatch:
            self.shared.refuse_once_graded(name, outputs, why)
            return
        if why is not None:
            self.coverage.skip(name, why)
            return
        call = batch_first(Call(*_torch_compat.tree_map_tensors(torch.Tensor.detach, (tuple(args), dict(kwargs))),
                                _torch_compat.autocast_dtype(output.device.type)), dim, mb.batch)
        why = rule.not_per_sample(module, call, sample_first(output, dim, mb.batch), mb.batch, mb.inputs)
        if why is not None:
            self.coverage.skip(name, why)
            return
        calls = mb.layers.setdefault(index, LayerCalls())
        # A forward inside backward is activation checkpointing recomputing the layer. Non-reentrant
        # checkpointing recorded the calls in the forward pass already (their outputs get the
        # gradients); reentrant checkpointing ran that pass without grad, so the recomputed calls
        # are the ones whose outputs get gradients.
        # (Inside a torch.compile'd region this is the forward pass: Dynamo cannot trace the check, and
        # the compiled region is not recomputed by checkpointing.)
        if torch.compiler.is_compiling() or not _torch_compat.in_backward():
            calls.in_forward += 1
        at = calls.add(call, dim)
        if self.bookkeeping and not dim and index not in self.tied:  # a tied head needs its input in backward
            replaced = rule.bookkeep(module, args[0] if args else kwargs.get("input"), output,
                                     functools.partial(self._bookkept, index, mb, at))
            if replaced is not None:
                return replaced
        graded = rule.graded_outputs(module, outputs)
        if len(graded) == 1:
            hook_gradient(output, functools.partial(self._backward_hook, index, mb, at), tuple(args))
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

    def watch_params(self, index: int, mb: MicroBatch, module: nn.Module, rule: NormRule) -> list[torch.Tensor]:
        """The trainable parameters this call of layer `index` uses (under FSDP2 the unsharded ones, read before the
        forward), their gradients watched by the use check; empty when the layer is frozen now."""
        params = mb.used.get(index)
        if params is None:
            params = mb.used[index] = rule.params(module)
        for p in params:
            self.checker.watch(p, self.layers[index][0], rule.factored_probe)
        return params

    def deliver(self, index: int, mb: MicroBatch, call: int, g: torch.Tensor) -> None:
        """Call `call` of layer `index`'s output gradient, found by another path than a hook on its output (a shared
        input's, shared_input): taken as the hook would take it."""
        self._backward_hook(index, mb, call, g)

    def _backward_hook(self, index: int, mb: MicroBatch, call: int, g: torch.Tensor) -> None:
        passes, params = self.checker.passes, mb.used.get(index) or []
        if passes.accumulating(params):
            self._take_gradient(index, mb, call, g)
        else:  # a pass for other tensors' gradients (parameter_passes)
            passes.wait(params, functools.partial(self._take_gradient, index, mb, call, g), mb)

    def _take_gradient(self, index: int, mb: MicroBatch, call: int, g: torch.Tensor) -> None:
        calls = mb.layers.get(index)
        if calls is None or calls.grads[call] is not None:
            # A second backward pass through this forward pass: the norms cannot be formed (refused when read,
            # refuse_second_backward); the user's backward runs on untouched.
            mb.second_backward = True
            return
        if isinstance(g, tuple):  # a rule of several outputs (graded_outputs) reads its layout itself
            calls.grads[call] = tuple(None if t is None else t.detach() for t in g)
        else:
            calls.grads[call] = sample_first(g.detach(), calls.dims[call], mb.batch)
        if calls.complete():
            self.finish(index, mb)

    def _bookkept(self, index: int, mb: MicroBatch, call: int, g: torch.Tensor, sq: torch.Tensor,
                  returned: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """BookkeepingLinear's backward of call `call` of layer `index`: g is the output gradient
        [B, T, p], sq the call's per-sample squared norms (weight and bias) and `returned` the (parameter, gradient)
        pairs it hands to autograd, each the sum of the per-sample gradients it formed (the use check takes them as
        they are)."""
        passes, params = self.checker.passes, mb.used.get(index) or []
        if passes.accumulating(params):
            self._take_bookkept(index, mb, call, g, sq, returned)
        else:  # a pass for other tensors' gradients (parameter_passes)
            passes.wait(params, functools.partial(self._take_bookkept, index, mb, call, g, sq, returned), mb)

    def _take_bookkept(self, index: int, mb: MicroBatch, call: int, g: torch.Tensor, sq: torch.Tensor,
                       returned: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        calls = mb.layers.get(index)
        if calls is not None and len(calls.calls) > 1:
            # The layer ran several times: its per-sample gradient is the sum over the calls, whose
            # norm needs all their gradients together (the weight gradient itself is exact).
            self._take_gradient(index, mb, call, g)
            return
        if calls is None or calls.grads[call] is not None:
            self._take_gradient(index, mb, call, g)  # a second backward through this call: noted
            return
        del mb.layers[index]
        name, module, rule = self.layers[index]
        acc = torch.float64 if g.dtype == torch.float64 else torch.float32
        self.checker.explain(name, module, rule, mb.used.get(index), (), g.dtype, returned, returned=True)
        mb.add(sq, acc, self.coverage.type_of(name, module), name)
        mb.finished.add(index)

    def finish(self, index: int, mb: MicroBatch) -> None:
        """Squared norms of layer `index` from the calls that got a gradient; releases the inputs."""
        calls = mb.layers.pop(index)
        name, module, rule = self.layers[index]
        pairs = [(call, g) for call, g in zip(calls.calls, calls.grads) if g is not None]
        if not pairs or name in self.coverage.skipped:  # (a tied partner found not per-sample since its forward)
            return
        with torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext():  # create_graph=True backward
            acc = torch.float64 if any(gradient_dtype(g) == torch.float64 for _, g in pairs) else torch.float32
            pieces = [rule.positions(module, call, g, acc) for call, g in pairs]
            if len(pieces) == 1:  # the use check takes the gradients when the norms formed them
                pos = pieces[0]
                sq, grads = rule.norm_sq_and_grads(module, pos)
                self.checker.explain(name, module, rule, mb.used.get(index), pos, rule.rounding_dtype(module, *pairs[0]),
                                     grads)
            else:
                for piece, (call, g) in zip(pieces, pairs):  # per call: autograd sums each call's gradient as it is
                    self.checker.explain(name, module, rule, mb.used.get(index), piece, rule.rounding_dtype(module, call, g))
                pos = tuple(torch.cat(parts, dim=1) for parts in zip(*pieces))
                sq = rule.norm_sq(module, pos)
            if index in self.tied:
                sq = sq + self.tied.cross(index, mb, pos, calls, acc)
        if self.keep_positions is True or (self.keep_positions and index in self.keep_positions):
            mb.keep_positions(index, pos)  # for gram() and per_sample_gradients(): they need the positions
        mb.add(sq, acc, self.coverage.type_of(name, module), name)
        mb.finished.add(index)

