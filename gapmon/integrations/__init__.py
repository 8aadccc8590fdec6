"""gapmon inside the trainers people already use, one module per framework:

- gapmon.integrations.huggingface: `attach(trainer, ...)` for `transformers.Trainer`
- gapmon.integrations.lightning: `GAPMonitorCallback` for `lightning.pytorch.Trainer`
- gapmon.integrations.olmo: `GAPMonitorCallback` for OLMo-core's `Trainer`

Each module imports its framework when it is imported (never `import gapmon` itself); a missing
framework raises ImportError naming the package to install.
"""
from __future__ import annotations

import importlib


def require(package: str, module: str, install: str) -> object:
    """Imports `package` for integration `module`, or raises ImportError that says what to install."""
    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise ImportError(f"gapmon.integrations.{module} needs the '{install}' package: pip install {install}") from e
