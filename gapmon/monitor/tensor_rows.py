"""The parameter and gradient side of GAPMonitor: which tensors a step measures, and their statistics
rows in one fused pass over all of them (DTensors and FSDP1 flat shards merged exactly across ranks,
sparse gradients without densifying), with their numerics and block-format rows in the same pass when asked."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..stats import ops
from ..stats.block_formats import states_numerics_blocks
from ..stats.distributed import dtensor_multi_states, fsdp1_shard_groups
from ..stats.layout import STAT_NAMES, STATE_NAMES
from ..stats.numerics import states_and_numerics
from ..utils import clean_named, layer_type_name, refuse_complex


def rows_with_sparse(tensors: list[torch.Tensor], correction: int) -> torch.Tensor:
    """Statistics rows of tensors some of which are sparse COO (nn.Embedding(sparse=True)
    gradients): each sparse one's are those of the dense tensor it stands for, without densifying
    it: the state of its coalesced values merged with the state of its implicit zeros."""
    values = [t.coalesce().values() if t.is_sparse else t for t in tensors]
    states = ops.multi_tensor_states(values)
    implicit = states.new_zeros(states.shape)
    for i, t in enumerate(tensors):
        if t.is_sparse:
            zeros = float(t.numel() - values[i].numel())
            implicit[i, STATE_NAMES.index("count")] = zeros
            implicit[i, STATE_NAMES.index("zeros")] = zeros
    return ops.finalize_rows(ops.merge_states(torch.stack((states, implicit))), correction)


class WatchedTensors:
    """The model's parameters (and their gradients) as GAPMonitor measures them: names, the layer type
    owning each (numerics histogram groups) and, under FSDP1, the group each flat shard merges over.
    `derive` again when the parameters were replaced (meta-device init then to_empty, assign=True loads)."""

    def __init__(self, model: nn.Module, modules: list[tuple[str, nn.Module]], real_only: bool):
        self.model, self.modules, self.real_only = model, modules, real_only
        self.derive()

    def derive(self) -> None:
        model = self.model
        self.params = clean_named(model, model.named_parameters(), "parameters")
        if self.real_only:
            refuse_complex(self.params, "GAPMonitor", "the statistics are of real tensors. Store it as real and "
                           "imaginary parts (torch.view_as_real) or pass params=False, grads=False")
        owner_types = {id(p): layer_type_name(m) for _, m in self.modules for p in m.parameters(recurse=False)}
        self.types = {n: owner_types.get(id(p), type(model).__name__) for n, p in self.params}
        shard_groups = fsdp1_shard_groups(model)
        self.flat_groups = [shard_groups.get(id(p)) for _, p in self.params]  # FSDP1 flat shards

    def gather(self, params: bool, grads: bool) -> tuple[list[tuple[str, str]], list[torch.Tensor], list]:
        """(kind, name) of each row, its tensor and its FSDP1 group (None elsewhere)."""
        names: list[tuple[str, str]] = []
        tensors: list[torch.Tensor] = []
        groups: list = []
        if params:
            names += [("params", n) for n, _ in self.params]
            tensors += [p.detach() for _, p in self.params]
            groups += self.flat_groups
        if grads:
            # An FSDP1 rank whose piece of a parameter is empty has no .grad: an empty stand-in keeps
            # the rows of every rank aligned for the merge.
            with_grad = [(n, p.grad if p.grad is not None else p.detach().new_empty(0), g)
                         for (n, p), g in zip(self.params, self.flat_groups)
                         if p.grad is not None or (g is not None and p.requires_grad)]
            names += [("grads", n) for n, _, _ in with_grad]
            tensors += [t for _, t, _ in with_grad]
            groups += [g for _, _, g in with_grad]
        return names, tensors, groups

    @staticmethod
    def rows_and_blocks(tensors: list[torch.Tensor], groups: list, correction: int, numerics: bool,
                        formats: tuple[str, ...], device: torch.device
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """rows(), and the tensors' block-format rows [N, F, 12] from the same pass (None when the formats need
        a pass of their own: sparse gradients; NaN rows for FSDP1 flat pieces)."""
        if not formats or not tensors or any(t.is_sparse for t in tensors):
            return *WatchedTensors.rows(tensors, groups, correction, numerics, device), None
        states, numerics_rows, blocks = states_numerics_blocks(tensors, formats, numerics, flat_groups=groups)
        return ops.finalize_rows(states, correction), numerics_rows, blocks

    @staticmethod
    def rows(tensors: list[torch.Tensor], groups: list, correction: int, numerics: bool,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Statistics rows of `tensors` (merged over ranks where sharded) and, with `numerics`, their
        numerics rows from the same pass (None when they need a pass of their own: sparse gradients)."""
        if not tensors:
            return torch.empty(0, len(STAT_NAMES), device=device), None
        if numerics and not any(t.is_sparse for t in tensors):  # one pass and one collective for both
            states, numerics_rows = states_and_numerics(tensors, groups)
            return ops.finalize_rows(states, correction), numerics_rows
        if any(g is not None for g in groups):  # FSDP1 flat shards: merge pieces over their groups
            return ops.finalize_rows(dtensor_multi_states(tensors, groups), correction), None
        try:
            return ops.multi_tensor_rows(tensors, correction), None
        except TypeError:
            if not any(t.is_sparse for t in tensors):
                raise
            return rows_with_sparse(tensors, correction), None
