"""`gapmon report RUN_DIR`: plots and a short markdown summary of a monitored run.

Reads RUN_DIR/metrics.jsonl (GAPMonitor), and when present RUN_DIR/train.jsonl (loss per step)
and RUN_DIR/per_sample_norms.jsonl (per-sample gradient norms per step), as gapmon.run_format
names them. Writes PNGs and RUN_DIR/report/report.md.
"""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..dump.per_sample_files import collected_layers, collected_steps, similarity_from_files
from ..dump.safe_io import atomic_write, ensure_real_dir
from ..monitor.metric_names import GNS_ALL, gns_name, parse_metric_name, parse_update_name
from ..stats.block_formats import BLOCK_FORMATS
from ..stats.layout import BIN, BIN_NAMES, EXP_MAX, EXP_MIN
from ..stats.numerics import FORMATS, format_shares, histogram_rows
from ..utils import check_real
from .run_format import METRICS_FILE, PER_SAMPLE_FILE, REPORT_DIR, TRAIN_FILE, per_sample_gradients_dir, read_run_file


def _series(records: list[dict[str, Any]], kind: str, field: str) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in records:
        for key, value in r.items():
            metric = parse_metric_name(key)
            if metric is not None and metric.kind == kind and metric.field == field and isinstance(value, (int, float)):
                out[metric.name].append((r["step"], float(value)))
    return dict(out)


def update_series(records: list[dict[str, Any]], field: str) -> dict[str, list[tuple[int, float]]]:
    """{parameter: [(step, value)]} of the optimizer-update metric `field` (gap/update/{parameter}/{field})."""
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in records:
        for key, value in r.items():
            parsed = parse_update_name(key)
            if parsed is not None and parsed[1] == field and isinstance(value, (int, float)):
                out[parsed[0]].append((r["step"], float(value)))
    return dict(out)


def gns_series(records: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{group: {"step": [(step, B_simple of that step)], "ema": [(step, B_simple of the moving averages)]}}."""
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    groups = {key.split("/")[2] for r in records for key in r if key.startswith("gap/gns/")}
    for group in sorted(groups):
        out[group] = {kind: [(r["step"], float(r[gns_name(group, field)])) for r in records
                             if isinstance(r.get(gns_name(group, field)), (int, float))]
                      for kind, field in (("step", "b_simple_step"), ("ema", "b_simple"))}
    return out


def block_format_series(records: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{"{kind} {format}": {"sqnr_db": [(step, mean over tensors)], "block_underflow": [...]}} of the per-block
    format metrics (GAPMonitor(block_formats=...)); finite values only (an exact cast has SQNR inf)."""
    sums: dict[tuple[str, str, str, int], list[float]] = defaultdict(list)
    for r in records:
        for key, value in r.items():
            metric = parse_metric_name(key)
            if metric is None or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            for fmt in BLOCK_FORMATS:
                for field in ("sqnr_db", "block_underflow"):
                    if metric.field == f"{fmt}_{field}":
                        sums[(f"{metric.kind} {fmt}", field, "", r["step"])].append(float(value))
    out: dict[str, dict[str, list[tuple[int, float]]]] = defaultdict(lambda: {"sqnr_db": [], "block_underflow": []})
    for (group, field, _, step), values in sorted(sums.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][3])):
        out[group][field].append((step, sum(values) / len(values)))
    return dict(out)


