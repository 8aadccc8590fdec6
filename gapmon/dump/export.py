"""The reconstruction's output format, written from gradients the reader (gapmon.reconstruct) rebuilt:

    OUTPUT_DIR/step{N}_{param}.safetensors       one gradient (name made file-safe, see gradient_file)
    OUTPUT_DIR/step{N}_all_gradients.safetensors every gradient (also .pt with fmt="pt")
    OUTPUT_DIR/step{N}_metadata.json             {"step", "parallel_type", "world_size",
        "parameters": {name: {"shape", "dtype", "norm", "max_abs", "mean", "var"}}, "parameter_norms": {name: norm}}

Written all or nothing, in one atomic switch: the names above are symbolic links through the step's
pointer `OUTPUT_DIR/.step{N}` to the generation directory that holds the files (write_reconstruction).
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from .format import DumpError, dtype_name
from .safe_io import HOST, current_umask, file_mode, fsync_path, process_start, remove_entry, write_json, writer_gone

ALL_GRADIENTS_GLOB = "step*_all_gradients.safetensors"  # how analysis.load_gradients finds the file in a directory


def gradient_file(step: int, name: str) -> str:
    return f"step{step}_{_safe_filename(name)}.safetensors"


def all_gradients_file(step: int, ext: str = "safetensors") -> str:
    return f"step{step}_all_gradients.{ext}"


def metadata_file(step: int) -> str:
    return f"step{step}_metadata.json"


# UTF-8 bytes of the name part of a file name: with "step{N}_" (N up to 20 digits) and ".safetensors" the
# whole stays within NAME_MAX (255 bytes) on every common file system, whatever the parameter's name.
_MAX_NAME_BYTES = 200


def _safe_filename(name: str) -> str:
    """A file-name-safe form of a parameter name, injective: a name that had to be changed (odd
    characters, or more than _MAX_NAME_BYTES bytes in UTF-8: 100 CJK characters are 300) is cut at a
    character boundary and gets a hash of the full name appended. The real name is the file's one
    safetensors key."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    if safe != name or len(safe.encode("utf-8")) > _MAX_NAME_BYTES:
        head = safe.encode("utf-8")[:_MAX_NAME_BYTES - 13].decode("utf-8", "ignore")
        safe = f"{head}-{hashlib.sha1(name.encode('utf-8')).hexdigest()[:12]}"
    return safe


