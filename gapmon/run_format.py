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


def read_jsonl(path: Path, skipped: list[str] | None = None, required: tuple[str, ...] = ("step",)) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, one per line ([] when there is no file). A line that is not
    a JSON object with the `required` keys and an integer step is left out and named, as
    "file:line: why", in `skipped`; the other lines are read."""
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
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                why = f"not valid JSON ({e})"
            if why is None:
                lacking = [key for key in required if key not in record]
                if lacking or not isinstance(record.get("step", 0), int):
                    why = f"lacks {', '.join(lacking)}" if lacking else f"step is {record['step']!r}, not an integer"
            if why is None:
                records.append(record)
            elif skipped is not None:
                skipped.append(f"{path}:{number}: {why}")
    return records


def read_run_file(run_dir: str | Path, name: str, skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """The records of run file `name` (METRICS_FILE, TRAIN_FILE or PER_SAMPLE_FILE) of `run_dir`."""
    if name not in REQUIRED:
        raise ValueError(f"{name!r} is not a JSONL file of a run directory; one of {sorted(REQUIRED)}")
    return read_jsonl(Path(run_dir) / name, skipped, REQUIRED[name])
