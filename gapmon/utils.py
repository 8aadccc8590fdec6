"""Small helpers shared by the monitor, per-sample norms and the dumper."""
from __future__ import annotations

import torch.distributed as dist

# Wrapper prefixes that DDP, FSDP1, activation checkpointing and torch.compile add to names.
_WRAPPER_PARTS = ("module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def clean_name(name: str) -> str:
    """Module/parameter name without the prefixes that wrappers add (DDP's `module.`, ...)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default process group, or (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