def write_reconstruction(grads: dict[str, torch.Tensor], output_dir: str | Path, step: int, config: dict[str, Any],
                         skip_individual: bool = False, fmt: str = "safetensors") -> list[Path]:
    """Writes the reconstruction of `step` (gradients from gapmon.reconstruct_gradients, `config` the
    step's dump configuration) into output_dir: each gradient's file, all of them in one, and the
    metadata (see the module docstring). Returns the paths written.

    One atomic switch: the files are written into a generation directory of their own
    (`.step{N}.<id>/`), and each name in output_dir is a symbolic link through the step's pointer
    (`step{N}_x -> .step{N}/step{N}_x`, `.step{N} -> .step{N}.<id>`). Replacing the pointer (one rename)
    moves every name to the new generation at once: a crash at any instant leaves the old or the new
    reconstruction readable, never a mix (a name only one generation has dangles, as an absent file).
    Anything that would collide (two gradients on one file name, a name taken by a directory) is refused
    before anything is written; generations of writers that died are removed by the next write."""
    from safetensors.torch import save_file

    from ..stats.layout import STAT_NAMES
    from ..stats.ops import multi_tensor_rows

    if fmt not in ("safetensors", "pt"):
        raise ValueError(f"format must be 'safetensors' or 'pt', got {fmt!r}")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    names = list(grads)
    for name in names:
        if grads[name].is_complex():
            raise DumpError(f"gradient '{name}' is {grads[name].dtype}: gapmon reconstructs real gradients only")
    planned: dict[str, str] = {}  # file name -> what it holds
    if not skip_individual:
        for name in names:
            planned.setdefault(gradient_file(step, name), f"gradient '{name}'")
            if planned[gradient_file(step, name)] != f"gradient '{name}'":
                raise DumpError(f"{planned[gradient_file(step, name)]} and gradient '{name}' would be written to the "
                                f"same file {gradient_file(step, name)}; nothing was written")
    for file, what in ((all_gradients_file(step, "safetensors"), "the combined file"),
                       *(((all_gradients_file(step, "pt"), "the combined .pt file"),) if fmt == "pt" else ()),
                       (metadata_file(step), "the metadata")):
        if file in planned:
            raise DumpError(f"{planned[file]} and {what} would both be written to {file} (rename the parameter, or "
                            "pass skip_individual); nothing was written")
        planned[file] = what
    written = list(planned)
    taken = [f for f in written if os.path.lexists(output_dir / f) and (output_dir / f).is_dir()
             and not (output_dir / f).is_symlink()]
    if taken:
        raise DumpError(f"{output_dir / taken[0]} exists and is not a file; nothing was written")

    rows = multi_tensor_rows([grads[n] for n in names]).tolist()  # one host read for all statistics
    params = {}
    for name, row in zip(names, rows):
        stats = dict(zip(STAT_NAMES, row))
        params[name] = {"shape": list(grads[name].shape), "dtype": dtype_name(grads[name].dtype),
                        **{key: stats[key] for key in ("norm", "max_abs", "mean", "var")}}
    metadata = {"step": step, "parallel_type": config.get("parallel_type", "single"),
                "world_size": config.get("world_size", 1), "parameters": params,
                "parameter_norms": {n: p["norm"] for n, p in params.items()}}

    pointer = output_dir / f".step{step}"
    remove_dead_generations(output_dir, step)
    generation = Path(tempfile.mkdtemp(prefix=f".step{step}.{_owner()}", dir=output_dir))
    try:
        contiguous = {n: t.contiguous() for n, t in grads.items()}
        if not skip_individual:
            for name, t in contiguous.items():
                save_file({name: t}, str(generation / gradient_file(step, name)))
        save_file(contiguous, str(generation / all_gradients_file(step, "safetensors")))
        if fmt == "pt":
            torch.save(contiguous, generation / all_gradients_file(step, "pt"))
        write_json(generation / metadata_file(step), metadata)
        for name in written:
            os.chmod(generation / name, file_mode())  # safetensors' save_file makes 0600 files
            fsync_path(generation / name)
        os.chmod(generation, 0o777 & ~current_umask())
        fsync_path(generation)
        for name in written:  # names new to this step point through the pointer (dangling until the switch)
            _link(output_dir / name, f"{pointer.name}/{name}")
        old = os.readlink(pointer) if pointer.is_symlink() else None
        _link(pointer, generation.name)  # the switch
        fsync_path(output_dir)
    except BaseException:
        remove_entry(generation)
        raise
    if old is not None and old != generation.name and re.fullmatch(rf"\.step{step}\.@[^/]*", old):
        remove_entry(output_dir / old)  # only a generation directory of ours, whatever a planted pointer named
    for link in output_dir.glob(f"step{step}_*"):  # names of the old generation this one does not have
        if link.name not in planned and link.is_symlink() and os.readlink(link) == f"{pointer.name}/{link.name}":
            link.unlink(missing_ok=True)
    return [output_dir / name for name in written]


def _owner() -> str:
    """This writer in a generation directory's name: `@host@pid@start@.` (see remove_dead_generations)."""
    return f"@{HOST}@{os.getpid()}@{process_start(os.getpid())}@."


def _link(path: Path, target: str) -> None:
    """Makes `path` a symbolic link to `target` in one rename (replacing a file or link there); a link
    that already points there is left as it is."""
    if path.is_symlink() and os.readlink(path) == target:
        return
    tmp = path.with_name(f".gapmon-link-{uuid.uuid4().hex}")  # short: `path` may be near NAME_MAX already
    os.symlink(target, tmp)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_dead_generations(output_dir: Path, step: int) -> None:
    """Removes generation directories of step `step` that a writer of this host left when it died
    (its pid is gone, or now belongs to a process started later), never the one the pointer names."""
    pointer = output_dir / f".step{step}"
    current = os.readlink(pointer) if pointer.is_symlink() else None
    for path in output_dir.glob(f".step{step}.@*"):
        owner = re.match(rf"\.step{step}\.@([^@/]*)@(\d+)@(\d+)@\.", path.name)
        if path.name != current and owner is not None and writer_gone(owner.group(1), int(owner.group(2)),
                                                                       int(owner.group(3))):
            remove_entry(path)
    for path in output_dir.glob(".gapmon-link-*"):  # links made but not renamed in (a writer killed then)
        if time.time() - os.lstat(path).st_mtime > 60:
            path.unlink(missing_ok=True)
