"""Full gradients from a GradientDumper directory, for every dump mode.

`reconstruct_gradients(grad_dir, step)` returns {name: full tensor}. Shards are placed at their
recorded offsets (uneven and empty shards included) and checked against the recorded global
shape; HSDP uses replica 0, and `verify=True` rebuilds every replica and compares them.
Anything missing, incomplete, corrupt or inconsistent raises DumpError naming what is wrong.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import torch

from ..utils import check_step
from .format import (
    CHECKSUM,
    COMPLETE,
    CONFIG,
    FULL_DIR,
    FULL_INDEX,
    HEADER_KEY,
    SAMPLED,
    STEP_PREFIX,
    CompleteRecord,
    ConfigRecord,
    DumpCorruptError,
    DumpError,
    DumpIncompleteError,
    DumpInconsistentError,
    DumpMissingError,
    ShardRecord,
    check_version,
    check_world_size,
    dtype_name,
    file_crc32,
    header_crc32,
    rank_file,
    read_full_index,
    read_json_object,
    step_dir,
    step_of,
    tensor_crc32,
)
from .safe_io import read_safetensors_header


def list_steps(grad_dir: str | Path) -> tuple[list[int], list[int]]:
    """(complete steps, incomplete steps) found under grad_dir, sorted. A step is complete when its
    COMPLETE record is readable and every file it names is present (checksums are checked when
    the step is read)."""
    grad_dir = Path(grad_dir)
    if not grad_dir.is_dir():
        raise DumpMissingError(f"gradient directory {grad_dir} does not exist")
    complete, incomplete = [], []
    for d in grad_dir.glob(f"{STEP_PREFIX}*"):
        step = step_of(d)
        if d.is_dir() and step is not None:
            (complete if _looks_complete(d) else incomplete).append(step)
    return sorted(complete), sorted(incomplete)


def _looks_complete(directory: Path) -> bool:
    try:
        record = read_complete(directory)
    except (DumpError, OSError):
        return False
    return all((directory / name).exists() for name in _listed_files(record))


def _listed_files(record: CompleteRecord) -> list[str]:
    return list(record.files)


def read_config(grad_dir: str | Path) -> dict[str, Any]:
    """The validated config.json of a gradient dump (raises DumpError naming what is wrong). It
    describes the run that last wrote there; each step's own configuration is in its COMPLETE."""
    grad_dir = Path(grad_dir)
    if not grad_dir.is_dir():
        raise DumpMissingError(f"gradient directory {grad_dir} does not exist")
    path = grad_dir / CONFIG
    if not path.exists():
        raise DumpMissingError(f"{path} is missing: {grad_dir} is not a gapmon gradient dump")
    return ConfigRecord.from_json(read_json_object(path, "the dump's configuration"), path).to_json()


def read_complete(directory: Path) -> CompleteRecord:
    """The validated COMPLETE record of a step directory."""
    path = directory / COMPLETE
    return CompleteRecord.from_json(read_json_object(path, "the step's completion record"), path)


def step_config(grad_dir: Path, record: CompleteRecord) -> dict[str, Any]:
    """The configuration a step was written with: its COMPLETE's (format 2), else config.json's."""
    return record.config if record.config is not None else read_config(grad_dir)


def _field(record: dict[str, Any], key: str, path: Path, what: str) -> Any:
    if not isinstance(record, dict) or key not in record:
        raise DumpCorruptError(f"{path}: {what} lacks the field '{key}'")
    return record[key]


