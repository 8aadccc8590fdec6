"""`gapmon demo`: train a small GPT-style LM with FSDP2 and every gapmon feature switched on.

Spawns N workers itself (gloo on CPU, NCCL on GPU) or runs under torchrun. Every step is
monitored (params, grads, activations, activation grads, per-sample gradient norms); gradients
are dumped every K steps; after training rank 0 reconstructs the last dumped step, writes the
report and prints a summary. The monitor's cost is measured at the end on paired steps: a plain
step, a step with the four kinds, and one with per-sample norms too, in turn (`timing_pairs` such
groups, labelled as such by the progress bar), so that all see the same machine load; the summary
gives the medians and ranges, rough figures on a busy CPU, for this small model.

The run directory is marked as the demo's (MARKER): a later `gapmon demo` replaces a directory so
marked, also one a failed or interrupted run left, and refuses any other non-empty directory.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..monitor.metric_names import parse_metric_name
from .run_format import METRICS_FILE, PER_SAMPLE_FILE, SUMMARY_FILE, TRAIN_FILE, PerSampleRecord, TrainRecord, read_run_file

MARKER = ".gapmon-demo"  # in a run directory the demo made (and may replace)
TIMING_KINDS = ("plain", "four kinds", "four kinds + per-sample norms + numerics + block formats + updates")


@dataclass
class DemoConfig:
    nproc: int = 2
    steps: int = 20
    device: str = "cpu"
    out: str = "gapmon-demo"
    dump_every: int = 5
    hsdp: bool = False
    batch_per_rank: int = 8
    timing_pairs: int = 3  # groups of TIMING_KINDS steps after training: the cost of monitoring, paired
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

    from ..dump.dumper import GradientDumper
    from ..monitor.gap_monitor import GAPMonitor
    from ..monitor.sinks import JSONLSink
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
    sinks = [JSONLSink(out / METRICS_FILE)]
    # numerics: exponent histograms and bf16/fp8 e4m3 underflow/overflow shares (the report's last figure)
    mon = GAPMonitor(model, per_sample_grad_norms=True, sinks=sinks, numerics=("bf16", "fp8_e4m3"),
                     block_formats=("mxfp8_e4m3", "nvfp4"))
    mon.watch_optimizer(opt)  # what AdamW does on the monitored steps (gap/update/...: the report's ratio heat map)
    four_kinds = GAPMonitor(model)  # timing only: the four kinds without per-sample norms, no sink
    dumper = GradientDumper(model, out / "gradients", step_interval=cfg.dump_every, mode="shards", async_write=True)
    progress = Progress("training", quiet=cfg.quiet or rank != 0)  # then the timing groups, labelled
    b = cfg.batch_per_rank
    times: dict[str, list[float]] = {kind: [] for kind in TIMING_KINDS}
    last_metrics, nonfinite, dumped = {}, {}, []
    n_timing = len(TIMING_KINDS) * cfg.timing_pairs
    with contextlib.ExitStack() as files:
        train_log = files.enter_context(open(out / TRAIN_FILE, "w")) if rank == 0 else None
        norms_log = files.enter_context(open(out / PER_SAMPLE_FILE, "w")) if rank == 0 else None
        for step in range(cfg.steps + n_timing):
            # Training steps are all monitored; the timing steps that follow cycle through TIMING_KINDS.
            timing = step >= cfg.steps
            kind = TIMING_KINDS[(step - cfg.steps) % len(TIMING_KINDS)] if timing else TIMING_KINDS[-1]
            monitor = {"plain": None, "four kinds": four_kinds}.get(kind, mon)
            x, y = synthetic_batch(mcfg, b * world, step, device=device)
            ids = torch.arange(step * b * world, (step + 1) * b * world)[rank * b:(rank + 1) * b]
            x, y = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            if monitor is not None:
                monitor.begin_step(step, batch_size=b)
            loss = lm_loss(model(x), y)
            loss.backward()
            if monitor is not None:
                metrics = monitor.end_step()
            if monitor is mon:
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
                times[kind].append(elapsed)
            if rank == 0:
                tokens = b * world * mcfg.seq_len
                train_log.write(TrainRecord(step=step, loss=loss_avg, step_s=elapsed, tokens_per_s=tokens / elapsed,
                                            monitored=kind, timing=timing).to_line())
                train_log.flush()
                if monitor is mon:
                    norms_log.write(PerSampleRecord(step=step, ids=sample_ids.tolist(), norms=norms.tolist()).to_line())
                    norms_log.flush()
                if timing:
                    progress(step - cfg.steps + 1, n_timing, f"timing: plain / four kinds / + per-sample norms, updates, loss {loss_avg:.3f}")
                else:
                    progress(step + 1, cfg.steps, f"loss {loss_avg:.3f}")
    dumper.close()
    mon.close()
    four_kinds.close()
    if rank == 0:
        _finish(out, cfg, world, mcfg, times, last_metrics, nonfinite, dumped)
    dist.barrier()


def _finish(out: Path, cfg: DemoConfig, world: int, mcfg, times: dict[str, list[float]], last_metrics, nonfinite,
            dumped) -> None:
    from ..dump.export import write_reconstruction
    from ..dump.reconstruct import read_config, reconstruct_gradients
    from .report import make_report

    recon_step = dumped[-1] if dumped else None
    if recon_step is not None:
        grads = reconstruct_gradients(out / "gradients", recon_step, verify=True)
        write_reconstruction(grads, out / "reconstructed", recon_step, read_config(out / "gradients"))
    try:
        report = make_report(out)
    except ImportError as e:  # the plotting extra is optional
        report = f"not written: {e}"
    # Paired timing: each monitored step against the plain step of its group.
    plain_times = times["plain"]
    ratios = {kind: [t / p - 1 for p, t in zip(plain_times, times[kind])] for kind in TIMING_KINDS[1:]}
    mon_t = statistics.median(times[TIMING_KINDS[-1]]) if plain_times else float("nan")
    plain_t = statistics.median(plain_times) if plain_times else float("nan")
    train = read_run_file(out, TRAIN_FILE)
    tokens = cfg.batch_per_rank * world * mcfg.seq_len
    parsed = ((parse_metric_name(k), v) for k, v in last_metrics.items())
    grad_norms = sorted(((m.name, v) for m, v in parsed if m is not None and m.kind == "grads" and m.field == "norm"),
                        key=lambda kv: -kv[1])
    summary = {
        "config": asdict(cfg), "world_size": world, "model": mcfg.__dict__,
        "loss_first": train[0]["loss"], "loss_last": train[-1]["loss"], "steps_trained": len(train),
        "tokens_per_s_monitored": tokens / mon_t, "tokens_per_s_plain": tokens / plain_t,
        "monitor_overhead": {kind: statistics.median(r) if r else None for kind, r in ratios.items()},
        "monitor_overhead_range": {kind: [min(r), max(r)] if r else None for kind, r in ratios.items()},
        "top_grad_norms": grad_norms[:5], "nonfinite": nonfinite, "dumped_steps": dumped,
        "reconstructed_step": recon_step,
        "files": {"metrics": str(out / METRICS_FILE), "train_log": str(out / TRAIN_FILE),
                  "per_sample_norms": str(out / PER_SAMPLE_FILE), "gradients": str(out / "gradients"),
                  "reconstructed": str(out / "reconstructed"), "report": str(report)},
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    if cfg.quiet:
        return
    layout = "HSDP (2 replicas)" if cfg.hsdp else "FSDP2"
    print(f"\ngapmon demo: {layout} on {world} {cfg.device} process(es), {cfg.steps} monitored steps")
    print(f"  loss            {summary['loss_first']:.4f} -> {summary['loss_last']:.4f} "
          f"({len(train)} steps: {cfg.steps} training + {2 * cfg.timing_pairs} timing)")
    print(f"  tokens/s        {summary['tokens_per_s_monitored']:.0f} monitored, {summary['tokens_per_s_plain']:.0f} plain")
    if plain_times:
        costs = "; ".join(f"{kind} {100 * statistics.median(r):+.0f}% (range {100 * min(r):+.0f}% to {100 * max(r):+.0f}%)"
                          for kind, r in ratios.items())
        print(f"  monitor cost    {costs}: added step time, median of {len(plain_times)} paired steps, on this small "
              f"model ({mcfg.n_layers} layers, d={mcfg.d_model}, {cfg.batch_per_rank}x{mcfg.seq_len} tokens per rank), "
              "where per-call costs weigh more than on the benchmark model of docs/benchmarks.md; rough on a shared CPU")
    print("  top grad norms  " + ", ".join(f"{n} {v:.3g}" for n, v in grad_norms[:3]))
    print(f"  non-finite      {nonfinite or 'none'}")
    verified = " and its 2 replicas compared" if cfg.hsdp else ""
    print(f"  dumped steps    {dumped}; step {recon_step} reconstructed{verified}")
    print("  files:")
    for key, path in summary["files"].items():
        print(f"    {key:<17} {path}")
    print(f"    {'summary':<17} {out / SUMMARY_FILE}")


def run_demo(cfg: DemoConfig) -> None:
    """Runs the demo: under torchrun when launched by it, else spawning cfg.nproc processes."""
    cfg.check()
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but torch sees no CUDA device")
    if cfg.device == "cuda" and cfg.nproc > torch.cuda.device_count():
        raise ValueError(f"--device cuda runs one process per GPU (NCCL): {cfg.nproc} processes asked for, "
                         f"{torch.cuda.device_count()} GPU(s) visible; pass --nproc {torch.cuda.device_count()}")
    out = Path(cfg.out)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not torchrun or os.environ["RANK"] == "0":
        _prepare_run_dir(out)
    if torchrun:
        _worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cfg, None)
        return
    _spawn(cfg)


def _prepare_run_dir(out: Path) -> None:
    """An empty run directory marked as the demo's: a new or empty one, or one an earlier demo made
    (finished or not), emptied; any other non-empty directory is refused."""
    if out.exists() and any(out.iterdir()):
        if not (out / MARKER).exists():
            raise FileExistsError(f"{out} exists, is not empty and is not a gapmon demo's; pass --out to a new directory")
        for path in out.iterdir():
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by gapmon demo: a later `gapmon demo --out` here replaces this directory\n")


def _spawn(cfg: DemoConfig) -> None:
    """Runs cfg.nproc workers as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR/PORT), each in a
    session of its own: a Ctrl-C in the terminal, at any moment (their start-up, importing torch,
    included), reaches only this process, which stops them (one line, exit code 130). A worker that
    fails reports its error through a pipe; the others are stopped and it becomes one line."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    read_end, write_end = os.pipe()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(cfg.nproc),
           _CONFIG_ENV: json.dumps(asdict(cfg)), _ERROR_FD_ENV: str(write_end), _PARENT_ENV: str(os.getpid())}
    command = [sys.executable, "-c", "from gapmon.apps.demo import _worker_main; _worker_main()"]
    workers: list[subprocess.Popen] = []
    try:
        # A Ctrl-C inside Popen would leave a started worker unlisted (and, in its own session, running
        # on): while Popen runs it is only recorded (Python runs signal handlers in the main thread,
        # whichever thread the signal reached), and raised once the worker is listed.
        pending: list[int] = []

        def hold(signum, frame):
            pending.append(signum)

        for rank in range(cfg.nproc):
            previous = signal.signal(signal.SIGINT, hold)
            try:
                workers.append(subprocess.Popen(command, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                                pass_fds=(write_end,), start_new_session=True))
            finally:
                signal.signal(signal.SIGINT, previous)
            if pending:
                raise KeyboardInterrupt
        os.close(write_end)
        write_end = -1
        while True:
            codes = [w.poll() for w in workers]
            if all(code == 0 for code in codes):
                return
            if any(code not in (None, 0) for code in codes):
                failed = next(r for r, code in enumerate(codes) if code not in (None, 0))
                _stop(workers)
                with os.fdopen(read_end, "r", errors="replace") as errors:
                    read_end = -1
                    reports = [line.strip() for line in errors.read().splitlines() if line.strip()]
                raise WorkerError(reports[0] if reports else f"rank {failed} exited with code {codes[failed]}")
            time.sleep(0.05)
    except BaseException:
        _stop(workers)
        raise
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)


