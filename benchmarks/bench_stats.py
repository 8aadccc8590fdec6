"""Measures the fused statistics ops side by side with their baselines, in one run.

For each case it times gapmon, the seed monitor's per-tensor approach (`x.abs().max()` plus
`torch.var_mean(x)`), the full pure-PyTorch reference (`gapmon.reference`, all 7 statistics)
and the memory-bandwidth bounds (`x.sum()`, and a device copy on CUDA). Prints a markdown table
and writes JSON to benchmarks/results/<device>.json.

    python benchmarks/bench_stats.py                 # CPU, sizes 2^10..2^26
    python benchmarks/bench_stats.py --device cuda   # GPU, sizes 2^10..2^28
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import machine

import gapmon


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timeit(fn, device: str, min_time: float = 0.5, max_reps: int = 200) -> float:
    """Seconds per call of `fn(i)` (i counts calls, for rotating inputs), after warm-up.

    CPU: the fastest repetition, timed by the host clock; it is the least disturbed by other tenants
    of a shared machine, whose memory bandwidth varies by tens of percent between runs.
    CUDA: the median over repetitions of a run of back-to-back calls timed with CUDA events, so
    that launches overlap as in a training loop. Every method of a case is timed the same way."""
    if device == "cuda":
        return _cuda_time(fn, min_time)
    fn(0)
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < max_reps):
        t0 = time.perf_counter()
        fn(len(times))
        times.append(time.perf_counter() - t0)
    return min(times)


def _cuda_time(fn, min_time: float, calls_per_rep: int = 20) -> float:
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    times: list[float] = []
    spent, i = 0.0, 0
    while len(times) < 5 or (spent < min_time and len(times) < 100):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls_per_rep):
            fn(i)
            i += 1
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        spent += seconds
        times.append(seconds / calls_per_rep)
    return statistics.median(times)


def rotation(x: torch.Tensor, device: str) -> list[torch.Tensor]:
    """Copies of `x` to cycle through, so that GPU timings read device memory rather than L2:
    together at least three times the L2 size (CPU: just `x`)."""
    if device != "cuda":
        return [x]
    l2 = getattr(torch.cuda.get_device_properties(x.device), "L2_cache_size", 64 << 20)
    bytes_ = x.numel() * x.element_size()
    copies = min(max(1, -(-3 * l2 // max(bytes_, 1))), 4096)
    return [x] + [x.clone() for _ in range(copies - 1)]


def seed_baseline(x: torch.Tensor):
    """The seed GAP monitor's per-tensor statistics: two torch ops, three passes over memory."""
    return x.abs().max(), torch.var_mean(x)


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of GPT-2 small (124M parameters, 148 tensors)."""
    d, v, ctx, layers = 768, 50257, 1024, 12
    shapes: list[tuple[int, ...]] = [(v, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def llama_1b_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of a 1.2B LLaMA-style model (16 layers, d=2048, GQA 32/8 heads, SwiGLU 8192)."""
    d, v, layers, kv, ffn = 2048, 128256, 16, 512, 8192
    shapes: list[tuple[int, ...]] = [(v, d)]
    for _ in range(layers):
        shapes += [(d,), (d, d), (kv, d), (kv, d), (d, d), (d,), (ffn, d), (ffn, d), (d, ffn)]
    return shapes + [(d,), (v, d)]


