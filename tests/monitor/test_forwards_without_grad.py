"""A forward pass of the watched model run with gradients off inside a step (an evaluation, a rollout, a
reference pass of the same model) is none of the step's: per-sample norms keep one entry per trained sample,
activation statistics and the sample count are the trained batch's. Reentrant checkpointing of the whole model,
whose first pass also runs without gradients, is counted through its recomputation. References: the same
steps without the extra pass, and float64 loops over the samples."""
import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import gapmon

B = 6


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (B,), generator=g)


def _loop_norms(model, x, y):
    norms = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), list(model.parameters()))
        norms.append(torch.sqrt(sum(g.square().sum() for g in grads)))
    return torch.stack(norms)


def _gradless_pass(model):
    with torch.no_grad():
        model(torch.randn(3, 4, dtype=torch.float64) * 100)


def _inference_pass(model):
    with torch.inference_mode():
        model(torch.randn(5, 4, dtype=torch.float64) * 100)


@pytest.mark.parametrize("extra", [_gradless_pass, _inference_pass], ids=["no_grad", "inference_mode"])
@pytest.mark.parametrize("where", ["before", "between", "after"])
def test_per_sample_norms_leave_out_a_pass_without_gradients(extra, where):
    model = _model()
    (x, y), (x2, y2) = _data(1), _data(2)
    want = torch.cat([_loop_norms(model, x, y), _loop_norms(model, x2, y2)])
    norms = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True)
    for xs, ys in ((x, y), (x2, y2)):
        if where == "before":
            extra(model)
        out = model(xs)
        if where == "between":
            extra(model)
        nn.functional.cross_entropy(out, ys, reduction="sum").backward()
        if where == "after":
            extra(model)
    got = norms.local_norms()
    assert got.shape == (2 * B,)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    extra(model)  # after the norms were read: they stay readable
    torch.testing.assert_close(norms.local_norms(), got, rtol=0, atol=0)


@pytest.mark.parametrize("bookkeeping", [False, True], ids=["hooks", "bookkeeping"])
def test_whole_model_under_reentrant_checkpointing_counts_its_recomputation(bookkeeping):
    """checkpoint(model, x, use_reentrant=True): the first pass runs without gradients, backward runs it again."""
    model = _model()
    batches = [_data(1), _data(2)]
    want = torch.cat([_loop_norms(model, x, y) for x, y in batches])
    norms = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True, bookkeeping=bookkeeping)
    for x, y in batches:
        x = x.clone().requires_grad_()  # reentrant checkpointing gives gradients only through inputs that need them
        nn.functional.cross_entropy(checkpoint(model, x, use_reentrant=True), y, reduction="sum").backward()
        _gradless_pass(model)  # an evaluation between the micro-batches is still left out
    torch.testing.assert_close(norms.local_norms(), want, rtol=1e-12, atol=0)


def _monitored_step(model, x, y, extra=None, wrap=None, per_sample=True):
    mon = gapmon.GAPMonitor(model, interval=1, per_sample_grad_norms=per_sample)
    try:
        mon.begin_step(0)
        model.zero_grad()
        if extra is not None:
            extra(model)
        out = model(x) if wrap is None else wrap(model, x)
        if extra is not None:
            extra(model)
        nn.functional.cross_entropy(out, y).backward()
        return mon.end_step()
    finally:
        mon.close()


@pytest.mark.parametrize("extra", [_gradless_pass, _inference_pass], ids=["no_grad", "inference_mode"])
def test_monitor_statistics_are_the_trained_batchs_alone(extra):
    model = _model()
    x, y = _data()
    want = _monitored_step(model, x, y)
    got = _monitored_step(model, x, y, extra)
    assert any(k.startswith("gap/activations/") for k in want)
    assert got == want


def test_monitor_counts_the_whole_model_checkpointed_reentrantly_once():
    model = _model()
    x, y = _data()
    want = _monitored_step(model, x, y, per_sample=False)
    got = _monitored_step(model, x.clone().requires_grad_(), y, per_sample=False,
                          wrap=lambda m, t: checkpoint(m, t, use_reentrant=True))
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key


def test_monitor_leaves_out_a_compiled_pass_without_gradients():
    """The model compiled (aot_eager): a compiled evaluation pass inside the step adds nothing either."""
    import torch._dynamo

    torch._dynamo.reset()
    model = _model()
    x, y = _data()
    compiled = torch.compile(model, backend="aot_eager")

    def extra(_):
        with torch.no_grad():
            compiled(torch.randn(3, 4, dtype=torch.float64) * 100)

    want = _monitored_step(model, x, y, per_sample=False, wrap=lambda m, t: compiled(t))
    got = _monitored_step(model, x, y, extra, per_sample=False, wrap=lambda m, t: compiled(t))
    assert any(k.startswith("gap/activations/") for k in want)
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key


class _FailsOnRequest(nn.Module):
    """Raises out of memory in the middle of its forward when asked (after its first layer ran)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.fail = nn.Linear(4, 8), nn.Linear(8, 3), False

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.fail:
            raise torch.OutOfMemoryError("out of memory (raised by the test)")
        return self.b(h)


@pytest.mark.parametrize("retry_inside_except", [False, True])
def test_a_forward_that_raised_holds_none_of_the_steps_samples(retry_inside_except):
    """A loop that skips a batch whose forward ran out of memory (or retries a smaller one inside its except block):
    the skipped forward's micro-batch is left out, the norms are the completed ones' (they raised 'no backward pass
    yet' before)."""
    torch.manual_seed(0)
    model = _FailsOnRequest().double()
    x, y = _data()
    want = _loop_norms(model, x, y)
    norms = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True)
    model.fail = True
    try:
        model(torch.randn(5, 4, dtype=torch.float64))
    except torch.OutOfMemoryError:
        model.fail = False
        if retry_inside_except:  # a forward that completes while the exception is being handled counts
            nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    if not retry_inside_except:
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    torch.testing.assert_close(norms.local_norms(), want, rtol=1e-12, atol=0)
    norms.close()
