"""Time added to a training step by monitoring all four kinds (params, grads, activations,
activation grads): the pure-PyTorch baseline monitor vs GAPMonitor on a GPT-style model. Each
monitor is active on every other step of its run, so the added time is a paired difference of
median step times within one run (a shared machine's drift cancels). Prints a table, writes JSON.

    python benchmarks/bench_monitor.py                      # CPU: 4 layers, d=256, T=128, B=8
    python benchmarks/bench_monitor.py --device cuda --gpt2 # GPU: GPT-2 small size
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import machine
from torch_monitor import TorchGAPMonitor

import gapmon
from gapmon.apps.examples import GPTConfig, TinyGPT, lm_loss, synthetic_batch


def run(mode: str, cfg: GPTConfig, batch: int, steps: int, device: str) -> tuple[float, float, dict]:
    """Trains with the monitor active on every other step only; returns the median step times with
    and without monitoring, paired within one run (machine drift hits both alike)."""
    torch.manual_seed(0)
    model = TinyGPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mon = gapmon.GAPMonitor(model, interval=2, sinks=[]) if mode == "gapmon" else TorchGAPMonitor(model)
    on, off, metrics = [], [], {}
    for step in range(2 * steps + 2):  # two warm-up steps
        active = step % 2 == 0
        x, y = synthetic_batch(cfg, batch, step, device=device)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if mode == "gapmon":
            mon.begin_step(step, batch_size=batch)  # interval=2: odd steps are skipped
        else:
            mon.active = active
        lm_loss(model(x), y).backward()
        out = mon.end_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if step >= 2:
            (on if active else off).append(time.perf_counter() - t0)
        if active:
            metrics = out
    mon.close()
    return statistics.median(on), statistics.median(off), metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--gpt2", action="store_true", help="GPT-2 small size (12 layers, d=768, T=1024)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="runs per monitor (the median is reported)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.gpt2:
        cfg, batch = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12), 8
    else:
        cfg, batch = GPTConfig(vocab_size=4096, seq_len=128, d_model=256, n_heads=4, n_layers=4), 8
    info = machine(args.device)
    print(f"# GAPMonitor overhead on {info['device']} / {info['cpu']}, torch {info['torch']}")
    print(f"model: {cfg}, batch {batch}")
    added: dict[str, list[float]] = {"torch": [], "gapmon": []}
    plain: list[float] = []
    counts = {}
    for _ in range(args.rounds):
        for mode in added:
            t_on, t_off, metrics = run(mode, cfg, batch, args.steps, args.device)
            added[mode].append(t_on - t_off)
            plain.append(t_off)
            counts[mode] = len(metrics)
    over_torch = statistics.median(added["torch"])
    over_gap = statistics.median(added["gapmon"])
    step = {"none": statistics.median(plain), "torch": statistics.median(plain) + over_torch,
            "gapmon": statistics.median(plain) + over_gap}
    result = {
        "machine": info, "config": cfg.__dict__, "batch": batch, "step_s": step, "metrics": counts,
        "overhead_torch_s": over_torch, "overhead_gapmon_s": over_gap,
        "gapmon_overhead_vs_torch_overhead": over_gap / over_torch if over_torch > 0 else None,
        "gapmon_overhead_vs_step": over_gap / step["none"],
    }
    table = "\n".join([
        "| monitor | step time | added time | % of step | metrics per step |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| none (the unmonitored steps) | {step['none']*1e3:.1f} ms | | | |",
        f"| pure-PyTorch (seed approach) | {step['torch']*1e3:.1f} ms | {over_torch*1e3:.1f} ms | "
        f"{100*over_torch/step['none']:.1f}% | {counts['torch']} |",
        f"| gapmon.GAPMonitor | {step['gapmon']*1e3:.1f} ms | {over_gap*1e3:.1f} ms | "
        f"{100*over_gap/step['none']:.1f}% | {counts['gapmon']} |",
    ])
    result["table"] = table
    print(table)
    if over_torch > 0:
        print(f"\ngapmon's added time is {100*over_gap/over_torch:.0f}% of the pure-PyTorch monitor's")
    name = "cpu-" + info["host"] if args.device == "cpu" else info["device"].replace(" ", "-").lower()
    out = Path(args.out or Path(__file__).parent / "results" / f"monitor-{name}.json")
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
