"""The reconstruction's output format, written from gradients the reader (gapmon.reconstruct) rebuilt:

    OUTPUT_DIR/step{N}_{param}.safetensors       one gradient (name made file-safe, see gradient_file)
    OUTPUT_DIR/step{N}_all_gradients.safetensors every gradient (also .pt with fmt="pt")
    OUTPUT_DIR/step{N}_metadata.json             {"step", "parallel_type", "world_size",
        "parameters": {name: {"shape", "dtype", "norm", "max_abs", "mean", "var"}}, "parameter_norms": {name: norm}}

Written all or nothing: staged in a temporary directory, then moved in.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from .dump_format import DumpError, dtype_name
from .safe_io import file_mode, write_json

ALL_GRADIENTS_GLOB = "step*_all_gradients.safetensors"  # how analysis.load_gradients finds the file in a directory


def gradient_file(step: int, name: str) -> str:
    return f"step{step}_{_safe_filename(name)}.safetensors"


def all_gradients_file(step: int, ext: str = "safetensors") -> str:
    return f"step{step}_all_gradients.{ext}"


def metadata_file(step: int) -> str:
    return f"step{step}_metadata.json"


_MAX_NAME = 120


def _safe_filename(name: str) -> str:
    """A file-name-safe form of a parameter name, injective: a name that had to be changed (odd
    characters, or longer than _MAX_NAME) gets a hash of the full name appended."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    if safe != name or len(safe) > _MAX_NAME:
        safe = f"{safe[:_MAX_NAME]}-{hashlib.sha1(name.encode()).hexdigest()[:12]}"
    return safe


def write_reconstruction(grads: dict[str, torch.Tensor], output_dir: str | Path, step: int, config: dict[str, Any],
                         skip_individual: bool = False, fmt: str = "safetensors") -> list[Path]:
    """Writes the reconstruction of `step` (gradients from gapmon.reconstruct_gradients, `config` the
    step's dump configuration) into output_dir: each gradient's file, all of them in one, and the
    metadata (see the module docstring). Files are staged in a temporary directory and moved into output_dir only
    once all are written; a target name taken by anything but a file is refused before any move,
    and a move that fails puts back what was there, so a failure leaves output_dir as it was."""
    from safetensors.torch import save_file

    from .ops import multi_tensor_rows
    from .stats import STAT_NAMES

    if fmt not in ("safetensors", "pt"):
        raise ValueError(f"format must be 'safetensors' or 'pt', got {fmt!r}")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    names = list(grads)
    files: dict[str, str] = {}
    for name in names:
        other = files.setdefault(_safe_filename(name), name)
        if other != name:
            raise DumpError(f"gradients '{other}' and '{name}' would be written to the same file; nothing was written")
    rows = multi_tensor_rows([grads[n] for n in names]).tolist()  # one host read for all statistics
    params = {}
    for name, row in zip(names, rows):
        stats = dict(zip(STAT_NAMES, row))
        if grads[name].is_complex():
            raise DumpError(f"gradient '{name}' is {grads[name].dtype}: gapmon reconstructs real gradients only")
        params[name] = {"shape": list(grads[name].shape), "dtype": dtype_name(grads[name].dtype),
                        **{key: stats[key] for key in ("norm", "max_abs", "mean", "var")}}
    metadata = {"step": step, "parallel_type": config.get("parallel_type", "single"),
                "world_size": config.get("world_size", 1), "parameters": params,
                "parameter_norms": {n: p["norm"] for n, p in params.items()}}
    staging = Path(tempfile.mkdtemp(prefix=".reconstruct-", dir=output_dir))
    try:
        written = []
        contiguous = {n: t.contiguous() for n, t in grads.items()}
        if not skip_individual:
            for name, t in contiguous.items():
                written.append(gradient_file(step, name))
                save_file({name: t}, str(staging / written[-1]))
        written.append(all_gradients_file(step, "safetensors"))
        save_file(contiguous, str(staging / written[-1]))
        if fmt == "pt":
            written.append(all_gradients_file(step, "pt"))
            torch.save(contiguous, staging / written[-1])
        written.append(metadata_file(step))
        write_json(staging / written[-1], metadata)
        taken = [name for name in written if (output_dir / name).exists() and not (output_dir / name).is_file()]
        if taken:
            raise DumpError(f"{output_dir / taken[0]} exists and is not a file; nothing was written")
        for name in written:
            os.chmod(staging / name, file_mode())  # safetensors' save_file makes 0600 files
        _move_all(staging, output_dir, written)
        return [output_dir / name for name in written]
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _move_all(staging: Path, output_dir: Path, names: list[str]) -> None:
    """Moves staging/name to output_dir/name for every name, or none: files they replace are set
    aside first and put back if a move fails."""
    aside = staging / ".replaced"
    aside.mkdir()
    moved: list[str] = []
    try:
        for name in names:
            if (output_dir / name).exists():
                os.replace(output_dir / name, aside / name)
            os.replace(staging / name, output_dir / name)
            moved.append(name)
    except BaseException:
        for name in moved:
            (output_dir / name).unlink(missing_ok=True)
        for name in names:
            if (aside / name).exists():
                os.replace(aside / name, output_dir / name)
        raise
