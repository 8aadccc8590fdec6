"""The ops are proper torch.library ops: opcheck (schema, fake kernels, autograd registration)
and torch.compile(fullgraph=True) tracing without graph breaks."""
import os
import subprocess
import sys

import pytest
import torch

import gapmon
from gapmon.stats.layout import BLOCK_COLUMNS

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
        (torch.ops.gapmon.accumulate_instance_stats.default, (x, torch.zeros(3, 6, dtype=torch.float64), 1, 1)),
        (torch.ops.gapmon.ghost_norm_sq.default, (torch.randn(2, 5, 3), torch.randn(2, 5, 4), 2)),
        (torch.ops.gapmon.direct_norm_sq.default, (torch.randn(2, 5, 3), torch.randn(2, 5, 4), 10)),
        (torch.ops.gapmon.embedding_norm_sq.default, (torch.randint(0, 4, (2, 5)), torch.randn(2, 5, 3), 0, 2)),
        (torch.ops.gapmon.direct_norm_sq_and_grad.default, (torch.randn(3, 5, 4), torch.randn(3, 5, 2), 16)),
        (torch.ops.gapmon.linear_norm_sq_and_grads.default, (torch.randn(3, 5, 4), torch.randn(3, 5, 2), 16)),
        (torch.ops.gapmon.linear_grad_sketch.default, (torch.randn(3, 5, 4), torch.randn(3, 5, 2), torch.randn(4), torch.randn(1))),
        (torch.ops.gapmon.linear_grad_sketch.default, (torch.randn(6, 4), torch.randn(6, 2), torch.randn(4, 3), None)),
        (torch.ops.gapmon.affine_norm_sums.default, (torch.randn(3, 5, 4), torch.randn(3, 5, 4), 1e-5, True)),
        (torch.ops.gapmon.affine_norm_sums.default, (torch.randn(3, 5, 4).double(), torch.randn(3, 5, 4).double(), 1e-6, False)),
        (torch.ops.gapmon.numerics_states.default, ([x, torch.randn(4).bfloat16()],)),
        (torch.ops.gapmon.multi_tensor_states_and_numerics.default, ([x, torch.randn(4).bfloat16()],)),
        (torch.ops.gapmon.accumulate_instance_stats_and_numerics.default,
         (x.bfloat16(), torch.zeros(3, 6, dtype=torch.float64), 1, 1, torch.zeros(2, len(gapmon.stats.NUMERICS_COLUMNS), dtype=torch.float64), 1)),
        (torch.ops.gapmon.accumulate_instance_stats_numerics_blocks.default,
         (torch.randn(3, 2, 40), torch.zeros(3, 6, dtype=torch.float64), 1, 1, True,
          torch.zeros(2, len(gapmon.stats.NUMERICS_COLUMNS), dtype=torch.float64), 1, [0, 3],
          torch.full((1,), 3.0, dtype=torch.float64), torch.zeros(2, 2, len(BLOCK_COLUMNS), dtype=torch.float64), 1)),
        (torch.ops.gapmon.accumulate_instance_stats_numerics_blocks.default,  # the amax measured by the op
         (torch.randn(3, 2, 40).bfloat16(), torch.zeros(3, 6, dtype=torch.float64), 1, 1, False,
          torch.zeros(0, len(gapmon.stats.NUMERICS_COLUMNS), dtype=torch.float64), 0, [3, 4], None,
          torch.zeros(2, 2, len(BLOCK_COLUMNS), dtype=torch.float64), 0)),
        (torch.ops.gapmon.merge_numerics_states.default, (torch.ops.gapmon.numerics_states([x, x]).unsqueeze(0).repeat(2, 1, 1),)),
        (torch.ops.gapmon.update_sums.default, ([x, torch.randn(3).bfloat16()], [x + 1, torch.randn(3).bfloat16()],
                                                [x.t().contiguous().t(), torch.randn(3)])),
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


