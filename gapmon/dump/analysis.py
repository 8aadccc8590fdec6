"""Offline analysis of dumped gradients: anomalies, comparisons, and norm evolution over steps."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..stats.ops import multi_tensor_stats
from ..utils import check_real
from .export import ALL_GRADIENTS_GLOB
from .format import DumpCorruptError, DumpError, DumpMissingError
from .reconstruct import list_steps, reconstruct_gradients


@dataclass
class Anomaly:
    name: str
    kind: str  # "nonfinite", "large_norm" or "small_norm"
    value: float

    def __str__(self) -> str:
        return f"{self.name}: {self.kind} ({self.value:.4g})"


def anomaly_scan(grads: dict[str, torch.Tensor], max_norm: float = 1e3, min_norm: float = 1e-8) -> list[Anomaly]:
    """Gradients with NaN/Inf, or an L2 norm above max_norm or below min_norm (one fused pass)."""
    max_norm = check_real(max_norm, "gapmon.analysis.anomaly_scan", "max_norm", minimum=0.0)
    min_norm = check_real(min_norm, "gapmon.analysis.anomaly_scan", "min_norm", minimum=0.0, maximum=max_norm)
    names = list(grads)
    if not names:
        return []
    s = multi_tensor_stats([grads[n] for n in names])
    found = []
    for name, nonfinite, norm in zip(names, s.nonfinite.tolist(), s.norm.tolist()):
        if nonfinite > 0:
            found.append(Anomaly(name, "nonfinite", nonfinite))
        elif norm > max_norm:
            found.append(Anomaly(name, "large_norm", norm))
        elif norm < min_norm:
            found.append(Anomaly(name, "small_norm", norm))
    return found


@dataclass
class Comparison:
    name: str
    norm_a: float
    norm_b: float
    rel_diff: float  # ||a - b|| / ||b||
    cosine: float


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[Comparison]:
    """Per-parameter relative difference and cosine similarity of two gradient dicts (shared names)."""
    shared = [n for n in a if n in b]
    out = []
    for name in shared:
        x, y = a[name].double().reshape(-1), b[name].double().reshape(-1)
        if x.shape != y.shape:
            raise ValueError(f"compare: '{name}' has {x.numel()} elements in A and {y.numel()} in B")
        nx, ny = x.norm().item(), y.norm().item()
        diff = (x - y).norm().item()
        cosine = (x @ y).item() / (nx * ny) if nx > 0 and ny > 0 else float("nan")
        out.append(Comparison(name, nx, ny, diff / ny if ny > 0 else float("inf") if diff > 0 else 0.0, cosine))
    return out


def norm_evolution(grad_dir: str | Path, steps: list[int] | None = None) -> dict[str, list[tuple[int, float]]]:
    """{parameter: [(step, gradient norm), ...]} over the complete steps of a dump."""
    complete, _ = list_steps(grad_dir)
    out: dict[str, list[tuple[int, float]]] = {}
    for step in steps if steps is not None else complete:
        grads = reconstruct_gradients(grad_dir, step)
        names = list(grads)
        norms = multi_tensor_stats([grads[n] for n in names]).norm.tolist() if names else []
        for name, norm in zip(names, norms):
            out.setdefault(name, []).append((step, norm))
    return out


def load_gradients(path: str | Path) -> dict[str, torch.Tensor]:
    """Gradients from a reconstruction: a step*_all_gradients .safetensors or .pt file (as
    `gapmon reconstruct --format pt` writes it), or the directory holding one .safetensors file."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob(ALL_GRADIENTS_GLOB))
        if len(files) != 1:
            raise DumpError(f"{path} holds {len(files)} {ALL_GRADIENTS_GLOB} files; name one of them")
        path = files[0]
    if not path.exists():
        raise DumpMissingError(f"{path} does not exist")
    if path.suffix == ".pt":
        try:  # weights_only: tensors in a dict, never arbitrary pickled objects
            grads = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise DumpCorruptError(f"{path} is not a readable tensor file: {e}") from e
        if not isinstance(grads, dict) or not all(isinstance(v, torch.Tensor) for v in grads.values()):
            raise DumpCorruptError(f"{path} does not hold a dict of tensors")
        return grads
    try:
        return load_file(str(path))
    except Exception as e:
        raise DumpCorruptError(f"{path} is not a readable safetensors file: {e}") from e
