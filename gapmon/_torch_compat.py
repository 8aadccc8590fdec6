"""Every private torch API gapmon uses, in one place, each with what it is for and the torch versions
it was tested on (2.11.0+cu130 on the GPU machines, 2.13.0+cpu in CI). A torch release that moves
one breaks here, with a clear name, rather than in several modules.

`tests/test_architecture.py` checks that no other library module reaches a private attribute of
torch (or of another object that is not its own).
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch
import torch.nn as nn

TESTED_ON = ("2.11.0", "2.13.0")

# Base classes torch keeps private: the batch-norm family (which mixes samples in training) and the
# convolutions (whose weights a per-sample rule unfolds).
BatchNormBase: type = nn.modules.batchnorm._BatchNorm
ConvNdBase: type = nn.modules.conv._ConvNd


def graph_task_id() -> int:
    """Id of the autograd graph task running now, -1 outside backward: a forward pass inside backward
    is activation checkpointing recomputing it."""
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    return graph_task_id() != -1


def accumulates_gradient(p: torch.Tensor) -> bool:
    """Whether the backward pass running now accumulates leaf p's gradient (loss.backward(), or backward(inputs=...)
    naming p); False for torch.autograd.grad, which captures gradients and accumulates none, and for backward(inputs=...)
    without p."""
    try:
        node = torch.autograd.graph.get_gradient_edge(p).node
    except RuntimeError:  # p needs no gradient: nothing to tell (taken as accumulating, as before the question)
        return True
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # "... we are currently running autograd.grad()"
        return False


def at_end_of_backward(callback: Callable[[], None]) -> None:
    """Runs `callback` when the backward pass running now ends (autograd's final callbacks)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def current_autograd_node() -> Any:
    """The autograd node backward evaluates now (in a tensor hook: the hooked tensor's grad_fn), None where this torch
    has no such call (callers then assume the worst)."""
    current = getattr(torch._C, "_current_autograd_node", None)
    return current() if current is not None else None


def functorch_transforms_active() -> bool:
    """Whether the code runs under torch.func (vmap, grad): hooks then see batched tensors."""
    return torch._C._are_functorch_transforms_active()


def saved_tensors_hooks_active() -> bool:
    """Whether a saved-tensors hook (activation offloading, checkpointing) is installed now."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs matrix products in on this device type now (None: autocast is off)."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def experts_gate(module: nn.Module, up: torch.Tensor) -> torch.Tensor:
    """transformers' experts gate (`_apply_gate`, which its mixture-of-experts integration sets on every experts class
    it dispatches: act(gate) · up by default, a family's own where it has one; transformers 5.24) applied to the up
    projection's output; the activation alone for experts without a gate."""
    return module._apply_gate(up) if getattr(module, "has_gate", True) else module.act_fn(up)


def own_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The module's own parameters, each once: what parameters(recurse=False) yields, read from its registry
    (`_parameters`, which FSDP2 updates when it swaps the objects) without the generator walk, ~10x slower."""
    own = [p for p in module._parameters.values() if p is not None]
    if len(own) > 1 and len({id(p) for p in own}) < len(own):  # one parameter registered under two names
        own = list({id(p): p for p in own}.values())
    return own


def fused_weight_norms(v: torch.Tensor, g: torch.Tensor, dim: int) -> torch.Tensor:
    """The norms torch's fused weight_norm kernel forms for W = g v / ||v|| over every dim but `dim` (0 or the last),
    shaped as its own output (g's): what its backward uses."""
    return torch._weight_norm_interface(v, g, dim)[1]


def forward_pre_hooks(module: nn.Module) -> list:
    """The module's forward pre-hooks (torch's hook-based weight_norm is one), in order."""
    return list(module._forward_pre_hooks.values())


def module_registries(module: nn.Module) -> tuple[dict, dict]:
    """The module's own parameter and child registries (`_parameters`, `_modules`: what named_parameters() walks),
    read without named_parameters()'s generators."""
    return module._parameters, module._modules


def has_kernel_for(op: str, dispatch_key: str) -> bool:
    """Whether the dispatcher has a kernel of `op` ("gapmon::tensor_stats") for `dispatch_key`."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, dispatch_key)


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor `t` is a view of (None: not a view)."""
    return t._base


def version_counter(t: torch.Tensor) -> int:
    """The tensor's in-place version counter (-1 for inference tensors, which have none)."""
    return -1 if t.is_inference() else t._version


def mha_same_embed_dim(module: nn.MultiheadAttention) -> bool:
    """Whether nn.MultiheadAttention packs q, k, v in one in_proj_weight (no kdim/vdim)."""
    return module._qkv_same_embed_dim


def fuses_lstm_cell(device: torch.device) -> bool:
    """Whether ATen's lstm_cell runs as one fused op on `device` (h' and c' outputs of one autograd node): on CUDA,
    XPU and PrivateUse1 devices; elsewhere it composes ops, h' computed from c'."""
    return device.type in ("cuda", "xpu", torch._C._get_privateuse1_backend_name())


def check(cond: Any, message: Callable[[], str]) -> None:
    """torch._check: a shape condition fake kernels state for the compiler."""
    torch._check(cond, message)


def dynamo_apply_backward_hook_bug() -> bool:
    """Whether this torch's Dynamo wraps tensor hooks in _ApplyBackwardHook, which mistraces a
    bound-method gradient hook registered inside a compiled region (it must then run untraced)."""
    import torch._dynamo.external_utils as utils  # cheap once Dynamo is loaded

    return hasattr(utils, "_ApplyBackwardHook")


def local_shape_and_global_offset(shape, mesh, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's piece of a DTensor of `shape` laid out by `placements`."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(shape, mesh, placements)


def foreach_norm(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """The 2-norm of each tensor (computed and returned in `dtype` when given), in one multi-tensor op
    (torch._foreach_norm)."""
    return list(torch._foreach_norm(tensors, 2, dtype=dtype))


def foreach_sub(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
    """a[i] - b[i] for each i, in one multi-tensor op (torch._foreach_sub)."""
    return list(torch._foreach_sub(a, b))


_PLAIN_LEAVES = (int, float, bool, str, type(None), torch.dtype, torch.device)


def tree_map_tensors(fn: Callable, tree: Any) -> Any:
    """`tree` with fn applied to every tensor in it (torch.utils._pytree.tree_map_only). A layer call's
    (args tuple, kwargs dict) of tensors and plain values is mapped directly: the pytree walk costs tens of
    µs per call and leaves reference cycles for the garbage collector (its recursive helper)."""
    if type(tree) is tuple and len(tree) == 2 and type(tree[0]) is tuple and type(tree[1]) is dict:
        args, kwargs = tree
        if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor:  # most layer calls: one input
            return (fn(args[0]),), {}
        if all(isinstance(v, (torch.Tensor, *_PLAIN_LEAVES)) for v in (*args, *kwargs.values())):
            return (tuple(fn(v) if isinstance(v, torch.Tensor) else v for v in args),
                    {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, fn, tree)


class ModeSuspended:
    """Runs a block with the torch-function mode `mode` off while it is the innermost one, else as it is:
    gapmon's layer hooks run inside the forward pass that BatchTracker (a TorchFunctionMode) follows, and
    their own tensor calls (shapes, detach, hooks) are not the model's: through the mode each cost its
    dispatch and rules, ~150 calls of a small GPT block's forward."""

    __slots__ = ("mode", "popped")

    def __init__(self, mode: Any):
        self.mode, self.popped = mode, False

    def __enter__(self) -> "ModeSuspended":
        n = torch._C._len_torch_function_stack()
        if self.mode is not None and n and torch._C._get_function_stack_at(n - 1) is self.mode:
            torch._C._pop_torch_function_stack()
            self.popped = True
        return self

    def __exit__(self, *exc) -> bool:
        if self.popped:
            torch._C._push_on_torch_function_stack(self.mode)
            self.popped = False
        return False


def tensor_leaves(tree: Any) -> list:
    """Every tensor in `tree` (nested dicts, lists, tuples), in order (torch.utils._pytree.tree_leaves)."""
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def dynamo_disable(fn: Callable) -> Callable:
    """fn, run untraced by Dynamo when called from a compiled region (imports Dynamo: see dynamo_loaded)."""
    return torch._dynamo.disable(fn)


def dynamo_loaded() -> bool:
    """Whether Dynamo is imported (torch.compile imports it). gapmon does not import it itself: ~1 s."""
    return "torch._dynamo" in sys.modules


def fsdp_param_groups(model: nn.Module) -> list:
    """The FSDP2 parameter groups (torch's private FSDPParamGroup) of every FSDPModule in `model`; empty
    without FSDP2. FSDPModule exposes setters for their reduction and no getters. A module's state holds a list of
    groups (`_fsdp_param_groups`, torch 2.13) or at most one (`_fsdp_param_group`, earlier releases)."""
    from torch.distributed.fsdp import FSDPModule

    groups = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            several = getattr(state, "_fsdp_param_groups", None)
            one = getattr(state, "_fsdp_param_group", None)
            groups += list(several) if several is not None else [one] if one is not None else []
    return groups


def fsdp_gradient_divide_factors(model: nn.Module) -> set:
    """The gradient divide factors of the FSDP2 parameter groups in `model` (None: FSDP2's default, the mean
    over the data-parallel ranks; a number: set_gradient_divide_factor's); empty without FSDP2."""
    return {getattr(group, "gradient_divide_factor", None) for group in fsdp_param_groups(model)}


class FSDPReduction:
    """What one FSDP2 parameter group's gradient reduction does, read from the group (torch 2.11, 2.13):
    its parameters (the sharded ones the model holds), the reduce-scatter it calls (`comm`), the number of
    data-parallel ranks (shard x replicate) and the factor the sum of their gradients is divided by (each read
    when used, so that later FSDP2 settings and replaced parameters are seen)."""

    def __init__(self, group: Any):
        self.group = group
        mesh_info = group.mesh_info
        self.shard_size = getattr(mesh_info, "shard_mesh_size", 1)
        self.data_parallel_size = self.shard_size * getattr(mesh_info, "replicate_mesh_size", 1)

    @property
    def divide_factor(self) -> float:
        """What FSDP2 divides the sum of the ranks' gradients by (set_gradient_divide_factor, else the ranks)."""
        factor = getattr(self.group, "gradient_divide_factor", None)
        return float(factor) if factor is not None else float(self.data_parallel_size)

    @property
    def force_sum(self) -> bool:
        return bool(getattr(self.group, "force_sum_reduction_for_comms", False))

    @property
    def params(self) -> list:
        """The group's sharded parameters as the model holds them now (read each time: meta-device init then
        to_empty, or a load with assign=True, replaces them)."""
        return [fsdp_param.sharded_param for fsdp_param in self.group.fsdp_params]

    @property
    def comm(self) -> Any:
        return self.group._reduce_scatter_comm

    def set_comm(self, comm: Any) -> None:
        """Replaces the group's reduce-scatter (FSDPModule.set_custom_reduce_scatter does this for a module
        with one parameter group and refuses several)."""
        self.group._reduce_scatter_comm = comm

    def predivide_factor(self, dtype: torch.dtype, device_type: str) -> float:
        """The factor FSDP2 divides the reduce-scatter input by before calling it (fp16/fp64 reductions split
        the division around the sum against overflow; 1 otherwise), from FSDP2's own helper (torch 2.11, 2.13)."""
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

        pre = _get_gradient_divide_factors(None, None, dtype, device_type, self.divide_factor, self.force_sum)[0]
        return float(pre) if pre else 1.0
