"""Small helpers shared by the monitor, per-sample norms and the dumper."""
from __future__ import annotations

import functools
import numbers
import weakref
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _torch_compat

# Attributes that FSDP1, activation checkpointing and torch.compile wrappers insert into names:
# private names, stripped wherever they appear.
_WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def name_cleaner(model: torch.nn.Module) -> Callable[[str], str]:
    """A function that removes wrapper components from `model`'s module/parameter names.

    DDP's and DataParallel's `module` is removed only right after such a wrapper, so a model's
    own submodule called `module` keeps its name.
    """
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    ddp = {n for n, m in model.named_modules() if isinstance(m, (DataParallel, DistributedDataParallel))}

    def clean(name: str) -> str:
        kept, path = [], []
        for part in name.split(".") if name else []:
            wrapper = part in _WRAPPER_PARTS or (part == "module" and ".".join(path) in ddp)
            if not wrapper:
                kept.append(part)
            path.append(part)
        return ".".join(kept)

    return clean


def clean_named(model: torch.nn.Module, named: Iterable[tuple[str, Any]], what: str) -> list[tuple[str, Any]]:
    """(clean name, value) pairs; raises ValueError if two different names clean to the same one.

    A wrapper module and the module it wraps (`block` and `block._checkpoint_wrapped_module`) share
    one clean name by design: the inner module is kept, in the wrapper's place."""
    clean = name_cleaner(model)
    out: list[tuple[str, Any]] = []
    seen: dict[str, tuple[str, int]] = {}  # clean name -> (raw name, index in out)
    for name, value in named:
        short = clean(name)
        if short in seen:
            first, index = seen[short]
            if name.startswith(first + ".") or (first == "" and name):  # the module a wrapper wraps
                out[index] = (short, value)
                seen[short] = (name, index)
                continue
            raise ValueError(f"gapmon: {what} '{first}' and '{name}' would both be reported as '{short}'; "
                             "rename one of them")
        seen[short] = (name, len(out))
        out.append((short, value))
    return out


def is_dtensor(x: Any) -> bool:
    """Whether x is a DTensor (checked by type name: no import of torch.distributed.tensor needed)."""
    return is_dtensor_type(type(x)) and hasattr(x, "placements")


def is_dtensor_type(kind: type) -> bool:
    """Whether tensors of type `kind` are DTensors (by name, as is_dtensor)."""
    return kind.__name__ == "DTensor"


def rank_and_world(group: Any = None) -> tuple[int, int]:
    """(rank, world size) in `group` (default: the default process group), or (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def first_tensor(value: Any) -> torch.Tensor | None:
    """The tensor itself, or the first tensor in a tuple/list/dict (not nested), else None."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        values: Iterable = value
    elif isinstance(value, Mapping):
        values = value.values()
    else:
        return None
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


def first_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The first tensor of a call's positional arguments, else of its keyword arguments."""
    found = first_tensor(args)
    return found if found is not None else first_tensor(kwargs)


def input_storages(args: tuple, kwargs: dict) -> set[int]:
    """The storages of a forward call's tensor arguments (what a forward pass's inputs are known by when backward
    runs it again on detached copies: reentrant activation checkpointing)."""
    return {t.untyped_storage().data_ptr() for t in _torch_compat.tensor_leaves((args, kwargs))}


def check_int(value: Any, who: str, name: str, minimum: int = 0) -> int:
    """`value` as an int >= minimum: any integral number (int, numpy.int64, a 0-dim integer tensor's
    item), never a float or bool. Raises TypeError/ValueError naming `who` and `name`."""
    wanted = "a non-negative integer" if minimum == 0 else f"an integer >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{who}: {name} must be {wanted}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{who}: {name} must be {wanted}, got {value}")
    return int(value)


def check_real(value: Any, who: str, name: str, minimum: float | None = None, maximum: float | None = None,
               above: float | None = None) -> float:
    """`value` as a finite float in [minimum, maximum] (and > `above`): any real number, never a bool, NaN or
    Inf. Raises TypeError/ValueError naming `who`, `name`, the type and the range."""
    parts = [f">= {minimum}" if minimum is not None else "", f"<= {maximum}" if maximum is not None else "",
             f"> {above}" if above is not None else ""]
    wanted = "a finite real number" + "".join(f" {p}" for p in parts if p)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{who}: {name} must be {wanted}, got {value!r} ({type(value).__name__})")
    v = float(value)
    if (v != v or v in (float("inf"), float("-inf")) or (minimum is not None and v < minimum)
            or (maximum is not None and v > maximum) or (above is not None and v <= above)):
        raise ValueError(f"{who}: {name} must be {wanted}, got {value!r}")
    return v


