"""The dumper's ``full`` mode: a torch.distributed.checkpoint of the gradients, stored as safetensors
(HuggingFaceStorageWriter), reshardable, replicas written once. It is staged in step{S}/.full.tmp and
renamed into place whole; async dumps go through dcp.async_save on a dedicated gloo group, one at a time."""
from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..utils import is_dtensor
from .background import BackgroundWriter, StagingSets
from .format import FULL_DIR, FULL_INDEX, FULL_STAGING, full_index, step_dir
from .placement import with_layout_of
from .safe_io import remove_entry, write_json
from .seal import StepSealer


def _checkpoint_failure(step: int, error: BaseException) -> BaseException:
    """DCP's CheckpointException (a BaseException with a traceback per rank) as one clear error:
    an OSError with the first failing rank's errno where it has one."""
    failures = getattr(error, "failures", None) or {}
    rank, cause = next(iter(failures.items()), (None, error))
    cause = cause[0] if isinstance(cause, tuple) else cause
    where = f" on rank {rank}" if rank is not None else ""
    message = f"GradientDumper: the distributed checkpoint of step {step} failed{where}: {type(cause).__name__}: {cause}"
    if isinstance(cause, OSError) and cause.errno is not None:
        return OSError(cause.errno, message)
    return RuntimeError(message)


class _AlreadyStaged:
    """A dcp.async_save stager for a state dict that is already a host copy: nothing to do."""

    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class FullCheckpointWriter:
    """Writes one step's gradients as a distributed checkpoint, then has `sealer` seal the step."""

    def __init__(self, save_dir: Path, rank: int, world: int, async_write: bool, writer: BackgroundWriter,
                 staging: StagingSets, sealer: StepSealer, recorded: Callable[[], dict[str, Any]]):
        self.save_dir, self.rank, self.world, self.async_write = save_dir, rank, world, async_write
        self.writer, self.staging, self.sealer, self.recorded = writer, staging, sealer, recorded
        # DCP's collectives run in a background thread, on their own group (collective: every rank builds it).
        self.group = dist.new_group(backend="gloo") if async_write and world > 1 else None

    def dump(self, step: int, generation: str, grads) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        self.writer.wait()  # one full dump in flight: bounded host memory, and DCP plans never overlap
        directory = step_dir(self.save_dir, step)
        staging = directory / FULL_STAGING
        if self.rank == 0:
            # Left by an interrupted dump of this step (or planted: a link is removed, never followed):
            # none of its files may join this one.
            remove_entry(staging)
        if self.world > 1:
            # Every rank creates the staging directory in DCP's local plan, before DCP's first collective:
            # none may do so while rank 0 is removing the old one (a rank whose mkdir met rank 0's rmtree
            # failed with FileExistsError).
            dist.barrier(group=self.group)
        # DCP's safetensors writer takes contiguous tensors (a channels_last conv's gradient is not).
        state = {name: g.detach() if is_dtensor(g) else g.detach().contiguous() for name, g in grads}
        index = full_index({name: (list(g.shape), g.dtype) for name, g in grads})
        writer = dcp.HuggingFaceStorageWriter(str(staging), save_distributed=True, enable_consolidation=False)
        if not self.async_write:
            try:
                dcp.save(state, storage_writer=writer, no_dist=self.world == 1)
            except BaseException as e:
                if self.rank == 0:
                    remove_entry(staging)  # a failed dump leaves nothing behind
                if isinstance(e, CheckpointException):
                    raise _checkpoint_failure(step, e) from None
                raise
            if self.world > 1:
                dist.barrier()
            self.writer.run(step, self._finish, step, generation, index)
            return
        # Local shards go to a staging set (as for shards mode) and are wrapped back into DTensors,
        # so DCP writes host copies in its thread and need not copy again (its own staging also
        # deep-copies CPU DTensors, which fails on FSDP2's gradient views).
        local = {name: (g.to_local() if is_dtensor(g) else g).detach() for name, g in grads}
        staged = self.staging.take(local)
        state = {name: with_layout_of(g, staged[name]) for name, g in grads}
        future = dcp.async_save(state, storage_writer=writer, process_group=self.group,
                                async_stager=_AlreadyStaged(), no_dist=self.world == 1)
        self.writer.submit(step, self._await, future, staged, step, generation, index)

    def _await(self, future, staged: dict[str, torch.Tensor], step: int, generation: str, index: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            future.result()  # DCP's coordinator (rank 0) finishes only after every rank reported its writes
        except BaseException as e:
            if self.rank == 0:
                remove_entry(step_dir(self.save_dir, step) / FULL_STAGING)  # a failed dump leaves nothing behind
            if isinstance(e, CheckpointException):
                raise _checkpoint_failure(step, e) from None
            raise
        finally:
            self.staging.give_back(staged)
        self._finish(step, generation, index)

    def _finish(self, step: int, generation: str, index: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        directory = step_dir(self.save_dir, step)
        full = directory / FULL_DIR
        old = directory / f".{FULL_DIR}.old.{uuid.uuid4().hex}"
        if os.path.lexists(full):  # an earlier generation's checkpoint (its COMPLETE is withdrawn already)
            os.replace(full, old)
        os.replace(directory / FULL_STAGING, full)
        remove_entry(old)
        write_json(directory / FULL_INDEX, index)
        files = [f"{FULL_DIR}/{p.relative_to(full).as_posix()}" for p in sorted(full.rglob("*")) if p.is_file()]
        self.sealer.complete(directory, step, generation, [*files, FULL_INDEX], self.recorded(), gapmon_files=False)

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
