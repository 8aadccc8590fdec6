"""Measures the fused statistics ops side by side with their baselines, in one run.

For each case it times gapmon, the seed monitor's per-tensor approach (`x.abs().max()` plus
`torch.var_mean(x)`), the full pure-PyTorch reference (`gapmon.reference`, all 7 statistics)
and the memory-bandwidth bounds (`x.sum()`; on CUDA `x.sum(dtype=float32)` and a device copy), each with the
SPEC target it answers to beside it. On CUDA it also times single calls (events around one call
after a synchronisation: the host cost counts) besides back-to-back calls, and the host cost of a
small call. Prints a markdown table and writes JSON to benchmarks/results/stats-<device>.json.

    python benchmarks/bench_stats.py                 # CPU, sizes 2^10..2^26
    python benchmarks/bench_stats.py --device cuda   # GPU, sizes 2^10..2^28
    python benchmarks/bench_stats.py --cases numerics --out benchmarks/results/numerics-cpu-vm.json
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from common import machine

import gapmon


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# --quick scales every timing's minimum duration by this (a check that the script runs, as the tests do).
TIME_SCALE = 1.0


def timeit(fn, device: str, min_time: float = 0.5, max_reps: int = 200) -> float:
    """Seconds per call of `fn(i)` (i counts calls, for rotating inputs), after warm-up.

    CPU: the fastest repetition, timed by the host clock; it is the least disturbed by other tenants
    of a shared machine, whose memory bandwidth varies by tens of percent between runs.
    CUDA: the median over repetitions of a run of back-to-back calls timed with CUDA events, so
    that launches overlap as in a training loop. Every method of a case is timed the same way."""
    min_time *= TIME_SCALE
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


def timeit_side_by_side(fns: dict, device: str, rounds: int = 4, min_time: float = 0.15) -> dict:
    """Seconds per call of each of `fns` (name -> fn(i)), timed in turn over `rounds` rounds, each round by
    `timeit`: the best of each over all rounds. A ratio of two of them is then measured side by side, through
    the same spells of a shared machine's memory bandwidth, not minutes apart."""
    best = {name: math.inf for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], timeit(fn, device, min_time=min_time))
    return best


def single_call_time(fn, device: str, reps: int = 50) -> float:
    """Seconds of one call on an idle device, host cost included: CUDA events around a single call
    after a synchronisation, median over `reps` (CPU: the fastest call, as `timeit`)."""
    if device != "cuda":
        return timeit(fn, device)
    for i in range(3):
        fn(i)
    times = []
    for i in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def host_time(fn, device: str, calls: int = 2000) -> float:
    """Host seconds to issue one call (back to back, no synchronisation inside the timed loop): the
    CPU cost of a small call, which bounds small GPU calls more than the kernel does."""
    for i in range(20):
        fn(i)
    _sync(device)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        best = min(best, (time.perf_counter() - t0) / calls)
        _sync(device)
    return best


# What SPEC.md section 8 asks of each ratio, per device: (ratio key, bound, label).
TARGETS = {
    ("tensor_stats", "cpu", "large"): [("x_seed_baseline", 20.0, ">= 20x seed"), ("vs_sum_throughput", 0.8, ">= 0.80x x.sum")],
    ("tensor_stats", "cuda", "large"): [("x_seed_baseline", 4.0, ">= 4x seed"), ("vs_sum_throughput", 0.9, ">= 0.90x x.sum")],
    ("tensor_stats", "cuda", "2^20"): [("vs_sum_single", 0.8, ">= 0.80x x.sum, single call")],
    ("host cost", "cuda", ""): [("host_vs_sum", 1 / 1.5, "<= 1.5x x.sum host cost")],
    ("multi_tensor_stats", "cpu", ""): [("x_seed_loop", 20.0, ">= 20x seed loop")],
    ("multi_tensor_stats", "cuda", ""): [("x_seed_loop", 20.0, ">= 20x seed loop"),
                                         ("x_foreach_norm", 1.0, "> 1x _foreach_norm, back to back"),
                                         ("x_foreach_norm_single", 1.0, "> 1x _foreach_norm, single call")],
    ("instance_stats", "cpu", ""): [("x_seed_baseline", 10.0, ">= 10x var_mean+amax")],
    ("instance_stats", "cuda", ""): [("vs_sum_throughput", 0.9, ">= 0.90x row sum")],
}


