"""Where a per-sample-norms training step spends its time: GPT-2 small (B=8, T=128; on CUDA bf16 autocast and
TF32, as bench_persample.py) under GAPMonitor with per-sample norms, after warm-up steps, one step profiled
(torch.profiler) next to a plain step. Prints, for each: each phase's time (begin_step, forward, backward, end_step,
optimizer; medians of 8 steps) as the host spends it and with the device drained after it, the step's wall time, the GPU's busy time (the sum of
its kernels' durations: far below the wall time means the host is the bottleneck), the ops and kernels
launched, the host calls that wait for the GPU (stream/device/event synchronisations, copies between host and
device), and the ops that cost the most host time; on CUDA also every synchronisation torch's sync debug mode
reports, with the gapmon line that made it. On the first H100 session the norms step took 3.85x the plain
step while the Linear products alone would make it 1.30x: this says why.

    python benchmarks/profile_persample.py [--device cuda] [--small] [--bookkeeping] [--out profile.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ", "cudaMemcpyAsync",
              "cudaHostAlloc", "cudaMalloc", "cudaFree")


PHASES = ("begin_step", "forward", "backward", "end_step", "optimizer")


def _phases(model, opt, mon, cfg, batch, i, device, autocast) -> list:
    """The calls of training step `i`, one per phase of PHASES, to run in order."""
    from gapmon.apps.examples import lm_loss, synthetic_batch

    x, y = synthetic_batch(cfg, batch, i, device=device)
    loss = []

    def forward():
        with autocast():
            loss.append(lm_loss(model(x), y))

    return [lambda: mon is not None and mon.begin_step(i, batch_size=batch), forward, lambda: loss[0].backward(),
            lambda: mon is not None and mon.end_step(), lambda: (opt.step(), opt.zero_grad(set_to_none=True))]


def _step(model, opt, mon, cfg, batch, i, device, autocast):
    for call in _phases(model, opt, mon, cfg, batch, i, device, autocast):
        call()


def _phase_times(model, opt, mon, cfg, batch, counter, device, autocast, steps: int = 8) -> dict:
    """Medians over `steps` steps of each phase's time, two ways: `host` (the host's own time to return from the
    phase's calls, the device left running: what the host spends enqueueing) and `drained` (the device synchronised
    after each phase as well: what the phase costs end to end). A phase whose host time is close to its drained time
    is host-bound; one whose drained time is far above it is GPU-bound (or waits on the GPU inside)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = {}
    for mode in ("host", "drained"):
        per_phase: dict[str, list[float]] = {name: [] for name in PHASES}
        for _ in range(steps):
            calls = _phases(model, opt, mon, cfg, batch, next(counter), device, autocast)
            sync()
            for name, call in zip(PHASES, calls):
                t0 = time.perf_counter()
                call()
                if mode == "drained":
                    sync()
                per_phase[name].append(time.perf_counter() - t0)
            sync()
        out[mode] = {name: statistics.median(v) * 1e3 for name, v in per_phase.items()}
    return out


def _profiled(run, device: str) -> dict:
    """One call of run() under the profiler: wall time, GPU busy time, launches, waits, top host ops."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run()
        sync()
        wall = time.perf_counter() - t0
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    runtime = collections.Counter(e.name for e in events if e.name.startswith("cuda"))
    waits = {name: n for name, n in runtime.items() if name.startswith(SYNC_CALLS)}
    ops = collections.Counter(e.name for e in events if e.name.startswith(("aten::", "gapmon::")))
    top = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:20]
    return {
        "wall_ms": wall * 1e3,
        "gpu_busy_ms": sum(e.device_time_total for e in kernels) / 1e3 if kernels else None,
        "kernels": len(kernels),
        "aten_and_gapmon_ops": sum(ops.values()),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "runtime_waits_and_allocs": waits,
        "top_self_cpu": [{"name": a.key, "calls": a.count, "self_cpu_ms": a.self_cpu_time_total / 1e3} for a in top],
    }


def _syncs(run) -> list[str]:
    """On CUDA: each synchronisation torch's sync debug mode warns about, with the innermost gapmon (or benchmark)
    frame that caused it, counted."""
    seen: collections.Counter = collections.Counter()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores showwarning and the filters when it ends
            warnings.simplefilter("always")

            def note(message, category, filename, lineno, file=None, line=None):
                frames = [f for f in traceback.extract_stack()[:-1]  # not this function's own frame
                          if "/gapmon/" in f.filename or "benchmarks" in f.filename]
                where = f"{frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"
                seen[where] += 1
            warnings.showwarning = note  # called as each warning is issued: the stack is the one that caused it
            run()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [f"{n} x {where}" for where, n in seen.most_common()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="a tiny model (a smoke test of the script)")
    parser.add_argument("--bookkeeping", action="store_true", help="profile the book-keeping mode instead")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from bench_persample import gpt2_training

    import gapmon

    device = args.device
    cfg, batch, model, opt, autocast = gpt2_training(device, args.seq_len, args.small)
    counter = iter(range(1, 1 << 30))
    results = {}
    for kind in ("plain", "norms"):  # plain first, before any monitor is attached
        mon = None
        if kind == "norms":
            mon = gapmon.GAPMonitor(model, params=False, grads=False, activations=False, activation_grads=False,
                                    per_sample_grad_norms=True, bookkeeping=args.bookkeeping, sinks=[])
        for _ in range(3):  # warm-up: the allocator's pools, the monitor's kept checks and probes
            _step(model, opt, mon, cfg, batch, next(counter), device, autocast)
        results[kind] = _profiled(lambda m=mon: _step(model, opt, m, cfg, batch, next(counter), device, autocast), device)
        results[kind]["phases_ms"] = _phase_times(model, opt, mon, cfg, batch, counter, device, autocast)
        if device == "cuda":
            results[kind]["syncs"] = _syncs(lambda m=mon: _step(model, opt, m, cfg, batch, next(counter), device, autocast))
        if mon is not None:
            mon.close()
    for kind, r in results.items():
        busy = "" if r["gpu_busy_ms"] is None else f", GPU busy {r['gpu_busy_ms']:.1f} ms, peak {r['peak_memory_gib']:.2f} GiB"
        print(f"{kind}: wall {r['wall_ms']:.1f} ms{busy}, {r['kernels']} kernels, {r['aten_and_gapmon_ops']} ops; "
              f"waits and allocations {r['runtime_waits_and_allocs']}")
        for mode, phases in r["phases_ms"].items():
            print(f"  phases ({mode}): " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in phases.items()))
        for line in r.get("syncs", []):
            print(f"  sync: {line}")
        for a in r["top_self_cpu"][:12]:
            print(f"  {a['self_cpu_ms']:8.2f} ms  {a['calls']:5d} x  {a['name']}")
    if args.out:
        meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
                "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d"), "seq_len": cfg.seq_len, "batch": batch,
                "bookkeeping": args.bookkeeping}
        with open(args.out, "w") as f:
            json.dump({**meta, **results}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
