"""GradientDumper: raw gradients to disk during training, in three layouts.

- ``shards``: every rank writes ``step{S}/rank{R}.safetensors`` with its local shard of every
  gradient; the header metadata records global shape, dtype, placements, mesh and offsets.
  ``config.json`` describes the run; ``step{S}/COMPLETE`` is written last, by rank 0, once every
  rank's file is in place.
- ``full``: torch.distributed.checkpoint of the gradient dict, stored as safetensors
  (HuggingFaceStorageWriter): reshardable, replicas written once.
- ``sampled``: the first ``save_first_n`` elements along every dim of every gradient, gathered to
  rank 0 one parameter at a time, in ``step{S}/sampled.safetensors``.

Every file is written atomically (temp file, fsync, rename) and no format uses pickle. Each dump of
a step is a generation (gapmon.dump_format): a re-dump withdraws the step's COMPLETE first, and
COMPLETE names exactly one generation's files with their checksums. With
``async_write=True`` the gradients are copied during ``maybe_dump`` into one of two reusable host
staging sets (pinned for GPU tensors) and written by a background thread; a third dump waits for a
free set. ``full`` dumps stage through ``dcp.async_save`` instead, whose collectives run on a
dedicated gloo group so that they never interleave with the training thread's; one such dump is
in flight at a time. Background errors are raised by the next call or close().
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import queue
import threading
import time
import uuid
import warnings
import weakref
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _torch_compat
from ..config import DumpConfig, dump_schedule
from ..stats.distributed import materialize_partial
from ..utils import ParameterWatch, check_step, clean_named, is_dtensor, rank_and_world, refuse_complex
from .format import (
    CHECKSUM,
    COMPLETE,
    CONFIG,
    FORMAT_VERSION,
    FULL_DIR,
    FULL_INDEX,
    FULL_STAGING,
    HEADER_KEY,
    REPLICATE,
    SAMPLED,
    STEP_PREFIX,
    ShardRecord,
    dtype_name,
    file_crc32,
    full_index,
    generation_id,
    placement_name,
    rank_file,
    sealed,
    step_dir,
    tensor_crc32,
)
from .safe_io import (
    HOST,
    ensure_real_dir,
    process_alive,
    read_safetensors_header,
    remove_entry,
    remove_stale_temps,
    write_json,
    write_safetensors,
)

_FAILED = ".{}.failed"  # step{S}/.rank{R}.failed: a rank's write of the step failed (its error inside)


def header_generation(path: Path) -> tuple[str | None, bytes]:
    """(the generation a gapmon safetensors file's header names, the raw header bytes), or
    (None, b"") if it cannot be read (yet)."""
    try:
        raw, meta = read_safetensors_header(path)
        return json.loads(meta[HEADER_KEY]).get("generation"), raw
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, b""


def _collective_device() -> torch.device:
    backend = str(dist.get_backend())
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _share_identity(run_id: str) -> tuple[str, list[tuple[str, int]]]:
    """Rank 0's run id, and (host, pid) of every rank: one all-gather of fixed-size byte tensors
    (no pickling, no numpy). The pids let rank 0 see a rank of its host die instead of waiting."""
    me = f"{run_id}\n{HOST}\n{os.getpid()}".encode()[:255]
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return run_id, [(HOST, os.getpid())]
    device = _collective_device()
    mine = torch.zeros(256, dtype=torch.uint8, device=device)
    mine[:len(me)] = torch.tensor(list(me), dtype=torch.uint8, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    fields = [bytes(t.cpu().tolist()).rstrip(b"\0").decode().split("\n") for t in everyone]
    return fields[0][0], [(host, int(pid)) for _, host, pid in fields]


def _close_at_exit(ref: "weakref.ref[GradientDumper]") -> None:
    dumper = ref()
    if dumper is None or dumper.closed:
        return
    try:
        dumper.close()
    except BaseException as e:  # at exit: report, never abort the interpreter
        warnings.warn(f"GradientDumper: pending gradient writes failed at exit: {e}", RuntimeWarning, stacklevel=1)


def parallel_layout(model: nn.Module) -> dict[str, Any]:
    """parallel_type (single|ddp|fsdp|hsdp), world_size, shard_degree, num_replicas, mesh_shape."""
    _, world = rank_and_world()
    for p in model.parameters():
        if is_dtensor(p):
            mesh = p.device_mesh
            shard_dims = [d for d, pl in enumerate(p.placements) if pl.is_shard()]
            repl_dims = [d for d, pl in enumerate(p.placements) if pl.is_replicate()]
            shard = 1
            for d in shard_dims:
                shard *= mesh.size(d)
            replicas = 1
            for d in repl_dims:
                replicas *= mesh.size(d)
            kind = "hsdp" if repl_dims and shard_dims else ("fsdp" if shard_dims else "ddp")
            return {"parallel_type": kind, "world_size": world, "shard_degree": shard, "num_replicas": replicas,
                    "mesh_shape": list(mesh.shape), "mesh_dim_names": list(mesh.mesh_dim_names or [])}
    if world > 1:
        return {"parallel_type": "ddp", "world_size": world, "shard_degree": 1, "num_replicas": world,
                "mesh_shape": [world], "mesh_dim_names": []}
    return {"parallel_type": "single", "world_size": 1, "shard_degree": 1, "num_replicas": 1, "mesh_shape": [1],
            "mesh_dim_names": []}


def shard_record(g: torch.Tensor, rank: int) -> tuple[torch.Tensor, ShardRecord]:
    """The local piece of gradient g and its record (global shape, placements, offsets; no checksum yet)."""
    if is_dtensor(g):
        g = materialize_partial(g)
        mesh = g.device_mesh
        local = g.to_local()
        local_shape, offsets = _torch_compat.local_shape_and_global_offset(g.shape, mesh, g.placements)
        return local, ShardRecord(
            global_shape=list(g.shape), local_shape=list(local_shape), offsets=list(offsets),
            placements=[placement_name(p) for p in g.placements], mesh_shape=list(mesh.shape),
            coordinate=list(mesh.get_coordinate() or []), dtype=dtype_name(g.dtype))
    _, world = rank_and_world()
    return g, ShardRecord(global_shape=list(g.shape), local_shape=list(g.shape), offsets=[0] * g.dim(),
                          placements=[REPLICATE], mesh_shape=[world], coordinate=[rank], dtype=dtype_name(g.dtype))


def _with_layout_of(g: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (a host copy of g's local shard) as a tensor laid out like gradient `g`."""
    if not is_dtensor(g):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, g.device_mesh, g.placements, run_check=False, shape=g.shape, stride=g.stride())


