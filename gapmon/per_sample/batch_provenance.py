"""Which dimension of each tensor made in a forward pass is the batch, by provenance, not by size.

Per-sample gradient norms need, at every covered layer, the dimension of its input that holds the
samples. Guessing it from sizes (dim 0 of size B) is silently wrong whenever another dimension has
size B too: sequence-first activations [T, B, d] with T == B, position ids arange(T) with T == B.
BatchTracker follows the batch instead: the model's batched inputs are marked (dim `batch_dim`),
and a TorchFunctionMode active during the forward pass maps each op's batched inputs to its
outputs with a rule per op family (pointwise and broadcasting, views and reshapes, transposes,
reductions, indexing, matmul/einsum/linear, convolutions, normalisations, attention).

A tensor's status is
- an int: the batch is that dimension (row i of it belongs to sample i);
- None: unbatched, made without the batched inputs (parameters, constants, arange(T));
- a str: it depends on the batch, but the batch dimension was lost there (a reduction over the
  batch, a reshape merging it, an op without a rule): the reason, naming the op.
An op without a rule never guesses: its outputs are lost. Tensors made from values' shapes only
(zeros_like, new_zeros) are unbatched.
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch.overrides import TorchFunctionMode

from .. import _torch_compat
from . import elementwise, fused_attention

Status = "int | str | None"

# Ops whose output has the input's shape and layout, or that are pointwise without an aten tag.
_SAME = {"to", "real", "imag", "type", "type_as", "float", "double", "half", "bfloat16", "int", "long", "bool", "contiguous",
         "clone", "detach", "detach_", "requires_grad_", "cpu", "cuda", "dropout", "alpha_dropout",
         "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d", "data", "float_power", "nan_to_num",
         "masked_fill", "masked_fill_", "where", "lerp", "clamp", "clip", "relu6", "hardtanh", "celu", "selu",
         "threshold", "rrelu", "softplus", "softsign", "tanhshrink", "hardswish", "hardsigmoid", "mish", "silu",
         "gelu", "elu", "leaky_relu", "logsigmoid", "prelu", "copy_", "zero_", "fill_", "normal_", "uniform_",
         "bernoulli", "bernoulli_", "pin_memory", "coalesce", "retain_grad", "as_tensor", "asarray",
         # in-place forms of pointwise ops that aten does not tag pointwise
         "abs_", "copysign_", "eq_", "gcd_", "ge_", "gt_", "heaviside_", "lcm_", "le_", "lt_", "ne_"}
# Made from shapes (and dtypes/devices) only: unbatched whatever their inputs.
_SHAPE_ONLY = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
               "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "arange", "zeros", "ones", "empty",
               "full"}
# Attributes that return a tensor the forward has already made (a view's base, a gradient): its status stays its own.
_ACCESSORS = {"_base", "grad"}
_PASSED = _SHAPE_ONLY | _ACCESSORS
_VIEWS = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "ravel", "view_as", "reshape_as",
          "squeeze_", "unsqueeze_", "atleast_1d", "atleast_2d", "atleast_3d"}
_EXPANDS = {"expand", "expand_as", "broadcast_to"}
_REDUCTIONS = {"sum", "mean", "nansum", "nanmean", "prod", "amax", "amin", "max", "min", "std", "var", "norm",
               "logsumexp", "any", "all", "argmax", "argmin", "count_nonzero", "median", "nanmedian", "mode",
               "std_mean", "var_mean", "aminmax", "vector_norm", "linalg_vector_norm", "linalg_norm"}
_ORD_FIRST = {"norm", "vector_norm", "linalg_vector_norm", "linalg_norm"}  # (x, p or ord, dim, keepdim)
# Loss functions, each sample's term from its own rows: elementwise (None), per row over a class dim (cross entropy's
# dim 1 of an input of 2+ dims, its last of 2 dims), or CTC's (log_probs [T, B, C]: the batch on dim 1).
_LOSSES: dict[str, int | None] = {
    "cross_entropy": 1, "nll_loss": 1, "multi_margin_loss": 1, "multilabel_margin_loss": 1,
    "multilabel_soft_margin_loss": 1, "mse_loss": None, "l1_loss": None, "smooth_l1_loss": None, "huber_loss": None,
    "binary_cross_entropy": None, "binary_cross_entropy_with_logits": None, "kl_div": None, "poisson_nll_loss": None,
    "soft_margin_loss": None, "ctc_loss": None}
# Same shape (or the dim's size changes in place), along one dim that must not be the batch's.
_ALONG_DIM = {"cumsum": 1, "cumprod": 1, "cummax": 1, "cummin": 1, "logcumsumexp": 1, "softmax": 1,
              "log_softmax": 1, "softmin": 1, "sort": 1, "argsort": 1, "topk": 2, "kthvalue": 2, "glu": 1,
              "normalize": 2, "diff": 2, "index_select": 1, "narrow": 1, "unfold": 1, "gather": 1,
              "take_along_dim": 2, "scatter": 1, "scatter_": 1, "scatter_add": 1, "scatter_add_": 1,
              "scatter_reduce": 1, "scatter_reduce_": 1, "flip": (1, "dims"), "roll": (2, "dims"), "rot90": (2, "dims"),
              **{f"fft_{k}": 2 for k in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft", "fft2", "ifft2", "rfft2",
                                         "irfft2", "fftn", "ifftn", "rfftn", "irfftn")}}
_DIM_DEFAULT = {"rot90": (0, 1), "topk": -1, "kthvalue": -1, "glu": -1, "normalize": 1, "diff": -1, "sort": -1, "argsort": -1,
                **{f"fft_{k}": -1 for k in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft")},
                **{f"fft_{k}": (-2, -1) for k in ("fft2", "ifft2", "rfft2", "irfft2")}}
# Of those, the ops whose values along the dim combine several of its entries (along the batch: a statistic of the whole
# batch); the others move or pick entries (along the batch: the batch is lost there, no sample's values are mixed).
_COMBINING_ALONG = {"cumsum", "cumprod", "logcumsumexp", "softmax", "log_softmax", "softmin", "normalize", "diff", "glu",
                    *(k for k in _ALONG_DIM if k.startswith("fft_"))}
# Reductions over the batch that are no sum of per-sample terms and use every sample's value (min, max and their
# kind pick one sample's for all: a statistic of the batch as well).
_COMBINING_REDUCTIONS = {"std", "var", "std_mean", "var_mean", "norm", "vector_norm", "linalg_vector_norm",
                         "linalg_norm", "prod", "logsumexp"}
_SPLITS = {"split", "chunk", "tensor_split", "split_with_sizes", "unsafe_split", "unsafe_chunk"}
_SAMPLE_LEADING = {"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                   "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
                   "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d",
                   "adaptive_max_pool2d", "adaptive_max_pool3d", "lp_pool1d", "lp_pool2d", "interpolate",
                   "upsample", "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "group_norm", "instance_norm",
                   "local_response_norm", "fold", "max_pool2d_with_indices", "fractional_max_pool2d"}
_DUNDER = {"__add__": "add", "__radd__": "add", "__iadd__": "add_", "__sub__": "sub", "__rsub__": "sub",
           "__isub__": "sub_", "__mul__": "mul", "__rmul__": "mul", "__imul__": "mul_", "__truediv__": "div",
           "__rtruediv__": "div", "__itruediv__": "div_", "__div__": "div", "__rdiv__": "div", "__pow__": "pow",
           "__rpow__": "pow", "__ipow__": "pow_", "__neg__": "neg", "__abs__": "abs", "__floordiv__": "floor_divide",
           "__rfloordiv__": "floor_divide", "__mod__": "remainder", "__rmod__": "remainder", "__and__": "bitwise_and",
           "__rand__": "bitwise_and", "__or__": "bitwise_or", "__ror__": "bitwise_or", "__xor__": "bitwise_xor",
           "__invert__": "bitwise_not", "__lt__": "lt", "__le__": "le", "__gt__": "gt", "__ge__": "ge",
           "__eq__": "eq", "__ne__": "ne", "__iand__": "bitwise_and_", "__ior__": "bitwise_or_"}


class Lost(Exception):
    """Raised by a rule: the batch dimension of the op's output cannot be told."""

    def status(self) -> str:
        """The status of the op's output: why its batch was lost."""
        return f"{self}"


class CrossSample(Lost):
    """Raised by a rule: the op multiplies two samples' tensors together (sample i's rows against sample j's columns: a
    contrastive loss's similarities). A loss that gets a gradient through it has no per-sample form: the hook
    `watch_cross_sample` puts on its output records that in the tracker's `mixing`, and the norms are refused."""

    def mixing(self) -> tuple[str, str]:
        """(what mixed the samples, what to do), recorded when a gradient comes through the op."""
        return (f"multiplies two samples' tensors together, and the loss depends on the product ({self})",
                "A loss over pairs of samples (a contrastive loss: CLIP's, SigLIP's) has no per-sample gradients of "
                "each sample's own loss.")


class BatchStatistic(CrossSample):
    """Raised by a rule: the op forms a statistic of the whole batch that is no sum of per-sample terms (a variance or a
    max over the batch, a softmax along it, a nonlinear function of a batch sum that carries a gradient: a batch norm
    written by hand). A gradient through it is refused as a CrossSample's is."""

    def mixing(self) -> tuple[str, str]:
        return (f"forms a statistic of the whole batch, and the loss depends on it ({self})",
                "A loss of the batch's statistics (a batch normalisation written by hand, a penalty on a batch mean) "
                "has no per-sample gradients of each sample's own loss: normalise each sample on its own (GroupNorm, "
                "LayerNorm), or keep that term out of the loss whose norms are read.")


class BatchSum(str):
    """A status: a sum (or mean) over the batch of the samples' terms (a loss's reduction). Linear ops keep it: it is
    still a sum of per-sample terms (after_batch_sum); a nonlinear one of such a sum that carries a gradient is a
    BatchStatistic. `graded`: summed with grad off from tensors that carry a graph (in a custom Function's forward,
    whose backward carries the gradient the sum would have)."""

    graded = False


class _Summed(Lost):
    """Raised by a reduction rule: a sum or mean over the batch (its output a BatchSum)."""

    def status(self) -> str:
        return BatchSum(f"{self}")


class Merged(NamedTuple):
    """A status: dim `dim` holds the batch merged with the `inner` elements of the dims that followed it, the batch
    outermost (x.view(-1, d) of a [B, T, d] activation: Merged(0, T)). Index b·inner + r of that dim is sample b's.
    Row-wise ops keep it (pointwise, Linear, mm/addmm/bmm, norms and softmax over other dims); a reshape that splits
    the batch out again gives it back as a dim; any other op loses it."""

    dim: int
    inner: int


class Shared(NamedTuple):
    """A status: the output of a layer call whose input every sample shares (position ids [1, T]), followed for its
    per-sample gradient (gapmon.per_sample.shared_input.SharedCall, `owner`), or a free parameter of the model
    (free_parameters.Piece: its reshapes and expansions stay Shared too, and a concatenation to a batched tensor calls
    owner.on_cat). Where it is added to a batched tensor, owner.on_add(sum, dim of its batch, sign) reads the sum's
    gradient; where it is copied or cast, the copy stays Shared; any other use calls owner.on_escape(). Elsewhere it
    counts as unbatched, as before it was followed."""

    owner: Any


_CATS = ("cat", "concat", "concatenate")  # torch.cat and its aliases
_COPIES = {"to", "type", "type_as", "float", "double", "half", "bfloat16", "contiguous", "clone", "cpu", "cuda"}
# Ops that only move a tensor's elements (a free parameter's positions follow them: free_parameters.Piece.rearranged)
_REARRANGES: dict[str, Callable] = {
    "permute": lambda t, *dims: t.permute(*dims), "transpose": torch.transpose, "swapaxes": torch.transpose,
    "swapdims": torch.transpose, "movedim": torch.movedim, "moveaxis": torch.movedim, "t": torch.t,
    "flip": lambda t, *dims: t.flip(*dims), "T": lambda t: t.permute(*reversed(range(t.dim()))), "mT": lambda t: t.transpose(-2, -1)}
# Views that keep a tensor's elements in order (a free parameter's reshapes stay followed: free_parameters)
_ORDER_KEEPING_VIEWS = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as",
                        "ravel"}
_SHAPED_AS = {"view_as", "reshape_as", "expand_as", "type_as"}  # ops that read only the shape or dtype of their second
_ADDS = {"add": 1, "__add__": 1, "__radd__": 1, "sub": -1, "__sub__": -1, "add_": 1, "__iadd__": 1, "sub_": -1,
         "__isub__": -1}
_MULS = elementwise.PRODUCTS  # a free parameter scaling a batched tensor (free_parameters)


# Rules that act on each index of the batch dim on its own (or lose it): run on a merged batch as on a plain one at
# its dim, the merge kept (their checks of the batch's size are the aligned/merged ones).
_MERGED_ROW_WISE = {"linear", "addmm", "mm", "matmul", "__matmul__", "bmm", "baddbmm", "einsum", "layer_norm", "rms_norm",
                    "scaled_dot_product_attention", "unsqueeze", "unsqueeze_",
                    "transpose", "transpose_", "swapaxes", "swapdims", "t", "T", "mT", "mH", "adjoint", "permute",
                    "movedim", "moveaxis", "__getitem__", "pad", *_REDUCTIONS, *_ALONG_DIM, *_LOSSES}


_POINTWISE: dict[str, bool] = {}


def _is_pointwise(name: str) -> bool:
    """An op aten tags pointwise (looked up once per name), or one of _SAME."""
    found = _POINTWISE.get(name)
    if found is None:
        aten = _DUNDER.get(name, name)
        packet = getattr(torch.ops.aten, aten, None)
        overloads = [getattr(packet, o) for o in packet.overloads()] if packet is not None else []
        found = aten in _SAME or any(torch.Tag.pointwise in op.tags for op in overloads)
        _POINTWISE[name] = found
    return found


_NAMES: dict = {}  # function -> its op name, looked up once per function
# torch's aliases, which aten does not tag pointwise, by the op they name (ConvBERT multiplies by `torch.multiply`)
_ALIASES = {alias + suffix: op + suffix for alias, op in (
    ("multiply", "mul"), ("subtract", "sub"), ("divide", "div"), ("true_divide", "div"), ("absolute", "abs"),
    ("arccos", "acos"), ("arccosh", "acosh"), ("arcsin", "asin"), ("arcsinh", "asinh"), ("arctan", "atan"),
    ("arctan2", "atan2"), ("arctanh", "atanh"), ("clip", "clamp"), ("fix", "trunc"), ("greater", "gt"),
    ("greater_equal", "ge"), ("less", "lt"), ("less_equal", "le"), ("not_equal", "ne"), ("negative", "neg"),
    ("special_expit", "sigmoid")) for suffix in ("", "_")}
