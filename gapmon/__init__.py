"""gapmon: fused one-pass statistics of gradients, activations and parameters for PyTorch training.

Subsystems, one folder each: stats/ (the ops), monitor/ (GAPMonitor), per_sample/ (per-sample
gradient norms), dump/ (gradient dumps), integrations/ (trainers) and apps/ (CLI, demo, report).
"""
import importlib as _importlib
import sys as _sys

from .config import DumpConfig, MonitorConfig, PerSampleConfig, Schedule
from .dump.dumper import GradientDumper
from .dump.format import DumpCorruptError, DumpError, DumpIncompleteError, DumpInconsistentError, DumpMissingError
from .dump.reconstruct import reconstruct_gradients
from .monitor.gap_monitor import GAPMonitor
from .monitor.sinks import JSONLSink, Sink, TensorBoardSink, WandbSink
from .per_sample import PerSampleGradNorms
from .stats.block_formats import BLOCK_FORMATS, block_format_metrics, block_numerics, states_numerics_blocks
from .stats.layout import STAT_NAMES, Stats
from .stats.numerics import FORMATS, Numerics, exponent_histogram, multi_tensor_numerics, numerics_states
from .stats.ops import (
    accumulate_instance_stats,
    backend,
    cpu_isa,
    finalize_states,
    instance_stats,
    merge_states,
    multi_tensor_states,
    multi_tensor_stats,
    tensor_stats,
)

__all__ = [
    "Stats",
    "STAT_NAMES",
    "backend",
    "cpu_isa",
    "tensor_stats",
    "instance_stats",
    "multi_tensor_stats",
    "multi_tensor_states",
    "merge_states",
    "finalize_states",
    "accumulate_instance_stats",
    "reference",
    "numerics",
    "Numerics",
    "FORMATS",
    "exponent_histogram",
    "multi_tensor_numerics",
    "numerics_states",
    "BLOCK_FORMATS",
    "block_numerics",
    "block_format_metrics",
    "states_numerics_blocks",
    "GAPMonitor",
    "PerSampleGradNorms",
    "GradientDumper",
    "MonitorConfig",
    "PerSampleConfig",
    "DumpConfig",
    "Schedule",
    "reconstruct_gradients",
    "DumpError",
    "DumpMissingError",
    "DumpIncompleteError",
    "DumpCorruptError",
    "DumpInconsistentError",
    "analysis",
    "Sink",
    "JSONLSink",
    "TensorBoardSink",
    "WandbSink",
]
__version__ = "0.1.0"

# Module paths of earlier releases (and of the docs), each the module that now holds it: `import
# gapmon.ops` and `from gapmon.reconstruct import ...` keep working, as the same module objects.
MOVED_MODULES = {
    "ops": "stats.ops",
    "numerics": "stats.numerics",
    "reference": "stats.reference",
    "sinks": "monitor.sinks",
    "metric_names": "monitor.metric_names",
    "dump_format": "dump.format",
    "reconstruct": "dump.reconstruct",
    "export": "dump.export",
    "analysis": "dump.analysis",
}
for _old, _new in MOVED_MODULES.items():
    _sys.modules[f"{__name__}.{_old}"] = globals()[_old] = _importlib.import_module(f".{_new}", __name__)

