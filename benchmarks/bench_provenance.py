"""The cost per op of following the batch (gapmon.per_sample.batch_provenance), and how many ops a GPT-2
small forward makes, so that the cost on a GPU (where an op takes a few µs) can be estimated; and the host
time the per-sample norms add to a whole training step of that structure (the batch tracking, the layer
hooks, the use check, end_step), per step and per covered layer.

The same forward pass is timed with and without the tracking TorchFunctionMode, on tiny tensors (the op
itself then costs little, so the difference is the mode's Python), and with an empty TorchFunctionMode
(torch's own dispatch into a mode, which any such mode pays: one that only counts). Paired, alternating, medians.

    python benchmarks/bench_provenance.py [--device cuda] [--out results/provenance-<machine>.json]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from common import write_result
from torch.overrides import TorchFunctionMode

TARGET_US = 5.0  # issue #34: at most 5 µs per op


class _Count(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def measure(device: str, rounds: int) -> dict:
    from gapmon.apps.examples import GPTConfig, TinyGPT, synthetic_batch
    from gapmon.per_sample.batch_provenance import batch_tracker

    torch.manual_seed(0)
    # GPT-2 small's structure (12 blocks, its ops), tiny widths: the ops cost little, the mode's Python shows.
    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=12)
    model = TinyGPT(cfg).to(device)
    x, _ = synthetic_batch(cfg, 2, 0, device=device)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def plain():
        model(x)

    def tracked():
        tracker = batch_tracker(x.shape[0])
        tracker.mark(x, 0)
        with tracker:
            model(x)

    def empty_mode():
        with _Count():
            model(x)

    counter = _Count()
    with counter:
        model(x)
    times: dict[str, list[float]] = {"plain": [], "tracked": [], "empty mode": []}
    runs = {"plain": plain, "tracked": tracked, "empty mode": empty_mode}
    for i in range(rounds + 2):
        for name, run in runs.items():
            sync()
            t0 = time.perf_counter()
            run()
            sync()
            if i >= 2:  # warm-up rounds
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    per_op = (med["tracked"] - med["plain"]) / counter.ops * 1e6
    return {"device": device, "ops_per_forward_gpt2_small": counter.ops, "forward_plain_ms": med["plain"] * 1e3,
            "forward_tracked_ms": med["tracked"] * 1e3, "per_op_us": per_op,
            "empty_mode_per_op_us": (med["empty mode"] - med["plain"]) / counter.ops * 1e6,
            "target": f"<= {TARGET_US} us per op", "met": per_op <= TARGET_US,
            "gpu_estimate_ms_per_forward": per_op * counter.ops / 1e3}


def measure_step_overhead(device: str, rounds: int) -> dict:
    """A training step of GPT-2 small's structure at tiny widths (its kernels cost little: what is left is host
    time) plain, and under GAPMonitor with per-sample norms (with and without book-keeping): the added time per
    step and per covered layer. Paired, alternating, medians."""
    import gapmon
    from gapmon.apps.examples import GPTConfig, TinyGPT, lm_loss, synthetic_batch

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=8, n_heads=2, n_layers=12)  # T >= d: direct form, book-kept
    model = TinyGPT(cfg).to(device)
    x, y = synthetic_batch(cfg, 2, 0, device=device)
    monitors = {kind: gapmon.GAPMonitor(model, params=False, grads=False, activations=False, activation_grads=False,
                                        per_sample_grad_norms=True, bookkeeping=kind == "bookkeeping", sinks=[])
                for kind in ("norms", "bookkeeping")}
    for mon in monitors.values():
        mon.per_sample.pause()
    # the covered layers: the modules owning the covered parameters
    covered = len({name.rpartition(".")[0] for name in monitors["norms"].per_sample.coverage()["covered"]})

    def step(kind: str, i: int) -> float:
        mon = monitors.get(kind)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if mon is not None:
            mon.begin_step(i, batch_size=x.shape[0])
        lm_loss(model(x), y).backward()
        if mon is not None:
            mon.end_step()
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"plain": [], "norms": [], "bookkeeping": []}
    for i in range(rounds + 2):
        for kind in times:  # a monitor not in this step's turn is paused: its hooks return at once
            for other, mon in monitors.items():
                if other != kind:
                    mon.per_sample.pause()
            spent = step(kind, i)
            if i >= 2:
                times[kind].append(spent)
    for mon in monitors.values():
        mon.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"step_plain_ms": med["plain"] * 1e3, "covered_layers": covered}
    for kind in ("norms", "bookkeeping"):
        added = med[kind] - med["plain"]
        out[f"step_{kind}_ms"] = med[kind] * 1e3
        out[f"added_per_step_ms_{kind}"] = added * 1e3
        out[f"added_per_layer_us_{kind}"] = added / covered * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = measure(args.device, args.rounds)
    result.update(measure_step_overhead(args.device, max(10, args.rounds // 2)))
    result.update(torch=torch.__version__, machine=platform.processor() or platform.machine(), cores=os.cpu_count(),
                  date=time.strftime("%Y-%m-%d"))
    print(f"# batch provenance on {args.device}: {result['ops_per_forward_gpt2_small']} ops per GPT-2-small forward")
    print("| per op (tracking) | per op (an empty TorchFunctionMode) | forward plain | forward tracked | target |")
    print("| ---: | ---: | ---: | ---: | --- |")
    print(f"| {result['per_op_us']:.1f} µs | {result['empty_mode_per_op_us']:.1f} µs | {result['forward_plain_ms']:.2f} ms | "
          f"{result['forward_tracked_ms']:.2f} ms | {result['target']}: {'met' if result['met'] else 'NOT met'} |")
    print(f"# per-sample norms' host time in a training step of that structure ({result['covered_layers']} covered "
          f"layers, tiny widths): plain step {result['step_plain_ms']:.2f} ms")
    print("| | added per step | added per covered layer |")
    print("| --- | ---: | ---: |")
    for kind in ("norms", "bookkeeping"):
        print(f"| {kind} | {result[f'added_per_step_ms_{kind}']:.2f} ms | {result[f'added_per_layer_us_{kind}']:.0f} µs |")
    write_result(args.out, result)


if __name__ == "__main__":
    main()
