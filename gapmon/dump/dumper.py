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
import uuid
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..config import DumpConfig, dump_schedule
from ..utils import ParameterWatch, check_step, clean_named, is_dtensor, rank_and_world, refuse_complex
from .background import FAILED_MARKER, BackgroundWriter, StagingSets
from .format import (
    COMPLETE,
    CONFIG,
    FORMAT_VERSION,
    HEADER_KEY,
    SAMPLED,
    STEP_PREFIX,
    ConfigRecord,
    ShardRecord,
    generation_id,
    rank_file,
    step_dir,
    tensor_crc32,
)
from .full_checkpoint import FullCheckpointWriter
from .placement import parallel_layout, shard_record
from .safe_io import ensure_real_dir, remove_stale_temps, write_json, write_safetensors
from .seal import StepSealer, share_identity


def _close_at_exit(ref: "weakref.ref[GradientDumper]") -> None:
    dumper = ref()
    if dumper is None or dumper.closed:
        return
    try:
        dumper.close()
    except BaseException as e:  # at exit: report, never abort the interpreter
        warnings.warn(f"GradientDumper: pending gradient writes failed at exit: {e}", RuntimeWarning, stacklevel=1)


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
        # Through the constructor, so that a subclass's __init__ runs; the config it rebuilds equals `config`.
        return cls(model, save_dir, **config.constructor_arguments())

    def _setup(self, model: nn.Module, save_dir: str | Path, config: DumpConfig) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"GradientDumper: model must be a torch.nn.Module, got {type(model).__name__}")
        self.config = config  # every option, read from here
        self.model = model
        self.save_dir = Path(save_dir)
        self._watch = ParameterWatch(model)
        self._derive_params()
        self.rank, self.world = rank_and_world()
        self._writer = BackgroundWriter(self.save_dir, self.rank, config.async_write)
        self._staging = StagingSets()
        self.closed = False
        self.run_id, peers = share_identity(uuid.uuid4().hex)
        self._sealer = StepSealer(self.run_id, peers, config.timeout)
        self._full = None
        if config.mode == "full":
            self._full = FullCheckpointWriter(self.save_dir, self.rank, self.world, config.async_write, self._writer,
                                              self._staging, self._sealer, lambda: self._recorded)
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
        write_json(self.save_dir / CONFIG, ConfigRecord(self._recorded, self.run_id).to_json())

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
        self._writer.raise_error()
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
        (directory / FAILED_MARKER.format(f"rank{self.rank}")).unlink(missing_ok=True)
        if self.world > 1 and (self.config.mode == "full" or any(is_dtensor(g) for _, g in grads)):
            self._sealer.check_peers_alive(step)  # modes whose collectives need every rank
        if self.config.mode == "full":
            self._full.dump(step, generation, grads)
        elif self.config.mode == "shards":
            local, records = {}, {}
            for name, g in grads:
                local[name], records[name] = shard_record(g.detach(), self.rank)
            self._writer.submit(step, self._write_shards, step, generation, self._stage(local), records)
        else:
            self._writer.submit(step, self._write_sampled, step, generation, *self._gather_sampled(grads))
        return True

    # ----------------------------------------------------------------- modes
    def _stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host copies of `tensors` that later training steps cannot change.

        Sync writes of CPU tensors need no copy; the others go to one of the reusable staging sets.
        """
        if not self.config.async_write and all(t.device.type == "cpu" for t in tensors.values()):
            return {n: t.contiguous() for n, t in tensors.items()}
        return self._staging.take(tensors)

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
                self._staging.give_back(tensors)  # the staging set may be filled again
        if self.rank == 0:
            self._sealer.complete(directory, step, generation, [rank_file(r) for r in range(self.world)], self._recorded)

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
        self._sealer.complete(directory, step, generation, [SAMPLED], self._recorded)

    def _wait(self) -> None:
        """Waits for the pending background writes; raises their first error."""
        self._writer.wait()

    def close(self) -> None:
        """Waits for pending writes; raises the first background error, if any."""
        if self.closed:
            return
        self.closed = True
        self._writer.close()
        self._staging.release()  # the staging buffers' host memory
        if self._full is not None:
            self._full.close()
        self._writer.raise_error()

    def __enter__(self) -> "GradientDumper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
