"""Full gradients from a GradientDumper directory, for every dump mode.

`reconstruct_gradients(grad_dir, step)` returns {name: full tensor}. Shards are placed at their
recorded offsets (uneven and empty shards included) and checked against the recorded global
shape; HSDP uses replica 0, and `verify=True` rebuilds every replica and compares them.
Anything missing, incomplete, corrupt or inconsistent raises DumpError naming what is wrong.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from .dump_format import (
    COMPLETE,
    CONFIG,
    FULL_DIR,
    FULL_INDEX,
    HEADER_KEY,
    SAMPLED,
    STEP_PREFIX,
    DumpError,
    check_version,
    rank_file,
    step_dir,
    step_of,
)
from .safe_io import write_json


def list_steps(grad_dir: str | Path) -> tuple[list[int], list[int]]:
    """(complete steps, incomplete steps) found under grad_dir, sorted."""
    grad_dir = Path(grad_dir)
    if not grad_dir.is_dir():
        raise DumpError(f"gradient directory {grad_dir} does not exist")
    complete, incomplete = [], []
    for d in grad_dir.glob(f"{STEP_PREFIX}*"):
        step = step_of(d)
        if d.is_dir() and step is not None:
            (complete if (d / COMPLETE).exists() else incomplete).append(step)
    return sorted(complete), sorted(incomplete)


_MAX_WORLD = 1 << 20


def _read_json_object(path: Path, what: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DumpError(f"{path} is corrupt: {e}") from e
    if not isinstance(value, dict):
        raise DumpError(f"{path} is corrupt: expected a JSON object ({what}), got {type(value).__name__}")
    return value


def _world_size(value: Any, path: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_WORLD:
        raise DumpError(f"{path}: field 'world_size' must be an int between 1 and {_MAX_WORLD}, got {value!r}")
    return value


def read_config(grad_dir: str | Path) -> dict[str, Any]:
    """The validated config.json of a gradient dump (raises DumpError naming what is wrong)."""
    grad_dir = Path(grad_dir)
    if not grad_dir.is_dir():
        raise DumpError(f"gradient directory {grad_dir} does not exist")
    path = grad_dir / CONFIG
    if not path.exists():
        raise DumpError(f"{path} is missing: {grad_dir} is not a gapmon gradient dump")
    config = _read_json_object(path, "the dump's configuration")
    check_version(config, path)
    _world_size(config.get("world_size", 1), path)
    return config


def _field(record: dict[str, Any], key: str, path: Path, what: str) -> Any:
    if not isinstance(record, dict) or key not in record:
        raise DumpError(f"{path}: {what} lacks the field '{key}'")
    return record[key]


def _open_safetensors(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error types for truncated or garbled files
        raise DumpError(f"{path} is corrupt or truncated: {e}") from e


def _header(handle, path: Path) -> dict[str, Any]:
    meta = handle.metadata() or {}
    if HEADER_KEY not in meta:
        raise DumpError(f"{path} has no gapmon metadata: not written by GradientDumper")
    try:
        header = json.loads(meta[HEADER_KEY])
    except json.JSONDecodeError as e:
        raise DumpError(f"{path}: the gapmon metadata is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise DumpError(f"{path}: the gapmon metadata is not a JSON object")
    check_version(header, path)
    return header


def _place(name: str, pieces: list[tuple[list[int], torch.Tensor]], shape: list[int], dtype, where: str) -> torch.Tensor:
    """Assembles a tensor of `shape` from (offsets, piece) pairs; every element must be covered
    exactly once (no gap, no overlap)."""
    full = torch.empty(shape, dtype=dtype)
    hits = torch.zeros(shape, dtype=torch.int32)
    for offsets, piece in pieces:
        if piece.numel() == 0:
            continue
        if len(offsets) != piece.dim() or any(o < 0 for o in offsets):
            raise DumpError(f"{where}: shard of '{name}' has bad offsets {offsets} for shape {list(piece.shape)}")
        index = tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))
        target = full[index]
        if list(target.shape) != list(piece.shape):
            raise DumpError(f"{where}: shard of '{name}' with shape {list(piece.shape)} at offsets {offsets} does not "
                            f"fit the global shape {shape}")
        target.copy_(piece)
        hits[index] += 1
    if full.numel() and not bool((hits == 1).all()):
        gaps, overlaps = int((hits == 0).sum()), int((hits > 1).sum())
        raise DumpError(f"{where}: shards of '{name}' (shape {shape}) leave {gaps} elements uncovered and cover "
                        f"{overlaps} more than once")
    return full


def _replica_of(record: dict[str, Any]) -> int:
    """Index of the replica group a rank belongs to (its coordinates on replicated mesh dims)."""
    replica = 0
    for placement, size, coord in zip(record["placements"], record["mesh_shape"], record["coordinate"]):
        if placement in ("R", "P"):
            replica = replica * size + coord
    return replica


def _load_shards(directory: Path, config: dict[str, Any], complete: dict[str, Any], step: int, verify: bool,
                 progress: Callable[[int, int], None] | None) -> dict[str, torch.Tensor]:
    world = _world_size(complete.get("world_size", config.get("world_size", 1)), directory / COMPLETE)
    paths = [directory / rank_file(r) for r in range(world)]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise DumpError(f"{directory}: missing rank file(s) {', '.join(missing)} of a world of {world}")
    odd = [p.name for p in paths if not p.is_file()]
    if odd:
        raise DumpError(f"{directory}: {', '.join(odd)} is not a regular file")
    handles, headers = [], []
    for path in paths:
        h = _open_safetensors(path)
        handles.append(h)
        header = _header(h, path)
        # Every rank file must come from the run and step that COMPLETE vouches for.
        if "run_id" in complete and header.get("run_id") != complete["run_id"]:
            raise DumpError(f"{path} was written by another run ({header.get('run_id')!r}) than the one that marked "
                            f"step {step} complete ({complete['run_id']!r}): the directory mixes runs")
        if header.get("step", step) != step:
            raise DumpError(f"{path} holds step {header.get('step')!r}, not step {step}")
        if not isinstance(_field(header, "tensors", path, "the gapmon header"), dict):
            raise DumpError(f"{path}: the gapmon header's 'tensors' is not an object")
        headers.append(header)
    names = list(headers[0]["tensors"])
    for r, header in enumerate(headers):
        if list(header["tensors"]) != names:
            raise DumpError(f"{directory}: rank {r} holds different gradients than rank 0")
    out = {}
    for i, name in enumerate(names):
        by_replica: dict[int, list[tuple[list[int], torch.Tensor]]] = {}
        rec0 = headers[0]["tensors"][name]
        for r in range(world):
            rec = headers[r]["tensors"][name]
            what = f"the record of '{name}'"
            for key in ("global_shape", "local_shape", "offsets", "placements", "mesh_shape", "coordinate", "dtype"):
                _field(rec, key, paths[r], what)
            if rec["global_shape"] != rec0["global_shape"]:
                raise DumpError(f"{directory}: rank {r} records shape {rec['global_shape']} for '{name}', rank 0 "
                                f"{rec0['global_shape']}")
            piece = handles[r].get_tensor(name)
            if list(piece.shape) != rec["local_shape"]:
                raise DumpError(f"{directory}: rank {r} stores '{name}' with shape {list(piece.shape)}, its header says "
                                f"{rec['local_shape']}")
            if str(piece.dtype).replace("torch.", "") != rec["dtype"] or rec["dtype"] != rec0["dtype"]:
                raise DumpError(f"{paths[r]}: '{name}' is stored as {piece.dtype}, its header says {rec['dtype']} "
                                f"(rank 0: {rec0['dtype']})")
            by_replica.setdefault(_replica_of(rec), []).append((rec["offsets"], piece))
        replicas = sorted(by_replica)
        where = str(directory)
        full = _place(name, by_replica[replicas[0]], rec0["global_shape"], by_replica[replicas[0]][0][1].dtype, where)
        if verify:
            for rep in replicas[1:]:
                other = _place(name, by_replica[rep], rec0["global_shape"], full.dtype, where)
                if not torch.equal(other, full):
                    diff = (other.double() - full.double()).abs().max().item()
                    raise DumpError(f"{directory}: replica {rep} of '{name}' differs from replica {replicas[0]} "
                                    f"(max abs difference {diff:.3g})")
        out[name] = full
        if progress:
            progress(i + 1, len(names))
    return out


def _load_sampled(directory: Path) -> dict[str, torch.Tensor]:
    path = directory / SAMPLED
    if not path.exists():
        raise DumpError(f"{directory}: {SAMPLED} is missing")
    h = _open_safetensors(path)
    _header(h, path)
    return {name: h.get_tensor(name) for name in h.keys()}


def _load_full(directory: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    index_path = directory / FULL_INDEX
    if not (directory / FULL_DIR).is_dir() or not index_path.exists():
        raise DumpError(f"{directory}: the distributed checkpoint ({FULL_DIR}/ and {FULL_INDEX}) is missing")
    index = json.loads(index_path.read_text())
    state = {name: torch.empty(info["shape"], dtype=getattr(torch, info["dtype"].replace("torch.", "")))
             for name, info in index.items()}
    try:
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(directory / FULL_DIR)), no_dist=True)
    except Exception as e:
        raise DumpError(f"{directory}/full cannot be loaded: {e}") from e
    return state


def reconstruct_gradients(grad_dir: str | Path, step: int, verify: bool = False,
                          progress: Callable[[int, int], None] | None = None) -> dict[str, torch.Tensor]:
    """The full gradients of `step` from a GradientDumper directory (any mode)."""
    grad_dir = Path(grad_dir)
    config = read_config(grad_dir)
    directory = step_dir(grad_dir, step)
    if not directory.is_dir():
        complete, _ = list_steps(grad_dir)
        raise DumpError(f"step {step} was not dumped under {grad_dir} (complete steps: {complete or 'none'})")
    if not (directory / COMPLETE).exists():
        present = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
        raise DumpError(f"step {step} is incomplete: {directory}/{COMPLETE} is missing (present: {present or 'nothing'})")
    complete = _read_json_object(directory / COMPLETE, "the step's completion record")
    check_version(complete, directory / COMPLETE)
    mode = config.get("mode", "shards")
    loaders = {"shards": lambda: _load_shards(directory, config, complete, step, verify, progress),
               "sampled": lambda: _load_sampled(directory), "full": lambda: _load_full(directory)}
    if mode not in loaders:
        raise DumpError(f"{grad_dir}/{CONFIG} names an unknown mode {mode!r}")
    grads = loaders[mode]()
    if not grads:
        raise DumpError(f"step {step} under {grad_dir} holds no gradients: the model had none when it was dumped "
                        "(was maybe_dump called after zero_grad, or before backward?)")
    return grads


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
    """Writes step{N}_{param}.safetensors, step{N}_all_gradients.safetensors (.pt with fmt="pt") and
    step{N}_metadata.json. Files are staged in a temporary directory and moved into output_dir only
    once all are written, so a failure leaves output_dir as it was."""
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
        params[name] = {"shape": list(grads[name].shape), "dtype": str(grads[name].dtype).replace("torch.", ""),
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
                written.append(f"step{step}_{_safe_filename(name)}.safetensors")
                save_file({name: t}, str(staging / written[-1]))
        written.append(f"step{step}_all_gradients.safetensors")
        save_file(contiguous, str(staging / written[-1]))
        if fmt == "pt":
            written.append(f"step{step}_all_gradients.pt")
            torch.save(contiguous, staging / written[-1])
        written.append(f"step{step}_metadata.json")
        write_json(staging / written[-1], metadata)
        final = []
        for name in written:
            (staging / name).replace(output_dir / name)
            final.append(output_dir / name)
        return final
    finally:
        shutil.rmtree(staging, ignore_errors=True)