def check_step(step: Any, who: str) -> int:
    """`step` as a non-negative int (see check_int), errors naming `who` (e.g. "GradientDumper.maybe_dump")."""
    return check_int(step, who, "step")


def refuse_complex(params: list[tuple[str, torch.Tensor]], who: str, advice: str) -> None:
    """TypeError naming the complex parameters among (name, parameter) pairs, if any: gapmon's
    statistics and dumps are of real tensors."""
    found = [f"'{n}' ({p.dtype})" for n, p in params if p.is_complex()]
    if found:
        raise TypeError(f"{who}: parameter {', '.join(found)} is complex; {advice}")


class ParameterWatch:
    """Tells when a model's parameters are no longer the objects they were: large models are built on
    the meta device and materialised later (`to_empty`), checkpoints load with
    `load_state_dict(..., assign=True)`, and a layer's parameter may be replaced by assignment. Those
    who cache parameters re-derive what they cached when `changed()` says so. Weak references: an old
    parameter is never kept alive."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._tree = self._snapshot()

    def _snapshot(self) -> list[tuple]:
        """Per module reachable from the model: (its weak reference, its own parameters' and its children's names and
        weak references). named_parameters() is made of these registries, so while none changes it is unchanged."""
        def refs(registry: dict) -> tuple:
            return tuple(registry), tuple(None if v is None else weakref.ref(v) for v in registry.values())

        return [(weakref.ref(m), *(part for registry in _torch_compat.module_registries(m) for part in refs(registry)))
                for m in self.model.modules()]

    def changed(self) -> bool:
        """Whether a parameter was replaced, added or removed since the last call (or construction): any module's
        parameter or child registry changed (names or objects). A walk of plain dicts, not named_parameters()'s
        generators (~1.5x faster: it runs every step)."""
        for module_ref, names, params, child_names, children in self._tree:
            module = module_ref()
            if module is None:
                self._tree = self._snapshot()
                return True
            own, kids = _torch_compat.module_registries(module)
            if not (_same(own, names, params) and _same(kids, child_names, children)):
                self._tree = self._snapshot()
                return True
        return False


def _same(registry: dict, names: tuple, refs: tuple) -> bool:
    """Whether `registry` holds the objects of `refs` under `names`, in that order."""
    if len(registry) != len(names):
        return False
    for (name, value), was_name, ref in zip(registry.items(), names, refs):
        if name != was_name or value is not (None if ref is None else ref()):
            return False
    return True


def layer_type_name(module: nn.Module) -> str:
    """The name of the module's own class: "Linear" also for a layer fully_shard turned into an FSDPLinear
    (FSDP2 gives each sharded module a subclass of FSDPModule and its class). Per class, once (the per-sample
    hooks ask for every layer call)."""
    return _layer_type_name_of(type(module))


@functools.lru_cache(maxsize=None)
def _layer_type_name_of(kind: type) -> str:
    from torch.distributed.fsdp import FSDPModule

    for cls in kind.__mro__:
        if issubclass(cls, nn.Module) and not issubclass(cls, FSDPModule):
            return cls.__name__
    return kind.__name__


def first_of_each_id(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the ids sorted, each once; the row of each one's first occurrence in `ids`)."""
    order = torch.argsort(ids, stable=True)
    ordered = ids[order]
    keep = torch.ones_like(ordered, dtype=torch.bool)
    keep[1:] = ordered[1:] != ordered[:-1]
    return ordered[keep], order[keep]


def cosine_from_gram(k: torch.Tensor) -> torch.Tensor:
    """Cosine similarities K[i, j] / (|g_i| |g_j|) from a Gram matrix (0 where a norm is 0)."""
    norms = k.diagonal().clamp(min=0).sqrt()
    outer = norms[:, None] * norms[None, :]
    return torch.where(outer > 0, k / torch.where(outer > 0, outer, torch.ones_like(outer)), torch.zeros_like(k))
