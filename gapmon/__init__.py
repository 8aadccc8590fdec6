"""gapmon: fused one-pass statistics of gradients, activations and parameters for PyTorch training."""
from . import analysis, numerics, reference
from .config import DumpConfig, MonitorConfig, PerSampleConfig, Schedule
from .dump import GradientDumper
from .dump_format import DumpCorruptError, DumpError, DumpIncompleteError, DumpInconsistentError, DumpMissingError
from .monitor import GAPMonitor
from .numerics import FORMATS, Numerics, exponent_histogram, multi_tensor_numerics, numerics_states
from .ops import (
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
from .per_sample import PerSampleGradNorms
from .reconstruct import reconstruct_gradients
from .sinks import JSONLSink, Sink, TensorBoardSink, WandbSink
from .stats import STAT_NAMES, Stats

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
