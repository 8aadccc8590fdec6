"""Cost of gradient dumps on a ~100M-parameter model (CPU): the time maybe_dump() blocks the
training step for each mode (sync and async), the total time until the step is on disk, and the
reconstruction throughput. Prints a table and writes JSON.

With --checksum-gb G: the cost of the dumps' checksums on a G GB dump (shards mode, sync), measured
side by side with the same dump and reconstruction with the checksum computations stubbed out, in
alternating rounds; and the raw CRC-32 throughput over the same bytes.

    python benchmarks/bench_dump.py [--dir /path/on/the/disk/to/test] [--checksum-gb 1]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager, nullcontext
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


@contextmanager
def checksums_stubbed():
    """The writer records 0 and the reader checks nothing: the same dump without checksum work."""
    import gapmon.dump.dumper as dump
    import gapmon.dump.reconstruct as reconstruct

    saved = dump.tensor_crc32, reconstruct._check_checksum
    dump.tensor_crc32, reconstruct._check_checksum = (lambda t: 0), (lambda t, *args: t)
    try:
        yield
    finally:
        dump.tensor_crc32, reconstruct._check_checksum = saved


def checksum_cost(root: Path, gigabytes: float, rounds: int = 3) -> dict:
    """Sync shards dump + reconstruction of `gigabytes` of float32 gradients, with and without
    checksums, alternating; medians of `rounds` rounds each."""
    from gapmon.dump.format import tensor_crc32

    n = int(gigabytes * 1e9 / 4 / 4096**2 + 0.5)
    model = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(n)])
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    t0 = time.perf_counter()
    for p in model.parameters():
        tensor_crc32(p.grad)
    crc_s = time.perf_counter() - t0
    times = {"checksums": {"dump": [], "reconstruct": []}, "stubbed": {"dump": [], "reconstruct": []}}
    for _ in range(rounds):
        for kind in ("stubbed", "checksums"):
            save = root / f"crc-{kind}"
            shutil.rmtree(save, ignore_errors=True)
            with checksums_stubbed() if kind == "stubbed" else nullcontext():
                t0 = time.perf_counter()
                with gapmon.GradientDumper(model, save, async_write=False) as dumper:
                    dumper.maybe_dump(0)
                times[kind]["dump"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                grads = gapmon.reconstruct_gradients(save, 0)
                times[kind]["reconstruct"].append(time.perf_counter() - t0)
            del grads
            shutil.rmtree(save, ignore_errors=True)
    med = {kind: {what: statistics.median(v) for what, v in d.items()} for kind, d in times.items()}
    return {"bytes": nbytes, "crc32_s": crc_s, "crc32_GBps": nbytes / crc_s / 1e9, "median_s": med, "rounds": times,
            "dump_added_s": med["checksums"]["dump"] - med["stubbed"]["dump"],
            "reconstruct_added_s": med["checksums"]["reconstruct"] - med["stubbed"]["reconstruct"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="where to write the dumps (default: a temporary directory)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--checksum-gb", type=float, default=None,
                        help="only measure the checksums' cost on a dump of this many GB")
    args = parser.parse_args()
    if args.checksum_gb:
        info = machine("cpu")
        root = Path(args.dir or tempfile.mkdtemp(prefix="gapmon-bench-crc-"))
        result = checksum_cost(root, args.checksum_gb)
        med = result["median_s"]
        gb = result["bytes"] / 1e9
        table = "\n".join([
            f"| {gb:.2f} GB shards dump (sync) | with checksums | checksums stubbed out | added |", "| --- | ---: | ---: | ---: |",
            *[f"| {what} | {med['checksums'][what]:.2f} s | {med['stubbed'][what]:.2f} s | "
              f"{med['checksums'][what] - med['stubbed'][what]:+.2f} s |" for what in ("dump", "reconstruct")],
            f"| CRC-32 of the same bytes (one thread) | {result['crc32_s']:.2f} s ({result['crc32_GBps']:.2f} GB/s) | | |"])
        print(table)
        out = Path(args.out or Path(__file__).parent / "results" / f"dump-checksum-cpu-{info['host']}.json")
        out.write_text(json.dumps({"machine": info, **result, "table": table}, indent=2))
        print(f"wrote {out}")
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
        return
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