# F.pad as Dynamo's decomposition calls it between graph breaks (transformers' label shift in a compiled forward)
_ALIASES.update({"constant_pad_nd": "pad", "constant_pad_nd.default": "pad"})


def _op_name(func: Callable) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a Tensor property: x.T, x.mT, x.data
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return _ALIASES.get(name, name)


def _arg(args: Sequence, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def _dims(value: Any, ndim: int) -> list[int] | None:
    """A dim argument (int, sequence, or None for all) as non-negative dims."""
    if value is None:
        return None
    if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
        value = [value]
    return [int(v) % max(ndim, 1) for v in value]


def _has_tensor(out: Any) -> bool:
    return isinstance(out, torch.Tensor) or (isinstance(out, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in out))


def _sizes(args: Sequence) -> list[int]:
    """Size varargs (x.view(a, b) or x.view((a, b)))."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return list(args[0])
    return list(args)


class BatchTracker(TorchFunctionMode):
    """A TorchFunctionMode, entered for one forward pass, that follows the batch dim of every tensor."""

    def __init__(self, batch: int):
        super().__init__()
        self.batch = batch
        self._status: dict[int, tuple[weakref.ref, int | str]] = {}  # id(tensor) -> (ref, status)
        self.mixing: dict | None = None  # where a CrossSample op's output got a gradient: the micro-batch's `mixing`
        # Called (status, autograd node) where a gradient comes back through an op that lost the batch (watch_lost)
        self.lost_gradient: Callable[[str, Any], None] | None = None
        self.ruled_depth = 0  # covered layers and row-keeping blocks whose forward runs now: their rules own their ops
        # (batch, func, args, kwargs, [(tensor, Shared)], output) -> the Shared status of an op's output whose inputs are
        # all unbatched and no rule follows (followed_through), or None: the followed inputs are left out then
        self.followed_through: Callable[..., Shared | None] | None = None
        # (batch, func, args, kwargs, (tensor, Shared), output, batch dim of the output) -> whether a pointwise op meeting
        # a followed tensor every sample shares with the batch reads its per-sample gradient (followed_through)
        self.met_in_pointwise: Callable[..., bool] | None = None
        self.func: Callable | None = None  # the op whose rules run now (the general rules' path only)

    # ------------------------------------------------------------------ statuses
    def mark(self, t: torch.Tensor, status: int | str | None) -> None:
        if status is None:
            self._status.pop(id(t), None)
        else:
            self._status[id(t)] = (weakref.ref(t), status)

    def status(self, t: torch.Tensor) -> int | str | None:
        entry = self._status.get(id(t))
        if entry is None or entry[0]() is not t:  # never marked, or an id reused by a new tensor
            return None
        return entry[1]

    # ------------------------------------------------------------------ the mode
    def __torch_function__(self, func, types, args=(), kwargs=None):
        """The hot path of the mode (every op of the forward pass): its lookups are inlined."""
        if kwargs:
            out = func(*args, **kwargs)
        else:
            kwargs = {}
            out = func(*args)
        status = self._status
        if not status:
            return out
        try:
            name = _NAMES[func]
        except (KeyError, TypeError):  # first sight of this function (or an unhashable one)
            name = _op_name(func)
            try:
                _NAMES[func] = name
            except TypeError:
                pass
        if name in _PASSED:
            return out
        one = type(out) is torch.Tensor
        if not one and name != "__setitem__" and not _has_tensor(out):  # x.shape, x.size(0), x.dim()
            return out
        # (tensor, status) of the arguments (and the items of list/tuple arguments) that carry a status
        inputs = []
        for value in (args if not kwargs else (*args, *kwargs.values())):
            kind = type(value)
            if kind is tuple or kind is list:
                for t in value:
                    entry = status.get(id(t))
                    if entry is not None and entry[0]() is t:
                        inputs.append((t, entry[1]))
            elif kind is not int and value is not None:
                entry = status.get(id(value))
                if entry is not None and entry[0]() is value:
                    inputs.append((value, entry[1]))
        if not inputs and name not in _EXPANDS and name != "__setitem__":
            return out
        if one:
            kept = self._kept_dim(name, args, kwargs, inputs, out)
            if kept is not None:
                status[id(out)] = (weakref.ref(out), kept)
                return out
        self.func = func
        try:
            result = self.status_by_rules(name, args, kwargs, inputs, out)
        except Lost as why:
            result = lost_status(self, why, inputs, out)
        except Exception as error:  # a rule's own bug must never break the user's forward pass
            result = f"{name} (no batch rule could read it: {type(error).__name__})"
            watch_lost(self, result, inputs, out)
        if one:
            self.mark(out, result[0] if type(result) is list else result)
        else:
            _mark_outputs(self, name, args, out, result)
        return out

    def _kept_dim(self, name: str, args: Sequence, kwargs: dict, inputs: list, out: torch.Tensor) -> int | None:
        """The hot paths, the ops most of a forward pass is made of, decided without the general rules (which
        give the same answer): a pointwise op whose batched inputs all have the output's rank and the batch on
        one dim (activations, casts, residual adds); a Linear over the last dim of its one batched input; a
        LayerNorm/RMSNorm over trailing dims that leave the batch out. None: the general rule decides."""
        if not inputs:
            return None
        s = inputs[0][1]
        if type(s) is not int:
            return None
        if _POINTWISE.get(name) and name not in _RULES and name != "type_as":  # type_as: its first input's values
            for t, ts in inputs:
                if ts != s or t.dim() != out.dim():
                    return None
            return s if out.shape[s] == self.batch else None
        if len(inputs) != 1 or inputs[0][0] is not args[0]:
            return None
        if name == "linear":
            return s if s != args[0].dim() - 1 else None
        if name in ("rms_norm", "layer_norm"):
            shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
            n = 1 if isinstance(shape, int) else len(shape)
            return s if s < args[0].dim() - n else None
        return None

    # ------------------------------------------------------------------ rules
    def status_by_rules(self, name: str, args: Sequence, kwargs: dict, inputs: list, out: Any) -> Any:
        """The status of op `name`'s output from its inputs' ((tensor, status) each), by the rule of the op's family."""
        for _, st in inputs:
            if type(st) is not int:
                break
        else:  # every input's batch on a plain dim (most ops): no shared, lost or merged input to look for
            if name in _VIEWS or name in _EXPANDS or name == "type_as":  # only self's values are used
                inputs = [(t, s) for t, s in inputs if t is args[0]]
                if not inputs:
                    return _expanded(self, name, args, out) if name in _EXPANDS else None
            return self._by_rule(name, args, kwargs, inputs, out)
        inputs = _without_constants(name, watch_mixed_inputs(self, inputs))
        if all(type(st) is int for _, st in inputs):
            return self._by_rule(name, args, kwargs, inputs, out)
        if any(type(st) is BatchSum for _, st in inputs):
            return after_batch_sum(self, name, args, kwargs, inputs, out)
        if any(type(st) is Shared for _, st in inputs):
            return self._shared_rule(name, args, kwargs, inputs, out)
        lost = [s for _, s in inputs if isinstance(s, str)]
        if name in _VIEWS or name in _EXPANDS or name == "type_as":  # only self's values are used
            inputs = [(t, s) for t, s in inputs if t is args[0]]
            lost = [s for _, s in inputs if isinstance(s, str)]
            if not inputs:
                return _expanded(self, name, args, out) if name in _EXPANDS else None
        if lost and name == "__setitem__" and self.batch == 1 and not any(type(st) is Merged for _, st in inputs):
            return _setitem(self, args, kwargs, inputs, out)  # one sample: a lost value may still be that sample's
        joined = _samples_rejoined(self, name, args, kwargs, inputs, lost, out)
        if joined is not None:
            return joined
        if lost and name != "embedding_bag":  # 1-D bags: the ids' batch dim is the offsets', not theirs
            watch_lost(self, lost[0], inputs, out)
            return lost[0]
        if any(type(st) is Merged for _, st in inputs):
            return merged_status(self, name, args, kwargs, inputs, out)
        return self._by_rule(name, args, kwargs, inputs, out)

    def _by_rule(self, name: str, args: Sequence, kwargs: dict, inputs: list, out: Any) -> Any:
        """The op's rule (or broadcasting, for a pointwise op without one) on inputs whose batch is on a plain dim."""
        rule = _RULES.get(name)
        if rule is not None:
            return rule(self, args, kwargs, inputs, out)
        if _is_pointwise(name) and isinstance(out, torch.Tensor):
            return self.aligned(name, inputs, out)
        raise Lost(f"{name} (no batch rule for this op)")

    def _shared_rule(self, name: str, args: Sequence, kwargs: dict, inputs: list, out: Any) -> Any:
        """An op on the output of a call whose input every sample shares, or on a free parameter (Shared): a copy stays
        Shared (a free parameter's order-keeping reshapes and expansions too); an add to one batched tensor hands the
        sum to its owner (its gradient, per sample, is the shared output's), as a free parameter's concatenation to
        batched tensors or product with one hands it the result; any other use is reported. The op's status is then the one it had with
        the shared output unbatched."""
        shared = [(t, st) for t, st in inputs if type(st) is Shared]
        plain = [(t, st) for t, st in inputs if type(st) is not Shared]
        if name in _SHAPED_AS and shared[0][0] is args[0]:  # only the first's values (p.expand_as(x), x.view_as(x))
            shared, plain = shared[:1], [(t, st) for t, st in plain if t is args[0]]
        if name == "linear" and kwargs:
            args, kwargs = _positional_linear(args, kwargs)
        if len(shared) == 1 and isinstance(out, torch.Tensor):
            t, st = shared[0]
            first = t is args[0] or (name in _MULS or name in _DIVS) and len(args) == 2 and t is args[1]  # (either way round)
            view = _shared_view(name, args, kwargs, t, st, out) if not plain and first else None
            if view is not None:
                return view
            joined = _shared_repeated(self, name, args, t, st, out) if not plain and first else None
            if joined is not None:
                return joined
        if not plain and 0 < len(shared) <= 2 and isinstance(out, torch.Tensor):
            combined = _shared_arithmetic(name, args, kwargs, shared, out)
            if combined is not None:
                return combined
        if not plain and len(shared) == 1 and name == "einsum" and isinstance(out, torch.Tensor):
            mapped = _shared_constant_contraction(args, *shared[0], out)
            if mapped is not None:
                return mapped
        if len(shared) == 1 and isinstance(out, torch.Tensor):
            t, st = shared[0]
            added = _shared_add(self, name, args, kwargs, t, st, plain, out)
            if added is not None:
                return added
            multiplied = _shared_mul(self, name, args, kwargs, t, st, plain, out)
            if multiplied is not None:
                return multiplied
            contracted = _shared_contraction(self, name, args, t, st, plain, out)
            if contracted is not None:
                return contracted
        found = _shared_in_op(self, name, args, kwargs, shared, plain, out)
        if found is not None:
            return found
        if name in _CATS and plain and isinstance(out, torch.Tensor) and all(
                hasattr(st.owner, "on_cat") for _, st in shared):
            try:
                d = self.status_by_rules(name, args, kwargs, plain, out)
            except Lost:
                d = None  # (the escape below, then the same Lost again)
            if type(d) is int and self._shared_cat(args, kwargs, out, d):
                return d
        if not plain and self.followed_through is not None:  # the same for every sample: its own product takes it back
            through = self.followed_through(self.batch, self.func, args, kwargs, shared, out)
            if through is not None:
                return through
        d = None  # the output's batch dim from the batched inputs, where a pointwise op needed it already
        if plain and len(shared) == 1 and self.met_in_pointwise is not None and isinstance(out, torch.Tensor) \
                and _is_pointwise(name) and name not in _RULES:
            try:
                d = self.status_by_rules(name, args, kwargs, plain, out)
            except Lost:
                d = None  # (formed again below: the same Lost, for the caller)
            if type(d) is int and self.met_in_pointwise(self.batch, self.func, args, kwargs, shared[0], out, d):
                return d
        for _, st in shared:
            escape_once_graded(st.owner, name, out)
        if type(d) is int:
            return d
        return self.status_by_rules(name, args, kwargs, plain, out) if plain else None

    def _shared_cat(self, args: Sequence, kwargs: dict, out: torch.Tensor, d: int) -> bool:
        """A concatenation, along another dim than its batch `d`, of batched tensors and expansions of free parameters
        over the batch: each expansion told where its rows are (on_cat). False when it is along the batch."""
        tensors = args[0] if args else kwargs.get("tensors")
        cat_dim = _arg(args, kwargs, 1, "dim", 0)
        cat_dim = cat_dim + out.dim() if cat_dim < 0 else cat_dim
        if cat_dim == d:
            return False
        start = 0
        for t in tensors:
            if t.dim() == 1 and t.numel() == 0:  # torch.cat skips these
                continue
            st = self.status(t)
            if type(st) is Shared:
                st.owner.on_cat(out, t, cat_dim, start, d)
            start += t.shape[cat_dim]
        return True

    def input_dim(self, args: Sequence, inputs: list) -> int:
        """The batch dim of the op's first argument (which must be the batched one)."""
        for t, s in inputs:
            if t is args[0]:
                return s
        raise Lost("an op whose batched input is not its first argument")

    def aligned(self, name: str, inputs: list, out: torch.Tensor) -> int:
        """Broadcasting: dims align from the right; every batched input must put the batch on one dim."""
        dims = {s + out.dim() - t.dim() for t, s in inputs}
        if len(dims) != 1:
            raise Lost(f"{name} (its inputs have their batch on different dims: sequence-first and batch-first mixed?)")
        d = dims.pop()
        if out.shape[d] != self.batch:
            raise Lost(f"{name} (broadcasts the batch)")
        return d


def merged_status(tracker: BatchTracker, name: str, args: Sequence, kwargs: dict, inputs: list, out: Any) -> Any:
    """An op with an input whose batch is merged with other dims (Merged): reshapes may split it out again,
    row-wise ops keep it, every other op loses it."""
    if name in _VIEWS and name not in ("unsqueeze", "unsqueeze_", "squeeze", "squeeze_"):
        return _view(tracker, args, kwargs, inputs, out)
    merges = {st for _, st in inputs}
    if _RULES.get(name) is _recurrent:
        return _merged_recurrent(tracker, args, inputs, out)
    if len(merges) == 1 and name == "__setitem__":
        return _merged_setitem(tracker, args, next(iter(merges)))
    if len(merges) == 1 and name == "as_strided":
        return _as_strided(tracker, args, kwargs, inputs, out, next(iter(merges)))
    if len(merges) == 1 and (name in _MERGED_PARTS or name == "repeat_interleave"):
        return _merged_parts(tracker, name, args, kwargs, inputs, out, next(iter(merges)))
    if len(merges) == 1 and (name in _CATS or name == "stack"):
        return _merged_joined(tracker, name, args, kwargs, inputs, out, next(iter(merges)))
    one = isinstance(out, torch.Tensor)
    first = out if one else next((o for o in out if isinstance(o, torch.Tensor)), None) \
        if isinstance(out, (tuple, list)) else None  # (topk: values and indices)
    if len(merges) != 1 or first is None:
        raise Lost(f"{name} of inputs whose batch is merged differently (or with a plain batch dim)")
    merged = merges.pop()
    if name in _MERGED_ROW_WISE or (one and _is_pointwise(name) and name not in _RULES):
        plain = [(t, st.dim) for t, st in inputs]
        if name in _MERGED_ROW_WISE:
            d = _RULES[name](tracker, args, kwargs, plain, out)
        else:
            dims = {st.dim + out.dim() - t.dim() for t, st in inputs}
            if len(dims) != 1:
                raise Lost(f"{name} of inputs whose merged batch is on different dims")
            d = dims.pop()
        each = d if type(d) is list else [d]
        if any(type(k) is not int for k in each) or first.shape[each[0]] != tracker.batch * merged.inner:
            raise Lost(f"{name} of a merged batch (its rows do not stay its rows)")
        return [Merged(k, merged.inner) for k in each] if type(d) is list else Merged(d, merged.inner)
    raise Lost(f"{name} on the batch merged with other dims (no rule follows it there)")


def _expanded(tracker: BatchTracker, name: str, args: Sequence, out: torch.Tensor) -> int | None:
    """An unbatched tensor expanded to the batch: `pos.expand(B, T)`, `pos.expand_as(x)`, is a copy
    per sample (each row read by its sample alone, as any batched tensor's row is)."""
    if name == "expand_as" and isinstance(args[1], torch.Tensor):
        s = tracker.status(args[1])
        return s if isinstance(s, int) else None
    base = args[0]
    new_dims = out.dim() - base.dim()
    if tracker.batch == 1:  # a batch of one sample: only a dim the expand adds can be told to be the batch
        grown = [d for d in range(new_dims) if out.shape[d] == 1]
    else:
        grown = [d for d in range(out.dim()) if out.shape[d] == tracker.batch
                 and (d < new_dims or base.shape[d - new_dims] == 1)]
    return grown[0] if len(grown) == 1 else None


def _view(tracker: BatchTracker, args, kwargs, inputs, out) -> int | Merged:
    """Reshapes keep the batch iff some output dim has a multiple of the batch's size and the same number of elements
    before it: each sample's elements are one contiguous block after those (the batch outermost), and so are the rows
    of that dim, `size / batch` of them per sample. One row each: the batch is that dim; several: it is merged with
    them (Merged): x.view(-1, d) of [B, T, d], Swin's windows [B, 6, C] -> [B·2, 3, C]; splitting a merged dim with the
    batch outermost gives it back."""
    x = args[0]
    status = next((st for t, st in inputs if t is args[0]), None)
    if status is None:
        raise Lost("an op whose batched input is not its first argument")
    d = status.dim if type(status) is Merged else status
    before = math.prod(x.shape[:d])
    batch = tracker.batch
    for j in range(out.dim()):
        if math.prod(out.shape[:j]) != before:
            continue
        size = out.shape[j]
        if size % batch or not size:
            continue
        rows = size // batch
        return j if rows == 1 else Merged(j, rows)
    raise Lost("a reshape that merges or splits the batch dim")


def _unsqueeze(tracker, args, kwargs, inputs, out) -> int:
    """The new dim's place is known (a view by sizes alone cannot tell which of several size-1 dims is a batch of
    one sample: [1, 5].unsqueeze(0) has it at dim 1)."""
    d = tracker.input_dim(args, inputs)
    at = _arg(args, kwargs, 1, "dim")
    at = at + out.dim() if at < 0 else at
    return d if d < at else d + 1


def _squeeze(tracker, args, kwargs, inputs, out) -> int:
    """Dims of size 1 removed (those named, else all): the batch moves left past the removed dims before it, and
    a batch of one sample whose dim is removed is lost."""
    x, d = args[0], tracker.input_dim(args, inputs)
    named = _arg(args, kwargs, 1, "dim")
    if named is None:
        named = range(x.dim())
    elif isinstance(named, int):
        named = (named,)
    removed = {k % x.dim() for k in named if x.dim() and x.shape[k] == 1}
    if d in removed:
        raise Lost("a squeeze that removes the batch dim (a batch of one sample)")
    return d - sum(1 for k in removed if k < d)


def _expand(tracker, args, kwargs, inputs, out) -> int:
    x, d = args[0], tracker.input_dim(args, inputs)
    return d + out.dim() - x.dim()


def _repeat(tracker, args, kwargs, inputs, out) -> int:
    x, d = args[0], tracker.input_dim(args, inputs)
    sizes = _sizes(args[1:]) or list(_arg(args, kwargs, 1, "repeats", ()))
    shifted = d + len(sizes) - x.dim()
    if sizes[shifted] != 1:
        raise Lost("repeat along the batch dim (samples copied)")
    return shifted


def _transpose(tracker, args, kwargs, inputs, out) -> int:
    x, d = args[0], tracker.input_dim(args, inputs)
    a, b = _dims([_arg(args, kwargs, 1, "dim0"), _arg(args, kwargs, 2, "dim1")], x.dim())
    return b if d == a else a if d == b else d


def _t(tracker, args, kwargs, inputs, out) -> int:
    x, d = args[0], tracker.input_dim(args, inputs)
    return x.dim() - 1 - d if x.dim() == 2 else d


def _matrix_t(tracker, args, kwargs, inputs, out) -> int:  # mT, mH, adjoint: the last two dims swap
    x, d = args[0], tracker.input_dim(args, inputs)
    n = x.dim()
    return {n - 1: n - 2, n - 2: n - 1}.get(d, d)


def _permute(tracker, args, kwargs, inputs, out) -> int:
    x, d = args[0], tracker.input_dim(args, inputs)
    order = _dims(_sizes(args[1:]) or _arg(args, kwargs, 1, "dims"), x.dim())
    return order.index(d)


def _movedim(tracker, args, kwargs, inputs, out) -> int:
    x, d = args[0], tracker.input_dim(args, inputs)
    src = _dims(_arg(args, kwargs, 1, "source"), x.dim())
    dst = _dims(_arg(args, kwargs, 2, "destination"), x.dim())
    order = [None] * x.dim()
    for s, t in zip(src, dst):
        order[t] = s
    rest = iter(i for i in range(x.dim()) if i not in src)
    order = [o if o is not None else next(rest) for o in order]
    return order.index(d)


def _reduction(name: str):
    def rule(tracker, args, kwargs, inputs, out) -> int:
        x, d = args[0], tracker.input_dim(args, inputs)
        if isinstance(_arg(args, kwargs, 1, "other"), torch.Tensor):  # torch.max(a, b): pointwise
            return tracker.aligned(name, inputs, out)
        shift = 1 if name in _ORD_FIRST else 0  # x.norm(p, dim, keepdim), torch.linalg.vector_norm(x, ord, dim, keepdim)
        dims = _dims(_arg(args, kwargs, 1 + shift, "dim"), x.dim())
        if not dims or d in dims:
            if name in _SUMS:
                raise _Summed(f"{name} over the batch dim")
            if name in _COMBINING_REDUCTIONS:
                raise BatchStatistic(f"{name} over the batch dim")
            # one sample's value for every sample: with a gradient back, that sample's row gets every sample's
            raise BatchStatistic(f"{name} over the batch dim (it picks among the samples)")
        keep = _arg(args, kwargs, 2 + shift, "keepdim", False) is True
        return d if keep else d - sum(1 for a in dims if a < d)
    return rule


def _loss(name: str):
    def rule(tracker, args, kwargs, inputs, out) -> int:
        """A loss over the batch: reduced (a 0-dim output: "mean", "sum", "batchmean") a sum of the samples' terms
        (a count of the batch dividing it is a constant: BatchSum); unreduced, the batch where its input has it, less
        the class dim. Its inputs (input and target) must have the batch on one dim, not the class dim (a softmax over
        the samples: a statistic of the batch)."""
        x = args[0] if args else next(iter(kwargs.values()))
        dims = {s for _, s in inputs}
        if len(dims) != 1:
            raise Lost(f"{name} of inputs batched on different dims")
        d = dims.pop()
        classes = _LOSSES[name] if x.dim() > 1 else None
        if name == "ctc_loss" and (x.dim() != 3 or d != 1):
            raise Lost(f"{name} of log-probabilities [T, B, C] whose batch is not on dim 1")
        if classes is not None and d == classes:
            raise BatchStatistic(f"{name} over classes along the batch dim (a softmax over the samples)")
        if out.dim() == 0:
            raise _Summed(f"{name} over the batch")
        if name == "ctc_loss":
            return 0
        return d if classes is None or d < classes else d - 1
    return rule


_SCATTERS = {"scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_"}


def _along_dim(name: str):
    def rule(tracker, args, kwargs, inputs, out) -> int:
        x = args[0]
        if name in _SCATTERS and not any(t is x for t, _ in inputs) and isinstance(out, torch.Tensor):
            # into a tensor the batch does not flow into (zeros of the batch's shape), by each sample's index and values
            dims = {s for _, s in inputs}
            d = dims.pop() if len(dims) == 1 else None
            if type(d) is not int or d >= x.dim() or x.shape[d] != tracker.batch:
                raise Lost(f"{name} of batched values into a tensor without the batch")
        else:
            d = tracker.input_dim(args, inputs)
        index, keyword = _ALONG_DIM[name] if isinstance(_ALONG_DIM[name], tuple) else (_ALONG_DIM[name], "dim")
        dim = _dims(_arg(args, kwargs, index, keyword, _DIM_DEFAULT.get(name)), x.dim())
        if dim is None:
            raise Lost(f"{name} along an unknown dim")
        if d in dim:
            if name in _COMBINING_ALONG:
                raise BatchStatistic(f"{name} along the batch dim")
            raise Lost(f"{name} along the batch dim (it moves or picks the samples)")
        index = [s for t, s in inputs if t is not x]
        if index and any(s != d for s in index):
            raise Lost(f"{name} with an index batched on another dim")
        return d
    return rule


def _recurrent(tracker, args, kwargs, inputs, out) -> list:
    """torch's fused RNN ops (`_VF.lstm/gru/rnn_tanh/rnn_relu(input, hx, params, has_biases, layers,
    dropout, train, bidirectional, batch_first)`): each sample's sequence runs on its own, so the
    output keeps the input's batch dim (0 when batch_first, else 1) and the final states hold it on
    dim 1. A packed sequence (input, batch_sizes, ...) interleaves the samples' time steps: lost."""
    x = args[0]
    if len(args) < 9 or not isinstance(args[8], bool):
        raise Lost("a packed sequence (its time steps interleave the samples)")
    status = tracker.status(x)
    if not isinstance(status, int):
        raise Lost("an RNN whose input does not carry the batch")
    if status != (0 if args[8] else 1):
        raise Lost(f"an RNN with batch_first={args[8]} on input batched on dim {status}")
    return [status] + [1] * (len(out) - 1)


def _merged_recurrent(tracker, args, inputs, out) -> list:
    """A fused RNN op over sequences whose batch is merged with other rows where the op takes its batch (Sequencer's
    LSTMs over [B·W, H, C]): each sequence runs on its own, so the outputs keep the merge (the final states on dim 1),
    as does an initial state given merged the same way."""
    x = args[0]
    status = tracker.status(x)
    if len(args) < 9 or not isinstance(args[8], bool):
        raise Lost("a packed sequence (its time steps interleave the samples)")
    if type(status) is not Merged or status.dim != (0 if args[8] else 1) or any(
            t is not x and st != Merged(1, status.inner) for t, st in inputs):
        raise Lost("an RNN over rows merged with the batch off the dim it takes its batch on")
    return [status] + [Merged(1, status.inner)] * (len(out) - 1)


def _shared_add(tracker: BatchTracker, name: str, args: Sequence, kwargs: dict, t: torch.Tensor, st: Shared,
                plain: list, out: torch.Tensor) -> Any:
    """out = t ± the one batched tensor of `plain`, t Shared: its owner reads the sum's gradient (on_add) and out's
    status is returned; None when this is no such add. The batched operand may be broadcast too (Swin's window mask
    over the heads): what reaches t is the sum's gradient summed where t was broadcast, whatever the other's shape. A
    model's own parameter may be added to rows merged with the batch (Swin's scores over windows)."""
    sign = _ADDS.get(name)
    if (sign is None or len(plain) != 1 or len(args) != 2 or kwargs or out.dim() != plain[0][0].dim()
            or (_in_place(name) and t is args[0])):
        return None
    sign = -1 if sign < 0 and t is args[1] else 1
    return _with_batched(tracker, name, args, kwargs, plain, out, st.owner,
                         lambda dim, *inner: st.owner.on_add(out, t, dim, sign, *inner))


def _with_batched(tracker: BatchTracker, name: str, args: Sequence, kwargs: dict, plain: list, out: torch.Tensor,
                  owner: Any, hand: Callable[..., None]) -> Any:
    """out's status where a Shared operand (of `owner`) meets one batched tensor, on a dim or, for a free parameter's
    piece, merged with the rows after it; hand(dim) or hand(dim, inner) gives the owner the op. None where out keeps
    neither."""
    if type(plain[0][1]) is int:
        d = tracker.status_by_rules(name, args, kwargs, plain, out)
        if type(d) is int:
            hand(d)
            return d
    elif type(plain[0][1]) is Merged and hasattr(owner, "sliced"):
        try:
            merged = merged_status(tracker, name, args, kwargs, plain, out)
        except Lost:
            return None  # (reported as an escape by the caller, then lost again)
        hand(merged.dim, merged.inner)
        return merged
    return None


class UntracedInCompiledRegions(BatchTracker):
    """The batch tracking where Dynamo is loaded: inside a compiled region each op goes through the tracking untraced, at
    a graph break, as torch 2.13 runs it. torch 2.11's Dynamo traces a TorchFunctionMode's __torch_function__ there, on
    fake tensors: the statuses it recorded never reached the real tensors (a compiled GPT's attention output lost the
    batch: its projection was left out) and each op's guards recompiled the frame past Dynamo's limit. Outside compiled
    regions the plain path (the untraced wrapper costs ~2.4 µs an op on the CPU)."""

    def __init__(self, batch: int):
        super().__init__(batch)
        self._untraced = _untraced_tracking()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _is_compiling():
            return self._untraced(self, func, types, args, kwargs)
        return _tracked(self, func, types, args, kwargs)


_is_compiling, _tracked = torch.compiler.is_compiling, BatchTracker.__torch_function__


@functools.cache
def _untraced_tracking() -> Callable:
    """BatchTracker's __torch_function__ run untraced by Dynamo (made once: a forward pass makes a tracker)."""
    return _torch_compat.dynamo_disable(BatchTracker.__torch_function__)


def batch_tracker(batch: int) -> BatchTracker:
    """The batch tracking of one forward pass of `batch` samples (UntracedInCompiledRegions once Dynamo is loaded)."""
    return UntracedInCompiledRegions(batch) if _torch_compat.dynamo_loaded() else BatchTracker(batch)


def _shared_mul(tracker: BatchTracker, name: str, args: Sequence, kwargs: dict, t: torch.Tensor, st: Shared,
                plain: list, out: torch.Tensor) -> Any:
    """out = t * x (or maximum / minimum of them), t Shared (a layer scale; Swin V2's temperature per head) and x batched,
    of out's shape (or, for a free parameter's product, broadcast to it), on a dim or merged with the rows after it
    (Swin's windows): t's owner reads each sample's gradient
    g ⊙ x (on_mul), and out's status is returned; None when this is no such product."""
    if (name not in _MULS and name not in ("maximum", "minimum") or not hasattr(st.owner, "on_mul") or len(plain) != 1
            or len(args) != 2 or kwargs or (_in_place(name) and t is args[0])):
        return None
    if out.shape != plain[0][0].shape and (name not in _MULS or getattr(st.owner, "base", None) is None):
        return None  # x broadcast too (Mamba's `A[None, :, None, :] * dt[..., None]`): a free parameter's pieces only
    # maximum / minimum (RWKV's decay): each sample's gradient is g times where t won (elementwise.extremum_slope)
    factor = plain[0][0] if name in _MULS else elementwise.extremum_slope(name, t, plain[0][0])
    return _with_batched(tracker, name, args, kwargs, plain, out, st.owner,
                         lambda dim, *inner: st.owner.on_mul(out, factor, dim, *inner))


def _contraction_equation(name: str, args: Sequence, x: torch.Tensor, d: int, t: torch.Tensor,
                          merged: bool = False) -> str | None:
    """The einsum equation of each sample's gradient of t from (x, the output's gradient) where the op contracts x,
    batched on its dim d, with t: F.linear(x, t) (t [p, q]), x @ t (t [q, p]), t @ x, a two-operand einsum. `merged`: x's dim
    d holds the batch merged with the rows after it, split in two dims (d, d + 1) when the equation is used (a MoE
    router's F.linear over [B·T, d]). None otherwise."""
    if name in ("matmul", "__matmul__") and len(args) == 2 and args[0] is t and args[1] is x and not merged:
        # t @ x, t [p, q] on the left (Mamba's `dt_proj.weight @ dt`): x [..., q, l] batched on a leading dim
        if t.dim() != 2 or x.dim() < 3 or not 0 <= d < x.dim() - 2:
            return None
        lead = "abcdefghijk"[:x.dim() - 2]
        return f"{lead}ql,{lead}pl->{lead[d]}pq"
    if name in ("linear", "matmul", "__matmul__"):
        if args[0] is not x or len(args) < 2 or args[1] is not t or t.dim() != 2 or not 0 <= d < x.dim() - 1:
            return None
        lead = "abcdefghijklm"[:x.dim() - 1 + merged]
        return f"{lead}q,{lead}p->{lead[d]}pq" if name == "linear" else f"{lead}q,{lead}p->{lead[d]}qp"
    if name != "einsum" or merged:
        return None
    operands = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
    equation = args[0].replace(" ", "") if isinstance(args[0], str) else ""
    if len(operands) != 2 or "->" not in equation or "..." in equation:
        return None
    (spec_a, spec_b), rhs = equation.split("->")[0].split(","), equation.split("->")[1]
    if operands[0] is x and operands[1] is t:
        spec_x, spec_t = spec_a, spec_b
    elif operands[1] is x and operands[0] is t:
        spec_x, spec_t = spec_b, spec_a
    else:
        return None
    batch = spec_x[d]
    if any(len(set(spec)) != len(spec) for spec in (spec_x, spec_t, rhs)) or batch in spec_t or batch not in rhs \
            or not set(spec_t) <= set(spec_x) | set(rhs):
        return None
    return f"{spec_x},{rhs}->{batch}{spec_t}"


def _shared_contraction(tracker: BatchTracker, name: str, args: Sequence, t: torch.Tensor, st: Shared, plain: list,
                        out: torch.Tensor) -> Any:
    """out = a contraction of t (Shared: a model's own parameter, whole) with one batched tensor (a weight in F.linear,
    `x @ W`, an einsum), or with rows merged with the batch: its owner gets the equation of each sample's gradient
    (on_contract) and out's status is returned; None when this is no such op."""
    if not hasattr(st.owner, "on_contract") or getattr(st.owner, "base", None) != tuple(t.shape) or len(plain) != 1 \
            or type(plain[0][1]) not in (int, Merged):
        return None
    x, status = plain[0]
    merged = type(status) is Merged
    equation = _contraction_equation(name, args, x, status.dim if merged else status, t, merged)
    if equation is None:
        return None
    try:
        status = (functools.partial(merged_status, tracker) if merged else tracker.status_by_rules)(name, args, {}, plain, out)
    except Lost:
        return None  # (reported as an escape by the caller, then lost again)
    if type(status) not in (int, Merged):
        return None
    st.owner.on_contract(out, x, equation, (status.dim, status.inner) if merged else None)
    return status


def _positional_linear(args: Sequence, kwargs: dict) -> tuple[tuple, dict]:
    """F.linear's arguments given by name (`F.linear(x, weight=W, bias=b)`: timm's BEiT) as positional ones."""
    if set(kwargs) - {"input", "weight", "bias"}:
        return tuple(args), kwargs
    args = tuple(_arg(args, kwargs, i, key) for i, key in enumerate(("input", "weight", "bias")))
    return (args if args[2] is not None else args[:2]), {}


def _shared_placed(tracker: BatchTracker, args: Sequence, kwargs: dict, out: torch.Tensor) -> Shared | None:
    """A concatenation of free parameters' pieces and constants (unbatched tensors without a gradient), none of them
    batched (BEiT's and EVA's `torch.cat((self.q_bias, self.k_bias, self.v_bias))`, k_bias a buffer): each piece placed
    where its rows are, the constants' rows holes; the result stays Shared. None when this is no such op."""
    tensors = _arg(args, kwargs, 0, "tensors")
    cat_dim = _arg(args, kwargs, 1, "dim", 0)
    cat_dim = cat_dim + out.dim() if cat_dim < 0 else cat_dim
    pieces, start = [], 0
    for t in tensors:
        if t.dim() == 1 and t.numel() == 0 and out.dim() != 1:  # torch.cat skips these
            continue
        st = tracker.status(t)
        if type(st) is Shared:
            piece = st.owner.placed(t, out, cat_dim, start) if hasattr(st.owner, "placed") else None
            if piece is None:
                return None
            pieces.append(piece)
        elif st is not None or t.requires_grad:
            return None
        start += t.shape[cat_dim]
    if not pieces:
        return None
    return Shared(pieces[0] if len(pieces) == 1 else pieces[0].plus(pieces[1:]))


def _shared_in_op(tracker: BatchTracker, name: str, args: Sequence, kwargs: dict, shared: list, plain: list,
                  out: Any) -> Any:
    """The ops that take Shared tensors where no add, product or contraction shows them: `torch.where` (a mask keeping
    some of their elements), fused attention (one as its mask), F.linear with a weight and a bias, an in-place
    zero_ or fill_ of a view of one. out's status, or None when the op is none of these."""
    if not isinstance(out, torch.Tensor):
        return None
    if name in _CATS and not plain:
        return _shared_placed(tracker, args, kwargs, out)
    if name == "where" and len(shared) == 1:
        return _shared_where(tracker, args, kwargs, *shared[0], plain, out)
    if name == "scaled_dot_product_attention" and len(shared) == 1:
        return _shared_attention_mask(tracker, args, kwargs, *shared[0], plain, out)
    if name in _AFFINE_NORMS:
        return _shared_affine_norm(tracker, name, args, kwargs, shared, plain, out)
    if name == "addcmul":
        return _shared_addcmul(tracker, args, kwargs, shared, plain, out)
    if name == "embedding" and len(shared) == 1 and len(plain) == 1:
        return _shared_table(args, kwargs, *shared[0], *plain[0], out)
    if name == "embedding" and len(shared) == 1 and not plain:
        return _shared_table_by_rows(tracker, args, kwargs, *shared[0], out)
    if name in ("conv1d", "conv2d"):
        return _shared_conv(name, args, kwargs, shared, plain, out)
    if len(shared) == 2:
        return _shared_linear_with_bias(tracker, name, args, kwargs, shared, plain, out)
    if (name == "zero_" or name == "fill_" and len(args) == 2 and type(args[1]) in (int, float)) and not plain \
            and not kwargs and out is args[0]:
        return _shared_cleared(tracker, *shared[0])
    return None


def _shared_table(args: Sequence, kwargs: dict, t: torch.Tensor, st: Shared, ids: torch.Tensor, dim: Any,
                  out: torch.Tensor) -> int | None:
    """F.embedding(ids, t) of ids batched on `dim` and a Shared table t (PEFT's LoRA on an embedding looks its A up by
    id): its owner keeps each sample's output gradient by id (looked_up), and out is batched where the ids are. None:
    another signature, a max_norm (it renormalises the table in place), scale_grad_by_freq (the batch's counts of
    each id scale every sample's gradient), or an owner that cannot take it."""
    if ids is not args[0] or _arg(args, kwargs, 1, "weight") is not t or type(dim) is not int or not hasattr(
            st.owner, "looked_up") or _arg(args, kwargs, 3, "max_norm") is not None or _arg(
            args, kwargs, 5, "scale_grad_by_freq", False):
        return None
    padding = _arg(args, kwargs, 2, "padding_idx")
    padding = -1 if padding is None else padding % t.shape[0]
    return dim if st.owner.looked_up(t, out, ids, dim, padding) else None


def _shared_constant_contraction(args: Sequence, t: torch.Tensor, st: Shared, out: torch.Tensor) -> Shared | None:
    """out = einsum(equation, a, b) of a Shared t (a free parameter's piece) and a constant (no batch, no gradient:
    Funnel's relative positions mapped by its r_kernel): out is followed as a linear map of t (Piece.contracted_with),
    each of its per-sample gradients taken back to t by einsum(const, g). None for any other einsum."""
    operands = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
    equation = args[0].replace(" ", "") if isinstance(args[0], str) else ""
    if len(operands) != 2 or "->" not in equation or "..." in equation or not hasattr(st.owner, "contracted_with"):
        return None
    (spec_a, spec_b), rhs = equation.split("->")[0].split(","), equation.split("->")[1]
    if operands[0] is t and isinstance(operands[1], torch.Tensor) and not operands[1].requires_grad:
        spec_t, spec_c, const = spec_a, spec_b, operands[1]
    elif operands[1] is t and isinstance(operands[0], torch.Tensor) and not operands[0].requires_grad:
        spec_t, spec_c, const = spec_b, spec_a, operands[0]
    else:
        return None
    letters = set(spec_t) | set(spec_c) | set(rhs)
    batch = next((c for c in "ZYXWVUTSRQ" if c not in letters), None)
    if batch is None or any(len(set(spec)) != len(spec) for spec in (spec_t, spec_c, rhs)) \
            or not set(spec_t) <= set(spec_c) | set(rhs):
        return None
    piece = st.owner.contracted_with(t, out, const, f"{spec_c},{batch}{rhs}->{batch}{spec_t}")
    return None if piece is None else Shared(piece)


def _shared_conv(name: str, args: Sequence, kwargs: dict, shared: list, plain: list, out: torch.Tensor) -> int | None:
    """F.conv1d / F.conv2d(x, W, b, stride, padding, dilation, groups) of x batched on dim 0 with W (and b, when it
    has a gradient) Shared and whole (a covered Conv's weights passed by its parent: Mamba's causal convolution): W's
    owner gets each sample's weight gradient (on_conv), b's its output gradient summed over the positions (on_bias);
    out is batched on dim 0. None for any other call (padding given as a string among them)."""
    x = _arg(args, kwargs, 0, "input")
    w, b = _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")
    stride, padding, dilation, groups = (_arg(args, kwargs, i, key, default) for i, key, default in (
        (3, "stride", 1), (4, "padding", 0), (5, "dilation", 1), (6, "groups", 1)))
    owners = {id(t): st.owner for t, st in shared}
    w_owner, b_owner = owners.get(id(w)), owners.get(id(b)) if b is not None else None
    if (len(plain) != 1 or plain[0][0] is not x or type(plain[0][1]) is not int or plain[0][1] != 0
            or x.dim() != (3 if name == "conv1d" else 4) or isinstance(padding, str) or type(groups) is not int
            or w_owner is None or not hasattr(w_owner, "on_conv") or getattr(w_owner, "base", None) != tuple(w.shape)
            or len(shared) != 1 + (b_owner is not None) or (b is not None and b_owner is None and b.requires_grad)
            or (b_owner is not None and (not hasattr(b_owner, "on_bias")
                                         or getattr(b_owner, "base", None) != tuple(b.shape)))):
        return None
    w_owner.on_conv(out, x, stride, padding, dilation, groups)
    if b_owner is not None:
        b_owner.on_bias(out)
    return 0


def _shared_table_by_rows(tracker: BatchTracker, args: Sequence, kwargs: dict, t: torch.Tensor, st: Shared,
                          out: torch.Tensor) -> Shared | None:
    """F.embedding(ids, t) of a Shared table t by ids no sample's data flows into (BART's positions,
    `arange(T).expand(B, -1)` or [1, T]): out is followed (row_lookup.RowLookup). None: float ids, another signature,
    max_norm or scale_grad_by_freq (as _shared_table), or an owner that cannot take it."""
    ids = args[0] if args else None
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or tracker.batch < 1 \
            or _arg(args, kwargs, 1, "weight") is not t or not hasattr(st.owner, "looked_up_rows") \
            or _arg(args, kwargs, 3, "max_norm") is not None or _arg(args, kwargs, 5, "scale_grad_by_freq", False):
        return None
    padding = _arg(args, kwargs, 2, "padding_idx")
    rows = st.owner.looked_up_rows(t, out, ids, -1 if padding is None else padding % t.shape[0])
    return None if rows is None else Shared(rows)


def graded_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of an op's or a layer's output (a tensor, or tuples, lists and dicts of them) that carry a gradient."""
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    parts = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    return [t for o in parts for t in graded_tensors(o)]


def escape_once_graded(owner: Any, name: str, out: Any) -> None:
    """A use of a Shared tensor that no rule follows: its owner escapes (its parameter or layer left out, named) once
    the op's output gets a gradient, since only through it does the use add to the gradient. An output without one in
    a forward that records gradients adds nothing: DoRA's embedding adapters multiplied into a weight norm that is
    detached. With grad off, or in place, at once (a custom Function's forward: its backward is its own)."""
    if not torch.is_grad_enabled() or _in_place(name):
        owner.on_escape(name)
        return
    for o in graded_tensors(out):
        o.register_hook(lambda _, owner=owner, name=name: owner.on_escape(name))


def _shared_cleared(tracker: BatchTracker, t: torch.Tensor, st: Shared) -> Shared | None:
    """t.zero_() or t.fill_(number) of a Shared view t of a Shared tensor (torchvision's Swin V2 zeroes the middle third
    of a clone of its qkv bias before F.linear): t's elements, and the base's in their places, become constants (holes:
    no gradient goes back from them). None: t is no such view."""
    base = _torch_compat.view_base(t)
    if base is None or base.grad_fn is None or not torch.is_grad_enabled():  # a leaf, or not recorded: not constants
        return None
    held = tracker.status(base)
    if type(held) is not Shared or not hasattr(held.owner, "masked") or not hasattr(st.owner, "masked"):
        return None
    kept = held.owner.masked(base, base, torch.isin(_storage_places(base), _storage_places(t), invert=True))
    cleared = st.owner.masked(t, t, torch.zeros(t.shape, dtype=torch.bool, device=t.device))
    if kept is None or cleared is None:
        return None
    tracker.mark(base, Shared(kept))
    return Shared(cleared)


def _storage_places(t: torch.Tensor) -> torch.Tensor:
    """The index of each of t's elements in its storage (views of one storage share them)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.arange(n, device=t.device).as_strided(t.shape, t.stride(), t.storage_offset())


# The functional normalisations with an affine weight and bias: name -> (the bias's position, or None, and the eps's).
_AFFINE_NORMS = {"layer_norm": (3, 4), "group_norm": (3, 4), "rms_norm": (None, 3)}


def _shared_affine_norm(tracker: BatchTracker, name: str, args: Sequence, kwargs: dict, shared: list, plain: list,
                        out: torch.Tensor) -> Any:
    """F.layer_norm / F.group_norm / F.rms_norm of a batched x with a Shared weight or bias, whole (a normalisation
    layer's own parameters, used by a forward that overrides torch's: timm's LayerNorm, LayerNorm2d, GroupNorm1):
    y = x̂ ⊙ weight + bias, so the weight's owner is told of a product with x̂ (on_normalised: x̂ formed again in
    backward) and the bias's of an add (on_add), both broadcast as the op broadcasts them (GroupNorm's over dim 1).
    out's status is returned; None when this is no such call."""
    bias_at, eps_at = _AFFINE_NORMS[name]
    x, shape_arg = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "num_groups" if name == "group_norm"
                                                        else "normalized_shape")
    weight = _arg(args, kwargs, 2, "weight")
    bias = None if bias_at is None else _arg(args, kwargs, bias_at, "bias")
    if len(plain) != 1 or plain[0][0] is not x or type(plain[0][1]) is not int or x.dim() < 2:
        return None
    for t, st in shared:
        if (t is not weight and t is not bias) or getattr(st.owner, "base", None) != tuple(t.shape) \
                or not hasattr(st.owner, "viewed"):
            return None
    try:
        d = tracker.status_by_rules(name, args, kwargs, plain, out)
    except Lost:
        return None  # (reported as an escape by the caller, then lost again)
    if type(d) is not int:
        return None
    eps = _arg(args, kwargs, eps_at, "eps", None if name == "rms_norm" else 1e-5)
    if name == "group_norm":
        aligned = (x.shape[1], *(1,) * (x.dim() - 2))  # the affine parameters scale dim 1, the channels

        def normalise(v: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.group_norm(v, shape_arg, None, None, eps)
    else:
        aligned = None

        def normalise(v: torch.Tensor) -> torch.Tensor:
            if name == "rms_norm":
                return torch.nn.functional.rms_norm(v, shape_arg, None, eps)
            return torch.nn.functional.layer_norm(v, shape_arg, None, None, eps)
    for t, st in shared:
        owner = st.owner if aligned is None else st.owner.viewed(aligned)
        if owner is None:
            return None
        if t is weight:
            owner.on_normalised(out, x, d, normalise)
        else:
            owner.on_add(out, t if aligned is None else t.view(aligned), d, 1)
    return d


def _shared_addcmul(tracker: BatchTracker, args: Sequence, kwargs: dict, shared: list, plain: list,
                    out: torch.Tensor) -> Any:
    """torch.addcmul(b, a, x) = b + a ⊙ x (value 1) of a batched x with a, b or both Shared (timm's Affine: its own
    alpha and beta): a's owner is told of a product with x (on_mul), b's of an add (on_add). out's status is returned;
    None when this is no such call."""
    if len(args) != 3 or set(kwargs) - {"value"} or kwargs.get("value", 1) != 1 or len(plain) != 1 \
            or type(plain[0][1]) is not int or plain[0][0] is not args[2] or out.shape != args[2].shape:
        return None
    base, factor, x = args
    if not all((t is base and hasattr(st.owner, "on_add")) or (t is factor and hasattr(st.owner, "on_mul"))
               for t, st in shared):
        return None
    d = tracker.status_by_rules("mul", (factor, x), {}, plain, out)
    if type(d) is not int:
        return None
    for t, st in shared:
        if t is base:
            st.owner.on_add(out, t, d, 1)
        else:
            st.owner.on_mul(out, x, d)
    return d


def _shared_linear_with_bias(tracker: BatchTracker, name: str, args: Sequence, kwargs: dict, shared: list, plain: list,
                             out: torch.Tensor) -> Any:
    """F.linear(x, W, b) of a batched x with W and b both Shared (gpt-oss's router: its own parameters, over the rows
    merged with the batch): W contracted with x, b added to the product, each told (on_contract, on_add); out's status
    is returned, None when this is no such call."""
    if name != "linear" or kwargs or len(args) != 3 or len(plain) != 1:
        return None
    (w, w_st), (b, b_st) = shared if shared[0][0] is args[1] else shared[::-1]
    if w is not args[1] or b is not args[2] or b.dim() != 1 or not hasattr(b_st.owner, "on_add"):
        return None
    status = _shared_contraction(tracker, name, args[:2], w, w_st, plain, out)
    if status is not None:
        b_st.owner.on_add(out, b, *((status.dim, 1, status.inner) if type(status) is Merged else (status, 1)))
    return status


def _shared_where(tracker: BatchTracker, args: Sequence, kwargs: dict, t: torch.Tensor, st: Shared, plain: list,
                  out: torch.Tensor) -> Any:
    """torch.where(cond, t, c) (or where(cond, c, t)) of a Shared t, c a number or an unbatched tensor without a
    gradient (T5's relative attention bias under a mask before fused attention): with cond unbatched, t's elements
    where it keeps them (a Shared piece with holes, owner.masked); with cond batched on a dim, t times each sample's
    0/1 keep mask (owner.on_mul), out batched there. None when this is no such call."""
    if kwargs or len(args) != 3 or not isinstance(args[0], torch.Tensor) or args[0].dtype != torch.bool \
            or t is args[0] or (args[1] is t) == (args[2] is t):
        return None
    cond, other = args[0], args[2] if args[1] is t else args[1]
    if isinstance(other, torch.Tensor) and (other.requires_grad or tracker.status(other) is not None):
        return None
    keep = cond if args[1] is t else ~cond
    status = tracker.status(cond)
    if status is None:
        piece = st.owner.masked(t, out, keep) if hasattr(st.owner, "masked") else None
        return None if piece is None else Shared(piece)
    if type(status) is not int or not hasattr(st.owner, "on_mul") or len(plain) != 1 or plain[0][0] is not cond:
        return None
    d = tracker.status_by_rules("where", args, kwargs, plain, out)
    if type(d) is not int:
        return None
    st.owner.on_mul(out, keep.expand(out.shape).to(out.dtype), d)
    return d


def _shared_attention_mask(tracker: BatchTracker, args: Sequence, kwargs: dict, t: torch.Tensor, st: Shared,
                           plain: list, out: torch.Tensor) -> Any:
    """F.scaled_dot_product_attention(q, k, v, attn_mask=t) of batched q, k, v (on one dim, or merged with windows:
    Swin's [B·windows, heads, N, d]) with t Shared: t is added to each sample's scores inside the fused op, so its
    owner is told of an add (on_add) to a stand-in for the scores, whose gradient is recomputed from the call and its
    output's gradient (fused_attention). out's status is returned; None when this is no such call (t is not the mask,
    dropout, a causal flag, a mask that does not broadcast to the scores)."""
    q, k, v = (_arg(args, kwargs, i, n) for i, n in enumerate(("query", "key", "value")))
    if (_arg(args, kwargs, 3, "attn_mask") is not t or not t.is_floating_point() or _arg(args, kwargs, 4, "dropout_p", 0.0)
            or _arg(args, kwargs, 5, "is_causal", False) or not hasattr(st.owner, "on_add")
            or {id(x) for x, _ in plain} != {id(q), id(k), id(v)}):
        return None
    shape = fused_attention.scores_shape(q, k, t)
    if shape is None:
        return None
    try:
        status = tracker.status_by_rules("scaled_dot_product_attention", args, {**kwargs, "attn_mask": None}, plain, out)
    except Lost:
        return None  # (reported as an escape by the caller, then lost again)
    merged = type(status) is Merged
    if not (type(status) is int or (merged and hasattr(st.owner, "sliced"))):
        return None
    scores = fused_attention.ScoresGradient(shape, out.requires_grad)
    st.owner.on_add(scores, t, *((status.dim, 1, status.inner) if merged else (status, 1)))
    if scores.hooks and out.requires_grad:
        scale, gqa = _arg(args, kwargs, 6, "scale"), _arg(args, kwargs, 7, "enable_gqa", False)
        q, k, v, mask = (x.detach() for x in (q, k, v, t))
        out.register_hook(lambda g: scores.deliver(fused_attention.scores_grad(q, k, v, mask, scale, gqa, g).to(g.dtype)))
    return status


def _shared_view(name: str, args: Sequence, kwargs: dict, t: torch.Tensor, st: Shared, out: torch.Tensor
                 ) -> Shared | None:
    """out = name(t, ...) of a Shared t alone: a copy stays Shared, as a free parameter's (free_parameters) cast (noting
    the rounding its gradient gets), order-keeping reshape, slice (basic indexing), expansion (a repeat that copies
    size-1 dims only is an expansion, for the gradient) or elementwise function with a slope (exp, clamp, sigmoid:
    gapmon.per_sample.elementwise) does; None for any other op."""
    owner, piece = st.owner, None
    if name in _COPIES:
        return Shared(owner.copied(out)) if hasattr(owner, "copied") else st
    if name in _ORDER_KEEPING_VIEWS and hasattr(owner, "reshaped"):
        piece = owner.reshaped(out)
    elif name == "__getitem__" and len(args) == 2 and hasattr(owner, "sliced"):
        piece = owner.sliced(t, args[1], out)
    elif name in _REARRANGES and hasattr(owner, "rearranged"):
        piece = owner.rearranged(t, out, lambda positions: _REARRANGES[name](positions, *args[1:]))
    elif name in _EXPANDS or name in ("repeat", "tile") and _repeats_only_ones(t, out):
        if hasattr(owner, "scaled"):
            piece = owner.scaled(out, 1.0)
        elif hasattr(owner, "expanded"):  # a shared layer output's (shared_input)
            piece = owner.expanded(out)
    elif hasattr(owner, "mapped") and not _in_place(name):
        slope = elementwise.slope(name, args, kwargs, t, out)
        piece = None if slope is None else owner.mapped(t, out, slope)
    return None if piece is None else Shared(piece)


_DIVS = elementwise.QUOTIENTS


def _shared_repeated(tracker: BatchTracker, name: str, args: Sequence, t: torch.Tensor, st: Shared, out: torch.Tensor
                     ) -> int | Merged | None:
    """out = t.repeat(batch, 1, ...) of a shared layer output (or a view of it) whose owner reads it there (on_repeat):
    one copy per sample along dim 0 (merged with t's own dim 0 when it is longer than one), each sample's gradient its
    copy's. None for any other repeat."""
    if name not in ("repeat", "tile") or not hasattr(st.owner, "on_repeat") or tracker.batch < 2 or not t.dim():
        return None
    sizes = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]  # (repeat(B, 1), tile((B, 1)))
    if list(sizes) != [tracker.batch, *([1] * (t.dim() - 1))]:
        return None
    st.owner.on_repeat(out, tuple(t.shape))
    return Merged(0, t.shape[0]) if t.shape[0] > 1 else 0


