"""The `gapmon` command line (also `python -m gapmon`)."""
from __future__ import annotations

import argparse
import sys
import time

import torch

from . import ops, reference
from .stats import STAT_NAMES


def _info(args: argparse.Namespace) -> int:
    print(f"gapmon backend: {ops.backend()}  (CPU instruction set: {ops.cpu_isa()})")
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}, threads: {torch.get_num_threads()}")
    return 0


def _example(args: argparse.Namespace) -> int:
    """Statistics of a few typical training tensors, checked against the reference and timed."""
    device = args.device
    g = torch.Generator(device="cpu").manual_seed(0)
    tensors = {
        "weight (bf16, 4096x1024)": (torch.randn(4096, 1024, generator=g) * 0.02).bfloat16(),
        "grad with a NaN (fp32)": torch.randn(1 << 20, generator=g) * 1e-3,
        "activations (fp16, [8, 512, 768])": torch.randn(8, 512, 768, generator=g).half(),
        "offset data (mean 1000x std)": torch.randn(1 << 22, generator=g) + 1000,
    }
    tensors["grad with a NaN (fp32)"][12345] = float("nan")
    tensors = {k: v.to(device) for k, v in tensors.items()}
    print(f"gapmon backend: {ops.backend()}\n")
    header = f"{'tensor':<36}" + "".join(f"{n:>12}" for n in STAT_NAMES)
    print(header + "\n" + "-" * len(header))
    multi = ops.multi_tensor_stats(list(tensors.values()))  # all tensors, one launch
    for i, name in enumerate(tensors):
        print(f"{name:<36}" + "".join(f"{float(getattr(multi, f)[i]):>12.5g}" for f in STAT_NAMES))
    x = tensors["offset data (mean 1000x std)"]
    fused = _time(lambda: ops.tensor_stats(x), device)
    slow = _time(lambda: reference.tensor_stats(x), device)
    print(f"\n{x.numel():,} fp32 elements: gapmon {fused*1e3:.2f} ms, pure-PyTorch reference {slow*1e3:.2f} ms "
          f"({slow/fused:.0f}x)")
    return 0


def _time(fn, device: str, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gapmon", description="Gradient/activation/parameter monitoring for PyTorch.")
    parser.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="show the active backend and instruction set")
    p.set_defaults(func=_info)
    p = sub.add_parser("example", help="statistics of a few tensors, checked and timed")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.set_defaults(func=_example)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Exception as e:  # one clear line unless --verbose
        if args.verbose:
            raise
        print(f"gapmon {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
