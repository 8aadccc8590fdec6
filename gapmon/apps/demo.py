"""`gapmon demo`: train a small GPT-style LM with FSDP2 and every gapmon feature switched on.

Spawns N workers itself (gloo on CPU, NCCL on GPU) or runs under torchrun. Every step is
monitored (params, grads, activations, activation grads, per-sample gradient norms); gradients
are dumped every K steps; after training rank 0 reconstructs the last dumped step, writes the
report and prints a summary. The monitor's cost is measured at the end on paired steps: plain and
monitored steps alternate (`timing_pairs` pairs, labelled as such by the progress bar), so that both
see the same machine load; the summary gives their median and range, a rough figure on a busy CPU.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..metric_names import parse_metric_name


@dataclass
class DemoConfig:
    nproc: int = 2
    steps: int = 20
    device: str = "cpu"
    out: str = "gapmon-demo"
    dump_every: int = 5
    hsdp: bool = False
    batch_per_rank: int = 8
    timing_pairs: int = 3  # (plain, monitored) step pairs after training: the cost of monitoring, paired
    quiet: bool = False

    def check(self) -> None:
        """Raises ValueError for arguments the workers would refuse, before any process is spawned."""
        if self.nproc < 1 or self.steps < 1 or self.dump_every < 1:
            raise ValueError("--nproc, --steps and --dump-every must be positive")
        if self.hsdp and (self.nproc < 2 or self.nproc % 2):
            raise ValueError(f"--hsdp needs an even number of processes (2 replicas), got --nproc {self.nproc}")


def _model_config():
    from .examples import GPTConfig

    return GPTConfig(vocab_size=512, seq_len=64, d_model=128, n_heads=4, n_layers=2)


def _worker(rank: int, world: int, cfg: DemoConfig, port: int | None) -> None:
    if port is not None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    if cfg.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        _train(rank, world, cfg)
    except KeyboardInterrupt:  # Ctrl-C reaches every worker: the parent prints the one line
        os._exit(130)
    finally:
        dist.destroy_process_group()


def _train(rank: int, world: int, cfg: DemoConfig) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ..dump import GradientDumper
    from ..monitor import GAPMonitor
    from ..sinks import JSONLSink
    from .examples import TinyGPT, lm_loss, synthetic_batch
    from .progress import Progress

    out = Path(cfg.out)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    mcfg = _model_config()
    torch.manual_seed(0)
    model = TinyGPT(mcfg).to(device)
    if cfg.hsdp:
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sinks = [JSONLSink(out / "metrics.jsonl")]
    mon = GAPMonitor(model, per_sample_grad_norms=True, sinks=sinks)
    dumper = GradientDumper(model, out / "gradients", step_interval=cfg.dump_every, mode="shards", async_write=True)
    progress = Progress("training", quiet=cfg.quiet or rank != 0)  # then the timing pairs, labelled
    b = cfg.batch_per_rank
    monitored_times, plain_times, last_metrics, nonfinite = [], [], {}, {}
    train_log = open(out / "train.jsonl", "w") if rank == 0 else None
    norms_log = open(out / "per_sample_norms.jsonl", "w") if rank == 0 else None
    dumped = []
    total = cfg.steps + 2 * cfg.timing_pairs
    for step in range(total):
        # Training steps are all monitored; the timing pairs that follow alternate plain, monitored.
        timing = step >= cfg.steps
        monitored = not timing or (step - cfg.steps) % 2 == 1
        x, y = synthetic_batch(mcfg, b * world, step, device=device)
        ids = torch.arange(step * b * world, (step + 1) * b * world)[rank * b:(rank + 1) * b]
        x, y = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if monitored:
            mon.begin_step(step, batch_size=b)
        loss = lm_loss(model(x), y)
        loss.backward()
        if monitored:
            metrics = mon.end_step()
            sample_ids, norms = mon.per_sample.global_norms(ids)
            if not timing:
                last_metrics = metrics
                nonfinite = mon.nonfinite_report or nonfinite
                if dumper.maybe_dump(step):
                    dumped.append(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_avg = loss.detach().clone()
        dist.all_reduce(loss_avg)
        loss_avg = loss_avg.item() / world
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        if timing:
            (monitored_times if monitored else plain_times).append(elapsed)
        if rank == 0:
            tokens = b * world * mcfg.seq_len
            train_log.write(json.dumps({"step": step, "loss": loss_avg, "step_s": elapsed, "tokens_per_s": tokens / elapsed,
                                        "monitored": monitored, "timing_pair": timing}) + "\n")
            train_log.flush()
            if monitored:
                norms_log.write(json.dumps({"step": step, "ids": sample_ids.tolist(), "norms": norms.tolist()}) + "\n")
                norms_log.flush()
            if timing:
                progress(step - cfg.steps + 1, 2 * cfg.timing_pairs, f"timing: plain/monitored pairs, loss {loss_avg:.3f}")
            else:
                progress(step + 1, cfg.steps, f"loss {loss_avg:.3f}")
    dumper.close()
    mon.close()
    if rank == 0:
        train_log.close()
        norms_log.close()
        _finish(out, cfg, world, mcfg, monitored_times, plain_times, last_metrics, nonfinite, dumped)
    dist.barrier()


def _finish(out: Path, cfg: DemoConfig, world: int, mcfg, monitored_times, plain_times, last_metrics, nonfinite,
            dumped) -> None:
    from ..reconstruct import read_config, reconstruct_gradients, write_reconstruction
    from .report import make_report

    recon_step = dumped[-1] if dumped else None
    if recon_step is not None:
        grads = reconstruct_gradients(out / "gradients", recon_step, verify=True)
        write_reconstruction(grads, out / "reconstructed", recon_step, read_config(out / "gradients"))
    try:
        report = make_report(out)
    except ImportError as e:  # the plotting extra is optional
        report = f"not written: {e}"
    # Paired timing: each pair is a plain step and the monitored step right after it.
    ratios = [m / p - 1 for p, m in zip(plain_times, monitored_times)]
    mon_t = statistics.median(monitored_times) if monitored_times else float("nan")
    plain_t = statistics.median(plain_times) if plain_times else float("nan")
    train = [json.loads(line) for line in open(out / "train.jsonl")]
    tokens = cfg.batch_per_rank * world * mcfg.seq_len
    parsed = ((parse_metric_name(k), v) for k, v in last_metrics.items())
    grad_norms = sorted(((m.name, v) for m, v in parsed if m is not None and m.kind == "grads" and m.field == "norm"),
                        key=lambda kv: -kv[1])
    summary = {
        "config": asdict(cfg), "world_size": world, "model": mcfg.__dict__,
        "loss_first": train[0]["loss"], "loss_last": train[-1]["loss"], "steps_trained": len(train),
        "tokens_per_s_monitored": tokens / mon_t, "tokens_per_s_plain": tokens / plain_t,
        "monitor_overhead": statistics.median(ratios) if ratios else None,
        "monitor_overhead_range": [min(ratios), max(ratios)] if ratios else None,
        "top_grad_norms": grad_norms[:5], "nonfinite": nonfinite, "dumped_steps": dumped,
        "reconstructed_step": recon_step,
        "files": {"metrics": str(out / "metrics.jsonl"), "train_log": str(out / "train.jsonl"),
                  "per_sample_norms": str(out / "per_sample_norms.jsonl"), "gradients": str(out / "gradients"),
                  "reconstructed": str(out / "reconstructed"), "report": str(report)},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if cfg.quiet:
        return
    layout = "HSDP (2 replicas)" if cfg.hsdp else "FSDP2"
    print(f"\ngapmon demo: {layout} on {world} {cfg.device} process(es), {cfg.steps} monitored steps")
    print(f"  loss            {summary['loss_first']:.4f} -> {summary['loss_last']:.4f} "
          f"({len(train)} steps: {cfg.steps} training + {2 * cfg.timing_pairs} timing)")
    print(f"  tokens/s        {summary['tokens_per_s_monitored']:.0f} monitored, {summary['tokens_per_s_plain']:.0f} plain")
    if summary["monitor_overhead"] is not None:
        low, high = summary["monitor_overhead_range"]
        print(f"  monitor cost    {100 * summary['monitor_overhead']:+.0f}% step time, median of {len(ratios)} paired "
              f"steps (range {100 * low:+.0f}% to {100 * high:+.0f}%; rough on a shared CPU; all four kinds + "
              "per-sample norms)")
    print("  top grad norms  " + ", ".join(f"{n} {v:.3g}" for n, v in grad_norms[:3]))
    print(f"  non-finite      {nonfinite or 'none'}")
    verified = " and its 2 replicas compared" if cfg.hsdp else ""
    print(f"  dumped steps    {dumped}; step {recon_step} reconstructed{verified}")
    print("  files:")
    for key, path in summary["files"].items():
        print(f"    {key:<17} {path}")
    print(f"    {'summary':<17} {out / 'summary.json'}")


def run_demo(cfg: DemoConfig) -> None:
    """Runs the demo: under torchrun when launched by it, else spawning cfg.nproc processes."""
    cfg.check()
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but torch sees no CUDA device")
    if cfg.device == "cuda" and cfg.nproc > torch.cuda.device_count():
        raise ValueError(f"--device cuda runs one process per GPU (NCCL): {cfg.nproc} processes asked for, "
                         f"{torch.cuda.device_count()} GPU(s) visible; pass --nproc {torch.cuda.device_count()}")
    out = Path(cfg.out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; pass --out to a new directory")
    out.mkdir(parents=True, exist_ok=True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        _worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cfg, None)
        return
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(cfg.nproc, cfg, port), nprocs=cfg.nproc, join=True)
