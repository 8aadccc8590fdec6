"""Every refusal the compiled ops raise in C++ reaches Python as the documented exception, in a process of its
own: on the first H100 session (2026-11-26, torch 2.11.0+cu130, the extension built with CUDA) three of them
killed the pytest worker with a segmentation fault instead of raising. A crash here names the case it was in."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gapmon

pytestmark = pytest.mark.skipif(gapmon.backend() == "torch", reason="needs the compiled extension")

_CASES = Path(__file__).with_name("native_error_cases.py")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_refusals_raised_in_cpp_reach_python(device):
    proc = subprocess.run([sys.executable, "-X", "faulthandler", str(_CASES), device], capture_output=True, text=True,
                          timeout=300)
    last = [line for line in proc.stdout.splitlines() if line.startswith("case ")][-1:]
    assert proc.returncode == 0 and "all raised" in proc.stdout, (
        f"exit code {proc.returncode} in {last}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
