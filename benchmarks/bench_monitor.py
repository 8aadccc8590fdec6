"""Time GAPMonitor adds to a training step, against the physical floor and the pure-PyTorch monitor.

Modes, each measured paired (the monitor is active on every other step of one run, so a shared
machine's drift hits both alike; the added time is the difference of median step times):
- torch:        the pure-PyTorch seed-style monitor, all four kinds (benchmarks/torch_monitor.py);
- all four:     GAPMonitor with params, grads, activations and activation grads;
- params+grads: GAPMonitor with params and grads only;
- params+grads + updates: the same with the optimizer's update measured (GAPMonitor.watch_optimizer);
and interval=10: blocks of 10 steps with a GAPMonitor(interval=10) attached (one step in ten
monitored) alternate with blocks of 10 plain steps with no monitor at all; the average overhead
per step is the difference of the blocks' mean step times.

The floor of a mode is the bytes its monitor reads in one step (counted at the statistics ops during
a probe step; a tensor several modules output is read once) divided by the device's memory bandwidth
(a device copy's read + write traffic per second on CUDA, `x.sum()` reads on the CPU). Each added
time is printed as a multiple of its floor, beside the SPEC target. A profiled step of each mode
counts the gapmon ops it runs and, on CUDA, the kernels, memsets and copies it adds to a plain step
(interval=10: a step the monitor skips, which should run none).

    python benchmarks/bench_monitor.py                      # CPU: 4 layers, d=256, T=128, B=8
    python benchmarks/bench_monitor.py --device cuda --gpt2 # GPU: GPT-2 small, T=1024, B=8, bf16 autocast,
                                                            # TF32, SDPA attention, fused AdamW
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
from common import machine
from torch_monitor import TorchGAPMonitor

import gapmon
from gapmon.apps.examples import GPTConfig, TinyGPT, lm_loss, synthetic_batch

GAPMON_MODES = {"all four": {}, "params+grads": {"activations": False, "activation_grads": False}}


class Trainer:
    """One model, optimizer and batch source, set up as the benchmark's device asks."""

    def __init__(self, cfg: GPTConfig, batch: int, device: str):
        torch.manual_seed(0)
        self.cfg, self.batch, self.device = cfg, batch, device
        self.model = TinyGPT(cfg).to(device)
        fused = {"fused": True} if device == "cuda" else {}
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, **fused)
        self.step_count = 0

    def autocast(self):
        if self.device == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step(self, mon=None, active: bool = True) -> float:
        """One training step (seconds), with `mon` asked to monitor it when `active`."""
        x, y = synthetic_batch(self.cfg, self.batch, self.step_count, device=self.device)
        self.sync()
        t0 = time.perf_counter()
        if isinstance(mon, gapmon.GAPMonitor):
            if active:
                mon.begin_step(self.step_count, batch_size=self.batch)
        elif mon is not None:
            mon.active = active
        with self.autocast():
            loss = lm_loss(self.model(x), y)
        loss.backward()
        if isinstance(mon, gapmon.GAPMonitor):
            if active:
                mon.end_step()
        elif mon is not None:
            mon.end_step()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sync()
        self.step_count += 1
        return time.perf_counter() - t0

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


def gap_monitor(model, interval: int = 1, **kinds) -> gapmon.GAPMonitor:
    return gapmon.GAPMonitor(model, interval=interval, sinks=[], **kinds)


def with_updates(mon: gapmon.GAPMonitor, optimizer: torch.optim.Optimizer) -> gapmon.GAPMonitor:
    """`mon`, also measuring the optimizer's update on its monitored steps (GAPMonitor.watch_optimizer)."""
    mon.watch_optimizer(optimizer)
    return mon


def paired(tr: Trainer, make_monitor, steps: int) -> tuple[float, float]:
    """Median step times with and without monitoring, alternating in one run (two warm-up steps)."""
    mon = make_monitor(tr.model)
    on, off = [], []
    for i in range(2 * steps + 2):
        active = i % 2 == 0
        seconds = tr.step(mon, active)
        if i >= 2:
            (on if active else off).append(seconds)
    mon.close()
    return statistics.median(on), statistics.median(off)