def _open_safetensors(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error types for truncated or garbled files
        raise DumpCorruptError(f"{path} is corrupt or truncated: {e}") from e


def _header(handle, path: Path) -> dict[str, Any]:
    meta = handle.metadata() or {}
    if HEADER_KEY not in meta:
        raise DumpCorruptError(f"{path} has no gapmon metadata: not written by GradientDumper")
    try:
        header = json.loads(meta[HEADER_KEY])
    except json.JSONDecodeError as e:
        raise DumpCorruptError(f"{path}: the gapmon metadata is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise DumpCorruptError(f"{path}: the gapmon metadata is not a JSON object")
    check_version(header, path)
    return header


class _Checked:
    """Checks the files of one step against its COMPLETE record: sizes and header checksums when a
    file is opened, each tensor's checksum when it is read, the generation every header names."""

    def __init__(self, directory: Path, record: CompleteRecord):
        self.directory = directory
        self.record = record
        self.files = record.checksums
        self.generation = record.generation

    @property
    def has_checksums(self) -> bool:
        return self.files is not None

    def open(self, name: str, step: int):
        """A safetensors handle on a gapmon file of the step, and its header: first checked to be of
        the run, step and dump that COMPLETE vouches for, then against COMPLETE's checksums."""
        path = self.directory / name
        handle = _open_safetensors(path)
        header = _header(handle, path)
        complete = self.record
        if complete.run_id is not None and header.get("run_id") != complete.run_id:
            raise DumpInconsistentError(f"{path} was written by another run ({header.get('run_id')!r}) than the one that marked "
                            f"step {step} complete ({complete.run_id!r}): the directory mixes runs")
        if header.get("step", step) != step:
            raise DumpInconsistentError(f"{path} holds step {header.get('step')!r}, not step {step}")
        if self.generation is not None and header.get("generation") != self.generation:
            raise DumpInconsistentError(f"{path} belongs to dump {header.get('generation')!r} of this step, not to the dump "
                            f"{self.generation!r} its {COMPLETE} vouches for: the step mixes two dumps")
        if self.files is not None:
            info = self.files.get(name)
            if info is None:
                raise DumpInconsistentError(f"{path} is not one of the files {self.directory / COMPLETE} names")
            if path.stat().st_size != info["bytes"]:
                raise DumpCorruptError(f"{path} is corrupt: {path.stat().st_size} bytes, {info['bytes']} when it was written")
            try:
                raw, _ = read_safetensors_header(path)
            except ValueError as e:
                raise DumpCorruptError(str(e)) from e
            if header_crc32(raw) != info.get(f"header_{CHECKSUM}"):
                raise DumpCorruptError(f"{path} is corrupt: its header does not match the checksum {COMPLETE} records")
        return handle, header

    def check_whole(self, name: str) -> None:
        """Size and checksum of a file recorded whole (DCP's files, the full-mode index)."""
        path = self.directory / name
        info = (self.files or {}).get(name)
        if info is None:
            return
        if not path.is_file():
            raise DumpCorruptError(f"{path} is missing ({self.directory / COMPLETE} names it)")
        if path.stat().st_size != info["bytes"] or file_crc32(path) != info.get(CHECKSUM):
            raise DumpCorruptError(f"{path} is corrupt: it does not match the size and checksum {COMPLETE} records")


def _tensor(handle, name: str, path: Path) -> torch.Tensor:
    try:
        return handle.get_tensor(name)
    except Exception as e:  # safetensors' own error types
        raise DumpCorruptError(f"{path}: tensor '{name}' that the header lists cannot be read: {e}") from e


def _check_checksum(t: torch.Tensor, checksum: Any, name: str, path: Path) -> torch.Tensor:
    """`t` if its bytes match the checksum recorded for it (None: format 1, none recorded)."""
    if checksum is not None and tensor_crc32(t) != checksum:
        raise DumpCorruptError(f"{path} is corrupt: tensor '{name}' does not match its checksum")
    return t


def _place(name: str, pieces: list[tuple[list[int], torch.Tensor]], shape: list[int], dtype, where: str) -> torch.Tensor:
    """Assembles a tensor of `shape` from (offsets, piece) pairs; every element must be covered
    exactly once (no gap, no overlap). Coverage is checked on the pieces' boxes (no per-element
    count unless something is off); one piece that is the whole tensor is returned as it is."""
    pieces = [(offsets, piece) for offsets, piece in pieces if piece.numel()]
    for offsets, piece in pieces:
        if len(offsets) != piece.dim() or len(offsets) != len(shape) or any(o < 0 for o in offsets) or any(
                o + s > n for o, s, n in zip(offsets, piece.shape, shape)):
            raise DumpInconsistentError(f"{where}: shard of '{name}' with shape {list(piece.shape)} at offsets {offsets} does not "
                            f"fit the global shape {shape}")
    if len(pieces) == 1 and list(pieces[0][1].shape) == list(shape) and pieces[0][1].dtype == dtype:
        return pieces[0][1]
    full = torch.empty(shape, dtype=dtype)
    for offsets, piece in pieces:
        full[tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))].copy_(piece)
    if full.numel() and not (len(pieces) <= _MAX_BOX_PAIRS and _boxes_tile(pieces, shape)):
        hits = torch.zeros(shape, dtype=torch.int32)
        for offsets, piece in pieces:
            hits[tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))] += 1
        if bool((hits == 1).all()):
            return full
        gaps, overlaps = int((hits == 0).sum()), int((hits > 1).sum())
        raise DumpInconsistentError(f"{where}: shards of '{name}' (shape {shape}) leave {gaps} elements uncovered and cover "
                        f"{overlaps} more than once")
    return full


