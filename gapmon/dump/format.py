"""The on-disk format of gradient dumps: every file name, the header key, the format version and
the checksums, named once here and used by the writer (gapmon.dump) and the reader (gapmon.reconstruct).

    GRAD_DIR/config.json                    the latest run: layout, mode, run_id, format_version
    GRAD_DIR/step{S}/rank{R}.safetensors    shards mode: rank R's local shards, header under "gapmon"
    GRAD_DIR/step{S}/sampled.safetensors    sampled mode
    GRAD_DIR/step{S}/full/ + full_index.json  full mode (torch.distributed.checkpoint)
    GRAD_DIR/step{S}/COMPLETE               written last, by rank 0: the step's generation

Records: a rank file's header describes each local shard with a ShardRecord (global and local
shape, offsets, placements S(d)/R/P on the mesh, the rank's mesh coordinate, dtype, checksum);
full_index.json lists each gradient's shape and dtype (full_index / read_full_index). Dtypes are
spelled one way, by dtype_name.

A *generation* is one dump of one step: `{run_id}.{step}.{n}` for the n-th dump of the step by a
run. Every gapmon header names its generation. COMPLETE (format 2) names the generation, the
configuration it was written with (layout, mode), and exactly its files, each with its size and
checksum; it carries a checksum of its own. Checksums are CRC-32 (zlib): of each tensor's bytes in
a gapmon safetensors header, of that header's bytes in COMPLETE; of whole files for files gapmon
did not lay out (DCP's). A re-dump withdraws COMPLETE first, so a step is either complete with one
generation's files or not complete; format 1 steps (no generations, no checksums) stay readable.
"""
from __future__ import annotations

import ctypes
import json
import numbers
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 2
SUPPORTED_VERSIONS = (1, 2)
CHECKSUM = "crc32"

CONFIG = "config.json"
COMPLETE = "COMPLETE"
SAMPLED = "sampled.safetensors"
FULL_DIR = "full"
FULL_STAGING = ".full.tmp"
FULL_INDEX = "full_index.json"
HEADER_KEY = "gapmon"  # the safetensors metadata key that holds a rank file's JSON header
STEP_PREFIX = "step"


class DumpError(Exception):
    """A gradient dump cannot be read as asked. The subclasses say why, so that a caller can tell a
    step that is not there yet from one that was damaged."""


class DumpMissingError(DumpError):
    """What was asked for is not there: no such directory, step, file or rank file."""


class DumpIncompleteError(DumpError):
    """The step exists but is not a complete, verifiable dump (no COMPLETE seal yet: being written or
    interrupted; or written without checksums)."""


class DumpCorruptError(DumpError):
    """A file's bytes are damaged or malformed: a checksum or size mismatch, unreadable or truncated
    data, a record with missing or ill-typed fields, an unknown format version."""


class DumpInconsistentError(DumpError):
    """The files are each readable but do not belong together: another run's or another dump
    generation's file, ranks that disagree, shards that overlap or leave gaps."""


def step_dir(grad_dir: str | Path, step: int) -> Path:
    return Path(grad_dir) / f"{STEP_PREFIX}{step}"


def step_of(directory: Path) -> int | None:
    """The step of a `step{S}` directory name as the writer spells it (decimal, no leading zero),
    else None: `step007` or `step5.0` are not steps (reconstruct could not find them)."""
    digits = directory.name[len(STEP_PREFIX):]
    if not directory.name.startswith(STEP_PREFIX) or not digits.isascii() or not digits.isdigit():
        return None
    return int(digits) if str(int(digits)) == digits else None


def generation_id(run_id: str, step: int, count: int) -> str:
    """The id of the `count`-th dump (from 0) of `step` by run `run_id`."""
    return f"{run_id}.{step}.{count}"


def tensor_crc32(t: torch.Tensor) -> int:
    """CRC-32 of a CPU tensor's bytes in its contiguous layout (as safetensors stores them)."""
    t = t.contiguous()
    size = t.numel() * t.element_size()
    if size == 0:
        return 0
    return zlib.crc32((ctypes.c_char * size).from_address(t.data_ptr()))


def file_crc32(path: str | Path, chunk: int = 16 << 20) -> int:
    """CRC-32 of a file's bytes, read in chunks."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def _record_crc32(record: dict[str, Any]) -> int:
    body = {k: v for k, v in record.items() if k != "record_crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def sealed(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with a checksum of its own content (key "record_crc32")."""
    return {**record, "record_crc32": _record_crc32(record)}


def check_sealed(record: dict[str, Any], where: str | Path) -> None:
    """Raises DumpError if a sealed record's content no longer matches its checksum."""
    if "record_crc32" in record and record["record_crc32"] != _record_crc32(record):
        raise DumpCorruptError(f"{where} is corrupt: its content does not match its checksum")


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def check_version(record: dict[str, Any], where: str | Path) -> None:
    """Raises DumpError unless `record` (a config, header or COMPLETE) has a format version this
    reader knows. Records without one predate versioning and are version 1."""
    version = record.get("format_version", 1)
    if isinstance(version, bool) or version not in SUPPORTED_VERSIONS:
        raise DumpCorruptError(f"{where}: format_version {version!r} is not one this gapmon reads "
                        f"({', '.join(map(str, SUPPORTED_VERSIONS))}); upgrade gapmon to read it")