def interval_blocks(tr: Trainer, interval: int, blocks: int) -> tuple[float, float]:
    """Mean step time of blocks with a GAPMonitor(interval) attached, and of blocks with none."""
    with_mon, plain = [], []
    for b in range(2 * blocks + 2):
        monitored = b % 2 == 0
        mon = gap_monitor(tr.model, interval=interval) if monitored else None
        # With a monitor, every step is begun and ended: the monitor itself skips all but one in `interval`.
        times = [tr.step(mon, active=mon is not None) for _ in range(interval)]
        if mon is not None:
            mon.close()
        if b >= 2:
            (with_mon if monitored else plain).append(statistics.fmean(times))
    return statistics.median(with_mon), statistics.median(plain)


def bytes_read(tr: Trainer, **kinds) -> int:
    """Bytes the statistics ops read during one monitored step (the monitor's data, read once)."""
    counted = [0]
    originals = {name: getattr(gapmon.ops, name) for name in ("accumulate_instance_stats", "multi_tensor_rows")}

    def count_one(x, *args, **kwargs):
        counted[0] += x.numel() * x.element_size()
        return originals["accumulate_instance_stats"](x, *args, **kwargs)

    def count_list(xs, *args, **kwargs):
        counted[0] += sum(x.numel() * x.element_size() for x in xs)
        return originals["multi_tensor_rows"](xs, *args, **kwargs)

    mon = gap_monitor(tr.model, **kinds)
    gapmon.ops.accumulate_instance_stats, gapmon.ops.multi_tensor_rows = count_one, count_list
    try:
        tr.step(mon, active=True)
    finally:
        gapmon.ops.accumulate_instance_stats = originals["accumulate_instance_stats"]
        gapmon.ops.multi_tensor_rows = originals["multi_tensor_rows"]
        mon.close()
    return counted[0]


