"""The files of collected per-sample gradients (gapmon.per_sample.PerSampleGradients), and their reader.

Layout, one generation per step and rank:

    DIR/step{S:08d}/rank{R}/{L:04d}.{chunk:06d}.safetensors  per-sample gradients of the L-th layer written
                                                          (its module name, any string, in the header and the
                                                          manifest), for a chunk of samples: "{param}"
                                                          [c, *shape], the chunk's sample ids "__ids__" [c]
                                                          (int64); header: step, rank, layer, dtype (JSON
                                                          under "gapmon")
    DIR/step{S:08d}/rank{R}/MANIFEST.json                 written last: every file with its size and the
                                                          CRC-32 of its bytes, the layers and parameters

A rank writes into ``rank{R}.tmp-*`` and renames it to ``rank{R}`` once its manifest is written, so a reader
sees a rank's step whole or not at all; a rewrite moves the old generation aside (``rank{R}.old-{pid}``) just
before, and the reader takes that one while ``rank{R}`` is missing: at any instant, the old or the new one.
Nothing is written through a link or outside DIR. The reader checks every size and checksum, and that the
files are the ones the manifest names.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..utils import cosine_from_gram, first_of_each_id
from .format import CHECKSUM, DumpCorruptError, DumpIncompleteError, DumpInconsistentError, DumpMissingError, dtype_name, file_crc32
from .safe_io import ensure_real_dir, fsync_path, write_json, write_safetensors

HEADER_KEY = "gapmon"
MANIFEST = "MANIFEST.json"
FORMAT = "gapmon-per-sample-gradients/1"
IDS_KEY = "__ids__"  # beside the parameters' names (a parameter of that name is refused)


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step{step:08d}"


def _file_name(layer_index: int, chunk: int) -> str:
    """A file's name from the layer's place among those written (not its module name, which may be "" for a
    root module, or hold characters a file name cannot)."""
    return f"{layer_index:04d}.{chunk:06d}.safetensors"


class RankWriter:
    """Writes one rank's generation of one step: chunks, then the manifest and the rename (`seal`)."""

    def __init__(self, root: str | Path, step: int, rank: int):
        self.root, self.step, self.rank = Path(root), step, rank
        parent = ensure_real_dir(self.root, step_dir(self.root, step))
        self.tmp = Path(tempfile.mkdtemp(prefix=f"rank{rank}.tmp-", dir=parent))
        self.files: list[dict[str, Any]] = []
        self.layers: dict[str, dict[str, Any]] = {}

    def write_chunk(self, layer: str, chunk: int, ids: torch.Tensor, grads: dict[str, torch.Tensor]) -> None:
        """Per-sample gradients of `layer`'s parameters (name -> [c, *shape]) for the samples `ids` [c]."""
        name = _file_name(list(self.layers).index(layer) if layer in self.layers else len(self.layers), chunk)
        tensors = {IDS_KEY: ids.to(torch.int64).cpu().contiguous()}
        dtypes = set()
        for param, g in grads.items():
            if param == IDS_KEY:
                raise ValueError(f"gapmon per-sample gradients: a parameter named {IDS_KEY!r} would hide the sample ids")
            if g.shape[0] != ids.numel():
                raise ValueError(f"gapmon per-sample gradients: {param!r}: {g.shape[0]} rows for {ids.numel()} ids")
            tensors[param] = g.detach().cpu().contiguous()
            dtypes.add(dtype_name(g.dtype))
        header = {"format": FORMAT, "step": self.step, "rank": self.rank, "layer": layer, "chunk": chunk,
                  "dtype": sorted(dtypes)}
        path = self.tmp / name
        write_safetensors(path, tensors, {HEADER_KEY: json.dumps(header, sort_keys=True)})
        self.files.append({"file": name, "layer": layer, "chunk": chunk, "samples": ids.numel(),
                           "bytes": path.stat().st_size, CHECKSUM: file_crc32(path)})
        entry = self.layers.setdefault(layer, {"params": {}, "chunks": 0, "samples": 0})
        entry["params"].update({p: list(g.shape[1:]) for p, g in grads.items()})
        entry["chunks"] += 1
        entry["samples"] += ids.numel()

    def seal(self) -> Path:
        """Writes the manifest and makes this generation the rank's step (replacing an older one)."""
        write_json(self.tmp / MANIFEST, {"format": FORMAT, "step": self.step, "rank": self.rank,
                                         "files": self.files, "layers": self.layers})
        final = step_dir(self.root, self.step) / f"rank{self.rank}"
        old = None
        if final.exists():
            if final.is_symlink() or not final.is_dir():
                raise DumpInconsistentError(f"{final} is not a directory gapmon wrote; refusing to replace it")
            old = final.with_name(f"{final.name}.old-{os.getpid()}")
            os.replace(final, old)
        os.replace(self.tmp, final)
        fsync_path(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def _manifest(rank_dir: Path) -> dict[str, Any]:
    path = rank_dir / MANIFEST
    if not path.is_file():
        raise DumpIncompleteError(f"{rank_dir} has no {MANIFEST}: not a complete generation")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DumpCorruptError(f"{path} cannot be read: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), list):
        raise DumpCorruptError(f"{path} is not a {FORMAT} manifest")
    return manifest


def collected_steps(root: str | Path) -> list[int]:
    """The steps under `root` with at least one sealed rank generation."""
    out = []
    for d in sorted(Path(root).glob("step*")):
        if d.is_dir() and not d.is_symlink() and d.name[4:].isdigit() and any(
                (r / MANIFEST).is_file() for r in d.glob("rank*") if r.is_dir() and r.name[4:].isdigit()):
            out.append(int(d.name[4:]))
    return out


def collected_layers(root: str | Path, step: int) -> list[str]:
    """The layers collected at `step` (any rank)."""
    layers = set()
    for rank_dir in _rank_dirs(root, step):
        layers.update(_manifest(rank_dir).get("layers", {}))
    return sorted(layers)


def _rank_dirs(root: str | Path, step: int) -> list[Path]:
    """Each rank's sealed generation of `step`: rank{R}, or, while a rewrite is between its two renames (or
    was cut there by a crash), the old generation it moved aside, rank{R}.old-{pid}."""
    d = step_dir(root, step)
    if not d.is_dir() or d.is_symlink():
        raise DumpMissingError(f"no collected per-sample gradients for step {step} under {root}")
    found: dict[int, Path] = {}
    for r in sorted(d.glob("rank*")):
        if not r.is_dir() or r.is_symlink():
            continue
        name, _, old = r.name.partition(".old-")
        if not name[4:].isdigit() or (old and (not old.isdigit() or not (r / MANIFEST).is_file())):
            continue
        rank = int(name[4:])
        if not old or rank not in found:  # the current generation wins over a moved-aside one
            found[rank] = r
    if not found:
        raise DumpIncompleteError(f"{d} holds no sealed rank generation")
    return [found[rank] for rank in sorted(found)]


def load_gradients(root: str | Path, step: int, layer: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(ids [N], {param: [N, *shape]}) of `layer`'s per-sample gradients collected at `step`, every rank's
    samples ordered by id (a sample several ranks hold appears once). Every file's size and CRC-32 are checked
    against its rank's manifest; typed errors (gapmon.DumpError) say what is wrong."""
    from safetensors.torch import load_file

    ids_parts: list[torch.Tensor] = []
    parts: dict[str, list[torch.Tensor]] = {}
    found = False
    for rank_dir in _rank_dirs(root, step):
        manifest = _manifest(rank_dir)
        if manifest.get("step") != step:
            raise DumpInconsistentError(f"{rank_dir} holds step {manifest.get('step')}, not {step}")
        for entry in sorted((f for f in manifest["files"] if f.get("layer") == layer), key=lambda f: f["chunk"]):
            path = rank_dir / entry["file"]
            if path.is_symlink() or not path.is_file():
                raise DumpMissingError(f"{path} is missing")
            if path.stat().st_size != entry["bytes"] or file_crc32(path) != entry[CHECKSUM]:
                raise DumpCorruptError(f"{path}: size or checksum does not match its manifest")
            tensors = load_file(str(path))
            ids = tensors.pop(IDS_KEY)
            ids_parts.append(ids)
            for name, t in tensors.items():
                parts.setdefault(name, []).append(t)
            found = True
    if not found:
        raise DumpMissingError(f"no per-sample gradients of layer {layer!r} at step {step} under {root}")
    ids, rows = first_of_each_id(torch.cat(ids_parts))
    return ids, {name: torch.cat(ts)[rows] for name, ts in parts.items()}


def similarity_from_files(root: str | Path, step: int, layer: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, [N, N] cosine similarity) of `layer`'s collected per-sample gradients at `step` (float64)."""
    ids, grads = load_gradients(root, step, layer)
    flat = torch.cat([g.reshape(g.shape[0], -1).double() for g in grads.values()], dim=1)
    return ids, cosine_from_gram(flat @ flat.T)
