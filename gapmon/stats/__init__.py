"""The op layer: one-pass statistics and numerics of tensors (ops, numerics), their exact merge over
DTensor shards (distributed), the pure-PyTorch reference, and the one door to torch.ops.gapmon
(_backend). The kernels' column layouts (layout) are re-exported here."""
from .layout import (
    ACC_NAMES,
    BIN,
    BIN_NAMES,
    EXP_MAX,
    EXP_MIN,
    MOMENT_NAMES,
    NUM_BINS,
    NUMERICS_COLUMNS,
    STAT_NAMES,
    STATE_NAMES,
    Stats,
)

__all__ = ["ACC_NAMES", "BIN", "BIN_NAMES", "EXP_MAX", "EXP_MIN", "MOMENT_NAMES", "NUM_BINS", "NUMERICS_COLUMNS",
           "STAT_NAMES", "STATE_NAMES", "Stats"]
