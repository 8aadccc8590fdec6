"""The refusals of the compiled ops, each called once: run by tests/stats/test_native_errors.py in a process of its
own (and by benchmarks/gpu_session.sh under cuda-gdb for a native backtrace). Argument: the device."""
import sys

import torch

import gapmon

assert gapmon.backend() != "torch", "needs the compiled extension"  # loads gapmon._C: registers torch.ops.gapmon
device = sys.argv[1]
x = torch.randn(6, 40, device=device)
g, ids = torch.ones(1, 3, 2, device=device), torch.zeros(1, 3, dtype=torch.long, device=device)
cases = [
    ("embedding_norm_sq tile", ValueError, "tile must be a positive number of positions (or None: automatic), got 0",
     lambda: torch.ops.gapmon.embedding_norm_sq(ids, g, -1, 0)),
    ("ghost_norm_sq tile", ValueError, "got -4", lambda: torch.ops.gapmon.ghost_norm_sq(g, g, -4)),
    ("embedding_norm_sq ids", ValueError, "ids must lie in [0, 2^32), got 0 .. 4294967296",
     lambda: torch.ops.gapmon.embedding_norm_sq(torch.tensor([[0, 1 << 32]]), torch.ones(1, 2, 3), -1)),
    ("states_numerics_blocks amax", ValueError, "amax: a contiguous float64 [1] tensor on",
     lambda: torch.ops.gapmon.states_numerics_blocks([x], True, [3], torch.zeros(0, dtype=torch.float64))),
    ("block_numerics format", ValueError, "unknown format code 9 (0..5)",
     lambda: torch.ops.gapmon.block_numerics([x], [9], torch.zeros(1, dtype=torch.float64, device=device))),
    ("update_sums dtype", ValueError, "Double",
     lambda: torch.ops.gapmon.update_sums([x], [x.double()], [x])),
    ("instance_stats 0-dim", ValueError, "batch dimension",
     lambda: torch.ops.gapmon.instance_stats(torch.tensor(1.0, device=device), 1)),
    ("tensor_stats int64", TypeError, "floating-point",
     lambda: torch.ops.gapmon.tensor_stats(torch.arange(3, device=device), 1)),
    ("merge_states float32", ValueError, "expected float64 [parts, tensors, 7] states (from multi_tensor_states), got Float [2, 3, 7]",
     lambda: torch.ops.gapmon.merge_states(torch.zeros(2, 3, 7, device=device))),
]
for name, kind, words, call in cases:
    print("case", name, flush=True)
    try:
        call()
    except kind as e:
        assert words in str(e), (name, str(e))
    else:
        raise AssertionError(f"{name}: no {kind.__name__}")
print("all raised", flush=True)