def judge(r: dict, device: str, size: str = "") -> None:
    """Adds the targets that apply to row `r` and whether each is met (printed beside the ratios)."""
    kind = r["case"].split(" ")[0] if not r["case"].startswith("host cost") else "host cost"
    targets = TARGETS.get((kind, device, size), [])
    r["targets"] = [{"metric": key, "target": label, "value": r.get(key), "met": r.get(key) is not None and r[key] >= bound}
                    for key, bound, label in targets]


def targets_text(r: dict) -> str:
    return "; ".join(f"{t['target']}: {'met' if t['met'] else 'NOT met'}" for t in r.get("targets", []))


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


def sum_kwargs(device: str) -> dict:
    """The bandwidth reference of each device as SPEC.md section 8 names it: `x.sum(dtype=float32)` on
    GPUs (a float32 accumulation, as the kernels do), plain `x.sum()` on the CPU."""
    return {"dtype": torch.float32} if device == "cuda" else {}


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


def gpt2_small_shapes(divisor: int = 1) -> list[tuple[int, ...]]:
    """Parameter shapes of GPT-2 small (124M parameters, 148 tensors); each size divided by `divisor` (--quick)."""
    d, v, ctx, layers = 768 // divisor, 50257 // divisor, 1024 // divisor, 12
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
            r["sum_s"] = timeit(lambda i: xs[i % n].sum(**sum_kwargs(device)), device)
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
            single = ""
            if device == "cuda":  # back-to-back calls hide the host cost of one call: time single calls too
                r["gapmon_single_s"] = single_call_time(lambda i: gapmon.tensor_stats(xs[i % n]), device)
                r["sum_single_s"] = single_call_time(lambda i: xs[i % n].sum(**sum_kwargs(device)), device)
                r["vs_sum_single"] = r["sum_single_s"] / r["gapmon_single_s"]
                single = f"  single call {r['gapmon_single_s']*1e3:.3f} ms ({r['vs_sum_single']:.2f}x sum)"
            judge(r, device, "large" if exp >= 26 else "2^20" if exp == 20 else "")
            rows.append(r)
            bw = f"  {r['of_copy_bandwidth']:.0%} of copy bandwidth" if "of_copy_bandwidth" in r else ""
            print(f"tensor_stats {r['dtype']:>8} 2^{exp:<2}: {r['gapmon_s']*1e3:8.3f} ms  "
                  f"{r['x_seed_baseline']:6.1f}x seed  {r['x_reference']:6.1f}x ref  "
                  f"{r['vs_sum_throughput']:.2f}x sum throughput  {r['gapmon_GBps']:.1f} GB/s{bw}{single}"
                  f"  {targets_text(r)}", flush=True)


