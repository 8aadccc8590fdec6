"""The on-disk format of gradient dumps: every file name, the header key and the format version,
named once here and used by the writer (gapmon.dump) and the reader (gapmon.reconstruct).

    GRAD_DIR/config.json                    the run: layout, mode, run_id, format_version
    GRAD_DIR/step{S}/rank{R}.safetensors    shards mode: rank R's local shards, header under "gapmon"
    GRAD_DIR/step{S}/sampled.safetensors    sampled mode
    GRAD_DIR/step{S}/full/ + full_index.json  full mode (torch.distributed.checkpoint)
    GRAD_DIR/step{S}/COMPLETE               written last: files, run_id, step, world_size
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)

CONFIG = "config.json"
COMPLETE = "COMPLETE"
SAMPLED = "sampled.safetensors"
FULL_DIR = "full"
FULL_STAGING = ".full.tmp"
FULL_INDEX = "full_index.json"
HEADER_KEY = "gapmon"  # the safetensors metadata key that holds a rank file's JSON header
STEP_PREFIX = "step"


class DumpError(Exception):
    """A gradient dump cannot be read as asked (missing, incomplete, corrupt or inconsistent)."""


def step_dir(grad_dir: str | Path, step: int) -> Path:
    return Path(grad_dir) / f"{STEP_PREFIX}{step}"


def step_of(directory: Path) -> int | None:
    """The step of a `step{S}` directory name, else None."""
    digits = directory.name[len(STEP_PREFIX):]
    return int(digits) if directory.name.startswith(STEP_PREFIX) and digits.isdigit() else None


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def check_version(record: dict[str, Any], where: str | Path) -> None:
    """Raises DumpError unless `record` (a config, header or COMPLETE) has a format version this
    reader knows. Records without one predate versioning and are version 1."""
    version = record.get("format_version", 1)
    if isinstance(version, bool) or version not in SUPPORTED_VERSIONS:
        raise DumpError(f"{where}: format_version {version!r} is not one this gapmon reads "
                        f"({', '.join(map(str, SUPPORTED_VERSIONS))}); upgrade gapmon to read it")
