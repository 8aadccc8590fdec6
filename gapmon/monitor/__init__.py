"""The training monitor: GAPMonitor (the step lifecycle) and the pieces it orchestrates, the metric
names it reports, and the sinks that receive them."""
from .gap_monitor import GAPMonitor
from .sinks import JSONLSink, Sink, TensorBoardSink, WandbSink

__all__ = ["GAPMonitor", "JSONLSink", "Sink", "TensorBoardSink", "WandbSink"]