_MAX_BOX_PAIRS = 64  # more pieces than this: coverage is counted per element (pairwise checks grow as n^2)


def _boxes_tile(pieces: list[tuple[list[int], torch.Tensor]], shape: list[int]) -> bool:
    """Whether boxes inside `shape` cover it exactly: their volumes add up to it and no two overlap."""
    boxes = [(offsets, list(piece.shape)) for offsets, piece in pieces]
    if sum(math.prod(size) for _, size in boxes) != math.prod(shape):
        return False
    for i, (a, sa) in enumerate(boxes):
        for b, sb in boxes[i + 1:]:
            if all(max(x, y) < min(x + m, y + n) for x, m, y, n in zip(a, sa, b, sb)):
                return False
    return True


def _load_shards(directory: Path, config: dict[str, Any], complete: CompleteRecord, step: int, verify: bool,
                 progress: Callable[[int, int], None] | None) -> dict[str, torch.Tensor]:
    if complete.world_size is not None:
        world = complete.world_size
    elif "world_size" in config:
        world = check_world_size(config["world_size"], directory.parent / CONFIG)
    else:  # without it the rank files cannot be counted: name the field, not a coverage gap it would cause
        raise DumpCorruptError(f"{directory / COMPLETE} and its configuration lack field 'world_size' (how many rank "
                               "files the step has)")
    paths = [directory / rank_file(r) for r in range(world)]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise DumpMissingError(f"{directory}: missing rank file(s) {', '.join(missing)} of a world of {world}")
    odd = [p.name for p in paths if not p.is_file()]
    if odd:
        raise DumpCorruptError(f"{directory}: {', '.join(odd)} is not a regular file")
    checked = _Checked(directory, complete)
    handles, headers = [], []
    for path in paths:
        h, header = checked.open(path.name, step)
        handles.append(h)
        tensors = _field(header, "tensors", path, "the gapmon header")
        if not isinstance(tensors, dict):
            raise DumpCorruptError(f"{path}: the gapmon header's 'tensors' is not an object")
        records = {name: ShardRecord.from_json(rec, name, path) for name, rec in tensors.items()}
        absent = sorted(set(tensors) - set(h.keys()))
        if absent:
            raise DumpCorruptError(f"{path}: the header lists tensor(s) {', '.join(repr(n) for n in absent)} that the file "
                            "does not hold")
        headers.append(records)
    names = list(headers[0])
    for r, records in enumerate(headers):
        if list(records) != names:
            raise DumpInconsistentError(f"{directory}: rank {r} holds different gradients than rank 0")
    out = {}
    for i, name in enumerate(names):
        by_replica: dict[int, list[tuple[list[int], torch.Tensor]]] = {}
        rec0 = headers[0][name]
        for r in range(world):
            rec = headers[r][name]
            if rec.global_shape != rec0.global_shape:
                raise DumpInconsistentError(f"{directory}: rank {r} records shape {rec.global_shape} for '{name}', rank 0 "
                                f"{rec0.global_shape}")
            replica = rec.replica()
            if not verify and replica != 0:
                continue  # only replica 0 is rebuilt (every replica with verify)
            piece = _tensor(handles[r], name, paths[r])
            if list(piece.shape) != rec.local_shape:
                raise DumpInconsistentError(f"{directory}: rank {r} stores '{name}' with shape {list(piece.shape)}, its header says "
                                f"{rec.local_shape}")
            if dtype_name(piece.dtype) != rec.dtype or rec.dtype != rec0.dtype:
                raise DumpInconsistentError(f"{paths[r]}: '{name}' is stored as {piece.dtype}, its header says {rec.dtype} "
                                f"(rank 0: {rec0.dtype})")
            _check_checksum(piece, rec.checksum, name, paths[r])
            by_replica.setdefault(replica, []).append((rec.offsets, piece))
        replicas = sorted(by_replica)
        if not replicas or replicas[0] != 0:
            raise DumpInconsistentError(f"{directory}: no rank holds replica 0 of '{name}'")
        where = str(directory)
        full = _place(name, by_replica[0], rec0.global_shape, rec0.torch_dtype, where)
        for rep in replicas[1:]:
            other = _place(name, by_replica[rep], rec0.global_shape, full.dtype, where)
            if not torch.equal(other, full):
                diff = (other.double() - full.double()).abs().max().item()
                raise DumpInconsistentError(f"{directory}: replica {rep} of '{name}' differs from replica 0 "
                                f"(max abs difference {diff:.3g})")
        out[name] = full
        if progress:
            progress(i + 1, len(names))
    return out


