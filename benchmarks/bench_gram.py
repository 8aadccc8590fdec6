"""The cost of per-sample gradient Gram matrices against the per-sample norms of the same Linear layer
(issue target: the Gram of a Linear layer at B samples costs no more than B x its norm computation), from
the positions a Linear layer's rule reads (input a [B, T, d], output gradient g [B, T, p], float32), in the
regimes where the norms take the direct form and where they take the ghost form. Prints a table; JSON to
benchmarks/results/gram-<device>.json.

    python benchmarks/bench_gram.py [--device cpu|cuda] [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402

from gapmon.per_sample.rules.linear import product_gram, product_norm_sq, use_ghost  # noqa: E402

CASES = [(8, 128, 128, 128), (32, 128, 128, 128), (8, 32, 1024, 1024), (32, 32, 1024, 1024), (8, 512, 256, 256)]


def timed(fn, device: str, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    info = machine(args.device)
    rows = []
    print(f"# Gram vs norms of one Linear layer on {info['device']}, torch {info['torch']}")
    print("| B | T | d | p | norms form | norms | Gram | Gram / norms | target: B |")
    print("| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for b, t, d, p in CASES:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(b, t, d, generator=g).to(args.device)
        grad = torch.randn(b, t, p, generator=g).to(args.device)
        norms_s = timed(lambda: product_norm_sq(a, grad), args.device)
        gram_s = timed(lambda: product_gram(a, grad, a, grad), args.device)
        r = {"B": b, "T": t, "d": d, "p": p, "norms_form": "ghost" if use_ghost(t, d, p) else "direct",
             "norms_s": norms_s, "gram_s": gram_s, "gram_over_norms": gram_s / norms_s, "target_B": b,
             "met": gram_s / norms_s <= b}
        rows.append(r)
        print(f"| {b} | {t} | {d} | {p} | {r['norms_form']} | {norms_s*1e3:.2f} ms | {gram_s*1e3:.2f} ms | "
              f"{r['gram_over_norms']:.1f}x | {b} |", flush=True)
    out = Path(args.out or Path(__file__).parent / "results" / f"gram-{args.device}-{info.get('host', 'host')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "results": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
