
import pytest
import torch
from helpers import cpu_isas

import gapmon


@pytest.fixture(params=cpu_isas() or ["torch"])
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