def bench_tensor_stats(device: str, sizes: list[int], rows: list[dict]) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for exp in sizes:
            xs = rotation(torch.randn(2**exp, device=device).to(dtype), device)
            n = len(xs)
            x = xs[0]
            r = {"case": "tensor_stats", "dtype": str(dtype).replace("torch.", ""), "numel": x.numel(),
                 "bytes": x.numel() * x.element_size(), "rotated_inputs": n}
            r["gapmon_s"] = timeit(lambda i: gapmon.tensor_stats(xs[i % n]), device)
            r["seed_baseline_s"] = timeit(lambda i: seed_baseline(xs[i % n]), device)
            r["reference_s"] = timeit(lambda i: gapmon.reference.tensor_stats(xs[i % n]), device)
            r["sum_s"] = timeit(lambda i: xs[i % n].sum(), device)
            if device == "cuda":
                ys = [torch.empty_like(x) for _ in range(min(n, 2))]
                r["copy_s"] = timeit(lambda i: ys[i % len(ys)].copy_(xs[i % n]), device)
                r["read_GBps_copy"] = 2 * r["bytes"] / r["copy_s"] / 1e9  # a copy reads and writes
                del ys
            r["gapmon_GBps"] = r["bytes"] / r["gapmon_s"] / 1e9
            r["sum_GBps"] = r["bytes"] / r["sum_s"] / 1e9
            r["x_seed_baseline"] = r["seed_baseline_s"] / r["gapmon_s"]
            r["x_reference"] = r["reference_s"] / r["gapmon_s"]
            r["vs_sum_throughput"] = r["sum_s"] / r["gapmon_s"]
            if "read_GBps_copy" in r:
                r["of_copy_bandwidth"] = r["gapmon_GBps"] / r["read_GBps_copy"]
            rows.append(r)
            bw = f"  {r['of_copy_bandwidth']:.0%} of copy bandwidth" if "of_copy_bandwidth" in r else ""
            print(f"tensor_stats {r['dtype']:>8} 2^{exp:<2}: {r['gapmon_s']*1e3:8.3f} ms  "
                  f"{r['x_seed_baseline']:6.1f}x seed  {r['x_reference']:6.1f}x ref  "
                  f"{r['vs_sum_throughput']:.2f}x sum throughput  {r['gapmon_GBps']:.1f} GB/s{bw}", flush=True)


def bench_multi(device: str, name: str, shapes, rows: list[dict]) -> None:
    params = [torch.randn(s, device=device) for s in shapes]
    total = sum(p.numel() for p in params)
    r = {"case": f"multi_tensor_stats {name}", "dtype": "float32", "tensors": len(params), "numel": total,
         "bytes": total * 4}
    r["gapmon_s"] = timeit(lambda i: gapmon.multi_tensor_stats(params), device)
    r["seed_loop_s"] = timeit(lambda i: [seed_baseline(p) for p in params], device, min_time=0.1, max_reps=5)
    r["gapmon_per_tensor_loop_s"] = timeit(lambda i: [gapmon.tensor_stats(p) for p in params], device)
    r["foreach_norm_s"] = timeit(lambda i: torch._foreach_norm(params), device)
    r["sum_s"] = timeit(lambda i: [p.sum() for p in params], device)
    r["x_seed_loop"] = r["seed_loop_s"] / r["gapmon_s"]
    r["vs_sum_throughput"] = r["sum_s"] / r["gapmon_s"]  # a per-tensor x.sum() loop: one read of the data
    r["seed_loop_vs_sum_loop"] = r["seed_loop_s"] / r["sum_s"]  # the most any one-read kernel could gain
    r["x_foreach_norm"] = r["foreach_norm_s"] / r["gapmon_s"]
    r["gapmon_GBps"] = r["bytes"] / r["gapmon_s"] / 1e9
    rows.append(r)
    print(f"multi_tensor_stats {name} ({len(params)} tensors, {total/1e6:.0f}M): {r['gapmon_s']*1e3:.2f} ms  "
          f"{r['x_seed_loop']:.1f}x seed loop (a sum loop: {r['seed_loop_vs_sum_loop']:.1f}x)  "
          f"{r['x_foreach_norm']:.2f}x _foreach_norm  {r['gapmon_GBps']:.1f} GB/s",
          flush=True)