def global_grad_norms(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """sqrt(sum over parameters of gradient norm^2) per step."""
    norms = _series(records, "grads", "norm")
    by_step: dict[int, float] = defaultdict(float)
    for values in norms.values():
        for step, v in values:
            by_step[step] += v * v
    return sorted((s, math.sqrt(v)) for s, v in by_step.items())


def anomalies(records: list[dict[str, Any]], spike: float = 10.0) -> list[tuple[int, str, str]]:
    """(step, tensor, what): non-finite values, and gradient norms above `spike` x their median."""
    spike = check_real(spike, "gapmon report", "spike (a multiple of the median norm)", above=1.0)
    found = []
    for r in records:
        for key, value in r.items():
            metric = parse_metric_name(key)
            if metric is not None and metric.field == "nonfinite" and isinstance(value, (int, float)) and value > 0:
                found.append((r["step"], f"{metric.kind}/{metric.name}", f"{int(value)} non-finite values"))
    for name, values in _series(records, "grads", "norm").items():
        finite = sorted(v for _, v in values if math.isfinite(v))
        if len(finite) < 3:
            continue
        median = finite[len(finite) // 2]
        for step, v in values:
            if median > 0 and v > spike * median:
                found.append((step, f"grads/{name}", f"norm {v:.3g} = {v / median:.0f}x its median"))
    return sorted(found)


def numerics_series(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per histogram group ("grads/Linear"): its steps, dense exponent histograms [steps][bins], and
    the underflow/overflow shares over steps of each format the run monitored (from the histograms:
    the group's share of all its elements)."""
    formats = sorted({m.field.removesuffix("_underflow") for r in records for m in map(parse_metric_name, r)
                      if m is not None and m.field.endswith("_underflow")} & set(FORMATS)) or ["bf16"]
    groups: dict[str, dict[int, dict[str, int]]] = defaultdict(dict)
    scaled: dict[str, dict[int, dict]] = defaultdict(dict)
    for r in records:  # a step written again (a resumed run into the same folder): its last record counts
        for group, bins in (r.get("numerics_histograms") or {}).items():
            if isinstance(bins, dict) and any(bins.values()):  # a group with no element this step: no data
                groups[group][r["step"]] = bins
                counts = (r.get("numerics_scaled") or {}).get(group)
                if isinstance(counts, dict):
                    scaled[group][r["step"]] = counts
    out = {}
    for group, by_step in groups.items():
        seen = sorted(by_step.items())
        rows = histogram_rows([bins for _, bins in seen])
        total = rows[:, len(BIN_NAMES)].tolist()
        shares = {f: {k: v.tolist() for k, v in format_shares(rows, f).items()} for f in formats}
        for f in formats:  # at each tensor's own power-of-two scale, where the run recorded it
            per_step = [scaled[group].get(step, {}).get(f) for step, _ in seen]
            if all(isinstance(c, dict) for c in per_step):
                for kind in ("underflow", "overflow"):
                    shares[f][f"{kind}_scaled"] = [c[kind] / n if n else math.nan for c, n in zip(per_step, total)]
        out[group] = {"steps": [s for s, _ in seen], "histograms": rows[:, :len(BIN_NAMES)].tolist(), "shares": shares}
    return out


def _log_heatmap(series: dict[str, list[tuple[int, float]]], steps: list[int], title: str, label: str, cmap: str,
                 path: Path, plt, np) -> None:
    """A tensors x steps heat map of log10 of `series` (blank where a value is missing, zero or non-finite)."""
    names = list(series)
    col = {s: i for i, s in enumerate(steps)}
    grid = np.full((len(names), len(steps)), np.nan)
    for i, name in enumerate(names):
        for step, v in series[name]:
            grid[i, col[step]] = math.log10(v) if v > 0 and math.isfinite(v) else np.nan
    fig, ax = plt.subplots(figsize=(max(6, len(steps) * 0.35 + 3), max(4, len(names) * 0.22 + 1.5)))
    im = ax.imshow(grid, aspect="auto", cmap=cmap, interpolation="nearest")
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xticks(range(len(steps)), steps, fontsize=7)
    ax.set_xlabel("step")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label=label)
    fig.tight_layout()
    _save(fig, path, 110)
    plt.close(fig)


def _add_figure(fig, out: Path, image: str, title: str, images: list, plt) -> None:
    """Lays out, saves (atomically) and closes a report figure, and lists it under `title`."""
    fig.tight_layout()
    _save(fig, out / image, 110)
    plt.close(fig)
    images.append((title, image))


def _save(fig, path: Path, dpi: int) -> None:
    """A figure as a PNG, written atomically (a link planted at `path` is replaced, never written through)."""
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))


def _numerics_figure(series: dict[str, dict[str, Any]], path: Path, plt, np) -> None:
    """Per group: the exponent histogram over steps (steps across, exponent up, colour the log10
    share of the group's elements), and the per-format underflow/overflow shares."""
    order = {"grads": 0, "activation_grads": 1, "activations": 2, "params": 3}  # gradients first: what a recipe casts
    groups = sorted(series, key=lambda g: (order.get(g.split("/")[0], 4), g))[:10]
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 2.8 * len(groups)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2]})
    for (heat, lines), group in zip(axes, groups):
        data = series[group]
        hist = np.asarray(data["histograms"], dtype=float)  # [steps, bins]
        # Rows, bottom up: zero, tiny (float64 below 2^-149), float32 subnormal, e-125..e128, huge (>= 2^128).
        order = ["zero", "tiny", "subnormal", *(f"e{e}" for e in range(EXP_MIN, EXP_MAX + 1)), "huge"]
        rows = hist[:, [BIN[name] for name in order]]
        labels = ["zero", "tiny", "sub", *(str(e) for e in range(EXP_MIN, EXP_MAX + 1)), "huge"]
        # Shown: the special rows that hold data, and the exponents from the lowest to the highest that
        # holds data (not the empty binades between zero and them).
        first, last = 3, len(order) - 2  # e-125 and e128
        used = np.nonzero(rows[:, first:last + 1].sum(0))[0] + first
        shown = ([i for i in (0, 1, 2) if rows[:, i].any()] + (list(range(used[0], used[-1] + 1)) if used.size else [])
                 + ([len(order) - 1] if rows[:, -1].any() else []))
        shown = shown or [0]
        total = np.maximum(hist.sum(1, keepdims=True), 1)
        with np.errstate(divide="ignore"):
            share = np.log10(rows[:, shown] / total).T
        share[~np.isfinite(share)] = np.nan
        im = heat.imshow(share, aspect="auto", origin="lower", cmap="magma", interpolation="nearest")
        special = [t for t, i in enumerate(shown) if i < first or i > last]
        exps = [t for t, i in enumerate(shown) if first <= i <= last]
        ticks = sorted(set(special) | set(exps[::max(1, len(exps) // 8)]) | set(exps[-1:]))
        heat.set_yticks(ticks, [labels[shown[t]] for t in ticks], fontsize=7)
        heat.set_xticks(range(len(data["steps"])), data["steps"], fontsize=6)
        heat.set_ylabel("exponent e: |x| in [2^(e-1), 2^e)", fontsize=7)
        heat.set_title(f"{group}: exponent histogram (log10 share)", fontsize=9)
        fig.colorbar(im, ax=heat)
        lines.plot(data["steps"], hist[:, 0] / total[:, 0], color="grey", label="zeros")
        for i, (fmt, shares) in enumerate(data["shares"].items()):
            colour = plt.cm.tab10(i % 10)
            lines.plot(data["steps"], shares["underflow"], color=colour, label=f"{fmt} underflow")
            lines.plot(data["steps"], shares["overflow"], color=colour, linestyle="--", label=f"{fmt} overflow")
            if "underflow_scaled" in shares:  # what a recipe that scales each tensor sees
                lines.plot(data["steps"], shares["underflow_scaled"], color=colour, linestyle=":", linewidth=2,
                           label=f"{fmt} underflow, scaled")
        lines.set_ylim(bottom=0)
        lines.set_xlabel("step", fontsize=7)
        lines.set_title(f"{group}: share of elements", fontsize=9)
        lines.legend(fontsize=6)
    fig.tight_layout()
    _save(fig, path, 100)
    plt.close(fig)


def similarity_figure(ids, cos, title: str, path, dpi: int = 110) -> Path:
    """Writes a [N, N] cosine-similarity matrix of per-sample gradients as a heat map PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(ids)
    fig, ax = plt.subplots(figsize=(5 + 0.05 * n, 4.5 + 0.05 * n))
    image = ax.imshow(cos.numpy(), cmap="RdBu_r", vmin=-1, vmax=1)
    if n <= 32:
        ax.set_xticks(range(n), [str(int(i)) for i in ids], rotation=90, fontsize=6)
        ax.set_yticks(range(n), [str(int(i)) for i in ids], fontsize=6)
    ax.set_title(f"Per-sample gradient cosine similarity: {title}")
    fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    _save(fig, Path(path), dpi)
    plt.close(fig)
    return Path(path)


def _numerics_table(series: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| group | format | zeros, first → last step | underflow, first → last step | overflow, last step "
             "| scaled underflow, first → last step | scaled overflow, last step |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]

    def pct(value: float) -> str:
        return "–" if value is None or math.isnan(value) else f"{value:.2%}"

    for group in sorted(series):
        data = series[group]
        hist = data["histograms"]
        zeros = [h[0] / max(sum(h), 1) for h in (hist[0], hist[-1])]
        first, last = data["steps"][0], data["steps"][-1]
        for fmt, shares in data["shares"].items():
            under_s, over_s = shares.get("underflow_scaled"), shares.get("overflow_scaled")
            scaled = (f"{pct(under_s[0])} → {pct(under_s[-1])} | {pct(over_s[-1])}" if under_s else "– | –")
            lines.append(f"| {group} | {fmt} | {zeros[0]:.2%} → {zeros[1]:.2%} | {pct(shares['underflow'][0])} → "
                         f"{pct(shares['underflow'][-1])} | {pct(shares['overflow'][-1])} | {scaled} |")
        lines[-len(data["shares"]):] = [line.replace(f"| {group} |", f"| {group} (steps {first}..{last}) |", 1)
                                        for line in lines[-len(data["shares"]):]]
    return lines


def make_report(run_dir: str | Path, skipped: list[str] | None = None) -> Path:
    """Writes the plots and report.md under RUN_DIR/report; returns the markdown path. Records that
    cannot be read are left out and named ("file:line: why") in `skipped` and in the report."""
    try:
        import matplotlib
        import numpy as np
    except ImportError as e:
        raise ImportError(f"gapmon report needs matplotlib and numpy ({e.name} is missing): "
                          "pip install 'gapmon[report]' (or: pip install matplotlib numpy)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    skipped = [] if skipped is None else skipped
    records = read_run_file(run_dir, METRICS_FILE, skipped)
    if not records:
        raise FileNotFoundError(f"{run_dir}/{METRICS_FILE} is missing or empty: not a GAPMonitor run directory")
    out = run_dir / REPORT_DIR
    out = ensure_real_dir(run_dir, out)  # never a link planted there: nothing is written outside run_dir
    images = []

    # 1. Gradient-norm heat map: layers x steps, log scale.
    grad_norms = _series(records, "grads", "norm")
    steps = sorted({r["step"] for r in records})
    names = list(grad_norms)
    _log_heatmap(grad_norms, steps, "Gradient norm per parameter (log10)", "log10 ||grad||", "viridis",
                 out / "grad_norm_heatmap.png", plt, np)
    images.append(("Gradient norm per parameter", "grad_norm_heatmap.png"))

    # 2. Activation max over steps (the 12 modules with the largest values).
    act_max = _series(records, "activations", "max")
    top = sorted(act_max, key=lambda n: -max((v for _, v in act_max[n] if math.isfinite(v)), default=0))[:12]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, name in enumerate(top):  # tab20: a distinct colour for each of up to 12 lines
        xs, ys = zip(*act_max[name])
        ax.plot(xs, ys, label=name, linewidth=1.2, color=plt.cm.tab20(i % 20))
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("max |activation|")
    ax.set_title("Activation max over steps (largest 12 modules)")
    ax.legend(fontsize=6, ncol=2)
    _add_figure(fig, out, "activation_max.png", "Activation max", images, plt)

    # 3. Loss and global gradient norm.
    train = read_run_file(run_dir, TRAIN_FILE, skipped)
    fig, ax = plt.subplots(figsize=(8, 4))
    gn = global_grad_norms(records)
    if gn:
        ax.plot(*zip(*gn), color="tab:blue", label="global grad norm")
    ax.set_xlabel("step")
    ax.set_ylabel("global gradient norm", color="tab:blue")
    ax.set_yscale("log")
    if train:
        ax2 = ax.twinx()
        ax2.plot([t["step"] for t in train], [t["loss"] for t in train], color="tab:red", label="loss")
        ax2.set_ylabel("loss", color="tab:red")
    ax.set_title("Loss and global gradient norm")
    _add_figure(fig, out, "loss_grad_norm.png", "Loss and global gradient norm", images, plt)

    # 4. Per-sample gradient norms.
    per_sample = read_run_file(run_dir, PER_SAMPLE_FILE, skipped)
    if per_sample:
        values = [v for r in per_sample for v in r["norms"] if math.isfinite(v)]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.hist(values, bins=40, color="tab:green")
        ax.set_xlabel("per-sample gradient norm")
        ax.set_ylabel("samples")
        ax.set_title(f"Per-sample gradient norms ({len(values)} samples over {len(per_sample)} steps)")
        _add_figure(fig, out, "per_sample_norms.png", "Per-sample gradient norms", images, plt)

    # 5. Low-precision numerics (GAPMonitor(numerics=...)): exponent histograms over steps.
    numerics = numerics_series(records)
    if numerics:
        _numerics_figure(numerics, out / "numerics.png", plt, np)
        images.append(("Low-precision numerics", "numerics.png"))

    # 6. Gradient noise scale (per-sample norms on) over steps, with its moving-average estimate.
    gns = gns_series(records)
    if gns:
        fig, ax = plt.subplots(figsize=(8, 4))
        for i, (group, series) in enumerate(gns.items()):
            color = "black" if group == GNS_ALL else plt.cm.tab10(i % 10)
            if series["ema"]:
                ax.plot(*zip(*series["ema"]), color=color, linewidth=1.6 if group == GNS_ALL else 1.0, label=group)
            if group == GNS_ALL and series["step"]:
                ax.scatter(*zip(*series["step"]), color=color, s=8, alpha=0.4, label="all (one step)")
        ax.set_yscale("symlog")
        ax.set_xlabel("step")
        ax.set_ylabel("B_simple = tr(Sigma) / |G|^2")
        ax.set_title("Gradient noise scale (critical batch size), moving averages")
        ax.legend(fontsize=7)
        _add_figure(fig, out, "noise_scale.png", "Gradient noise scale", images, plt)

    # 7. Per-block formats (GAPMonitor(block_formats=...)): mean SQNR and underflow share per kind and format.
    blocks = block_format_series(records)
    if blocks:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
        for i, (group, series) in enumerate(blocks.items()):
            color = plt.cm.tab10(i % 10)
            if series["sqnr_db"]:
                top.plot(*zip(*series["sqnr_db"]), color=color, label=group)
            if series["block_underflow"]:
                bottom.plot(*zip(*series["block_underflow"]), color=color, label=group)
        top.set_ylabel("SQNR (dB), mean over tensors")
        top.set_title("Per-block formats: quantisation SQNR and non-zero values cast to zero")
        bottom.set_ylabel("share cast to zero")
        bottom.set_xlabel("step")
        top.legend(fontsize=7)
        _add_figure(fig, out, "block_formats.png", "Per-block formats (MX, NVFP4, current scaling)", images, plt)

    # 8. Per-sample gradient similarity of the last collected step (PerSampleGradients under RUN_DIR).
    collected = per_sample_gradients_dir(run_dir)
    if collected != run_dir:
        steps_held = collected_steps(collected)
        if steps_held:
            for k, layer in enumerate(collected_layers(collected, steps_held[-1])[:4]):  # a few, not one per layer
                ids, cos = similarity_from_files(collected, steps_held[-1], layer)
                image = f"similarity_{k}.png"  # by place: a module name may be "" or hold any character
                similarity_figure(ids, cos, f"step {steps_held[-1]}, {layer}", out / image)
                images.append((f"Per-sample gradient similarity, {layer} (step {steps_held[-1]})", image))

    # 9. Update-to-weight ratio per parameter (GAPMonitor.watch_optimizer), log scale.
    ratios = update_series(records, "ratio")
    if ratios:
        _log_heatmap(ratios, steps, "Update / weight norm ratio per parameter (log10)", "log10 ||dw|| / ||w||",
                     "magma", out / "update_ratio_heatmap.png", plt, np)
        images.append(("Update / weight ratio per parameter", "update_ratio_heatmap.png"))

    found = anomalies(records)
    lines = [f"# gapmon report: {run_dir.name}", "",
             f"{len(steps)} monitored steps ({steps[0]}..{steps[-1]}), {len(names)} parameters.", ""]
    last = gns.get(GNS_ALL, {}).get("ema")
    if last:
        lines += [f"Gradient noise scale B_simple (moving averages, step {last[-1][0]}): {last[-1][1]:.4g} samples.", ""]
    if train:
        lines.append(f"Loss: {train[0]['loss']:.4f} at step {train[0]['step']} -> {train[-1]['loss']:.4f} "
                     f"at step {train[-1]['step']}.")
        lines.append("")
    lines += ["## Anomalies", ""]
    if found:
        lines += ["| step | tensor | what |", "| ---: | --- | --- |"]
        lines += [f"| {s} | {t} | {w} |" for s, t, w in found[:50]]
        if len(found) > 50:
            lines.append(f"\n({len(found) - 50} more)")
    else:
        lines.append("None: no non-finite values, no gradient-norm spikes (> 10x a parameter's median).")
    lines.append("")
    if numerics:
        lines += ["## Low-precision numerics", "",
                  "Shares of all elements of each group (parameters, gradients, activations or their gradients "
                  "of one layer type). Zeros: exact zeros (in a 16-bit tensor, also values that already flushed). "
                  "Underflow: finite non-zero values below the format's smallest normal (they become subnormal or "
                  "zero in it). Overflow: at or above 2^E of the format's largest binade. Unscaled: cast as they "
                  "are. Scaled: each tensor first multiplied by the power of two that puts its largest |x| in the "
                  "format's top binade (OCP MX per-tensor scaling): what a scaled fp8 recipe sees.", "",
                  *_numerics_table(numerics), ""]
    if blocks:
        lines += ["## Per-block formats", "",
                  "Each tensor cast exactly to the format (blocks along its last dim; gapmon.stats.block_formats): "
                  "the mean over tensors, at the last step, of the SQNR (10 log10 of signal over quantisation error "
                  "energy) and of the share of non-zero values that become zero.", "",
                  "| kind and format | step | SQNR (dB) | cast to zero |", "| --- | ---: | ---: | ---: |"]
        for group, series in blocks.items():
            last_sqnr = series["sqnr_db"][-1] if series["sqnr_db"] else (None, math.nan)
            last_zero = series["block_underflow"][-1] if series["block_underflow"] else (None, math.nan)
            lines.append(f"| {group} | {last_sqnr[0] if last_sqnr[0] is not None else last_zero[0]} | "
                         f"{last_sqnr[1]:.2f} | {last_zero[1]:.3g} |")
        lines.append("")
    if skipped:
        lines += ["## Records left out", "", *[f"- `{line}`" for line in skipped], ""]
    for title, image in images:
        lines += [f"## {title}", "", f"![{title}]({image})", ""]
    path = out / "report.md"
    atomic_write(path, lambda tmp: Path(tmp).write_text("\n".join(lines), encoding="utf-8"))
    return path