def _shared_arithmetic(name: str, args: Sequence, kwargs: dict, shared: list, out: torch.Tensor) -> Shared | None:
    """Free parameters' pieces (free_parameters) negated, scaled by a number, added to an unbatched tensor or to each
    other (`self.cls_token + self.pos_embed[:, :1]`): the result's gradient reaches each piece times its factor
    (summed where the result broadcasts it), so the result stays Shared. None for any other op."""
    if kwargs or not all(hasattr(st.owner, "scaled") for _, st in shared) or _in_place(name):
        return None
    tensors = [t for t, _ in shared]
    if len(tensors) == 2 and tensors[0] is tensors[1]:
        return None
    if name in ("neg", "__neg__", "negative") and len(args) == 1:
        factors = [-1.0]
    elif len(args) != 2:
        return None
    elif name in _MULS or name in _DIVS:
        number = args[1] if args[0] is tensors[0] else args[0]
        if len(tensors) != 1 or type(number) not in (int, float) or number == 0 or name in _DIVS and args[1] is not number:
            return None
        factors = [1.0 / number if name in _DIVS else float(number)]
    else:
        sign = -1 if name == "__rsub__" else _ADDS.get(name)
        if sign is None:
            return None
        subtracted = args[0] if name == "__rsub__" else args[1]
        factors = [-1.0 if sign < 0 and t is subtracted else 1.0 for t in tensors]
    terms = [st.owner.scaled(out, f) for (_, st), f in zip(shared, factors)]
    return Shared(terms[0] if len(terms) == 1 else terms[0].plus(terms[1:]))


