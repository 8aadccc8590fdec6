"""Collection of per-sample gradients of chosen layers to disk (gapmon.dump.per_sample_files), for the
analyses that need the gradients themselves (similarities between samples, per-layer statistics) rather
than their norms: PerSampleGradients(model, out_dir, layers=("*.attn.*",)).

Each monitored step keeps the chosen layers' inputs and output gradients (what backward holds for them
anyway), then materialises each sample's own-loss gradient of each chosen layer `chunk` samples at a time
and writes the chunks, optionally on a background thread (the next begin_step waits for it); at most one
chunk of per-sample gradients is in memory at once. Under FSDP2 each rank writes its own samples'
gradients of the full (unsharded) layer: they come from activations, which FSDP does not shard."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..dump.per_sample_files import RankWriter
from ..dump.safe_io import ensure_real_dir
from ..utils import check_int, check_step
from .grad_norms import PerSampleGradNorms
from .sample_ids import sample_ids as checked_sample_ids


class PerSampleGradients:
    """Collects the per-sample gradients of the layers of `model` whose module names match `layers` (globs)
    into `out_dir`, one generation per step and rank; read them back with gapmon.per_sample.load_gradients."""

    def __init__(self, model: nn.Module, out_dir: str | Path, layers: Sequence[str] = ("*",), chunk: int = 8,
                 loss_reduction: str = "mean", batch_dim: int = 0, batch_inputs: Sequence[Any] | dict | None = None,
                 process_group: Any = None, async_write: bool = False):
        if isinstance(layers, str):
            layers = (layers,)
        self.chunk = check_int(chunk, "PerSampleGradients", "chunk", 1)
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        ensure_real_dir(self.out_dir, self.out_dir)
        self.group, self.async_write = process_group, async_write
        self.norms = PerSampleGradNorms(model, loss_reduction=loss_reduction, batch_dim=batch_dim,
                                        batch_inputs=batch_inputs, process_group=process_group)
        self.layers = self.norms.keep_layers(tuple(layers))
        self.norms.pause()
        self._step: int | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.written: list[Path] = []  # the rank directories sealed so far

    def begin_step(self, step: int) -> None:
        """Collects the forward and backward passes that follow as step `step` (all its micro-batches)."""
        self.wait()
        self._step = check_step(step, "PerSampleGradients.begin_step")
        self.norms.reset()
        self.norms.start()

    def end_step(self, sample_ids: Any = None) -> None:
        """Writes the step's per-sample gradients (`sample_ids`: this rank's samples' ids in order; default
        0..B-1, which needs a single process)."""
        if self._step is None:
            raise RuntimeError("PerSampleGradients.end_step: call begin_step(step) before the forward pass")
        step, self._step = self._step, None
        self.norms.pause()
        chunks = self.norms.per_sample_gradients(self.chunk)  # checks (and refusals) happen here, in this thread
        total = len(self.norms.loss_weights())
        world = dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1
        if sample_ids is None:
            if world > 1:
                raise ValueError("PerSampleGradients.end_step: pass sample_ids under several ranks (each rank's own, "
                                 "so that the files can be merged by id)")
            ids = torch.arange(total)
        else:
            ids = checked_sample_ids(sample_ids, "PerSampleGradients.end_step")
            if ids.numel() != total:
                raise ValueError(f"PerSampleGradients.end_step: {ids.numel()} sample ids for {total} samples")
        rank = dist.get_rank(self.group) if world > 1 else 0
        if self.async_write:
            self._thread = threading.Thread(target=self._write_guarded, args=(chunks, ids, step, rank), daemon=True)
            self._thread.start()
        else:
            self._write(chunks, ids, step, rank)

    def _write_guarded(self, chunks, ids, step, rank) -> None:
        try:
            self._write(chunks, ids, step, rank)
        except BaseException as e:  # re-raised by wait()
            self._error = e

    def _write(self, chunks, ids: torch.Tensor, step: int, rank: int) -> None:
        writer = RankWriter(self.out_dir, step, rank)
        try:
            counts: dict[str, int] = {}
            for layer, first, count, grads in chunks:
                writer.write_chunk(layer, counts.get(layer, 0), ids[first:first + count], grads)
                counts[layer] = counts.get(layer, 0) + 1
                del grads  # one chunk at a time
            self.written.append(writer.seal())
        except BaseException:
            writer.abort()
            raise

    def wait(self) -> None:
        """Waits for a background write; raises what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.norms.close()

    def __enter__(self) -> "PerSampleGradients":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