def bandwidth(device: str) -> tuple[float, str]:
    """Bytes per second the floor divides by, and how it was measured."""
    n = 1 << 28 if device == "cuda" else 1 << 25
    x = torch.randn(n, device=device)
    if device == "cuda":
        y = torch.empty_like(x)
        y.copy_(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(10):
            start.record()
            y.copy_(x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return 2 * x.numel() * 4 / min(times), "device copy (read + write bytes per second)"
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / min(times), "x.sum() (bytes read per second)"


def work_per_step(tr: Trainer, make_monitor, active_step: bool = True) -> dict:
    """gapmon op calls in one step with a monitor attached, and on CUDA the kernels, memsets and
    copies that step queues beyond a plain step's (profiler). With `active_step=False` the step is
    one that the monitor's interval skips."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if tr.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def profiled(mon) -> tuple[int, int]:
        with torch.profiler.profile(activities=activities) as prof:
            tr.step(mon, active=mon is not None)
        events = prof.events()
        ops = sum(1 for e in events if e.name.startswith("gapmon::"))
        return ops, sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)

    mon = make_monitor(tr.model)
    tr.step(mon, active=True)  # warm-up: buffers, counters
    while active_step != mon.config.schedule.includes(tr.step_count):
        tr.step(mon, active=True)
    ops, device_on = profiled(mon)
    mon.close()
    _, device_off = profiled(None)
    return {"gapmon_ops": ops, "device_work_added": device_on - device_off if tr.device == "cuda" else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--gpt2", action="store_true", help="GPT-2 small size (12 layers, d=768, T=1024, B=8)")
    parser.add_argument("--small", action="store_true", help="a tiny model (a smoke test of the script)")
    parser.add_argument("--steps", type=int, default=10, help="monitored (and plain) steps per paired run")
    parser.add_argument("--rounds", type=int, default=3, help="paired runs per mode (the median is reported)")
    parser.add_argument("--blocks", type=int, default=3, help="blocks of each kind for interval=10")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.gpt2:
        cfg, batch = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12), 8
    elif args.small:
        cfg, batch = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2), 4
    else:
        cfg, batch = GPTConfig(vocab_size=4096, seq_len=128, d_model=256, n_heads=4, n_layers=4), 8
    device = args.device
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    info = machine(device)
    print(f"# GAPMonitor overhead on {info['device']} / {info['cpu']}, torch {info['torch']}")
    print(f"model: {cfg}, batch {batch}" + (", bf16 autocast, TF32, SDPA, fused AdamW" if device == "cuda" else ""))
    tr = Trainer(cfg, batch, device)
    bw, bw_how = bandwidth(device)
    floors = {mode: bytes_read(tr, **kinds) / bw for mode, kinds in GAPMON_MODES.items()}

    makers = {"torch": TorchGAPMonitor, **{mode: (lambda kinds: lambda m: gap_monitor(m, **kinds))(kinds)
                                            for mode, kinds in GAPMON_MODES.items()},
              # the optimizer statistics' cost: this mode's added time minus params+grads'
              "params+grads + updates": lambda m: with_updates(gap_monitor(m, **GAPMON_MODES["params+grads"]), tr.opt)}
    added: dict[str, list[float]] = {mode: [] for mode in makers}
    plain: list[float] = []
    for _ in range(args.rounds):
        for mode, make in makers.items():
            t_on, t_off = paired(tr, make, args.steps)
            added[mode].append(t_on - t_off)
            plain.append(t_off)
    step = statistics.median(plain)
    t_int, t_plain = interval_blocks(tr, 10, args.blocks)
    rows = {mode: {"added_s": statistics.median(v), "floor_s": floors.get(mode)} for mode, v in added.items()}
    rows["interval=10"] = {"added_s": t_int - t_plain, "floor_s": None, "block_step_s": t_int, "plain_block_step_s": t_plain}
    for mode, kinds in GAPMON_MODES.items():
        rows[mode]["work"] = work_per_step(tr, lambda m: gap_monitor(m, **kinds))
    rows["interval=10"]["work"] = work_per_step(tr, lambda m: gap_monitor(m, interval=10), active_step=False)

    # SPEC targets (GPU: floor multiples; CPU: a share of the pure-PyTorch monitor's added time).
    def target(mode: str) -> tuple[str, bool] | None:
        r = rows[mode]
        if device == "cuda":
            if mode == "all four":
                return "<= 1.5x floor + 1 ms", r["added_s"] <= 1.5 * r["floor_s"] + 1e-3
            if mode == "params+grads":
                return "<= 1.5x floor + 0.5 ms", r["added_s"] <= 1.5 * r["floor_s"] + 0.5e-3
            if mode == "interval=10":
                return "<= 1.5% of the step", r["added_s"] <= 0.015 * t_plain
        elif mode == "all four":
            return "<= 25% of the pure-PyTorch monitor's", r["added_s"] <= 0.25 * rows["torch"]["added_s"]
        return None

    lines = ["| monitor | added time | % of step | floor | added / floor | target | gapmon ops / step | "
             "GPU launches added / step |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for mode, r in rows.items():
        t = target(mode)
        r["target"], r["met"] = (t if t else (None, None))
        floor = f"{r['floor_s']*1e3:.2f} ms" if r["floor_s"] else ""
        ratio = f"{r['added_s']/r['floor_s']:.1f}x" if r["floor_s"] else ""
        met = f"{t[0]}: {'met' if t[1] else 'NOT met'}" if t else ""
        work = r.get("work") or {}
        ops = "" if not work else str(work["gapmon_ops"]) + (" (a skipped step)" if mode == "interval=10" else "")
        launches = "" if work.get("device_work_added") is None else str(work["device_work_added"])
        lines.append(f"| {mode} | {r['added_s']*1e3:.2f} ms | {100*r['added_s']/step:.1f}% | {floor} | {ratio} | {met} | "
                     f"{ops} | {launches} |")
    table = "\n".join(lines)
    print(f"\nplain step {step*1e3:.1f} ms; bandwidth {bw/1e9:.0f} GB/s ({bw_how})")
    print(table)
    name = "cpu-" + info["host"] if device == "cpu" else info["device"].replace(" ", "-").lower()
    out = Path(args.out or Path(__file__).parent / "results" / f"monitor-{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "config": cfg.__dict__, "batch": batch, "plain_step_s": step,
                               "bandwidth_Bps": bw, "bandwidth_from": bw_how, "modes": rows, "table": table}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