def _load_sampled(directory: Path, complete: CompleteRecord, step: int) -> dict[str, torch.Tensor]:
    path = directory / SAMPLED
    if not path.exists():
        raise DumpMissingError(f"{directory}: {SAMPLED} is missing")
    h, header = _Checked(directory, complete).open(SAMPLED, step)
    checksums = header.get("checksums", {})
    if not isinstance(checksums, dict):
        raise DumpCorruptError(f"{path}: the gapmon header's 'checksums' is not an object")
    return {name: _check_checksum(_tensor(h, name, path), checksums.get(name), name, path) for name in h.keys()}


def _load_full(directory: Path, complete: CompleteRecord) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    index_path = directory / FULL_INDEX
    if not (directory / FULL_DIR).is_dir() or not index_path.exists():
        raise DumpMissingError(f"{directory}: the distributed checkpoint ({FULL_DIR}/ and {FULL_INDEX}) is missing")
    checked = _Checked(directory, complete)
    for name in checked.files or {}:
        checked.check_whole(name)
    state = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in read_full_index(index_path).items()}
    reader = dcp.HuggingFaceStorageReader(str(directory / FULL_DIR))
    try:
        stored = set(reader.read_metadata().state_dict_metadata)
        if stored != set(state):
            raise DumpInconsistentError(f"{directory}: {FULL_INDEX} and the checkpoint disagree: only in the index: "
                            f"{sorted(set(state) - stored) or 'none'}, only in the checkpoint: {sorted(stored - set(state)) or 'none'}")
        dcp.load(state, storage_reader=reader, no_dist=True)
    except DumpError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise DumpCorruptError(f"{directory}/{FULL_DIR} cannot be loaded: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    return state


def reconstruct_gradients(grad_dir: str | Path, step: int, verify: bool = False,
                          progress: Callable[[int, int], None] | None = None) -> dict[str, torch.Tensor]:
    """The full gradients of `step` from a GradientDumper directory (any mode).

    Every file is checked against the checksums its step recorded; the files of one step must all
    belong to the dump its COMPLETE names. `verify=True` also rebuilds every replica (HSDP/DDP)
    and compares them, and refuses a step that has no checksums (written by gapmon's format 1)."""
    grad_dir = Path(grad_dir)
    step = check_step(step, "reconstruct_gradients")
    read_config(grad_dir)  # refuses a folder that is not a gradient dump
    directory = step_dir(grad_dir, step)
    if not directory.is_dir():
        complete, _ = list_steps(grad_dir)
        raise DumpMissingError(f"step {step} was not dumped under {grad_dir} (complete steps: {complete or 'none'})")
    if not (directory / COMPLETE).exists():
        present = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
        raise DumpIncompleteError(f"step {step} is incomplete: {directory}/{COMPLETE} is missing (present: {present or 'nothing'})")
    complete = read_complete(directory)
    if verify and complete.checksums is None:
        raise DumpIncompleteError(f"step {step} under {grad_dir} was written without checksums (format 1): it cannot be verified")
    config = step_config(grad_dir, complete)
    mode = config.get("mode", "shards")
    loaders = {"shards": lambda: _load_shards(directory, config, complete, step, verify, progress),
               "sampled": lambda: _load_sampled(directory, complete, step), "full": lambda: _load_full(directory, complete)}
    if mode not in loaders:
        raise DumpCorruptError(f"{directory / COMPLETE} names an unknown mode {mode!r}")
    grads = loaders[mode]()
    if not grads:
        raise DumpMissingError(f"step {step} under {grad_dir} holds no gradients: the model had none when it was dumped "
                        "(was maybe_dump called after zero_grad, or before backward?)")
    return grads