FALLBACK_SCRIPT = """
import json, sys, torch, gapmon
from gapmon.apps.examples import GPTConfig, TinyGPT, lm_loss, synthetic_batch
cfg = GPTConfig(vocab_size=37, seq_len=8, d_model=24, n_heads=2, n_layers=2)
torch.manual_seed(0)
model = TinyGPT(cfg)
x, y = synthetic_batch(cfg, 4, 0)
with gapmon.GAPMonitor(model, per_sample_grad_norms=True, sinks=[]) as mon:
    mon.begin_step(0, batch_size=4)
    lm_loss(model(x), y).backward()
    metrics = mon.end_step()
w = torch.randn(50, 30, generator=torch.Generator().manual_seed(1))
out = {"backend": gapmon.backend(), "metrics": metrics,
       "multi": gapmon.multi_tensor_stats([w, w.t().half(), torch.empty(0)]).rows().tolist(),
       "instance": gapmon.instance_stats(w).rows().tolist()}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_fallback_backend_gives_the_same_results():
    """Monitor, per-sample norms and ops through the pure-PyTorch fallback match the compiled kernels."""
    import json
    import math

    runs = {}
    for backend in ("torch", ""):
        env = dict(os.environ, GAPMON_BACKEND=backend)
        proc = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[backend] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs["torch"]["backend"] == "torch" and runs[""]["backend"] == gapmon.backend()
    slow, fast = runs["torch"], runs[""]
    assert set(slow["metrics"]) == set(fast["metrics"])
    bad = [k for k in fast["metrics"] if not math.isclose(slow["metrics"][k], fast["metrics"][k], rel_tol=1e-4, abs_tol=1e-6)]
    assert not bad, bad[:5]
    torch.testing.assert_close(torch.tensor(slow["multi"]), torch.tensor(fast["multi"]), rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(torch.tensor(slow["instance"]), torch.tensor(fast["instance"]), rtol=1e-5, atol=1e-6)


def test_fallback_backend_in_subprocess():
    """GAPMON_BACKEND=torch forces the pure-PyTorch fallback, which gives the same statistics."""
    code = (
        "import torch, gapmon; x = torch.randn(100, 7, generator=torch.Generator().manual_seed(3));"
        "assert gapmon.backend() == 'torch'; print(gapmon.tensor_stats(x).rows().tolist())"
    )
    env = dict(os.environ, GAPMON_BACKEND="torch")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    got = torch.tensor(eval(out.stdout), dtype=torch.float64)
    x = torch.randn(100, 7, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(got, gapmon.tensor_stats(x).rows())


def test_ops_take_tensors_that_require_grad_without_detach(recwarn):
    """The statistics ops are not differentiable: their Autograd keys fall through to the kernels, so
    parameters and activations go in as they are (no per-tensor detach in Python), the rows never
    require grad, and nothing warns about a missing autograd kernel."""
    if gapmon.backend() == "torch":
        pytest.skip("needs the compiled ops")
    xs = [torch.randn(5, 3, requires_grad=True), torch.nn.Parameter(torch.randn(7))]
    outs = [torch.ops.gapmon.tensor_stats(xs[0], 1), torch.ops.gapmon.instance_stats(xs[0], 1),
            torch.ops.gapmon.multi_tensor_stats(xs, 1), torch.ops.gapmon.multi_tensor_states(xs)]
    assert not any(o.requires_grad for o in outs)
    acc = torch.zeros(1, len(gapmon.stats.ACC_NAMES), dtype=torch.float64)
    torch.ops.gapmon.accumulate_instance_stats(xs[0], acc, 0, 1)
    assert not acc.requires_grad and acc[0, 0].item() == 5
    torch.testing.assert_close(outs[2][0], gapmon.reference.tensor_stats(xs[0].detach()).rows())
    assert not [w for w in recwarn if "autograd" in str(w.message).lower()]


def test_bad_tensor_in_a_long_list_is_named():
    """The one-pass list check still gives each bad input its own clear error."""
    good = [torch.randn(3) for _ in range(20)]
    with pytest.raises(TypeError, match="int64"):
        gapmon.multi_tensor_stats(good + [torch.arange(3)])
    with pytest.raises(TypeError, match="torch.Tensor"):
        gapmon.multi_tensor_stats(good + [[1.0, 2.0]])
    with pytest.raises(ValueError, match="meta tensor"):
        gapmon.multi_tensor_stats(good + [torch.empty(3, device="meta")])