def _in_place(name: str) -> bool:
    return name.endswith("_") and not name.startswith("__") or name.startswith("__i")


def _repeats_only_ones(t: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether x.repeat(...) / x.tile(...) giving `out` only copied dims of size 1 (or added leading ones): the same
    elements broadcast, as an expansion would give them."""
    aligned = (1,) * (out.dim() - t.dim()) + tuple(t.shape)
    return all(a == o or a == 1 for a, o in zip(aligned, out.shape))


def _recurrent_cell(tracker, args, kwargs, inputs, out) -> int | list:
    """torch's RNN cells (`_VF.rnn_tanh_cell/rnn_relu_cell/gru_cell(input, hx, w_ih, w_hh, b_ih, b_hh)` and
    `_VF.lstm_cell(input, (h, c), ...)`): one step of each sample's own recurrence, with the batch on dim 0 of the
    input, the state and the outputs (h', and c' for an LSTM cell)."""
    dims = sorted({s for _, s in inputs})
    if dims != [0]:
        raise Lost(f"a recurrent cell with inputs batched on dim {dims[-1]} (a cell takes the batch on dim 0)")
    return [0] * len(out) if isinstance(out, (tuple, list)) else 0


# Ops that take parts of a tensor along one dim (a window attention's q, k, v: `qkv.unbind(0)` over rows merged with
# the batch): run on a merged batch as on a plain one at its dim, the merge kept, when they cut another dim.
_MERGED_PARTS = {"unbind", "select", *_SPLITS}


def _merged_parts(tracker, name: str, args: Sequence, kwargs: dict, inputs: list, out: Any, merged: Merged) -> Merged:
    """The status of the parts (unbind, select, split) or the repeats (repeat_interleave) of a tensor whose batch is
    merged with rows (`merged`): merged as before on the dim the batch's rows are on then; lost when the op cuts that
    dim."""
    x = args[0]
    if x is not inputs[0][0] or len(inputs) != 1:
        raise Lost(f"{name} of a merged batch given other than as its first argument")
    if name == "repeat_interleave":
        return _repeat_interleave(tracker, args, kwargs, inputs, out, merged)
    d = _RULES[name](tracker, args, kwargs, [(x, merged.dim)], out)
    parts = out if isinstance(out, (tuple, list)) else (out,)
    if type(d) is not int or any(p.shape[d] != tracker.batch * merged.inner for p in parts):
        raise Lost(f"{name} of a merged batch (its rows do not stay its rows)")
    return Merged(d, merged.inner)


def _merged_joined(tracker, name: str, args: Sequence, kwargs: dict, inputs: list, out: Any, merged: Merged) -> Merged:
    """cat / stack of tensors whose batch is merged with rows alike (`merged`), along another dim: merged as before
    (on the dim after it where stack puts a new dim before it); lost along the merged dim itself."""
    tensors = [t for t in _arg(args, kwargs, 0, "tensors") if not (t.dim() == 1 and t.numel() == 0)]
    rows = tracker.batch * merged.inner
    if not isinstance(out, torch.Tensor) or not tensors or any(
            t.dim() != tensors[0].dim() or t.shape[merged.dim] != rows for t in tensors):
        raise Lost(f"{name} of a merged batch with a tensor without its rows")
    dim = _dims(_arg(args, kwargs, 1, "dim", 0), tensors[0].dim() + (name == "stack"))[0]
    if name == "stack":
        return Merged(merged.dim + (dim <= merged.dim), merged.inner)
    if dim == merged.dim:
        raise Lost(f"{name} along the dim where the batch is merged with other rows")
    return merged


def _as_strided(tracker, args, kwargs, inputs, out, merged: Merged | None = None) -> int | Merged:
    """x.as_strided(size, stride, offset) that keeps x's batch dim (its size and stride) and reads, in each of its rows,
    only that row's elements of x: Longformer's overlapping chunks of each sample's sequence (`as_strided` over
    [B·heads, T, d], the batch merged with the heads). The batch is where it was; any other view of the storage loses
    it."""
    x = args[0]
    size, stride = _arg(args, kwargs, 1, "size"), _arg(args, kwargs, 2, "stride")
    offset = _arg(args, kwargs, 3, "storage_offset")
    d = merged.dim if merged is not None else inputs[0][1]
    if (x is not inputs[0][0] or len(inputs) != 1 or not isinstance(out, torch.Tensor) or size is None
            or stride is None or len(size) != len(stride) or len(size) <= d or size[d] != x.shape[d]
            or stride[d] != x.stride(d) or not _reads_own_rows(x, d, size, stride, offset)):
        raise Lost("as_strided (a view of the storage that may cross the samples' rows)")
    return merged if merged is not None else d


def _reads_own_rows(x: torch.Tensor, d: int, size: Sequence[int], stride: Sequence[int], offset: int | None) -> bool:
    """Whether every element a view (size, stride, offset) of x's storage, x's dim d kept, reads in its row b along d
    is an element of x's row b: x's elements are at distinct addresses (its strides sorted, each past the reach of the
    smaller ones), and the view's offsets within a row are offsets x has within a row. False where too many to check."""
    dims = sorted((s, n) for n, s in zip(x.shape, x.stride()) if n > 1)
    reach = 0
    for s, n in dims:
        if s <= reach:
            return False  # (x's own elements overlap: an expanded tensor)
        reach += (n - 1) * s
    shift = (offset if offset is not None else x.storage_offset()) - x.storage_offset()

    def offsets(shape: Sequence[int], strides: Sequence[int]) -> torch.Tensor | None:
        if math.prod(n for k, n in enumerate(shape) if k != d) > _MOST_OFFSETS:
            return None
        found = torch.zeros(1, dtype=torch.long)
        for k, (n, s) in enumerate(zip(shape, strides)):
            if k != d:
                found = (found[:, None] + torch.arange(n) * s).reshape(-1)
        return found

    have, want = offsets(x.shape, x.stride()), offsets(size, stride)
    return have is not None and want is not None and bool(torch.isin(want + shift, have).all())