def bench_numerics(device: str, sizes: list[int], rows: list[dict]) -> None:
    """The numerics pass (exponent histogram + moments to the 4th) against the plain statistics pass
    (numerics off), both together (numerics on: what the monitor pays), x.sum(), the pure-PyTorch
    reference (frexp + bincount + float64 moments) and the usual ad-hoc script (torch.histc of
    log2|x|, which gives no exact bins, no zeros/subnormals/non-finite bins and no moments)."""
    for dtype in (torch.float32, torch.bfloat16):
        for exp in sizes:
            xs = rotation(torch.randn(2**exp, device=device).to(dtype), device)
            n, x = len(xs), xs[0]
            r = {"case": "numerics_states", "dtype": str(dtype).replace("torch.", ""), "numel": x.numel(),
                 "bytes": x.numel() * x.element_size(), "rotated_inputs": n}
            r["gapmon_s"] = timeit(lambda i: gapmon.numerics_states([xs[i % n]]), device)
            r["stats_s"] = timeit(lambda i: gapmon.tensor_stats(xs[i % n]), device)
            r["stats_and_numerics_s"] = timeit(
                lambda i: (gapmon.tensor_stats(xs[i % n]), gapmon.numerics_states([xs[i % n]])), device)
            # what the monitor runs over parameters and gradients: both in one pass (one launch on CUDA)
            r["one_pass_s"] = timeit(lambda i: gapmon.numerics.states_and_numerics([xs[i % n]]), device)
            r["reference_s"] = timeit(lambda i: gapmon.reference.numerics_states([xs[i % n]]), device, max_reps=3)
            r["histc_s"] = timeit(lambda i: torch.histc(xs[i % n].float().abs().log2(), bins=256, min=-128, max=128),
                                  device, max_reps=20)
            r["sum_s"] = timeit(lambda i: xs[i % n].sum(**sum_kwargs(device)), device)
            r["gapmon_GBps"] = r["bytes"] / r["gapmon_s"] / 1e9
            r["x_reference"] = r["reference_s"] / r["gapmon_s"]
            r["x_histc"] = r["histc_s"] / r["gapmon_s"]
            r["vs_sum_throughput"] = r["sum_s"] / r["gapmon_s"]
            r["on_over_off"] = r["stats_and_numerics_s"] / r["stats_s"]
            r["one_pass_over_off"] = r["one_pass_s"] / r["stats_s"]
            rows.append(r)
            print(f"numerics_states {r['dtype']:>8} 2^{exp:<2}: {r['gapmon_s']*1e3:8.3f} ms  "
                  f"{r['x_reference']:6.1f}x ref  {r['x_histc']:5.2f}x histc  {r['vs_sum_throughput']:.3f}x sum throughput  "
                  f"stats with numerics {r['on_over_off']:.2f}x stats alone ({r['stats_s']*1e3:.3f} ms), "
                  f"in one pass {r['one_pass_over_off']:.2f}x", flush=True)


def bench_block_formats(device: str, sizes: list[int], rows: list[dict]) -> None:
    """The per-block formats per format and for all six, against the plain statistics pass (SPEC 10; issue
    target: the one pass with block numerics on <= 6x the plain pass): gapmon.block_numerics alone (each
    element read once and cast to every format named, given the tensor's amax), and the one pass the monitor
    runs, gapmon.states_numerics_blocks (statistics, numerics and the block formats of each chunk while it is in
    cache; on CUDA for now two launches), with the amax given ("one_pass") and, for the formats scaled per
    tensor, without it (the monitor's case: the pass measures it, then those formats take a second read)."""
    from gapmon.stats.block_formats import BLOCK_FORMATS, finite_amaxes, needs_tensor_amax, states_numerics_blocks

    for dtype in (torch.float32, torch.bfloat16):
        for exp in sizes:
            xs = [x.reshape(-1, min(4096, 2**exp)) for x in rotation(torch.randn(2**exp, device=device).to(dtype), device)]
            n, x = len(xs), xs[0]
            amaxes = [finite_amaxes([t]).to(device) for t in xs]
            numerics_s = timeit(lambda i: gapmon.numerics.states_and_numerics([xs[i % n]]), device)
            for formats in [(f,) for f in BLOCK_FORMATS] + [BLOCK_FORMATS]:
                fns = {"stats_s": lambda i: gapmon.tensor_stats(xs[i % n]),
                       "gapmon_s": lambda i: gapmon.block_numerics([xs[i % n]], formats, amaxes[i % n]),
                       "one_pass_s": lambda i: states_numerics_blocks([xs[i % n]], formats, amaxes=amaxes[i % n])}
                if any(needs_tensor_amax(f) for f in formats):
                    fns["amax_from_the_pass_s"] = lambda i: states_numerics_blocks([xs[i % n]], formats)
                r = {"case": "block_numerics " + ("all six" if len(formats) > 1 else formats[0]),
                     "dtype": str(dtype).replace("torch.", ""), "numel": x.numel(), "bytes": x.numel() * x.element_size(),
                     "rotated_inputs": n, "formats": list(formats), "stats_and_numerics_s": numerics_s,
                     **timeit_side_by_side(fns, device)}
                stats_s = r["stats_s"]
                r["gapmon_GBps"] = r["bytes"] / r["gapmon_s"] / 1e9
                r["over_stats"] = r["gapmon_s"] / stats_s
                r["with_numerics_over_stats"] = (r["gapmon_s"] + numerics_s) / stats_s
                r["one_pass_over_stats"] = r["one_pass_s"] / stats_s
                rows.append(r)
                later = (f"; amax from the pass {r['amax_from_the_pass_s'] / stats_s:5.1f}x" if "amax_from_the_pass_s" in r
                         else "")
                print(f"{r['case']:<36} {r['dtype']:>8} 2^{exp:<2}: {r['gapmon_s']*1e3:8.3f} ms = {r['over_stats']:5.1f}x "
                      f"the statistics pass ({stats_s*1e3:.3f} ms); statistics+numerics+blocks in one pass "
                      f"{r['one_pass_s']*1e3:8.3f} ms = {r['one_pass_over_stats']:5.1f}x{later}", flush=True)