def _supersedes(found: str, generation: str) -> bool:
    """Whether generation id `found` is a later dump of the same run and step than `generation`."""
    head, _, count = found.rpartition(".")
    mine, _, my_count = generation.rpartition(".")
    return head == mine and count.isdigit() and my_count.isdigit() and int(count) > int(my_count)


def _remove_unlisted(directory: Path, listed: dict[str, Any]) -> None:
    """Removes the files an earlier generation of a step left that its new COMPLETE does not list
    (rank files of a larger world, another mode's files)."""
    tops = {name.split("/")[0] for name in listed}
    for path in directory.iterdir():
        name = path.name
        if name in tops:
            continue
        try:
            if name == FULL_DIR or name in (SAMPLED, FULL_INDEX) or (name.startswith("rank") and name.endswith(".safetensors")):
                remove_entry(path)  # a link is removed, never followed
        except OSError:
            pass


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


class GradientDumper:
    """Writes gradients at steps start_step, start_step + step_interval, ... up to end_step (inclusive).

    Call `maybe_dump(step)` after backward and before zero_grad, on every rank; `close()` (or
    the context manager) waits for background writes and raises their errors. A dumper that is
    never closed is closed at interpreter exit, so pending steps are still written.

    Every dumper has a fresh `run_id`, written into config.json, every rank file and COMPLETE: a
    directory can be reused (a resumed run), and a step is complete only when every rank file
    carries the run id of its COMPLETE. `timeout` bounds how long rank 0 waits for the other
    ranks' files of a step (in the background with async_write, else on the training thread).

    The options are validated once, into `self.config` (a gapmon.DumpConfig, whose `schedule` is the
    gapmon.Schedule of start_step, step_interval and end_step); `GradientDumper.from_config(model,
    save_dir, config)` takes one directly.
    """

    def __init__(self, model: nn.Module, save_dir: str | Path, start_step: int = 0, step_interval: int = 1,
                 end_step: int | None = None, mode: str = "shards", save_first_n: int | None = None,
                 async_write: bool = True, timeout: float = 600.0):
        config = DumpConfig(schedule=dump_schedule(start_step, step_interval, end_step), mode=mode,
                            save_first_n=save_first_n, async_write=async_write, timeout=timeout)
        self._setup(model, save_dir, config)

    @classmethod
    def from_config(cls, model: nn.Module, save_dir: str | Path, config: DumpConfig) -> "GradientDumper":
        """A dumper of `model`'s gradients into `save_dir` with the options of `config` (a gapmon.DumpConfig)."""
        if not isinstance(config, DumpConfig):
            raise TypeError(f"GradientDumper.from_config: config must be a gapmon.DumpConfig, got {type(config).__name__}")
        dumper = cls.__new__(cls)
        cls._setup(dumper, model, save_dir, config)
        return dumper

    def _setup(self, model: nn.Module, save_dir: str | Path, config: DumpConfig) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"GradientDumper: model must be a torch.nn.Module, got {type(model).__name__}")
        self.config = config  # every option, read from here
        self.model = model
        self.save_dir = Path(save_dir)
        self._watch = ParameterWatch(model)
        self._derive_params()
        self.rank, self.world = rank_and_world()
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._free_staging: queue.Queue = queue.Queue()
        self._staging_made = 0
        # Async full dumps: DCP's collectives run in a background thread, on their own group.
        self._full_group = None
        if config.mode == "full" and config.async_write and self.world > 1:
            self._full_group = dist.new_group(backend="gloo")  # collective: every rank builds the dumper
        self.closed = False
        self.run_id, self._peers = _share_identity(uuid.uuid4().hex)
        self._dumps: dict[int, int] = {}  # step -> how many times this run dumped it (generations)
        # What every step records in its COMPLETE: each step reads back with the layout it was written with.
        self._recorded = {**self._layout, "mode": config.mode, "save_first_n": config.save_first_n}
        if self.rank == 0:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            # Temp files of killed writers (this host: their process is gone; others: older than timeout).
            remove_stale_temps([*self.save_dir.glob(".*.tmp"), *self.save_dir.glob(f"{STEP_PREFIX}*/.*.tmp")],
                               self.config.timeout)
            self._write_config()
        atexit.register(_close_at_exit, weakref.ref(self))

    def _derive_params(self) -> None:
        """The parameters to dump and their parallel layout, as the model holds them now."""
        self._params = clean_named(self.model, self.model.named_parameters(), "parameters")
        refuse_complex(self._params, "GradientDumper",
                       "dumps hold real gradients. Store it as real and imaginary parts (torch.view_as_real)")
        self._layout = parallel_layout(self.model)

    def _follow_parameters(self) -> None:
        """Re-derives the parameters when the model's were replaced since the last dump (meta-device init
        then to_empty, load_state_dict(assign=True), assignment). A new parallel layout is recorded in
        config.json while this directory holds no step of this run; after that it is refused."""
        if not self._watch.changed():
            return
        old_layout = self._layout
        self._derive_params()
        if self._layout == old_layout:
            return
        if self._dumps:
            raise RuntimeError(f"GradientDumper: the model's parallel layout changed after steps {sorted(self._dumps)} were "
                               f"dumped into {self.save_dir} ({old_layout} -> {self._layout}); dump the new layout into "
                               "a new directory with a new GradientDumper")
        self._recorded = {**self._layout, "mode": self.config.mode, "save_first_n": self.config.save_first_n}
        if self.rank == 0:
            self._write_config()

    def _write_config(self) -> None:
        write_json(self.save_dir / CONFIG, {**self._recorded, "format_version": FORMAT_VERSION, "run_id": self.run_id})

    def _keep_config(self) -> None:
        """Writes config.json again if it vanished (the dump directory deleted during the run), so that
        every step dumped from now on can be read; says so, since the steps written before are gone."""
        if (self.save_dir / CONFIG).is_file():
            return
        warnings.warn(f"GradientDumper: {self.save_dir / CONFIG} vanished during the run (was the dump directory "
                      "deleted?); writing it again: steps dumped before are gone, the next ones are readable",
                      RuntimeWarning, stacklevel=3)
        self.save_dir.mkdir(parents=True, exist_ok=True)
        self._write_config()

    def should_dump(self, step: int) -> bool:
        return self.config.schedule.includes(check_step(step, "GradientDumper.should_dump"))

    def maybe_dump(self, step: int) -> bool:
        """Dumps the gradients of `step` (a non-negative integer) if the schedule says so; returns
        whether it did. Dumping a step again (here, or in a resumed run) replaces it: its COMPLETE is
        withdrawn first, and written again only for the new generation's files."""
        step = check_step(step, "GradientDumper.maybe_dump")
        if self.closed:
            raise RuntimeError("GradientDumper: the dumper is closed")
        self._raise_background_error()
        if not self.should_dump(step):
            return False
        self._follow_parameters()
        # Sparse gradients (nn.Embedding(sparse=True)) are dumped as the dense tensors they stand for.
        grads = [(n, p.grad.to_dense() if p.grad.is_sparse else p.grad) for n, p in self._params if p.grad is not None]
        if not grads:
            warnings.warn(f"GradientDumper: step {step} has no gradients to dump (was maybe_dump called after "
                          "zero_grad, or before backward?)", RuntimeWarning, stacklevel=2)
        count = self._dumps[step] = self._dumps.get(step, -1) + 1
        generation = generation_id(self.run_id, step, count)
        if self.rank == 0:
            self._keep_config()
        # A real directory inside save_dir: never a symbolic link planted there (every rank checks its own view).
        directory = ensure_real_dir(self.save_dir, step_dir(self.save_dir, step))
        if self.rank == 0:  # the step's earlier generation stops being complete before any new file lands
            (directory / COMPLETE).unlink(missing_ok=True)
        (directory / _FAILED.format(f"rank{self.rank}")).unlink(missing_ok=True)
        if self.world > 1 and (self.config.mode == "full" or any(is_dtensor(g) for _, g in grads)):
            self._check_peers_alive(step)  # modes whose collectives need every rank
        if self.config.mode == "full":
            self._dump_full(step, generation, grads)
        elif self.config.mode == "shards":
            local, records = {}, {}
            for name, g in grads:
                local[name], records[name] = shard_record(g.detach(), self.rank)
            self._submit(step, self._write_shards, step, generation, self._stage(local), records)
        else:
            self._submit(step, self._write_sampled, step, generation, *self._gather_sampled(grads))
        return True

    # ----------------------------------------------------------------- modes
    def _stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host copies of `tensors` that later training steps cannot change.

        Sync writes of CPU tensors need no copy. Async writes copy into one of two reusable staging
        sets (pinned for GPU tensors): no fresh pages to fault in every step, and host memory stays
        bounded at two copies. Waits if both sets are still being written.
        """
        if not self.config.async_write and all(t.device.type == "cpu" for t in tensors.values()):
            return {n: t.contiguous() for n, t in tensors.items()}
        if self._staging_made < 2 and self._free_staging.empty():
            staging: dict[str, torch.Tensor] = {}
            self._staging_made += 1
        else:
            staging = self._free_staging.get()
        on_gpu = False
        for name, t in tensors.items():
            buf = staging.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = staging[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            buf.copy_(t, non_blocking=t.is_cuda)
            on_gpu |= t.is_cuda
        for name in [n for n in staging if n not in tensors]:
            del staging[name]
        if on_gpu:
            torch.cuda.current_stream().synchronize()
        return staging

    def _write_shards(self, step: int, generation: str, tensors: dict[str, torch.Tensor],
                      records: dict[str, ShardRecord]) -> None:
        directory = step_dir(self.save_dir, step)
        try:
            described = {name: dataclasses.replace(record, checksum=tensor_crc32(tensors[name])).to_json()
                         for name, record in records.items()}
            header = {"format_version": FORMAT_VERSION, "step": step, "rank": self.rank, "world_size": self.world,
                      "run_id": self.run_id, "generation": generation, "tensors": described}
            write_safetensors(directory / rank_file(self.rank), tensors, {HEADER_KEY: json.dumps(header)})
        finally:
            if self.config.async_write:
                self._free_staging.put(tensors)  # the staging set may be filled again
        if self.rank == 0:
            self._complete(directory, step, generation, [rank_file(r) for r in range(self.world)])

    def _gather_sampled(self, grads) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        n = self.config.save_first_n
        tensors, shapes = {}, {}
        for name, g in grads:  # one parameter at a time: memory bounded by the largest gradient
            full = g.full_tensor() if is_dtensor(g) else g
            if self.rank == 0:
                piece = full[tuple(slice(0, min(n, s)) for s in full.shape)] if full.dim() else full
                tensors[name] = piece.detach().to("cpu", copy=True).contiguous()
                shapes[name] = list(full.shape)
            del full
        return tensors, shapes

    def _write_sampled(self, step: int, generation: str, tensors: dict[str, torch.Tensor], shapes: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        directory = step_dir(self.save_dir, step)
        header = {"format_version": FORMAT_VERSION, "step": step, "save_first_n": self.config.save_first_n,
                  "run_id": self.run_id, "generation": generation, "global_shapes": shapes,
                  "checksums": {name: tensor_crc32(t) for name, t in tensors.items()}}
        write_safetensors(directory / SAMPLED, tensors, {HEADER_KEY: json.dumps(header)})
        self._complete(directory, step, generation, [SAMPLED])

    def _dump_full(self, step: int, generation: str, grads) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        self._wait()  # one full dump in flight: bounded host memory, and DCP plans never overlap
        directory = step_dir(self.save_dir, step)
        staging = directory / FULL_STAGING
        if self.rank == 0:
            # Left by an interrupted dump of this step (or planted: a link is removed, never followed):
            # none of its files may join this one. No rank writes before DCP's first collective, which
            # needs rank 0 past this point.
            remove_entry(staging)
        # DCP's safetensors writer takes contiguous tensors (a channels_last conv's gradient is not).
        state = {name: g.detach() if is_dtensor(g) else g.detach().contiguous() for name, g in grads}
        index = full_index({name: (list(g.shape), g.dtype) for name, g in grads})
        writer = dcp.HuggingFaceStorageWriter(str(staging), save_distributed=True, enable_consolidation=False)
        if not self.config.async_write:
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
            self._run(step, self._finish_full, step, generation, index)
            return
        # Local shards go to a staging set (as for shards mode) and are wrapped back into DTensors,
        # so DCP writes host copies in its thread and need not copy again (its own staging also
        # deep-copies CPU DTensors, which fails on FSDP2's gradient views).
        local = {name: (g.to_local() if is_dtensor(g) else g).detach() for name, g in grads}
        staged = self._stage(local)
        state = {name: _with_layout_of(g, staged[name]) for name, g in grads}
        future = dcp.async_save(state, storage_writer=writer, process_group=self._full_group,
                                async_stager=_AlreadyStaged(), no_dist=self.world == 1)
        self._submit(step, self._await_full, future, staged, step, generation, index)

    def _await_full(self, future, staged: dict[str, torch.Tensor], step: int, generation: str, index: dict[str, Any]) -> None:
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
            self._free_staging.put(staged)
        self._finish_full(step, generation, index)

    def _finish_full(self, step: int, generation: str, index: dict[str, Any]) -> None:
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
        self._complete(directory, step, generation, [*files, FULL_INDEX], gapmon_files=False)

    def _complete(self, directory: Path, step: int, generation: str, expected: list[str], gapmon_files: bool = True) -> None:
        """Writes COMPLETE (rank 0) once every expected file of `generation` is in place, naming
        them with their sizes and checksums. A gapmon safetensors file counts once its header names
        this generation (a file an earlier dump left under the same name does not): its tensors'
        checksums are in that header, and COMPLETE records the header's. Other files (DCP's) are
        checksummed whole. Fails fast when a rank of this host died or reported a failed write."""
        records: dict[str, dict[str, int]] = {}
        if not gapmon_files:
            for name in expected:
                path = directory / name
                records[name] = {"bytes": path.stat().st_size, CHECKSUM: file_crc32(path)}
        deadline = time.monotonic() + self.config.timeout
        missing = [name for name in expected if name not in records]
        while missing:
            for name in list(missing):
                found, raw = header_generation(directory / name)
                if found == generation:
                    records[name] = {"bytes": (directory / name).stat().st_size, f"header_{CHECKSUM}": zlib.crc32(raw)}
                    missing.remove(name)
                elif found is not None and _supersedes(found, generation):
                    return  # this step was dumped again meanwhile: that newer generation completes it
            if not missing:
                break
            self._check_writers(directory, step, missing)
            if time.monotonic() > deadline:
                raise TimeoutError(f"GradientDumper: {directory} still lacks {missing} of this dump after "
                                   f"{self.config.timeout:.0f}s (a rank died or is stuck?); step left incomplete")
            time.sleep(0.01)
        write_json(directory / COMPLETE, sealed({
            "format_version": FORMAT_VERSION, "step": step, "run_id": self.run_id, "generation": generation,
            "world_size": self.world, "config": self._recorded, "checksum": CHECKSUM, "files": records}))
        _remove_unlisted(directory, records)

    def _peer_exited(self, rank: int) -> bool:
        """Whether rank `rank` is a process of this host (not this one) that no longer runs."""
        peer_host, pid = self._peers[rank] if rank < len(self._peers) else (None, 0)
        return peer_host == HOST and pid != os.getpid() and not process_alive(pid)

    def _check_peers_alive(self, step: int) -> None:
        """Raises at once, naming the rank, if a rank of this host has exited: the collectives of the full
        and sampled modes would otherwise wait for it until the process group's timeout."""
        for rank, (_, pid) in enumerate(self._peers):
            if self._peer_exited(rank):
                raise RuntimeError(f"GradientDumper: rank {rank} (pid {pid}) has exited; step {step} is not dumped "
                                   "(its collectives would wait for it)")

    def _check_writers(self, directory: Path, step: int, missing: list[str]) -> None:
        """Raises at once, naming the rank, if a rank whose file is missing reported a failed write
        or (a process of this host) is no longer running. Ranks on other hosts are waited for."""
        for name in missing:
            rank = int(name[len("rank"):-len(".safetensors")]) if name.startswith("rank") else 0
            marker = directory / _FAILED.format(f"rank{rank}")
            if marker.exists():
                raise RuntimeError(f"GradientDumper: rank {rank} failed to write step {step}: "
                                   f"{marker.read_text(errors='replace').strip()}; step left incomplete")
            if self._peer_exited(rank):
                raise RuntimeError(f"GradientDumper: rank {rank} (pid {self._peers[rank][1]}) exited without writing {directory / name}; "
                                   "step left incomplete")

    # ----------------------------------------------------------------- background writes
    def _submit(self, step: int, fn, *args) -> None:
        if not self.config.async_write:
            self._run(step, fn, *args)
            return
        if self._thread is None:
            self._queue = queue.Queue(maxsize=1)  # at most one step waiting: bounded host memory
            self._thread = threading.Thread(target=self._worker, name="gapmon-dump", daemon=True)
            self._thread.start()
        self._queue.put((step, fn, args))

    def _run(self, step: int, fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as e:
            # Tell rank 0, which may be waiting for this rank's file, so that it fails fast.
            try:
                marker = step_dir(self.save_dir, step) / _FAILED.format(f"rank{self.rank}")
                write_json(marker, {"error": f"{type(e).__name__}: {e}"})
            except OSError:
                pass
            if not isinstance(e, OSError) or e.errno is None:  # TimeoutError and others: raised as they are
                raise
            raise OSError(e.errno, f"GradientDumper: writing gradients under {self.save_dir} failed: {e.strerror or e}; "
                                   "earlier steps are intact") from e

    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            step, fn, args = item
            try:
                if self._error is None:
                    self._run(step, fn, *args)
            except BaseException as e:  # re-raised on the training thread
                self._error = e
            finally:
                self._queue.task_done()

    def _wait(self) -> None:
        if self._queue is not None:
            self._queue.join()
        self._raise_background_error()

    def _raise_background_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Waits for pending writes; raises the first background error, if any."""
        if self.closed:
            return
        self.closed = True
        if self._thread is not None:
            self._queue.join()
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._free_staging = queue.Queue()  # release the staging buffers' host memory
        if self._full_group is not None:
            dist.destroy_process_group(self._full_group)
            self._full_group = None
        self._raise_background_error()

    def __enter__(self) -> "GradientDumper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