_MOST_OFFSETS = 1 << 22  # the most elements per row as_strided's check looks at (on the host)


def _repeat_interleave(tracker, args, kwargs, inputs, out, merged: Merged | None = None) -> int | Merged:
    """x.repeat_interleave(n, dim) with n a number: along the batch dim each sample's rows repeated n times in a row,
    which is the batch merged with n rows each, sample-major (GC ViT's global query over each image's windows); along
    another dim each sample's own values repeated, the batch where it was."""
    x = args[0]
    repeats, dim = _arg(args, kwargs, 1, "repeats"), _arg(args, kwargs, 2, "dim")
    if isinstance(repeats, torch.Tensor) and repeats.numel() == 1 and repeats.dim() == 0:
        repeats = int(repeats)
    if type(repeats) is not int or dim is None or not isinstance(out, torch.Tensor):
        raise Lost("repeat_interleave (by a tensor of repeats, or of the flattened tensor)")
    dim = _dims(dim, x.dim())[0]
    d = merged.dim if merged is not None else inputs[0][1]
    inner = merged.inner if merged is not None else 1
    if dim == d:
        inner *= repeats
    if out.shape[d] != tracker.batch * inner:
        raise Lost("repeat_interleave (its output's rows are not the batch's)")
    return d if inner == 1 else Merged(d, inner)


