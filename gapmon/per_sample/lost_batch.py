"""Gradients that come back through an op where the batch tracking lost the batch (batch_provenance.watch_lost): an op
with no batch rule, a reshape that mixes the batch's rows with others, one sample's tensor broadcast over the rest.
Past such an op a row of the gradient may hold several samples' losses (`h + h.roll(1, 0)`: sample b's output holds
sample b-1's features too), and so may the per-sample gradients of everything before it, which no check would see.
So once a non-zero gradient comes back through one, every covered layer, layer used functionally and free parameter
whose gradient it reaches (found by walking the autograd graph down from that op's node to the parameters) is left
out of the norms, named; the layers after it are left out already (their input's batch is lost).

The ops inside a covered layer or a row-keeping block (a mixture of experts gathering rows per expert) are their
rule's: watched only where the outermost such module returns an output whose batch is still lost.
"""
from __future__ import annotations

from typing import Any

import torch

from ..utils import first_tensor
from .batch_provenance import watch_lost


def upstream_leaves(node: Any) -> set[int] | None:
    """Ids of the leaf tensors (parameters) whose gradient the gradient at autograd node `node` reaches; None when the
    node is unknown (a torch without `_current_autograd_node`): then every one may be."""
    if node is None:
        return None
    leaves: set[int] = set()
    seen: dict[int, Any] = {}  # (the node objects kept alive while walking: their ids stay theirs)
    stack = [node]
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen[id(n)] = n
        variable = getattr(n, "variable", None)  # AccumulateGrad: a leaf's
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(f for f, _ in n.next_functions)
    return leaves


def refuse_upstream(hooks: Any, mb: Any, status: str, node: Any) -> None:
    """Micro-batch `mb`'s layers of LayerHooks `hooks` (and its layers used functionally, its free parameters) that the
    gradient at `node` reaches, refused at the next flush_refused (outside backward): a gradient came back through an
    op whose output lost the batch (`status`)."""
    leaves = upstream_leaves(node)

    def reached(p: torch.Tensor | None) -> bool:
        return p is not None and (leaves is None or id(p) in leaves)

    why = (f"a gradient comes back to it through {status}, where the batch could not be followed: its per-sample "
           "gradients may hold other samples' losses; keep the batch on one dim through that op, declare a module around "
           "it whose output rows are its input rows' alone (a mixture of experts: gapmon.per_sample.register_norm_rule("
           "Block)(TokenWiseBlockRule)), or keep its output out of the loss whose norms are read")
    names = [hooks.layers[index][0] for index, params in mb.used.items() if any(reached(p) for p in params)]
    names += [hooks.layers[index][0] for (index, _), uses in mb.functional.items() if reached(uses.param)]
    names += [name for name, uses in mb.free.items() if reached(uses.param)]
    for name in dict.fromkeys(names):
        hooks.shared.refuse_later(name, why)


def enter_ruled(tracking: Any) -> None:
    """A covered layer's or a row-keeping block's forward begins: its ops are its rule's (watch_lost passes them)."""
    if tracking is not None:
        tracking.ruled_depth += 1


def leave_ruled(tracking: Any, args: tuple, kwargs: dict, output: Any) -> None:
    """That forward returned (after its output's batch was put back where its rule keeps rows): the outermost one whose
    output is still lost while an input had the batch is watched as an op that lost it."""
    if tracking is None or not tracking.ruled_depth:
        return
    tracking.ruled_depth -= 1
    out = first_tensor(output)
    status = tracking.status(out) if out is not None and not tracking.ruled_depth else None
    if isinstance(status, str):
        inputs = [(t, tracking.status(t)) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        watch_lost(tracking, status, inputs, output)
