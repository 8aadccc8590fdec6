"""benchmarks/gpu_session.sh cannot rot without a GPU: a dry run of every call prints the commands of
each phase; each call's time limits fit a device call (10 minutes, with headroom) and its files back
fit the 8-file limit; ncu leaves the clocks alone; every flag passed to a benchmark script is one
that script accepts."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CALLS = ("solo", "quick1", "quick2", "quick3", "call1", "call2", "call3", "call4", "variants")


def _dry_run(tmp_path, call):
    out = tmp_path / call
    env = {**os.environ, "GAPMON_GPU_DRY_RUN": "1", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), str(out), call], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = (out / "session.log").read_text()
    commands = [shlex.split(line[2:]) for line in text.splitlines() if line.startswith("+ timeout ")]
    return out, text, commands


@pytest.mark.parametrize("call", CALLS)
def test_each_call_fits_a_device_call(tmp_path, call):
    out, text, commands = _dry_run(tmp_path, call)
    assert commands, text
    assert sum(int(c[1]) for c in commands) <= 570, text  # limits of one call: under 10 minutes
    files = {"session.log"}
    for command in commands:
        files |= {Path(arg).name for arg in command if arg.startswith(str(out))}
    if "build" in text and "setup.py" in text and call != "solo":  # solo brings no .so back
        files |= {"build.log", "_C.so.gz"}
    assert len(files) <= 8, files
    for command in commands:
        if command[2:3] == ["ncu"]:
            assert command[3:5] == ["--clock-control", "none"], command


def _flags_of(command):
    return [arg.split("=")[0] for arg in command if arg.startswith("--")]


def test_benchmark_flags_exist(tmp_path):
    # Each script's --help once (each run imports torch): the calls run the same few scripts many times.
    helptexts: dict[str, str] = {}
    checked = 0
    for call in CALLS:
        _, _, commands = _dry_run(tmp_path, call)
        for command in commands:
            scripts = [arg for arg in command if re.fullmatch(r"benchmarks/\w+\.py", arg)]
            if not scripts:
                continue
            if scripts[0] not in helptexts:
                helptexts[scripts[0]] = subprocess.run(
                    [sys.executable, str(ROOT / scripts[0]), "--help"], capture_output=True, text=True,
                    cwd=ROOT / "benchmarks", timeout=120).stdout
            for flag in _flags_of(command[command.index(scripts[0]):]):
                assert flag in helptexts[scripts[0]], (scripts[0], flag)
                checked += 1
    assert checked >= 10


def test_kernel_bench_has_the_once_mode_ncu_uses():
    source = (ROOT / "benchmarks" / "cuda" / "kernel_bench.cu").read_text()
    assert '"--once"' in source and "cudaMemsetAsync" not in source  # counters zeroed once, not per launch
