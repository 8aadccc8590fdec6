"""Cost of gradient dumps on a ~100M-parameter model (CPU): the time maybe_dump() blocks the
training step for each mode (sync and async), the total time until the step is on disk, and the
reconstruction throughput. Prints a table and writes JSON.

    python benchmarks/bench_dump.py [--dir /path/on/the/disk/to/test]
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
from common import machine

import gapmon


def model_100m() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(6)])  # 100.7M parameters
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="where to write the dumps (default: a temporary directory)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = model_100m()
    numel = sum(p.numel() for p in model.parameters())
    nbytes = numel * 4
    info = machine("cpu")
    print(f"# gradient dumps of {numel/1e6:.1f}M parameters ({nbytes/2**20:.0f} MiB) on {info['cpu']}")
    root = Path(args.dir or tempfile.mkdtemp(prefix="gapmon-bench-dump-"))
    rows = []
    cases = [("shards", True, {}), ("shards", False, {}), ("full", True, {}), ("full", False, {}),
             ("sampled", True, {"save_first_n": 64})]
    for mode, async_write, kwargs in cases:
        save = root / f"{mode}-{'async' if async_write else 'sync'}"
        shutil.rmtree(save, ignore_errors=True)
        calls = []
        with gapmon.GradientDumper(model, save, mode=mode, async_write=async_write, **kwargs) as dumper:
            for step in range(3):  # the first async dumps also allocate the two staging sets
                t0 = time.perf_counter()
                dumper.maybe_dump(step)
                calls.append(time.perf_counter() - t0)
                dumper._wait()
                if step == 0:
                    total = time.perf_counter() - t0
        blocking = calls[-1]
        rec = float("inf")
        for _ in range(2):  # the best of two: the first pays for faulting in fresh host memory
            t0 = time.perf_counter()
            grads = gapmon.reconstruct_gradients(save, 2)
            rec = min(rec, time.perf_counter() - t0)
        rec_bytes = sum(g.numel() * g.element_size() for g in grads.values())
        row = {"mode": mode, "async": async_write, "blocking_s": blocking, "blocking_first_s": calls[0],
               "until_on_disk_s": total,
               "write_GBps": nbytes / total / 1e9 if mode != "sampled" else None,
               "reconstruct_s": rec, "reconstruct_GBps": rec_bytes / rec / 1e9, "reconstructed_bytes": rec_bytes}
        rows.append(row)
        print(row, flush=True)
        shutil.rmtree(save, ignore_errors=True)
    lines = ["| mode | write | blocks the step (first dump) | blocks the step (later) | until on disk | reconstruction |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['mode']} | {'async' if r['async'] else 'sync'} | {r['blocking_first_s']*1e3:.0f} ms | "
                     f"{r['blocking_s']*1e3:.0f} ms | "
                     f"{r['until_on_disk_s']*1e3:.0f} ms | {r['reconstruct_GBps']:.2f} GB/s |")
    table = "\n".join(lines)
    print("\n" + table)
    out = Path(args.out or Path(__file__).parent / "results" / f"dump-cpu-{info['host']}.json")
    out.write_text(json.dumps({"machine": info, "parameters": numel, "bytes": nbytes, "results": rows,
                               "table": table}, indent=2))
    print(f"wrote {out}")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
