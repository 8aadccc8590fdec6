
import pytest
import torch

import gapmon

CPU_ISAS = [isa for isa in ("generic", "avx2", "avx512") if gapmon.backend() != "torch"]


def _supported(isa: str) -> bool:
    previous = gapmon.cpu_isa()
    try:
        gapmon.cpu_isa(isa)
        return True
    except ValueError:
        return False
    finally:
        gapmon.cpu_isa(previous)


@pytest.fixture(params=[i for i in CPU_ISAS if _supported(i)] or ["torch"])
def cpu_isa(request):
    """Runs a test once per CPU instruction set this machine supports (kernel code paths)."""
    if request.param == "torch":
        yield "torch"
        return
    previous = gapmon.cpu_isa()
    gapmon.cpu_isa(request.param)
    yield request.param
    gapmon.cpu_isa(previous)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
