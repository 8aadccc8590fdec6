"""Every refusal the compiled ops raise in C++ reaches Python as the documented exception, in a process of its
own: on the first H100 session (2026-11-26, torch 2.11.0+cu130, the extension built with CUDA) three of them
killed the pytest worker with a segmentation fault instead of raising. A crash here names the case it was in.
The cause, found on an H200 (2026-11-27): on that image a std::ostringstream made in any torch extension crashes when a
number is written to it, and c10::str makes one for each TORCH_CHECK message of several parts. So every refusal's
message is made into one string by csrc/torch/message.h first; a source check keeps it so."""
import re
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


_GLUE = Path(__file__).parents[2] / "csrc" / "torch"


def _checks(source: str):
    """Each TORCH_CHECK* call of a C++ source: its top-level arguments, as text."""
    for m in re.finditer(r"\bTORCH_CHECK(?:_[A-Z]+)?\(", source):
        depth, j, start, args, in_string = 0, m.end(), m.end(), [], False
        while True:
            c = source[j]
            if in_string:
                j += c == "\\"
                in_string = c != '"'
            elif c == '"':
                in_string = True
            elif c in "([{":
                depth += 1
            elif c in ")]}" and depth:
                depth -= 1
            elif c == ")" or (c == "," and depth == 0):
                args.append(source[start:j].strip())
                start = j + 1
                if c == ")":
                    break
            j += 1
        yield source[:m.start()].count("\n") + 1, args


@pytest.mark.skipif(not _GLUE.is_dir(), reason="needs the source tree")
def test_every_refusal_message_reaches_torch_check_as_one_string():
    found, wrong = 0, []
    for path in sorted(_GLUE.glob("*.[ch]*")):
        for line, args in _checks(path.read_text()):
            found += 1
            message = args[1:]
            if not (len(message) == 1 and re.fullmatch(r'message\(.*\)|"[^"]*"|\w+\.what\(\)', message[0], re.S)):
                wrong.append(f"{path.name}:{line}: {', '.join(message)[:80]}")
    assert found > 20
    assert not wrong, "TORCH_CHECK messages of several parts (wrap them in gapmon::message):\n" + "\n".join(wrong)