# ---------------------------------------------------------------------------- records
DTYPES = ("float16", "bfloat16", "float32", "float64")  # the dtypes a dump holds, as dtype_name spells them
REPLICATE, PARTIAL = "R", "P"


def dtype_name(dtype: torch.dtype) -> str:
    """How the format spells a dtype: "float32" (no "torch." prefix)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: Any, where: str) -> torch.dtype:
    """The torch dtype a record names (format 1's full_index spelled "torch.float32": read too);
    DumpCorruptError naming `where` otherwise."""
    bare = name.removeprefix("torch.") if isinstance(name, str) else name
    if bare not in DTYPES:
        raise DumpCorruptError(f"{where}: field 'dtype' must be one of {list(DTYPES)}, got {name!r}")
    return getattr(torch, bare)


def placement_name(placement: Any) -> str:
    """A DTensor placement as the format spells it: S(d) for a shard on tensor dim d, R, P."""
    if placement.is_shard():
        return f"S({placement.dim})"
    return REPLICATE if placement.is_replicate() else PARTIAL


def _is_placement(value: Any) -> bool:
    return isinstance(value, str) and (value in (REPLICATE, PARTIAL) or (
        value.startswith("S(") and value.endswith(")") and value[2:-1].isascii() and value[2:-1].isdigit()))


def is_count(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _is_int_list(value: Any, positive: bool = False) -> bool:
    return isinstance(value, list) and all(is_count(v) and (v > 0 or not positive) for v in value)


@dataclass(frozen=True)
class ShardRecord:
    """One local shard of a gradient in a rank file's header: where it sits in the global tensor
    (offsets, local_shape within global_shape), how the tensor is placed on the mesh and where
    this rank is on it, its dtype, and the CRC-32 of its bytes (None in format 1)."""

    global_shape: list[int]
    local_shape: list[int]
    offsets: list[int]
    placements: list[str]
    mesh_shape: list[int]
    coordinate: list[int]
    dtype: str
    checksum: int | None = None

    _FIELDS = ("global_shape", "local_shape", "offsets", "placements", "mesh_shape", "coordinate", "dtype")

    def to_json(self) -> dict[str, Any]:
        out = {key: getattr(self, key) for key in self._FIELDS}
        if self.checksum is not None:
            out[CHECKSUM] = self.checksum
        return out

    @classmethod
    def from_json(cls, rec: Any, name: str, path: str | Path) -> "ShardRecord":
        """The record of tensor `name` read from file `path`; DumpCorruptError naming the file, the
        tensor and the field when it is malformed."""
        what = f"{path}: the record of '{name}'"
        if not isinstance(rec, dict):
            raise DumpCorruptError(f"{what} is not an object")
        missing = [key for key in cls._FIELDS if key not in rec]
        if missing:
            raise DumpCorruptError(f"{what} lacks field(s) {', '.join(repr(k) for k in missing)}")
        for key in ("global_shape", "local_shape", "offsets", "coordinate"):
            if not _is_int_list(rec[key]):
                raise DumpCorruptError(f"{what}: field '{key}' must be a list of non-negative ints, got {rec[key]!r}")
        if not _is_int_list(rec["mesh_shape"], positive=True):
            raise DumpCorruptError(f"{what}: field 'mesh_shape' must be a list of positive ints, got {rec['mesh_shape']!r}")
        placements = rec["placements"]
        if not isinstance(placements, list) or not all(_is_placement(p) for p in placements):
            raise DumpCorruptError(f"{what}: field 'placements' must list S(d), R or P, got {placements!r}")
        dims = len(rec["global_shape"])
        if len(rec["local_shape"]) != dims or len(rec["offsets"]) != dims:
            raise DumpCorruptError(f"{what}: global_shape, local_shape and offsets must have the same length")
        if not (len(placements) == len(rec["mesh_shape"]) == len(rec["coordinate"])):
            raise DumpCorruptError(f"{what}: placements, mesh_shape and coordinate must have the same length")
        if rec["dtype"] not in DTYPES:
            raise DumpCorruptError(f"{what}: field 'dtype' must be one of {list(DTYPES)}, got {rec['dtype']!r}")
        checksum = rec.get(CHECKSUM)
        if checksum is not None and not is_count(checksum):
            raise DumpCorruptError(f"{what}: field '{CHECKSUM}' must be a non-negative int, got {checksum!r}")
        return cls(*(rec[key] for key in cls._FIELDS), checksum=checksum)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def replica(self) -> int:
        """Index of the replica group of the rank that wrote it (its coordinates on the mesh dims
        where the tensor is replicated or partial)."""
        replica = 0
        for placement, size, coord in zip(self.placements, self.mesh_shape, self.coordinate):
            if placement in (REPLICATE, PARTIAL):
                replica = replica * size + coord
        return replica


MAX_WORLD = 1 << 20  # a world_size beyond this is a corrupt record, not a run


def check_world_size(value: Any, path: str | Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WORLD:
        raise DumpCorruptError(f"{path}: field 'world_size' must be an int between 1 and {MAX_WORLD}, got {value!r}")
    return value


def header_crc32(raw: bytes) -> int:
    """The checksum COMPLETE records of a gapmon safetensors file: of its raw header bytes."""
    return zlib.crc32(raw)


@dataclass(frozen=True)
class ConfigRecord:
    """config.json: the parallel layout and options of the run that last wrote the dump directory
    (parallel_type, world_size, shard_degree, num_replicas, mesh_shape, mesh_dim_names, mode,
    save_first_n), its run id and the format version."""

    layout: dict[str, Any]
    run_id: str | None = None
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {**self.layout, "format_version": self.format_version, "run_id": self.run_id}

    @classmethod
    def from_json(cls, record: dict[str, Any], path: str | Path) -> "ConfigRecord":
        """The record read from `path`; DumpError naming what is wrong."""
        check_version(record, path)
        if "world_size" not in record:
            raise DumpCorruptError(f"{path}: field 'world_size' is missing (how many ranks wrote the dump)")
        check_world_size(record["world_size"], path)
        layout = {k: v for k, v in record.items() if k not in ("format_version", "run_id")}
        return cls(layout, record.get("run_id"), record.get("format_version", 1))


@dataclass(frozen=True)
class CompleteRecord:
    """step{S}/COMPLETE, written last by rank 0: the step, the run and dump (generation) it vouches for,
    the world that wrote it, the configuration it was written with, and every file of the step with its
    size and checksum (format 2: {name: {"bytes": n, "crc32" or "header_crc32": c}}; format 1: a list of
    names). Sealed by a checksum of its own content."""

    files: dict[str, dict[str, int]] | list[str]
    step: int | None = None
    run_id: str | None = None
    generation: str | None = None
    world_size: int | None = None
    config: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return sealed({"format_version": FORMAT_VERSION, "step": self.step, "run_id": self.run_id,
                       "generation": self.generation, "world_size": self.world_size, "config": self.config,
                       "checksum": CHECKSUM, "files": self.files})

    @property
    def checksums(self) -> dict[str, dict[str, int]] | None:
        """Each file's size and checksum (None for a format 1 record, which has none)."""
        return self.files if isinstance(self.files, dict) else None

    @classmethod
    def from_json(cls, record: dict[str, Any], path: str | Path) -> "CompleteRecord":
        """The record read from `path`; DumpError naming what is wrong."""
        check_version(record, path)
        check_sealed(record, path)
        files = record.get("files", [])
        if isinstance(files, dict):
            for name, info in files.items():
                if (not isinstance(info, dict) or not is_count(info.get("bytes")) or Path(name).is_absolute()
                        or ".." in Path(name).parts):
                    raise DumpCorruptError(f"{path}: bad entry for file {name!r}: {info!r}")
        elif not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise DumpCorruptError(f"{path}: field 'files' must list the step's files, got {files!r}")
        config = record.get("config")
        if config is not None and not isinstance(config, dict):
            raise DumpCorruptError(f"{path}: field 'config' must be an object, got {config!r}")
        world = record.get("world_size")
        return cls(files, record.get("step"), record.get("run_id"), record.get("generation"),
                   None if world is None else check_world_size(world, path), config)


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in file `path` (`what` it holds, for the message); DumpCorruptError otherwise."""
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DumpCorruptError(f"{path} is corrupt: {e}") from e
    if not isinstance(value, dict):
        raise DumpCorruptError(f"{path} is corrupt: expected a JSON object ({what}), got {type(value).__name__}")
    return value


def full_index(shapes_and_dtypes: dict[str, tuple[list[int], torch.dtype]]) -> dict[str, Any]:
    """full_index.json's content: each gradient's shape and dtype (what the reader allocates before
    loading the distributed checkpoint into it)."""
    return {name: {"shape": list(shape), "dtype": dtype_name(dtype)} for name, (shape, dtype) in shapes_and_dtypes.items()}


def read_full_index(path: Path) -> dict[str, tuple[list[int], torch.dtype]]:
    """The (shape, dtype) of each gradient of a full-mode step; DumpError subclasses when the file is
    missing, not JSON or malformed."""
    if not path.is_file():
        raise DumpMissingError(f"{path} is missing: the step's gradient shapes and dtypes are unknown")
    index = read_json_object(path, "gradient names with their shapes and dtypes")
    out = {}
    for name, info in index.items():
        if not isinstance(info, dict) or not _is_int_list(info.get("shape")):
            raise DumpCorruptError(f"{path}: bad entry for '{name}': {info!r} (expected {{'shape': [...], 'dtype': ...}})")
        out[name] = (info["shape"], dtype_from_name(info.get("dtype"), f"{path}: '{name}'"))
    return out
