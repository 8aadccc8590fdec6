"""Crash-safe file writes: write to a temporary file beside the target, fsync, then rename.

A reader never sees a half-written file under its final name; a failed write (full disk, a
killed process) leaves the previous state of the directory as it was.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import struct
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch


def fsync_path(path: str | Path) -> None:
    """Flushes a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process's umask as it is now, read without changing it where the OS says it (Linux's
    /proc/self/status); elsewhere set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode the user's umask gives a new file now (mkstemp alone would make it 0600): read at every
    write, so a process that tightens its umask later gets files as private as it asked."""
    return 0o666 & ~current_umask()


class UnsafePathError(OSError):
    """A path gapmon would write through is a symbolic link (or not a directory) inside the directory
    it was given: it refuses rather than write where the link points."""


def ensure_real_dir(root: str | Path, path: str | Path) -> Path:
    """Creates directory `path`, which must lie under `root`, with its missing parents below root. Every
    component below root must be a real directory, never a symbolic link (root itself, named by the
    user, may be one): gapmon never writes through a link it did not create, nor outside root."""
    root, path = Path(root), Path(path)
    relative = path.relative_to(root)  # ValueError: not under root
    if ".." in relative.parts:
        raise UnsafePathError(f"gapmon: {path} leaves {root}")
    root.mkdir(parents=True, exist_ok=True)
    current = root
    for part in relative.parts:
        current = current / part
        try:
            current.mkdir()
        except FileExistsError:
            pass
        info = os.lstat(current)
        if stat.S_ISLNK(info.st_mode):
            raise UnsafePathError(f"gapmon: {current} is a symbolic link inside {root}; refusing to write through it "
                                  "(remove it, or choose another directory)")
        if not stat.S_ISDIR(info.st_mode):
            raise UnsafePathError(f"gapmon: {current} is not a directory; refusing to write there")
    return path


def remove_entry(path: str | Path) -> None:
    """Removes a file, a symbolic link (never what it points to) or a directory tree; nothing if absent."""
    path = Path(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass

# A temp file's name says who writes it (host, pid and the process's start time), so that one left by a
# killed writer can be told from one a live writer is still filling, even once its pid was given to a
# new process: `.{name}.@{host}@{pid}@{start}@.{random}.tmp` (older names lack the start).
HOST = socket.gethostname()  # this host, as temp names and the dumper's peers record it
_OWNER = re.compile(r"\.@([^@/]*)@(\d+)@(?:(\d+)@)?\.")


def process_start(pid: int) -> int:
    """When process `pid` of this host started (clock ticks since boot, /proc/PID/stat's field 22); 0 where
    that cannot be read. With the pid it names one process: a pid given again to a new process differs."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


_MY_START = process_start(os.getpid())


def _temp_prefix(name: str) -> str:
    return f".{name}.@{HOST}@{os.getpid()}@{_MY_START}@."


def writer_gone(host: str, pid: int, started: int | None) -> bool:
    """Whether the writer (host, pid, start time) provably no longer runs: a process of this host whose pid
    is gone, or now belongs to a process that started at another time."""
    if host != HOST:
        return False
    if not process_alive(pid):
        return True
    return bool(started) and process_start(pid) not in (0, started)


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs (an exited process its parent has not reaped
    yet, a zombie, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):  # no /proc (not Linux): kill's answer stands
        return True


def remove_stale_temps(paths: Iterable[Path], max_age: float) -> None:
    """Removes temp files of writers that are gone: written by a process of this host that no longer
    runs, or (other hosts, whose processes cannot be asked) untouched for `max_age` seconds."""
    cutoff = time.time() - max_age
    for tmp in paths:
        owner = _OWNER.search(tmp.name)
        try:
            dead = owner is not None and writer_gone(owner.group(1), int(owner.group(2)), int(owner.group(3) or 0))
            if tmp.is_file() and (dead or tmp.stat().st_mtime < cutoff):
                tmp.unlink()
        except OSError:
            pass  # another process removed it first


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Calls write(tmp_path), then fsyncs and renames tmp_path to `path`; cleans up on failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.parent.is_symlink():
        raise UnsafePathError(f"gapmon: {path.parent} is a symbolic link; refusing to write {path.name} through it")
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path.name), suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, file_mode())  # after writing: a writer may replace the file it was given
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


def read_safetensors_header(path: str | Path, limit: int = 100 << 20) -> tuple[bytes, dict[str, str]]:
    """The raw header bytes (length prefix included) and the `__metadata__` of a safetensors file,
    read from its header alone (no tensor data).

    Raises ValueError for anything that is not a regular file with a well-formed header."""
    path = Path(path)
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise ValueError(f"{path} is not a regular file")
    with open(path, "rb") as f:
        size_bytes = f.read(8)
        if len(size_bytes) != 8:
            raise ValueError(f"{path} is truncated (no safetensors header)")
        (size,) = struct.unpack("<Q", size_bytes)
        if size > limit:
            raise ValueError(f"{path} has a {size}-byte header, more than the {limit} allowed")
        raw = f.read(size)
    if len(raw) != size:
        raise ValueError(f"{path} is truncated (header of {size} bytes, {len(raw)} present)")
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} has a corrupt safetensors header: {e}") from e
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise ValueError(f"{path} has a corrupt safetensors header")
    return size_bytes + raw, meta


def read_safetensors_metadata(path: str | Path, limit: int = 100 << 20) -> dict[str, str]:
    """The `__metadata__` of a safetensors file (see read_safetensors_header)."""
    return read_safetensors_header(path, limit)[1]
