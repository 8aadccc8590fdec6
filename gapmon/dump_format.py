"""The on-disk format of gradient dumps: every file name, the header key, the format version and
the checksums, named once here and used by the writer (gapmon.dump) and the reader (gapmon.reconstruct).

    GRAD_DIR/config.json                    the latest run: layout, mode, run_id, format_version
    GRAD_DIR/step{S}/rank{R}.safetensors    shards mode: rank R's local shards, header under "gapmon"
    GRAD_DIR/step{S}/sampled.safetensors    sampled mode
    GRAD_DIR/step{S}/full/ + full_index.json  full mode (torch.distributed.checkpoint)
    GRAD_DIR/step{S}/COMPLETE               written last, by rank 0: the step's generation

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
import zlib
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
