"""gapmon inside the trainers people already use, one module per framework:

- gapmon.integrations.huggingface: `attach(trainer, ...)` for `transformers.Trainer`
- gapmon.integrations.lightning: `GAPMonitorCallback` for `lightning.pytorch.Trainer`
- gapmon.integrations.olmo: `GAPMonitorCallback` for OLMo-core's `Trainer`

Each module imports its framework when it is imported (never `import gapmon` itself); a missing
framework raises ImportError naming the package to install.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from ..config import DumpConfig, MonitorConfig
from ..dump import GradientDumper
from ..monitor import GAPMonitor


def require(package: str, module: str, install: str) -> object:
    """Imports `package` for integration `module`, or raises ImportError that says what to install."""
    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise ImportError(f"gapmon.integrations.{module} needs the '{install}' package: pip install {install}") from e


def make_monitor(model: Any, config: MonitorConfig | None, options: dict[str, Any]) -> GAPMonitor:
    """A GAPMonitor from a MonitorConfig or from GAPMonitor's keyword arguments (not both)."""
    if config is None:
        return GAPMonitor(model, **options)
    if options:
        raise TypeError(f"gapmon: give the monitor's options either as monitor_config or as keyword arguments, "
                        f"not both (got monitor_config and {sorted(options)})")
    return GAPMonitor.from_config(model, config)


def make_dumper(model: Any, dump_dir: str | Path | None, config: DumpConfig | None,
                options: dict[str, Any]) -> GradientDumper | None:
    """A GradientDumper into `dump_dir` (None: no dumps) from a DumpConfig or from GradientDumper's
    keyword arguments (dump_kwargs; not both)."""
    if dump_dir is None:
        if config is not None or options:
            raise TypeError("gapmon: dump options were given without dump_dir; pass dump_dir to dump gradients")
        return None
    if config is None:
        return GradientDumper(model, dump_dir, **options)
    if options:
        raise TypeError(f"gapmon: give the dumper's options either as dump_config or as dump_kwargs, not both "
                        f"(got dump_config and {sorted(options)})")
    return GradientDumper.from_config(model, dump_dir, config)
