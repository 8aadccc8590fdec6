"""The `gapmon` command line (also `python -m gapmon`)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from ..stats import ops, reference
from ..stats.layout import STAT_NAMES


def _info(args: argparse.Namespace) -> int:
    print(f"gapmon backend: {ops.backend()}  (CPU instruction set: {ops.cpu_isa()})")
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}, threads: {torch.get_num_threads()}")
    if ops.cuda_kernels_compiled():
        print("CUDA kernels: compiled in")
    else:
        print("CUDA kernels: not compiled in (build with GAPMON_CUDA=1 where torch has CUDA and nvcc is found)")
    return 0


def _example(args: argparse.Namespace) -> int:
    """Statistics of a few typical training tensors, checked against the reference and timed."""
    device = args.device
    g = torch.Generator(device="cpu").manual_seed(0)
    tensors = {
        "weight (bf16, 4096x1024)": (torch.randn(4096, 1024, generator=g) * 0.02).bfloat16(),
        "grad with a NaN (fp32)": torch.randn(1 << 20, generator=g) * 1e-3,
        "activations (fp16, [8, 512, 768])": torch.randn(8, 512, 768, generator=g).half(),
        "offset data (mean 1000x std)": torch.randn(1 << 22, generator=g) + 1000,
    }
    tensors["grad with a NaN (fp32)"][12345] = float("nan")
    tensors = {k: v.to(device) for k, v in tensors.items()}
    print(f"gapmon backend: {ops.backend()}\n")
    header = f"{'tensor':<36}" + "".join(f"{n:>12}" for n in STAT_NAMES)
    print(header + "\n" + "-" * len(header))
    multi = ops.multi_tensor_stats(list(tensors.values()))  # all tensors, one launch
    for i, name in enumerate(tensors):
        print(f"{name:<36}" + "".join(f"{float(getattr(multi, f)[i]):>12.5g}" for f in STAT_NAMES))
    x = tensors["offset data (mean 1000x std)"]
    fused = _time(lambda: ops.tensor_stats(x), device)
    slow = _time(lambda: reference.tensor_stats(x), device)
    print(f"\n{x.numel():,} fp32 elements: gapmon {fused*1e3:.2f} ms, pure-PyTorch reference {slow*1e3:.2f} ms "
          f"({slow/fused:.0f}x)")
    return 0


def _time(fn, device: str, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    if args.verbose:  # the workers print their tracebacks too
        os.environ["GAPMON_VERBOSE"] = "1"
    nproc = args.nproc
    if nproc is None:  # two processes; on GPUs one per GPU (NCCL), at most two
        nproc = 2 if args.device == "cpu" else max(1, min(2, torch.cuda.device_count()))
    run_demo(DemoConfig(nproc=nproc, steps=args.steps, device=args.device, out=args.out,
                        dump_every=args.dump_every, hsdp=args.hsdp, quiet=args.quiet))
    return 0


def _report(args: argparse.Namespace) -> int:
    from .report import make_report

    skipped: list[str] = []
    path = make_report(args.run_dir, skipped)
    for line in skipped:
        print(f"gapmon report: left out {line}", file=sys.stderr)
    print(f"report written to {path}")
    return 0


def _reconstruct(args: argparse.Namespace) -> int:
    from ..dump.export import write_reconstruction
    from ..dump.format import step_dir
    from ..dump.reconstruct import read_complete, reconstruct_gradients, step_config
    from .progress import Progress

    progress = Progress(f"step {args.step}", quiet=args.quiet)
    grads = reconstruct_gradients(args.grad_dir, args.step, verify=args.verify, progress=progress)
    record = read_complete(step_dir(args.grad_dir, args.step))
    config = step_config(Path(args.grad_dir), record)
    files = write_reconstruction(grads, args.output_dir, args.step, config, skip_individual=args.skip_individual,
                                 fmt=args.format)
    if not args.quiet:
        total = sum(t.numel() for t in grads.values())
        replicas = int(config.get("num_replicas", 1))
        verified = ""
        if args.verify:
            checked = len(record.files)
            compared = f"{replicas} replicas compared" if replicas > 1 else "one replica"
            verified = f" (checksums of {checked} file{'s' if checked != 1 else ''} verified; {compared})"
        print(f"step {args.step}: {len(grads)} gradients, {total:,} elements{verified} -> {args.output_dir}")
        if args.verbose:
            for f in files:
                print(f"  {f}")
    return 0


def _steps(args: argparse.Namespace) -> int:
    from ..dump.reconstruct import list_steps, read_config

    read_config(args.grad_dir)  # refuses a folder that is not a dump
    complete, incomplete = list_steps(args.grad_dir)
    print(f"complete:   {' '.join(map(str, complete)) or '-'}")
    print(f"incomplete: {' '.join(map(str, incomplete)) or '-'}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from ..dump.analysis import compare, load_gradients

    a, b = load_gradients(args.a), load_gradients(args.b)
    rows = compare(a, b)
    for side, mine, other in (("A", a, b), ("B", b, a)):
        only = [name for name in mine if name not in other]
        if only:
            print(f"only in {side} ({len(only)}): {', '.join(only)}")
    if not rows:
        raise ValueError("the two dumps share no gradient names")
    width = max(len(r.name) for r in rows)
    print(f"{'parameter':<{width}}  {'norm A':>11}  {'norm B':>11}  {'rel. diff':>10}  {'cosine':>8}")
    for r in rows:
        print(f"{r.name:<{width}}  {r.norm_a:>11.4g}  {r.norm_b:>11.4g}  {r.rel_diff:>10.3g}  {r.cosine:>8.5f}")
    return 0


def _similarity(args: argparse.Namespace) -> int:
    from ..dump.per_sample_files import collected_layers, collected_steps, similarity_from_files
    from .run_format import per_sample_gradients_dir

    root = per_sample_gradients_dir(args.dir)
    steps = collected_steps(root)
    if not steps:
        raise FileNotFoundError(f"{args.dir} holds no collected per-sample gradients (gapmon.per_sample.PerSampleGradients)")
    step = steps[-1] if args.step is None else args.step
    layers = collected_layers(root, step)
    layer = args.layer or (layers[0] if layers else None)
    if layer not in layers:
        raise ValueError(f"no layer {layer!r} collected at step {step}; collected: {', '.join(layers) or '-'}")
    ids, cos = similarity_from_files(root, step, layer)
    print(f"step {step}, layer {layer}: cosine similarity of {len(ids)} samples' gradients (rows and columns: ids)")
    print("      " + " ".join(f"{int(i):>6}" for i in ids))
    for i, row in zip(ids.tolist(), cos.tolist()):
        print(f"{i:>6} " + " ".join(f"{v:6.3f}" for v in row))
    if args.plot:
        from .report import similarity_figure

        print(f"wrote {similarity_figure(ids, cos, f'step {step}, {layer}', args.plot)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gapmon", description="Gradient/activation/parameter monitoring for PyTorch.")
    parser.add_argument("--verbose", action="store_true", help="more output; tracebacks on errors")
    # Also accepted after the subcommand; SUPPRESS keeps a --verbose given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="more output; tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)
    add = sub.add_parser

    def add_parser(name, **kwargs):
        return add(name, parents=[common], **kwargs)

    sub.add_parser = add_parser
    p = sub.add_parser("demo", help="train a small GPT with FSDP2 and every gapmon feature, then report")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to spawn (default 2; with --device cuda one per GPU, at most 2; ignored under torchrun)")
    p.add_argument("--steps", type=int, default=20,
                   help="training steps, all monitored (3 plain/monitored timing pairs follow)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default="gapmon-demo", help="run directory (must be new or empty)")
    p.add_argument("--dump-every", type=int, default=5, help="dump gradients every K steps")
    p.add_argument("--hsdp", action="store_true", help="2-D mesh: 2 replicas x nproc/2 shards")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_demo)
    p = sub.add_parser("report", help="plots and a markdown summary of a run directory")
    p.add_argument("run_dir", help="a run directory with metrics.jsonl (written by `gapmon demo` or a JSONLSink)")
    p.set_defaults(func=_report)
    p = sub.add_parser("info", help="show the active backend and instruction set")
    p.set_defaults(func=_info)
    p = sub.add_parser("example", help="statistics of a few tensors, checked and timed")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.set_defaults(func=_example)
    p = sub.add_parser("reconstruct", help="rebuild full gradients of one dumped step")
    p.add_argument("grad_dir", help="a GradientDumper directory (holds config.json)")
    p.add_argument("output_dir", help="where the reconstructed files go (created if missing)")
    p.add_argument("--step", type=int, required=True, help="the dumped step to rebuild")
    p.add_argument("--verify", action="store_true", help="compare every HSDP/DDP replica; fail on a mismatch")
    p.add_argument("--skip-individual", action="store_true", help="only write the combined file")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--format", default="safetensors", choices=["safetensors", "pt"])
    p.set_defaults(func=_reconstruct)
    p = sub.add_parser("steps", help="list complete and incomplete dumped steps")
    p.add_argument("grad_dir", help="a GradientDumper directory (holds config.json)")
    p.set_defaults(func=_steps)
    p = sub.add_parser("compare", help="compare two reconstructed steps (relative difference, cosine)")
    p.add_argument("a", help="reconstructed gradients: a .safetensors or .pt file, or a directory holding one "
                             "step*_all_gradients file")
    p.add_argument("b", help="the other reconstructed gradients, as for A")
    p.set_defaults(func=_compare)
    p = sub.add_parser("similarity", help="cosine similarity of collected per-sample gradients (PerSampleGradients)")
    p.add_argument("dir", help="a PerSampleGradients directory, or a run directory holding per_sample_gradients/")
    p.add_argument("--step", type=int, default=None, help="the step (default: the last collected)")
    p.add_argument("--layer", default=None, help="the layer's module name (default: the first collected)")
    p.add_argument("--plot", default=None, help="also write the matrix as a heat map to this PNG")
    p.set_defaults(func=_similarity)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        print("gapmon: interrupted", file=sys.stderr)
        return 130
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"gapmon {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one clear line unless --verbose
        if args.verbose:
            raise
        print(f"gapmon {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
