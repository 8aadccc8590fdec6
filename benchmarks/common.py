"""What the benchmark scripts share: the machine description written into every result file, and the
torch.func per-sample gradient baseline. Scripts run as `python benchmarks/<script>.py`, so this
directory is on sys.path and `from common import ...` needs no path set-up."""
from __future__ import annotations

import datetime
import json
import os
import platform

import torch

import gapmon
from gapmon.apps.examples import lm_loss


def machine(device: str) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "backend": gapmon.backend(),
            "date": datetime.date.today().isoformat(), "host": platform.node(), "threads": torch.get_num_threads(),
            "cpu_isa": gapmon.cpu_isa()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        info["cpu"] = platform.processor()
    info["cores"] = os.cpu_count()
    if device == "cuda":
        info["device"] = torch.cuda.get_device_name()
    else:
        info["device"] = f"cpu ({info['cores']} cores)"
    return info


def vmap_norms(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Norms of per-sample gradients materialised with torch.func.vmap(grad(...)) (gapmon.reference)."""
    return gapmon.reference.per_sample_grad_norms(model, lm_loss, x, y)


def write_result(path: str | None, result: dict) -> None:
    """Writes a benchmark's result as JSON to `path` (nothing when None) and says so."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}")
