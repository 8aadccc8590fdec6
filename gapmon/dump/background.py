"""The dumper's background writes: one writer thread fed a step at a time, and the two reusable host
staging sets that hold the gradients it writes."""
from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Callable

import torch

from .format import step_dir
from .safe_io import write_json

FAILED_MARKER = ".{}.failed"  # step{S}/.rank{R}.failed: a rank's write of the step failed (its error inside)


class StagingSets:
    """Host copies of tensors that later training steps cannot change, in at most two reusable sets
    (pinned for GPU tensors): no fresh pages to fault in every step, and host memory bounded at two
    copies. `take` waits while both sets are being written; `give_back` returns one after its write."""

    def __init__(self) -> None:
        self._free: queue.Queue = queue.Queue()
        self._made = 0

    def take(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._made < 2 and self._free.empty():
            staging: dict[str, torch.Tensor] = {}
            self._made += 1
        else:
            staging = self._free.get()
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

    def give_back(self, staging: dict[str, torch.Tensor]) -> None:
        self._free.put(staging)

    def release(self) -> None:
        """Drops the free sets (their host memory)."""
        self._free = queue.Queue()


class BackgroundWriter:
    """Runs a step's write now (`async_write=False`) or in one writer thread, at most one step waiting
    (bounded host memory). A failed write leaves a marker in its step directory (rank 0, waiting for this
    rank's file, then fails fast) and is raised on the training thread by the next call or `close`."""

    def __init__(self, save_dir: Path, rank: int, async_write: bool):
        self.save_dir, self.rank, self.async_write = save_dir, rank, async_write
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, step: int, fn: Callable, *args) -> None:
        if not self.async_write:
            self.run(step, fn, *args)
            return
        if self._thread is None:
            self._queue = queue.Queue(maxsize=1)
            self._thread = threading.Thread(target=self._worker, name="gapmon-dump", daemon=True)
            self._thread.start()
        self._queue.put((step, fn, args))

    def run(self, step: int, fn: Callable, *args) -> None:
        try:
            fn(*args)
        except BaseException as e:
            # Tell rank 0, which may be waiting for this rank's file, so that it fails fast.
            try:
                marker = step_dir(self.save_dir, step) / FAILED_MARKER.format(f"rank{self.rank}")
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
                    self.run(step, fn, *args)
            except BaseException as e:  # re-raised on the training thread
                self._error = e
            finally:
                self._queue.task_done()

    def wait(self) -> None:
        """Waits for the pending writes; raises the first background error."""
        if self._queue is not None:
            self._queue.join()
        self.raise_error()

    def raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Waits for the pending writes and stops the thread (errors stay for raise_error)."""
        if self._thread is not None:
            self._queue.join()
            self._queue.put(None)
            self._thread.join()
            self._thread = None
