"""Crash-safe file writes: write to a temporary file beside the target, fsync, then rename.

A reader never sees a half-written file under its final name; a failed write (full disk, a
killed process) leaves the previous state of the directory as it was.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch


def fsync_path(path: str | Path) -> None:
    """Flushes a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Calls write(tmp_path), then fsyncs and renames tmp_path to `path`; cleans up on failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_json(path: str | Path, obj: Any) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True)

    atomic_write(path, write)


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    def write(tmp: str) -> None:
        try:
            save_file(tensors, tmp, metadata=metadata)
        except Exception as e:  # safetensors reports I/O failures (full disk, ...) as SafetensorError
            found = re.search(r"os error (\d+)", str(e))
            if found is None:
                raise
            code = int(found.group(1))
            raise OSError(code, os.strerror(code), tmp) from e

    atomic_write(path, write)
