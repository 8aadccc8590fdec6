"""The files of a monitored run directory, as `gapmon demo` (and a JSONLSink) write them and `gapmon
report` reads them: one JSON object per line, each with an integer "step".

    RUN_DIR/metrics.jsonl           GAPMonitor's JSONLSink: {"step", "<metric name>": value, ..., info}
    RUN_DIR/train.jsonl             TrainRecord per step: loss, time, throughput
    RUN_DIR/per_sample_norms.jsonl  PerSampleRecord per monitored step: global sample ids and their norms
    RUN_DIR/summary.json            the demo's summary (one JSON object)
    RUN_DIR/report/                 what `gapmon report` writes

A reader leaves out a line that is not such an object (a torn last line after a crash, a flipped
byte) and names it, so one bad line never hides the rest of a run.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
TRAIN_FILE = "train.jsonl"
PER_SAMPLE_FILE = "per_sample_norms.jsonl"
SUMMARY_FILE = "summary.json"
REPORT_DIR = "report"
# Collected per-sample gradients (gapmon.per_sample.PerSampleGradients), when a run keeps them beside its metrics.
PER_SAMPLE_GRADIENTS_DIR = "per_sample_gradients"


def per_sample_gradients_dir(path: str | Path) -> Path:
    """The PerSampleGradients directory of `path`: its per_sample_gradients/ when it is a run directory."""
    inner = Path(path) / PER_SAMPLE_GRADIENTS_DIR
    return inner if inner.is_dir() else Path(path)


@dataclass(frozen=True)
class TrainRecord:
    """One training step: its loss (averaged over ranks), wall time, tokens per second, which
    monitoring ran ("plain" for none) and whether it was a timing step rather than training."""

    step: int
    loss: float
    step_s: float
    tokens_per_s: float
    monitored: str
    timing: bool

    def to_line(self) -> str:
        return json.dumps(dataclasses.asdict(self)) + "\n"


@dataclass(frozen=True)
class PerSampleRecord:
    """The per-sample gradient norms of one step, ordered by global sample id."""

    step: int
    ids: list[int]
    norms: list[float]

    def to_line(self) -> str:
        return json.dumps(dataclasses.asdict(self)) + "\n"


# The keys a line of each file must have to be read.
REQUIRED = {METRICS_FILE: ("step",), TRAIN_FILE: ("step", "loss"), PER_SAMPLE_FILE: ("step", "norms")}


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _bad_histograms(value: Any) -> str | None:
    """Why a record's numerics_histograms ({group: {bin name: count}}) cannot be read (None: it can)."""
    from ..stats.layout import BIN_NAMES

    if not isinstance(value, dict):
        return f"numerics_histograms is a {type(value).__name__}, not an object"
    for group, bins in value.items():
        if not isinstance(bins, dict):
            return f"numerics_histograms[{group!r}] is a {type(bins).__name__}, not an object"
        for name, count in bins.items():
            if name not in BIN_NAMES:
                return f"numerics_histograms[{group!r}] has an unknown bin {name!r}"
            if not _is_count(count):
                return f"numerics_histograms[{group!r}][{name!r}] is {count!r}, not a count"
    return None


def _bad_scaled(value: Any) -> str | None:
    """Why a record's numerics_scaled ({group: {format: {"underflow": n, "overflow": n}}}) cannot be read."""
    if not isinstance(value, dict):
        return f"numerics_scaled is a {type(value).__name__}, not an object"
    for group, formats in value.items():
        if not isinstance(formats, dict):
            return f"numerics_scaled[{group!r}] is a {type(formats).__name__}, not an object"
        for fmt, counts in formats.items():
            if not isinstance(counts, dict) or not all(_is_count(counts.get(k)) for k in ("underflow", "overflow")):
                return f"numerics_scaled[{group!r}][{fmt!r}] is {counts!r}, not underflow and overflow counts"
    return None


def _bad_fields(name: str, record: dict[str, Any]) -> str | None:
    """Why a record of run file `name` cannot be used (a field of the wrong type), or None."""
    if name == METRICS_FILE:
        if "numerics_histograms" in record:
            why = _bad_histograms(record["numerics_histograms"])
            if why:
                return why
        if "numerics_scaled" in record:
            return _bad_scaled(record["numerics_scaled"])
    elif name == TRAIN_FILE:
        if not _is_real(record["loss"]):
            return f"loss is {record['loss']!r}, not a number"
    elif name == PER_SAMPLE_FILE:
        norms = record["norms"]
        if not isinstance(norms, list) or not all(_is_real(v) for v in norms):
            return f"norms is {str(norms)[:40]!r}, not a list of numbers"
        ids = record.get("ids", [])
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            return f"ids is {str(ids)[:40]!r}, not a list of integers"
    return None


def read_jsonl(path: Path, skipped: list[str] | None = None, required: tuple[str, ...] = ("step",),
               check: Any = None) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, one per line ([] when there is no file). A line that is not
    a JSON object with the `required` keys and an integer step (or that `check(record)` finds a reason
    against) is left out and named, as "file:line: why", in `skipped`; the other lines are read."""
    if not path.exists():
        return []
    records = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
                why = None if isinstance(record, dict) else f"a JSON {type(record).__name__}, not an object"
            except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, or an integer of too many digits
                why = f"not valid JSON ({str(e)[:120]})"
            except RecursionError:
                why = "nested too deeply to read"
            if why is None:
                lacking = [key for key in required if key not in record]
                step = record.get("step", 0)
                if lacking or not isinstance(step, int) or isinstance(step, bool):
                    why = f"lacks {', '.join(lacking)}" if lacking else f"step is {record['step']!r}, not an integer"
                elif check is not None:
                    why = check(record)
            if why is None:
                records.append(record)
            elif skipped is not None:
                skipped.append(f"{path}:{number}: {why}")
    return records


def read_run_file(run_dir: str | Path, name: str, skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """The records of run file `name` (METRICS_FILE, TRAIN_FILE or PER_SAMPLE_FILE) of `run_dir`."""
    if name not in REQUIRED:
        raise ValueError(f"{name!r} is not a JSONL file of a run directory; one of {sorted(REQUIRED)}")
    return read_jsonl(Path(run_dir) / name, skipped, REQUIRED[name], lambda record: _bad_fields(name, record))