def _select(tracker, args, kwargs, inputs, out) -> int:
    x, d = args[0], tracker.input_dim(args, inputs)
    dim = _dims(_arg(args, kwargs, 1, "dim"), x.dim())[0]
    if dim == d:
        raise Lost("select on the batch dim (one sample)")
    return d - (dim < d)


def _split(tracker, args, kwargs, inputs, out) -> int:
    x, d = args[0], tracker.input_dim(args, inputs)
    dim = _dims(_arg(args, kwargs, 2, "dim", 0), x.dim())[0]
    if dim == d:
        raise Lost("a split of the batch dim")
    return d


class MixedUnseen(str):
    """A lost status: an op that mixes the samples (a CrossSample) ran with grad off over inputs that carry a graph, as
    in a custom autograd.Function's forward, whose backward is its own and carries the mixing back. When a tensor of
    this status carries a gradient again (the Function's output), it is watched there as the op's output would have
    been (`why`); one that never does (a statistic taken under torch.no_grad) is a constant of the step."""

    why: CrossSample


def lost_status(tracker: BatchTracker, why: Lost, inputs: list, out: Any) -> str:
    """The status of out where a rule raised `why`: a CrossSample's outputs with a gradient are watched (each output of
    a tuple: torch.max(x, 0) gives values and indices); under no grad over inputs with a graph, MixedUnseen (a sum
    over the batch, `graded`)."""
    status = why.status()
    graph_under_no_grad = not torch.is_grad_enabled() and any(t.requires_grad for t, _ in inputs)
    if type(status) is BatchSum and graph_under_no_grad:
        status.graded = True
    if not isinstance(why, CrossSample):
        watch_lost(tracker, status, inputs, out)
        return status
    for o in graded_tensors(out):
        watch_cross_sample(tracker, o, why)
    if graph_under_no_grad:
        status = MixedUnseen(status)
        status.why = why
    return status


def watch_mixed_inputs(tracker: BatchTracker, inputs: list) -> list:
    """`inputs`, a MixedUnseen status plain lost once grad is on: an output of a custom Function (its graph node the
    Function's backward) is watched then as a CrossSample's output (once: its status plain lost from there); any other
    tensor of that status got its gradient, if any, some other way (a statistic taken under torch.no_grad, then used as
    a constant)."""
    if not torch.is_grad_enabled() or not any(type(st) is MixedUnseen for _, st in inputs):
        return inputs
    for t, st in inputs:
        if type(st) is MixedUnseen:
            if t.requires_grad and isinstance(t.grad_fn, torch.autograd.function.BackwardCFunction):
                watch_cross_sample(tracker, t, st.why)
            tracker.mark(t, str(st))
    return [(t, str(st) if type(st) is MixedUnseen else st) for t, st in inputs]


def _without_constants(name: str, inputs: list) -> list:
    """A pointwise op's inputs without its constants of the step, with grad on, where it has a batched input (on a
    plain dim, or merged): inputs whose batch was lost or summed over that carry no gradient (a statistic of the batch
    taken under torch.no_grad or detached: `h / h.abs().amax(0).detach()`; a mask made from routing indices). No
    gradient goes back through them, so the op keeps its batched inputs' rows: each sample's loss term, with that
    constant in it. `inputs` itself where the op is not of that kind: a lost input with a gradient (the rows after the
    op may hold several samples' values, and its gradient several samples' losses: lost, watch_lost), or grad off (in
    a custom Function's forward, a tensor without a gradient may still carry one back through its backward)."""
    if not torch.is_grad_enabled() or not _is_pointwise(name):
        return inputs
    held = [(t, s) for t, s in inputs if not isinstance(s, str)]
    if not any(type(s) is int or type(s) is Merged for _, s in held) or len(held) == len(inputs) or any(
            isinstance(s, str) and (t.requires_grad or getattr(s, "graded", False)) for t, s in inputs):
        return inputs
    return held


def watch_lost(tracker: BatchTracker, status: str, inputs: list, out: Any) -> None:
    """An op whose output lost the batch (`status`) while an input had it (no batch rule for the op, a reshape that
    mixes the batch's rows with others, one sample's tensor broadcast over the others): a row of the gradient that comes
    back through it may hold several samples' losses, and so may the per-sample gradients of everything before it. A hook
    on each output with a gradient reports a non-zero one (one device sync, in that backward) to the tracker's
    `lost_gradient` with the autograd node it reached, whose callee leaves out what lies before it. Not inside a
    covered layer or a row-keeping block (ruled_depth: their rule owns their ops; one whose output stays lost is watched
    as it returns), nor for one sample, a sum over the batch (BatchSum, a loss's reduction) or with grad off."""
    report = tracker.lost_gradient
    if (report is None or tracker.ruled_depth or tracker.batch < 2 or type(status) is BatchSum
            or not torch.is_grad_enabled() or not any(type(st) is int or type(st) is Merged for _, st in inputs)):
        return
    for o in graded_tensors(out):
        o.register_hook(functools.partial(_lost_gradient, report, str(status)))


def _lost_gradient(report: Callable[[str, Any], None], status: str, g: torch.Tensor) -> None:
    if g is not None and bool((g.detach() != 0).any()):  # (a NaN counts: it came back through the op too)
        report(status, _torch_compat.current_autograd_node())


def watch_cross_sample(tracker: BatchTracker, out: torch.Tensor, why: CrossSample) -> None:
    """A hook on out, the product of two samples' tensors or a statistic of the batch: a gradient there that is not zero
    (one device sync, in that backward) means the loss depends on several samples at once, recorded in the tracker's
    `mixing`."""
    def hook(g: torch.Tensor) -> None:
        if tracker.mixing is not None and g is not None and bool(g.detach().abs().amax() > 0):
            tracker.mixing["the model's forward"] = why.mixing()
    out.register_hook(hook)