def bench_instance(device: str, shape, rows: list[dict]) -> None:
    xs = rotation(torch.randn(*shape, device=device), device)
    n, x = len(xs), xs[0]
    r = {"case": f"instance_stats {list(shape)}", "dtype": "float32", "numel": x.numel(), "bytes": x.numel() * 4,
         "rotated_inputs": n}
    r["gapmon_s"] = timeit(lambda i: gapmon.instance_stats(xs[i % n]), device)
    r["seed_baseline_s"] = timeit(lambda i: (torch.var_mean(xs[i % n], dim=-1), xs[i % n].abs().amax(dim=-1)), device)
    r["reference_s"] = timeit(lambda i: gapmon.reference.instance_stats(xs[i % n]), device)
    r["sum_s"] = timeit(lambda i: xs[i % n].sum(dim=-1), device)
    r["x_seed_baseline"] = r["seed_baseline_s"] / r["gapmon_s"]
    r["x_reference"] = r["reference_s"] / r["gapmon_s"]
    r["vs_sum_throughput"] = r["sum_s"] / r["gapmon_s"]
    r["gapmon_GBps"] = r["bytes"] / r["gapmon_s"] / 1e9
    rows.append(r)
    print(f"instance_stats {list(shape)}: {r['gapmon_s']*1e3:.2f} ms  {r['x_seed_baseline']:.1f}x var_mean+amax  "
          f"{r['x_reference']:.1f}x ref  {r['vs_sum_throughput']:.2f}x sum throughput", flush=True)


def markdown(rows: list[dict]) -> str:
    """The results as a markdown table; the copy-bandwidth column appears for GPU runs."""
    gpu = any("of_copy_bandwidth" in r for r in rows)

    def ratio(value, fmt="{:.1f}x"):
        return "" if value is None else fmt.format(value)

    head = ["case", "dtype", "elements", "gapmon", "vs seed baseline", "vs full reference", "vs `x.sum()` throughput"]
    head += ["of copy bandwidth"] if gpu else []
    head += ["vs `_foreach_norm`", "GB/s"]
    out = ["| " + " | ".join(head) + " |", "| --- | --- |" + " ---: |" * (len(head) - 2)]
    for r in rows:
        cells = [r["case"], r["dtype"], f"{r['numel']:,}", f"{r['gapmon_s']*1e3:.3f} ms",
                 ratio(r.get("x_seed_baseline", r.get("x_seed_loop"))), ratio(r.get("x_reference")),
                 ratio(r.get("vs_sum_throughput"), "{:.2f}x")]
        cells += [ratio(r.get("of_copy_bandwidth"), "{:.0%}")] if gpu else []
        cells += [ratio(r.get("x_foreach_norm"), "{:.2f}x"), f"{r['gapmon_GBps']:.1f}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--sizes", default=None, help="comma-separated powers of two (default 10,14,18,22,26[,28])")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<device>.json)")
    parser.add_argument("--skip-llama", action="store_true", help="skip the 1B-parameter list")
    args = parser.parse_args()
    if gapmon.backend() == "torch":
        raise SystemExit("gapmon._C is not built: nothing to benchmark (pip install --no-build-isolation -e .)")
    device = args.device
    default_sizes = "10,14,18,22,26" + (",28" if device == "cuda" else "")
    sizes = [int(s) for s in (args.sizes or default_sizes).split(",")]
    info = machine(device)
    print(f"# gapmon benchmark on {info['device']} / {info['cpu']}, torch {info['torch']}, ISA {info['cpu_isa']}")
    rows: list[dict] = []
    bench_tensor_stats(device, sizes, rows)
    bench_multi(device, "GPT-2 small", gpt2_small_shapes(), rows)
    if device == "cuda" and not args.skip_llama:
        bench_multi(device, "LLaMA 1B", llama_1b_shapes(), rows)
    bench_instance(device, (64, 2**20), rows)
    if device == "cuda":
        bench_instance(device, (8192, 4096), rows)
    table = markdown(rows)
    print("\n" + table)
    name = info["device"].replace(" ", "-").replace("(", "").replace(")", "").lower()
    out = Path(args.out or Path(__file__).parent / "results" / f"{'cpu-' + info['host'] if device == 'cpu' else name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "results": rows, "table": table}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