def _stop(workers) -> None:
    for w in workers:
        if w.poll() is None:
            w.terminate()
    for w in workers:
        w.wait()


_CONFIG_ENV = "GAPMON_DEMO_CONFIG"
_ERROR_FD_ENV = "GAPMON_DEMO_ERROR_FD"
_PARENT_ENV = "GAPMON_DEMO_PARENT"


def _end_with_parent(parent: int) -> None:
    """A worker is in a session of its own, out of reach of the terminal: if its parent is killed
    outright (SIGKILL), Linux sends the worker SIGTERM (PR_SET_PDEATHSIG) rather than leave it running."""
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the request: end now
        sys.exit(1)


def _worker_main() -> None:
    """A worker that _spawn started: runs the demo's rank; an error is written to the parent's pipe
    as one line ("rank R: Type: message"; the traceback too with GAPMON_VERBOSE=1) and exits 1."""
    import sys
    import traceback

    _end_with_parent(int(os.environ[_PARENT_ENV]))
    rank = int(os.environ["RANK"])
    cfg = DemoConfig(**json.loads(os.environ[_CONFIG_ENV]))
    try:
        _worker(rank, int(os.environ["WORLD_SIZE"]), cfg, None)
        # Done, its files closed and its process group destroyed: it ends here, before the interpreter's own
        # finalisation, where gloo's worker threads, still freeing tensors of finished async work, can abort the
        # process (SIGABRT, "terminate called without an active exception"; seen once in ~10 demos on the 2-core VM;
        # pytorch/pytorch#179291 describes the race).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        with os.fdopen(int(os.environ[_ERROR_FD_ENV]), "w") as report:
            report.write(f"rank {rank}: {type(e).__name__}: {first}\n")
        if os.environ.get("GAPMON_VERBOSE"):
            traceback.print_exc()
        sys.exit(1)


class WorkerError(RuntimeError):
    """A demo worker failed: the message names its rank and its exception."""