_SUMS = {"sum", "mean", "nansum", "nanmean"}
# Ops that keep a sum over the batch a sum of per-sample terms whatever their other operands without a gradient
_SUM_KEEPING = {*_VIEWS, *_EXPANDS, *_COPIES, *_ORDER_KEEPING_VIEWS, *_SPLITS, *_SUMS, "__getitem__", "select",
                "unbind", "cat", "concat", "concatenate", "stack", "neg", "__neg__", "negative", "clone", "detach",
                "transpose", "permute", "t", "T", "movedim", "flip", "where", "masked_fill", *_ADDS, "rsub",
                "__rsub__"}


def after_batch_sum(tracker: BatchTracker, name: str, args: Sequence, kwargs: dict, inputs: list, out: Any) -> Any:
    """The status of an op on a sum over the batch (BatchSum). With an input still batched, merged or lost: a
    BatchStatistic where a sum carries a gradient (its gradient back into the batch mixes the samples: a batch
    centred by hand), else lost there, as for any reduction over it. Else: kept by a linear op (views, copies, sums,
    negation, adds, a product or a quotient in which one sum with a gradient is a factor or the dividend, `where`);
    a BatchStatistic for any other op of a sum that carries a gradient (a product of two such sums, `exp` or a power of
    one, a division by one), as a statistic of the batch that is no sum of per-sample terms."""
    sums = [(t, s) for t, s in inputs if type(s) is BatchSum]
    others = [(t, s) for t, s in inputs if type(s) is not BatchSum and type(s) is not Shared]
    if others:
        # x - x.mean(0): each sample's row gets every sample's gradient through the sum (not a constant that scales the
        # loss: a count or a maximum of the batch without a gradient)
        live = any(t.requires_grad or s.graded for t, s in sums)  # (graded: summed in a Function's forward)
        # (a lost tensor with a gradient added to it, a loss's term that mixes the samples: watched where it was lost)
        if live and any(not isinstance(s, str) or t.requires_grad and name not in _ADDS for t, s in others):
            raise BatchStatistic(f"{name} of a sum over the batch, with a gradient, and the batch ({sums[0][1]})")
        raise Lost(f"{name} of a sum over the batch with the batch or its loss ({sums[0][1]})")
    live = [t for t, _ in sums if t.requires_grad]
    if name in _SUM_KEEPING or not live:
        return sums[0][1]
    if (name in _MULS or name in _DIVS) and len(live) == 1 and (name in _MULS or args[0] is live[0]):
        return sums[0][1]
    raise BatchStatistic(f"{name} of a sum over the batch ({sums[0][1]})")


def _mark_outputs(tracker: BatchTracker, name: str, args: Sequence, out: Any, result: Any) -> None:
    """Marks the outputs of an op of several (or none: __setitem__ marks the tensor written), result a status or one per
    output."""
    if name == "__setitem__":  # x[i] = value: x now holds what value holds
        if isinstance(result, (int, str, Merged)) or result is None:
            tracker.mark(args[0], result)
        return
    if isinstance(out, torch.Tensor):
        tracker.mark(out, result if not isinstance(result, list) else result[0])
    elif isinstance(out, (tuple, list)):
        statuses = result if isinstance(result, list) else [result] * len(out)
        for t, s in zip(out, statuses):
            if isinstance(t, torch.Tensor):
                tracker.mark(t, s)


class SampleSlice(str):
    """A status: sample `sample`'s tensor of those `unbind` made of a tensor along its batch dim (`list(features)`):
    lost, as its str says, except to `cat` and `stack` of all of them in order, which make the batch again (LLaVA's
    image features: `torch.cat(list(features), 0)`)."""

    def __new__(cls, why: str, source: int, sample: int):
        out = super().__new__(cls, why)
        out.source, out.sample = source, sample
        return out


def _unbind(tracker, args, kwargs, inputs, out) -> int | list:
    x, d = args[0], tracker.input_dim(args, inputs)
    dim = _dims(_arg(args, kwargs, 1, "dim", 0), x.dim())[0]
    if dim == d:
        return [SampleSlice("unbind of the batch dim (one sample per tensor)", id(out), b) for b in range(len(out))]
    return d - (dim < d)


def _samples_joined(tracker, name: str, args: Sequence, kwargs: dict, inputs: list) -> int | Merged | None:
    """cat (or stack) of every sample's tensor of one unbind (SampleSlice), in order: along dim k, dim k holds the batch
    merged with each tensor's rows there (plain for stack). None when the op is not that."""
    tensors = _arg(args, kwargs, 0, "tensors")
    if not isinstance(tensors, (list, tuple)) or len(tensors) != tracker.batch or len(inputs) != len(tensors):
        return None
    slices = [tracker.status(t) for t in tensors]
    if not all(type(sl) is SampleSlice and sl.source == slices[0].source and sl.sample == b for b, sl in enumerate(slices)) \
            or any(t.shape != tensors[0].shape for t in tensors):
        return None
    ndim = tensors[0].dim() + (name == "stack")
    dim = _dims(_arg(args, kwargs, 1, "dim", 0), ndim)[0]
    if name == "stack":
        return dim
    return dim if tensors[0].shape[dim] == 1 else Merged(dim, tensors[0].shape[dim])


def _samples_rejoined(tracker, name: str, args: Sequence, kwargs: dict, inputs: list, lost: list, out: Any) -> Any:
    """The batch made again from what had lost it as a dim of its own: every sample's tensor of one unbind
    concatenated or stacked in order (_samples_joined), or source rows merged with the batch scattered into it
    (_masked_scatter). None when the op is neither."""
    if lost and (name in _CATS or name == "stack"):
        return _samples_joined(tracker, name, args, kwargs, inputs)
    if not lost and name in ("masked_scatter", "masked_scatter_"):
        return _masked_scatter(tracker, args, kwargs, inputs, out)
    return None


