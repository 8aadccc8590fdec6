"""The ops are proper torch.library ops: opcheck (schema, fake kernels, autograd registration)
and torch.compile(fullgraph=True) tracing without graph breaks."""
import os
import subprocess
import sys

import pytest
import torch

import gapmon

pytestmark = pytest.mark.skipif(gapmon.backend() == "torch", reason="needs the compiled extension")


def _samples():
    x = torch.randn(6, 5)
    return [
        (torch.ops.gapmon.tensor_stats.default, (x, 1)),
        (torch.ops.gapmon.tensor_stats.default, (x.t().bfloat16(), 0)),
        (torch.ops.gapmon.instance_stats.default, (x, 1)),
        (torch.ops.gapmon.multi_tensor_stats.default, ([x, torch.randn(3).half()], 1)),
        (torch.ops.gapmon.multi_tensor_states.default, ([x, torch.randn(0)],)),
        (torch.ops.gapmon.merge_states.default, (torch.ops.gapmon.multi_tensor_states([x, x]).unsqueeze(0).repeat(3, 1, 1),)),
        (torch.ops.gapmon.finalize_states.default, (torch.ops.gapmon.multi_tensor_states([x]), 1)),
    ]


@pytest.mark.parametrize("case", range(len(_samples())))
def test_opcheck(case):
    op, args = _samples()[case]
    torch.library.opcheck(op, args)


def test_compile_fullgraph():
    def step(w, acts):
        s = gapmon.tensor_stats(w * 2)
        a = gapmon.instance_stats(acts)
        m = gapmon.multi_tensor_stats([w, acts])
        return s.norm + a.max_abs.max() + m.var.sum()

    w, acts = torch.randn(16, 8), torch.randn(4, 3, 5)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(w, acts), step(w, acts))
    compiled_inductor = torch.compile(step, fullgraph=True)
    torch.testing.assert_close(compiled_inductor(w, acts), step(w, acts))


def test_cpu_isa_selection():
    current = gapmon.cpu_isa()
    assert current in ("avx512", "avx2", "generic")
    with pytest.raises(ValueError, match="unknown"):
        gapmon.cpu_isa("sse9")
    assert gapmon.cpu_isa() == current


def test_fallback_backend_in_subprocess():
    """GAPMON_BACKEND=torch forces the pure-PyTorch fallback, which gives the same statistics."""
    code = (
        "import torch, gapmon; x = torch.randn(100, 7, generator=torch.Generator().manual_seed(3));"
        "assert gapmon.backend() == 'torch'; print(gapmon.tensor_stats(x).rows().tolist())"
    )
    env = dict(os.environ, GAPMON_BACKEND="torch")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    got = torch.tensor(eval(out.stdout))
    x = torch.randn(100, 7, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(got, gapmon.tensor_stats(x).rows())