def hook_row(r: dict, base: str) -> dict:
    """An activation-hook case's row: its one op as gapmon's time and throughput, and the one op and the separate ops
    it replaced as multiples of `base` (the row's `{base}_s`)."""
    r["gapmon_s"] = r["one_op_s"]
    r["gapmon_GBps"] = r["bytes"] / r["one_op_s"] / 1e9
    r[f"one_op_over_{base}"] = r["one_op_s"] / r[f"{base}_s"]
    r[f"separate_over_{base}"] = r["separate_ops_s"] / r[f"{base}_s"]
    return r


def bench_activation_blocks(device: str, sizes: list[int], rows: list[dict]) -> None:
    """What an activation hook costs with block formats on: the one op that folds the instance statistics, the
    numerics row and the block rows (accumulate_instance_stats_numerics_blocks: one pass on CPU, the amax of a
    format scaled per tensor measured by the op first) against the ops the hook ran before it (the numerics op, the
    amax by torch ops, block_numerics, a merge of the rows) and against the numerics op alone. Instances [8, 2^exp / 8]
    as [8, 512, ...] rows of 4096."""
    from gapmon.stats import _backend
    from gapmon.stats import block_formats as bf
    from gapmon.stats.layout import BLOCK_COLUMNS

    for dtype in (torch.float32, torch.bfloat16):
        for exp in sizes:
            xs = [x.reshape(8, -1, min(4096, 2**exp // 8)) for x in rotation(torch.randn(2**exp, device=device).to(dtype), device)]
            n, x = len(xs), xs[0]
            acc = torch.zeros(2, len(gapmon.stats.ACC_NAMES), dtype=torch.float64, device=device)
            table = torch.zeros(2, len(gapmon.numerics.NUMERICS_COLUMNS), dtype=torch.float64, device=device)
            for formats in (("mxfp8_e4m3",), ("mxfp8_e4m3", "nvfp4")):
                codes, scaled = bf.format_codes(formats), any(bf.needs_tensor_amax(f) for f in formats)
                blocks = torch.zeros(2, len(formats), len(BLOCK_COLUMNS), dtype=torch.float64, device=device)
                blocks[..., BLOCK_COLUMNS.index("min_nonzero")] = math.inf

                def separate(i):
                    t = xs[i % n]
                    gapmon.ops.accumulate_instance_stats_and_numerics(t, acc, 1, 1, table, 1)
                    amax = (torch.where(torch.isfinite(t), t.abs(), 0).amax().double().reshape(1) if scaled
                            else torch.zeros(1, dtype=torch.float64, device=device))
                    blocks[1] = bf.merge_block_rows(torch.stack((blocks[1], bf.block_numerics([t], formats, amax)[0])))

                fns = {"numerics_op_s": lambda i: gapmon.ops.accumulate_instance_stats_and_numerics(xs[i % n], acc, 1, 1,
                                                                                                       table, 1),
                       "separate_ops_s": separate,
                       "one_op_s": lambda i: _backend.accumulate_instance_stats_numerics_blocks(
                           xs[i % n], acc, 1, 1, table[1:2], 0, codes, None, blocks, 1)}
                r = {"case": "activation hook with block formats " + "+".join(formats),
                     "dtype": str(dtype).replace("torch.", ""), "numel": x.numel(), "bytes": x.numel() * x.element_size(),
                     "rotated_inputs": n, "formats": list(formats), **timeit_side_by_side(fns, device)}
                rows.append(hook_row(r, "numerics_op"))
                print(f"activation hook {r['dtype']:>8} 2^{exp:<2} {'+'.join(formats):<17}: numerics op "
                      f"{r['numerics_op_s']*1e3:8.3f} ms; with blocks one op {r['one_op_s']*1e3:8.3f} ms, the ops before "
                      f"{r['separate_ops_s']*1e3:8.3f} ms", flush=True)


def bench_activation_hook(device: str, sizes: list[int], rows: list[dict]) -> None:
    """What an activation hook costs with numerics on: the one op that folds the instance statistics
    and merges the numerics row in place (accumulate_instance_stats_and_numerics; one pass on CPU)
    against the separate ops it replaced (the fold, numerics_states, then a stack, merge and copy into
    the row), and against the fold alone (numerics off). Instances: [8, 2^exp / 8]."""
    for dtype in (torch.float32, torch.bfloat16):
        for exp in sizes:
            xs = rotation(torch.randn(8, 2**exp // 8, device=device).to(dtype), device)
            n, x = len(xs), xs[0]
            acc = torch.zeros(2, len(gapmon.stats.ACC_NAMES), dtype=torch.float64, device=device)
            table = torch.zeros(2, len(gapmon.numerics.NUMERICS_COLUMNS), dtype=torch.float64, device=device)
            row = table[1:2]

            def separate(i):
                gapmon.ops.accumulate_instance_stats(xs[i % n], acc, 1)
                new = gapmon.numerics_states([xs[i % n]])
                row.copy_(gapmon.numerics.merge_numerics_states(torch.stack((row, new))))

            r = {"case": "activation hook with numerics", "dtype": str(dtype).replace("torch.", ""),
                 "numel": x.numel(), "bytes": x.numel() * x.element_size(), "rotated_inputs": n}
            r["fold_s"] = timeit(lambda i: gapmon.ops.accumulate_instance_stats(xs[i % n], acc, 1), device)
            r["one_op_s"] = timeit(
                lambda i: gapmon.ops.accumulate_instance_stats_and_numerics(xs[i % n], acc, 1, 1, table, 1), device)
            r["separate_ops_s"] = timeit(separate, device)
            rows.append(hook_row(r, "fold"))
            print(f"activation hook {r['dtype']:>8} 2^{exp:<2}: fold alone {r['fold_s']*1e3:8.3f} ms, with numerics "
                  f"one op {r['one_op_over_fold']:.2f}x, separate ops {r['separate_over_fold']:.2f}x", flush=True)


def bench_host_cost(device: str, rows: list[dict]) -> None:
    """Host cost of one small call (1,000 elements) against x.sum()."""
    x = torch.randn(1000, device=device)
    r = {"case": "host cost of one call", "dtype": "float32", "numel": x.numel(), "bytes": x.numel() * 4}
    r["gapmon_s"] = host_time(lambda i: gapmon.tensor_stats(x), device)
    r["sum_host_s"] = host_time(lambda i: x.sum(), device)
    r["host_vs_sum"] = r["sum_host_s"] / r["gapmon_s"]
    r["gapmon_GBps"] = r["bytes"] / r["gapmon_s"] / 1e9
    judge(r, device)
    rows.append(r)
    print(f"host cost of one call (1,000 elements): gapmon {r['gapmon_s']*1e6:.1f} us, x.sum {r['sum_host_s']*1e6:.1f} us "
          f"({1 / r['host_vs_sum']:.2f}x)  {targets_text(r)}", flush=True)


def bench_multi(device: str, name: str, shapes, rows: list[dict], dtype: torch.dtype = torch.float32) -> None:
    params = [torch.randn(s, device=device).to(dtype) for s in shapes]
    total = sum(p.numel() for p in params)
    r = {"case": f"multi_tensor_stats {name}", "dtype": str(dtype).replace("torch.", ""), "tensors": len(params),
         "numel": total, "bytes": total * params[0].element_size()}
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
    single = ""
    if device == "cuda":
        r["gapmon_single_s"] = single_call_time(lambda i: gapmon.multi_tensor_stats(params), device)
        r["foreach_norm_single_s"] = single_call_time(lambda i: torch._foreach_norm(params), device)
        r["x_foreach_norm_single"] = r["foreach_norm_single_s"] / r["gapmon_single_s"]
        single = f"  single call {r['gapmon_single_s']*1e3:.3f} ms ({r['x_foreach_norm_single']:.2f}x _foreach_norm)"
    judge(r, device)
    rows.append(r)
    print(f"multi_tensor_stats {name} {r['dtype']} ({len(params)} tensors, {total/1e6:.0f}M): {r['gapmon_s']*1e3:.2f} ms  "
          f"{r['x_seed_loop']:.1f}x seed loop (a sum loop: {r['seed_loop_vs_sum_loop']:.1f}x)  "
          f"{r['x_foreach_norm']:.2f}x _foreach_norm  {r['gapmon_GBps']:.1f} GB/s{single}  {targets_text(r)}",
          flush=True)


def bench_instance(device: str, shape, rows: list[dict], dtype: torch.dtype = torch.float32) -> None:
    xs = rotation(torch.randn(*shape, device=device).to(dtype), device)
    n, x = len(xs), xs[0]
    r = {"case": f"instance_stats {list(shape)}", "dtype": str(dtype).replace("torch.", ""), "numel": x.numel(),
         "bytes": x.numel() * x.element_size(), "rotated_inputs": n}
    r["gapmon_s"] = timeit(lambda i: gapmon.instance_stats(xs[i % n]), device)
    r["seed_baseline_s"] = timeit(lambda i: (torch.var_mean(xs[i % n], dim=-1), xs[i % n].abs().amax(dim=-1)), device)
    r["reference_s"] = timeit(lambda i: gapmon.reference.instance_stats(xs[i % n]), device)
    r["sum_s"] = timeit(lambda i: xs[i % n].sum(dim=-1, **sum_kwargs(device)), device)
    r["x_seed_baseline"] = r["seed_baseline_s"] / r["gapmon_s"]
    r["x_reference"] = r["reference_s"] / r["gapmon_s"]
    r["vs_sum_throughput"] = r["sum_s"] / r["gapmon_s"]
    r["gapmon_GBps"] = r["bytes"] / r["gapmon_s"] / 1e9
    judge(r, device)
    rows.append(r)
    print(f"instance_stats {list(shape)} {r['dtype']}: {r['gapmon_s']*1e3:.2f} ms  {r['x_seed_baseline']:.1f}x var_mean+amax  "
          f"{r['x_reference']:.1f}x ref  {r['vs_sum_throughput']:.2f}x row sum throughput  {targets_text(r)}", flush=True)


def markdown(rows: list[dict]) -> str:
    """The results as a markdown table; the copy-bandwidth column appears for GPU runs."""
    gpu = any("of_copy_bandwidth" in r for r in rows)

    def ratio(value, fmt="{:.1f}x"):
        return "" if value is None else fmt.format(value)

    head = ["case", "dtype", "elements", "gapmon", "vs seed baseline", "vs full reference", "vs `x.sum()` throughput"]
    head += ["of copy bandwidth"] if gpu else []
    head += ["vs `_foreach_norm`", "GB/s", "targets"]
    out = ["| " + " | ".join(head) + " |", "| --- | --- |" + " ---: |" * (len(head) - 3) + " --- |"]
    for r in rows:
        cells = [r["case"], r["dtype"], f"{r['numel']:,}", f"{r['gapmon_s']*1e3:.3f} ms",
                 ratio(r.get("x_seed_baseline", r.get("x_seed_loop"))), ratio(r.get("x_reference")),
                 ratio(r.get("vs_sum_throughput"), "{:.2f}x")]
        cells += [ratio(r.get("of_copy_bandwidth"), "{:.0%}")] if gpu else []
        cells += [ratio(r.get("x_foreach_norm"), "{:.2f}x"), f"{r['gapmon_GBps']:.1f}", targets_text(r)]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--sizes", default=None, help="comma-separated powers of two (default 10,14,18,22,26[,28])")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/stats-<device>.json)")
    parser.add_argument("--skip-llama", action="store_true", help="skip the 1B-parameter list")
    parser.add_argument("--cases", default="stats,host,multi,instance,numerics,blocks",
                        help="comma-separated subset of stats,host,multi,instance,numerics,blocks")
    parser.add_argument("--numerics-sizes", default="18,22,26", help="powers of two for the numerics cases")
    parser.add_argument("--quick", action="store_true",
                        help="short timings and GPT-2 small's and the instance case's sizes / 16: checks that every "
                             "case runs (the tests), its numbers are not the ones to report")
    args = parser.parse_args()
    global TIME_SCALE
    divisor = 16 if args.quick else 1
    TIME_SCALE = 0.05 if args.quick else 1.0
    if gapmon.backend() == "torch":
        raise SystemExit("gapmon._C is not built: nothing to benchmark (pip install --no-build-isolation -e .)")
    device = args.device
    default_sizes = "10,14,18,22,26" if device == "cpu" else "10,14,18,20,22,26,28"
    sizes = [int(s) for s in (args.sizes or default_sizes).split(",")]
    info = machine(device)
    print(f"# gapmon benchmark on {info['device']} / {info['cpu']}, torch {info['torch']}, ISA {info['cpu_isa']}")
    rows: list[dict] = []
    cases = set(args.cases.split(","))
    if "stats" in cases:
        bench_tensor_stats(device, sizes, rows)
    if "host" in cases:
        bench_host_cost(device, rows)
    if "multi" in cases:
        bench_multi(device, "GPT-2 small" + (f" (sizes / {divisor})" if divisor > 1 else ""), gpt2_small_shapes(divisor),
                    rows)
        if device == "cuda" and not args.skip_llama:
            bench_multi(device, "LLaMA 1B", llama_1b_shapes(), rows, torch.bfloat16)
    if "instance" in cases:
        bench_instance(device, (64, 2**20 // divisor), rows)
        if device == "cuda":
            bench_instance(device, (64, 2**20 // divisor), rows, torch.bfloat16)
            for dtype in (torch.float32, torch.bfloat16):
                bench_instance(device, (8192, 4096), rows, dtype)
    if "numerics" in cases:
        bench_numerics(device, [int(e) for e in args.numerics_sizes.split(",")], rows)
        bench_activation_hook(device, [int(e) for e in args.numerics_sizes.split(",")], rows)
    if "blocks" in cases:
        bench_block_formats(device, [int(e) for e in args.numerics_sizes.split(",")], rows)
        # activations up to 2^26 (the hook's old path makes three tensor-sized temporaries; a GPU session's time)
        bench_activation_blocks(device, [int(e) for e in args.numerics_sizes.split(",") if int(e) <= 26], rows)
    missed = [f"{r['case']} {r['dtype']}: {t['target']}" for r in rows for t in r.get("targets", []) if not t["met"]]
    print("\ntargets not met:" + "".join(f"\n  {m}" for m in missed) if missed else "\nall targets met")
    table = markdown(rows)
    print("\n" + table)
    name = info["device"].replace(" ", "-").replace("(", "").replace(")", "").lower()
    out = Path(args.out or Path(__file__).parent / "results" / f"stats-{'cpu-' + info['host'] if device == 'cpu' else name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "results": rows, "table": table}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