def _masked_scatter(tracker, args: Sequence, kwargs: dict, inputs: list, out: torch.Tensor) -> int:
    """x.masked_scatter(mask, source): source's elements, in order, into x where mask holds (LLaVA's image features into
    the image tokens' embeddings). With x and mask batched on dim 0 (or shared by every sample) and source's elements
    sample-major (batched on dim 0, or merged there), row b of the result is sample b's when every sample's row takes
    the same number of source elements, its own (the mask's counts are read: one device sync)."""
    x, mask, source = args[0], _arg(args, kwargs, 1, "mask"), _arg(args, kwargs, 2, "source")
    statuses = {id(t): s for t, s in inputs}
    sx, sm, ss = (statuses.get(id(t)) for t in (x, mask, source))
    if sx not in (0, None) or sm not in (0, None) or not (ss == 0 or (type(ss) is Merged and ss.dim == 0)) \
            or out.dim() == 0 or out.shape[0] != tracker.batch or source.numel() % tracker.batch:
        raise Lost("masked_scatter whose samples' elements may go to other samples")
    taken = mask.expand(out.shape).reshape(tracker.batch, -1).sum(1)
    if not bool((taken == source.numel() // tracker.batch).all()):
        raise Lost("masked_scatter whose samples take different numbers of elements")
    return 0


def _cat(tracker, args, kwargs, inputs, out) -> int:
    # torch.cat skips 1-D empty tensors whatever the others' shape (a KV cache starts as one: the
    # transformers DynamicCache concatenates its keys onto torch.tensor([])).
    tensors = [t for t in _arg(args, kwargs, 0, "tensors") if not (t.dim() == 1 and t.numel() == 0)] or [out]
    ndim = tensors[0].dim()
    dim = _dims(_arg(args, kwargs, 1, "dim", 0), ndim)[0]
    dims = {s for _, s in inputs}
    if len(dims) != 1 or dim in dims:
        raise Lost("cat along the batch dim, or of tensors batched on different dims")
    d = dims.pop()
    if any(t.dim() != ndim or t.shape[d] != tracker.batch for t in tensors):
        raise Lost("cat of a tensor without the batch dim")
    return d


def _stack(tracker, args, kwargs, inputs, out) -> int:
    tensors = _arg(args, kwargs, 0, "tensors")
    dim = _dims(_arg(args, kwargs, 1, "dim", 0), tensors[0].dim() + 1)[0]
    dims = {s for _, s in inputs}
    if len(dims) != 1:
        raise Lost("stack of tensors batched on different dims")
    d = dims.pop()
    return d + (dim <= d)


def _getitem(tracker, args, kwargs, inputs, out) -> int:
    """Basic indexing (ints, slices, None, ...); an index tensor only off the batch dim and alone. An unbatched tensor
    indexed by a batched one: _looked_up."""
    x = args[0]
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    if not any(t is x for t, _ in inputs):
        return _looked_up(tracker, x, index, out)
    d = tracker.input_dim(args, inputs)
    picked = _samples_picked_in_order(tracker, x, index, d, out)
    if picked is not None:
        return picked
    if any(isinstance(i, torch.Tensor) and tracker.status(i) is not None for i in index):
        raise Lost("indexing with a batched index tensor")
    return _indexed_dim(x, index, d)


def _looked_up(tracker, x: torch.Tensor, index: tuple, out: torch.Tensor) -> int:
    """x[index] of an unbatched x (a table) by one integer index tensor batched on a plain dim, beside slices, None
    and ints next to it (a position table's rows picked by each sample's ids: `pos[0, ids % n]`): the index tensor's
    dims take the place of the dims it and those ints index, so row b of the result is sample b's."""
    if any(isinstance(i, bool) or not (isinstance(i, (int, slice, torch.Tensor)) or i is None) for i in index):
        raise Lost("indexing of an unbatched tensor by a batched index beside an Ellipsis or a mask")
    tensors = [i for i in index if isinstance(i, torch.Tensor)]
    picked = [k for k, i in enumerate(index) if isinstance(i, (int, torch.Tensor))]
    s = tracker.status(tensors[0]) if len(tensors) == 1 else None
    if type(s) is not int or tensors[0].dtype not in (torch.int64, torch.int32) \
            or picked != list(range(picked[0], picked[-1] + 1)):
        raise Lost("indexing of an unbatched tensor by batched indices (several index tensors, or ints apart from it)")
    at = sum(1 for i in index[:picked[0]] if i is None or isinstance(i, slice))  # the result's dims before them
    if tuple(out.shape[at:at + tensors[0].dim()]) != tuple(tensors[0].shape):
        raise Lost("indexing of an unbatched tensor by a batched index (its result not laid out as the index)")
    return at + s


def _samples_picked_in_order(tracker, x: torch.Tensor, index: tuple, d: int, out: torch.Tensor) -> int | None:
    """Where the batch lands in x[i_0, ..., i_k] of integer index tensors, the one on the batch dim d counting the
    samples in order along one of its dims, the others shared by every sample or batched along that same dim
    (Hugging Face's masks: `padding_mask[batch_idx, kv_idx]` with batch_idx = arange(B)[:, None, None, None]; CLIP's
    end-of-text pick `h[arange(B), ids.argmax(-1)]`; whole slices between them too, Longformer's global tokens
    `g[batch_idx, :, local_idx]`): there row b of the result is sample b's. None where the index is not of that kind
    (its values are read: one device sync)."""
    batch = tracker.batch
    if (not 0 < len(index) <= x.dim() or d >= len(index) or not isinstance(index[d], torch.Tensor)
            or tracker.status(index[d]) is not None or not all(
                isinstance(i, torch.Tensor) and i.dtype in (torch.int64, torch.int32)
                or isinstance(i, slice) and i == slice(None) for i in index)):
        return None
    counting = index[d]
    varying = [k for k, n in enumerate(counting.shape) if n != 1]
    if counting.dim() == 0 or len(varying) > 1 or (varying and counting.shape[varying[0]] != batch) \
            or (not varying and batch != 1):
        return None
    tensors = [k for k, i in enumerate(index) if isinstance(i, torch.Tensor)]
    try:
        shape = torch.broadcast_shapes(*(index[k].shape for k in tensors))
    except RuntimeError:
        return None
    # torch puts the index tensors' dims where they stand when they are adjacent, else first
    lead = tensors[0] if tensors == list(range(tensors[0], tensors[-1] + 1)) else 0
    sliced = [x.shape[k] for k in range(len(index)) if k not in tensors]
    if tuple(out.shape) != (*sliced[:lead], *shape, *sliced[lead:], *x.shape[len(index):]):
        return None
    at = lead + len(shape) - counting.dim() + (varying[0] if varying else counting.dim() - 1)
    for i in index:
        if not isinstance(i, torch.Tensor):
            continue
        s = tracker.status(i)
        if s is not None and (type(s) is not int or lead + len(shape) - i.dim() + s != at):
            return None  # an index batched along another dim than the samples are counted on
    if not torch.equal(counting.reshape(-1), torch.arange(batch, device=counting.device, dtype=counting.dtype)):
        return None
    return at


def _indexed_dim(x: torch.Tensor, index: tuple, d: int) -> int:
    """Where dim d of x lands in x[index] (basic indexing and one index tensor off d); Lost where the index selects
    along d (some samples, not all of them)."""
    used = sum(0 if i is None or i is Ellipsis else (i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                      else 1) for i in index)
    if Ellipsis in [i for i in index if not isinstance(i, torch.Tensor)]:
        at = next(k for k, i in enumerate(index) if i is Ellipsis)
        index = (*index[:at], *([slice(None)] * (x.dim() - used)), *index[at + 1:])
    tensors = [i for i in index if isinstance(i, torch.Tensor)]
    if len(tensors) > 1 or any(t.dtype == torch.bool for t in tensors):
        raise Lost("advanced indexing (boolean masks, several index tensors)")
    src, dst = 0, 0
    for i in index:
        if i is None:
            dst += 1
            continue
        if src == d:
            if isinstance(i, slice) and i == slice(None):
                return dst
            raise Lost("indexing that selects samples")
        if isinstance(i, slice):
            dst += 1
        elif isinstance(i, torch.Tensor):
            if src < d and i.dim() != 1:
                raise Lost("an index tensor before the batch dim")
            dst += i.dim()
        src += 1
    return dst + (d - src)


def _indexed_rank(x: torch.Tensor, index: tuple) -> int:
    """The number of dims of x[index] (basic indexing, an integer index tensor)."""
    rank = x.dim()
    for i in index:
        if i is None:
            rank += 1
        elif isinstance(i, torch.Tensor):
            rank += i.dim() - 1
        elif i is not Ellipsis and not isinstance(i, slice):  # an int
            rank -= 1
    return rank


def _setitem(tracker, args, kwargs, inputs, out) -> Any:
    """x[index] = value. An unbatched value leaves x as it was. A batched one keeps (or makes) x batched on dim d where
    the index takes every sample along d and value's batch lands on d's place in x[index]: each sample's slice of x
    then holds its own values and what x held for every sample (T5's and BART's `shifted = ids.new_zeros(ids.shape);
    shifted[..., 1:] = ids[..., :-1]`). Views of x taken before the write keep their own status (none)."""
    x, value = args[0], args[2] if len(args) > 2 else None
    sx = tracker.status(x)
    sv = tracker.status(value) if isinstance(value, torch.Tensor) else None
    if sv is None:
        return sx
    lost = "an indexed assignment of batched values (x[i] = y)"
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    if tracker.batch == 1 and type(sx) is int and isinstance(sv, str):
        # One sample: a value whose batch dim was squeezed away (mBART's `ids.gather(1, last).squeeze()`, written back
        # into its ids) is that sample's; x keeps its batch where the index keeps it whole.
        try:
            _indexed_dim(x, index, sx)
            return sx
        except Lost:
            return lost
    if type(sv) is not int or (sx is not None and type(sx) is not int) or any(
            isinstance(i, torch.Tensor) and tracker.status(i) is not None for i in index):
        return lost
    d = _written_dim(x, index, value, sv, sx, tracker.batch)
    if d is None:
        d = _samples_written_in_order(x, index, value, sv, sx, tracker.batch)
    return lost if d is None else d


def _samples_written_in_order(x: torch.Tensor, index: tuple, value: torch.Tensor, sv: int, sx: int | None,
                              rows: int) -> int | None:
    """x[i_0, ..., i_k] = value by integer index tensors no sample's data flows into, value laid out as x[index] with its
    `rows` samples on dim sv among the index's dims: the dim d of x (x's own batch dim sx, or one of x's first k + 1 of
    `rows` size when x is fresh) whose index names, for every element written, the sample its value is from
    (Longformer's global tokens: `g[local_idx, batch_idx] = h[pos_idx, batch_idx]`), so sample b's values land in x's
    slice b along d. None where there is none (the index's values are read: one device sync)."""
    if not 0 < len(index) <= x.dim() or not all(
            isinstance(i, torch.Tensor) and i.dtype in (torch.int64, torch.int32) for i in index):
        return None
    try:
        shape = torch.broadcast_shapes(*(i.shape for i in index))
    except RuntimeError:
        return None
    if sv >= len(shape) or shape[sv] != rows or tuple(value.shape) != (*shape, *x.shape[len(index):]):
        return None
    sample = torch.arange(rows, device=index[0].device).reshape([-1 if k == sv else 1 for k in range(len(shape))])
    for d in [sx] if sx is not None else [k for k in range(len(index)) if x.shape[k] == rows]:
        if d < len(index) and torch.equal(index[d].expand(shape), sample.to(index[d].dtype).expand(shape)):
            return d
    return None


def _written_dim(x: torch.Tensor, index: tuple, value: torch.Tensor, sv: int, sx: int | None, rows: int) -> int | None:
    """The dim of x that holds `rows` batch rows after x[index] = value, value's rows on its dim sv (x's own on sx, or
    found by size when x is fresh): where the index keeps that dim whole and value's rows land on it; None otherwise."""
    for d in ([sx] if sx is not None else [k for k in range(x.dim()) if x.shape[k] == rows]):
        try:
            at = _indexed_dim(x, index, d)
        except Lost:
            continue
        if sv + _indexed_rank(x, index) - value.dim() == at and value.shape[sv] == rows:
            return d
    return None


def _merged_setitem(tracker, args, merged: Merged) -> Any:
    """x[index] = value, value's batch merged with rows (`merged`) and x fresh or merged alike: as _setitem, with the
    batch's rows (Longformer's diagonals written into a new [B·heads, ...] tensor)."""
    x, value = args[0], args[2] if len(args) > 2 else None
    sx = tracker.status(x)
    sv = tracker.status(value) if isinstance(value, torch.Tensor) else None
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    if sv != merged or (sx is not None and sx != merged) or any(
            isinstance(i, torch.Tensor) and tracker.status(i) is not None for i in index):
        return "an indexed assignment of batched values (x[i] = y)"
    d = _written_dim(x, index, value, sv.dim, None if sx is None else sx.dim, tracker.batch * merged.inner)
    return "an indexed assignment of batched values (x[i] = y)" if d is None else Merged(d, merged.inner)


def _matmul(tracker, args, kwargs, inputs, out) -> int:
    a, b = args[0], args[1]
    dims = set()
    for t, s in inputs:
        n = t.dim()
        if n < 2:
            raise Lost("matmul of a batched vector")
        contracted = n - 1 if t is a else n - 2
        if s == contracted:
            raise Lost("matmul contracting the batch dim (it mixes the samples)")
        if t is a and s == n - 2:
            dims.add(out.dim() - 2)
        elif t is b and s == n - 1:
            dims.add(out.dim() - 1)
        else:
            dims.add(s + out.dim() - n)
    if len(dims) != 1:
        if len(inputs) == 2 and len(dims) == 2:
            raise CrossSample("matmul of two tensors batched on different dims: sample i's rows against sample j's")
        raise Lost("matmul of operands batched on different dims")
    return dims.pop()


def _rmatmul(tracker, args, kwargs, inputs, out) -> int:
    return _matmul(tracker, (args[1], args[0]), kwargs, inputs, out)


def _einsum(tracker, args, kwargs, inputs, out) -> int:
    equation = args[0].replace(" ", "")
    operands = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
    if "..." in equation or "->" not in equation:
        raise Lost("einsum with '...' or an implicit output")
    lhs, rhs = equation.split("->")
    letters = set()
    dims = {id(t): s for t, s in inputs}  # (a merged batch's dim, when called for one: merged_status)
    for spec, t in zip(lhs.split(","), operands):
        s = dims.get(id(t))
        if isinstance(s, int):
            letters.add(spec[s])
    if len(letters) > 1 and all(letter in rhs for letter in letters):
        raise CrossSample("einsum of tensors whose batches stay on different letters: every pair of samples")
    if len(letters) != 1 or next(iter(letters)) not in rhs:
        raise Lost("einsum that sums over the batch or puts it on several letters")
    return rhs.index(letters.pop())


def _linear(tracker, args, kwargs, inputs, out) -> int:
    x = args[0]
    if any(t is not x for t, _ in inputs):
        raise Lost("linear with a batched weight")
    d = tracker.input_dim(args, inputs)
    if d == x.dim() - 1:
        raise Lost("linear over the batch dim (it mixes the samples)")
    return d


def _bilinear(tracker, args, kwargs, inputs, out) -> int:
    """bilinear(x1, x2, W, b): x1 and x2 share their leading dims, each row of the output the form of the same rows of
    both; a batched weight or bias, or the batch on the features' dim, mixes the samples."""
    x1, x2 = args[0], (args[1] if len(args) > 1 else kwargs.get("input2"))
    dims = {s for t, s in inputs if t is x1 or t is x2}
    if len(dims) != 1 or any(t is not x1 and t is not x2 for t, _ in inputs):
        raise Lost("bilinear of a batched weight, or of inputs batched on different dims")
    d = dims.pop()
    if d == x1.dim() - 1:
        raise Lost("bilinear over the batch dim (it mixes the samples)")
    return d


def _addmm(tracker, args, kwargs, inputs, out) -> int:
    """addmm(bias, x, W): rows of x are rows of the output; a batched bias or W mixes the samples."""
    x = args[1]
    if any(t is not x for t, _ in inputs):
        raise Lost("addmm with a batched bias or weight")
    d = next(st for t, st in inputs if t is x)
    if d != 0:
        raise Lost("addmm contracting the batch dim (it mixes the samples)")
    return 0


def _baddbmm(tracker, args, kwargs, inputs, out) -> int:
    """baddbmm(input, batch1, batch2): matrix i of the output is input[i] + batch1[i] @ batch2[i] (input broadcast):
    the batch must be dim 0 of every batched operand (a 3-D one; a broadcast input of fewer dims is not batched)."""
    for t, st in inputs:
        if t.dim() != 3 or st != 0:
            raise Lost("baddbmm with an operand batched off its dim 0 (it mixes the samples)")
    return 0


def _embedding(tracker, args, kwargs, inputs, out) -> int:
    if any(t is not args[0] for t, _ in inputs):
        raise Lost("embedding with a batched weight")
    return tracker.input_dim(args, inputs)


def _embedding_bag(tracker, args, kwargs, inputs, out) -> int | str:
    ids = args[0]
    if any(t is not ids for t, _ in inputs if not _offsets(t, args, kwargs)):
        raise Lost("embedding_bag with a batched weight")
    if ids.dim() == 2:
        if isinstance(tracker.status(ids), str):
            return tracker.status(ids)
        if tracker.input_dim(args, inputs) != 0:
            raise Lost("embedding_bag with the batch off dim 0")
        return 0
    # 1-D ids and offsets: the bags are the samples when there is one bag per sample; which ids make
    # which bag is the offsets', which provenance cannot follow. Taken when the ids come from the batch.
    bags = out if isinstance(out, torch.Tensor) else out[0]  # F.embedding_bag, or torch.embedding_bag's tuple
    if bags.shape[0] != tracker.batch:
        raise Lost("embedding_bag with a number of bags other than the batch size")
    return 0


def _offsets(t: torch.Tensor, args, kwargs) -> bool:
    return t is _arg(args, kwargs, 2, "offsets") or t is _arg(args, kwargs, 8, "per_sample_weights")


def _sample_leading(name: str):
    def rule(tracker, args, kwargs, inputs, out) -> int:
        if any(t is not args[0] for t, _ in inputs) or tracker.input_dim(args, inputs) != 0:
            raise Lost(f"{name} with the batch off dim 0 (it mixes the samples)")
        return 0
    return rule


def _batch_norm(tracker, args, kwargs, inputs, out) -> int:
    """F.batch_norm: each sample on its own with running statistics (training=False); with the batch's own statistics
    (training=True, or no running statistics: a batch norm in training mode, or one called functionally, which the
    BatchNorm modules' hooks do not see) a statistic of the whole batch."""
    if _arg(args, kwargs, 5, "training", False) or _arg(args, kwargs, 1, "running_mean") is None:
        raise BatchStatistic("batch_norm with the batch's statistics")
    return _sample_leading("batch_norm")(tracker, args, kwargs, inputs, out)


def _last_dims_norm(tracker, args, kwargs, inputs, out) -> int:
    x = args[0]
    d = tracker.input_dim(args, inputs)
    shape = _arg(args, kwargs, 1, "normalized_shape")
    n = 1 if isinstance(shape, int) else len(shape)
    if d >= x.dim() - n or any(t is not x for t, _ in inputs):
        raise Lost("a normalisation over the batch dim (it mixes the samples)")
    return d


def _pad(tracker, args, kwargs, inputs, out) -> int:
    x, d = args[0], tracker.input_dim(args, inputs)
    pad = list(_arg(args, kwargs, 1, "pad"))
    k = x.dim() - 1 - d  # the batch is the k-th dim from the end
    if 2 * k + 1 < len(pad) and (pad[2 * k] or pad[2 * k + 1]):
        raise Lost("padding of the batch dim")
    return d


def _attention(tracker, args, kwargs, inputs, out) -> int:
    q = args[0]
    dims = {s + q.dim() - t.dim() for t, s in inputs}
    if len(dims) != 1:
        raise Lost("attention with inputs batched on different dims")
    d = dims.pop()
    if d >= q.dim() - 2:
        raise Lost("attention along the batch dim (it mixes the samples)")
    return d


def _mha(tracker, args, kwargs, inputs, out) -> list:
    """F.multi_head_attention_forward: sequence-first [T, B, E] inputs; attention weights [B, T, S]."""
    q = args[0]
    need = 1 if q.dim() == 3 else None
    for t, s in inputs:
        if t.dim() == 3 and s != need or t.dim() == 2 and s != 0:  # key_padding_mask [B, S] is batched at 0
            raise Lost("multi_head_attention_forward with the batch off dim 1 of [T, B, E] (it mixes the samples)")
    return [1, 0]


def _one_hot(tracker, args, kwargs, inputs, out) -> int:
    return tracker.input_dim(args, inputs)


_RULES: dict[str, Callable] = {
    **{n: _view for n in _VIEWS}, "unsqueeze": _unsqueeze, "unsqueeze_": _unsqueeze, "squeeze": _squeeze,
    "squeeze_": _squeeze, "expand": _expand, "expand_as": _expand, "broadcast_to": _expand,
    "repeat": _repeat, "tile": _repeat, "transpose": _transpose, "swapaxes": _transpose, "swapdims": _transpose,
    "transpose_": _transpose, "t": _t, "T": _t, "mT": _matrix_t, "mH": _matrix_t, "adjoint": _matrix_t,
    "permute": _permute, "movedim": _movedim, "moveaxis": _movedim,
    **{n: _reduction(n) for n in _REDUCTIONS}, **{n: _along_dim(n) for n in _ALONG_DIM}, **{n: _loss(n) for n in _LOSSES},
    "select": _select, **{n: _split for n in _SPLITS}, "unbind": _unbind, "repeat_interleave": _repeat_interleave, "as_strided": _as_strided,
    "masked_scatter": _masked_scatter, "masked_scatter_": _masked_scatter,
    "cat": _cat, "concat": _cat, "concatenate": _cat, "stack": _stack,
    "__getitem__": _getitem, "__setitem__": _setitem,
    "matmul": _matmul, "__matmul__": _matmul, "__rmatmul__": _rmatmul, "mm": _matmul, "bmm": _matmul, "addmm": _addmm,
    "baddbmm": _baddbmm,
    "einsum": _einsum, "linear": _linear, "bilinear": _bilinear, "embedding": _embedding, "embedding_bag": _embedding_bag,
    **{n: _sample_leading(n) for n in _SAMPLE_LEADING}, "batch_norm": _batch_norm,
    "layer_norm": _last_dims_norm, "rms_norm": _last_dims_norm, "pad": _pad,
    "scaled_dot_product_attention": _attention, "multi_head_attention_forward": _mha, "one_hot": _one_hot,
    "view_as_real": _one_hot, "view_as_complex": _one_hot,
    "lstm": _recurrent, "gru": _recurrent, "rnn_tanh": _recurrent, "rnn_relu": _recurrent,
    "lstm_cell": _recurrent_cell, "gru_cell": _recurrent_cell, "rnn_tanh_cell": _recurrent_cell,
    "rnn_relu_cell": _recurrent_cell,
}
