"""The cost of per-sample norms through a computation every sample shares (gapmon.per_sample.followed_through):
blocks of Swin V2's window attention (gapmon.apps.examples.WindowAttentionV2) whose continuous-position-bias MLP is
frozen (its path not taken) or trained (every parameter covered, each taken back through the MLP), timed against a
plain step side by side (alternating steps, medians).

    python benchmarks/bench_followed_through.py [--blocks 4] [--batch 8] [--out results/followed-<machine>.json]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
from common import machine, write_result

import gapmon
from gapmon.apps.examples import WindowAttentionV2


class Blocks(nn.Module):
    def __init__(self, n: int, trained: bool):
        super().__init__()
        self.blocks = nn.ModuleList([WindowAttentionV2(d=32, heads=4, window=4, hidden=64) for _ in range(n)])
        for block in self.blocks:
            block.cpb_mlp.requires_grad_(trained)

    def forward(self, x):
        return sum(block(x) for block in self.blocks)


def measure(blocks: int, batch: int, steps: int) -> dict:
    out = {}
    for trained in (False, True):
        torch.manual_seed(0)
        model = Blocks(blocks, trained)
        x, y = torch.randn(batch, 32, 32), torch.randn(batch, 32)
        psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True)
        times: dict[str, list[float]] = {"plain": [], "norms": []}
        for i in range(steps + 3):
            for kind in times:
                if kind == "plain":
                    psn.pause()
                else:
                    psn.start()
                t0 = time.perf_counter()
                ((model(x) - y) ** 2).sum().backward()
                if kind == "norms":
                    psn.local_norms()
                model.zero_grad(set_to_none=True)
                if i >= 3:
                    times[kind].append(time.perf_counter() - t0)
        psn.close()
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        out["trained" if trained else "frozen"] = {"plain_ms": med["plain"], "norms_ms": med["norms"],
                                                   "ratio": med["norms"] / med["plain"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=22)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = {"blocks": args.blocks, "batch": args.batch, **measure(args.blocks, args.batch, args.steps),
              **machine("cpu")}
    print(f"# {args.blocks} Swin V2 window-attention blocks, B={args.batch}, position-bias MLP frozen or trained")
    print("| position-bias MLP | plain step | with norms | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for kind in ("frozen", "trained"):
        r = result[kind]
        print(f"| {kind} | {r['plain_ms']:.2f} ms | {r['norms_ms']:.2f} ms | {r['ratio']:.2f}x |")
    write_result(args.out, result)


if __name__ == "__main__":
    main()
