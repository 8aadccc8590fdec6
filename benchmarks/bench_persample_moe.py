"""Per-sample gradient norms in a mixture of experts' training steps: a 2-layer transformers Mixtral (hidden 256,
experts' intermediate 512, top-2 of E experts, vocabulary 4096, B=8, T=128, float32 on the CPU, bf16 autocast on
CUDA), its experts run by each of transformers' implementations (eager loop, batched or grouped products).

Three kinds of step rotate in one process (plain, with norms, with norms and book-keeping), each a block of
three steps, the first untimed; the ratio is the median over rotations of a block over the plain block of its
rotation (a shared machine's drift moves both alike). Needs transformers.

    python benchmarks/bench_persample_moe.py [--device cuda] [--experts 8 64] [--implementations grouped_mm eager]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import gapmon

VOCAB, BATCH, SEQ = 4096, 8, 128
KINDS = ("plain", "norms", "bookkeeping")


def mixtral(device: str, experts: int, implementation: str) -> torch.nn.Module:
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                                     num_local_experts=experts, num_experts_per_tok=2)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM._from_config(cfg, experts_implementation=implementation).to(device)


def measure(device: str, experts: int, implementation: str, rotations: int) -> dict:
    model = mixtral(device, experts, implementation)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device == "cuda" else contextlib.nullcontext

    def step(monitor, i: int) -> float:
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(i)).to(device)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if monitor is not None:
            monitor.begin_step(i, batch_size=BATCH)
        with autocast():
            logits = model(input_ids=ids).logits
        F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1)).backward()
        if monitor is not None:
            monitor.end_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    covered = None
    i = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (nothing is left out in this model; a warning would show in `covered`)
        for rotation in range(rotations + 1):  # the first rotation warms up
            for kind in KINDS:
                monitor = None if kind == "plain" else gapmon.GAPMonitor(
                    model, params=False, grads=False, activations=False, activation_grads=False,
                    per_sample_grad_norms=True, bookkeeping=kind == "bookkeeping", sinks=[])
                spent = []
                for k in range(3):
                    i += 1
                    t = step(monitor, i)
                    if k:
                        spent.append(t)
                if rotation:
                    times[kind].append(statistics.mean(spent))
                if monitor is not None:
                    cov = monitor.per_sample.coverage()
                    covered = f"{len(cov['covered'])}/{len(cov['covered']) + len(cov['uncovered'])}"
                    monitor.close()
    ratio = {kind: statistics.median(t / p for t, p in zip(times[kind], times["plain"])) for kind in KINDS}
    return {"experts": experts, "implementation": implementation, "covered": covered,
            **{f"{kind}_s": statistics.median(times[kind]) for kind in KINDS},
            **{f"{kind}_ratio": ratio[kind] for kind in KINDS if kind != "plain"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--experts", type=int, nargs="+", default=[8])
    parser.add_argument("--implementations", nargs="+", default=["grouped_mm", "eager"])
    parser.add_argument("--rotations", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from common import machine

    info = machine(args.device)
    print(f"# per-sample norms in Mixtral training steps (B={BATCH}, T={SEQ}) on {info['device']}, torch {info['torch']}")
    rows = ["| experts | implementation | covered | plain step | with norms | with norms, book-keeping |",
            "| ---: | --- | ---: | ---: | ---: | ---: |"]
    results = []
    for experts in args.experts:
        for implementation in args.implementations:
            r = measure(args.device, experts, implementation, args.rotations)
            results.append(r)
            rows.append(f"| {experts} | {implementation} | {r['covered']} | {r['plain_s']*1e3:.1f} ms | "
                        f"{r['norms_s']*1e3:.1f} ms ({r['norms_ratio']:.2f}x) | "
                        f"{r['bookkeeping_s']*1e3:.1f} ms ({r['bookkeeping_ratio']:.2f}x) |")
            print(rows[-1], flush=True)
    table = "\n".join(rows)
    print("\n" + table)
    name = "cpu-" + info["host"] if args.device == "cpu" else info["device"].replace(" ", "-").lower()
    out = Path(args.out or Path(__file__).parent / "results" / f"persample-moe-{name}.json")
    out.write_text(json.dumps({"machine": info, "results": results, "table": table}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
