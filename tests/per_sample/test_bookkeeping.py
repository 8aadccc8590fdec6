"""Book-keeping (gapmon.per_sample.bookkeeping): weight gradients formed from the per-sample gradients equal
autograd's, and the per-sample norms stay exact, against independent references."""
import copy

import pytest
import torch
import torch.nn as nn
from helpers import Autocast, loop_per_sample_norms, seeded_gpt, vmap_per_sample_norms

import gapmon
from gapmon.apps.examples import GPTConfig, lm_loss, synthetic_batch

# T = 16 against d = 16: every Linear layer of this model takes the direct form (T (d + p) >= d p),
# so every one is book-kept.
CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=16, n_heads=2, n_layers=2)
BOOKKEEPING_OP = "BookkeepingLinear"  # the autograd Function, once per book-kept call (the op also serves plain norms)


def _linears(model: nn.Module) -> int:
    return sum(type(m) is nn.Linear for m in model.modules())


def _run(model: nn.Module, batches, loss=lm_loss, **kwargs):
    """(norms, gradients, book-kept calls, weight-gradient matmuls) of one step with the norms on."""
    psn = gapmon.PerSampleGradNorms(model, **kwargs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for x, y in batches:
            loss(model(x), y).backward()
    counts = {e.key: e.count for e in prof.key_averages()}
    norms = psn.local_norms()
    psn.close()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return norms, grads, counts.get(BOOKKEEPING_OP, 0), counts.get("aten::mm", 0)


def _plain_grads(model: nn.Module, batches, loss=lm_loss) -> dict[str, torch.Tensor]:
    for x, y in batches:
        loss(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _mse(out, target):
    return (out - target).square().mean()


def _check_exact(model: nn.Module, batches, loss, bookkept: int, reference: nn.Module | None = None) -> int:
    """One float64 step with book-keeping: `bookkept` layer calls run through it, the gradients are
    autograd's (a plain step) and the norms the brute-force loop's on `reference` (default: model).
    Returns the weight-gradient matmuls of the step."""
    want_grads = _plain_grads(copy.deepcopy(model), batches, loss)
    norms, grads, calls, mm = _run(copy.deepcopy(model), batches, loss, bookkeeping=True)
    assert calls == bookkept
    for name, want in want_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-12, atol=1e-15, msg=name)
    reference = reference or model
    want = torch.cat([loop_per_sample_norms(reference, loss, x.detach(), y) for x, y in batches])
    torch.testing.assert_close(norms, want, rtol=1e-10, atol=0)
    return mm


def test_float64_gradients_are_autograds_and_norms_exact():
    model = seeded_gpt(CFG).double()
    batch = synthetic_batch(CFG, 4, 0)
    mm = _check_exact(model, [batch], lm_loss, bookkept=_linears(model))
    _, _, plain_bookkept, plain_mm = _run(copy.deepcopy(model), [batch])
    assert plain_bookkept == 0
    assert mm < plain_mm  # autograd's weight-gradient matmuls of the book-kept layers are gone


def test_micro_batches_accumulate_gradients_and_norms():
    model = seeded_gpt(CFG).double()
    x, y = synthetic_batch(CFG, 5, 1)
    _check_exact(model, [(x[:2], y[:2]), (x[2:], y[2:])], lm_loss, bookkept=2 * _linears(model))


class _Reused(nn.Module):
    """One Linear called twice: its per-sample gradient is the sum over both calls."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3, bias=False)

    def forward(self, x):
        return self.head(self.lin(torch.tanh(self.lin(x))))


def test_a_layer_called_twice_keeps_exact_norms():
    torch.manual_seed(0)
    model = _Reused().double()
    x, y = torch.randn(4, 20, 6, dtype=torch.float64), torch.randn(4, 20, 3, dtype=torch.float64)
    _check_exact(model, [(x, y)], _mse, bookkept=3)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_falls_back_to_the_hooks(use_reentrant):
    """Checkpointed layers are not book-kept (their forward is recomputed); the norms stay exact."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)).double()
    head = nn.Linear(6, 2).double()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.head = inner, head
            self.checkpointed = True

        def forward(self, x):
            if not self.checkpointed:
                return self.head(self.inner(x))
            return self.head(checkpoint(self.inner, x, use_reentrant=use_reentrant))

    model = Model()
    x, y = torch.randn(3, 24, 6, dtype=torch.float64, requires_grad=True), torch.randn(3, 24, 2, dtype=torch.float64)
    reference = copy.deepcopy(model)
    reference.checkpointed = False  # the brute-force reference runs without checkpointing
    _check_exact(model, [(x, y)], _mse, bookkept=1, reference=reference)  # the head only


def test_ghost_form_layers_are_not_book_kept():
    """Short sequences take the ghost form, which needs no per-sample gradient: nothing is book-kept."""
    model = seeded_gpt(GPTConfig(vocab_size=64, seq_len=4, d_model=32, n_heads=2, n_layers=1))
    x, y = synthetic_batch(model.cfg, 3, 0)
    _, _, bookkept, _ = _run(model, [(x, y)], bookkeeping=True)
    assert bookkept == 0


def test_bf16_autocast_matches_the_hooks_and_autograd():
    """Under bf16 autocast the book-kept layers see the bf16 operands F.linear used: norms equal those
    of the hook path (same products, float32 sums), gradients autocast's up to its bf16 rounding."""
    model = seeded_gpt(CFG)
    batch = synthetic_batch(CFG, 4, 2)

    def loss(out, target):
        return lm_loss(out.float(), target)

    want_grads = _plain_grads(Autocast(copy.deepcopy(model), "cpu"), [batch], loss)
    hooks, _, _, _ = _run(Autocast(copy.deepcopy(model), "cpu"), [batch], loss)
    norms, grads, bookkept, _ = _run(Autocast(copy.deepcopy(model), "cpu"), [batch], loss, bookkeeping=True)
    assert bookkept == _linears(model) and norms.dtype == torch.float32
    torch.testing.assert_close(norms, hooks, rtol=1e-5, atol=0)
    for name, want in want_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=2e-2, atol=1e-4, msg=name)


def test_gapmonitor_with_bookkeeping_reports_the_same_metrics():
    """GAPMonitor(bookkeeping=True): every metric (Linear activation gradients included, whose hooks
    must see the output that gets the gradient) equals the hook path's, and the norms the reference."""
    model = seeded_gpt(CFG).double()
    x, y = synthetic_batch(CFG, 4, 3)
    metrics = {}
    for bookkeeping in (False, True):
        m = copy.deepcopy(model)
        with gapmon.GAPMonitor(m, sinks=[], per_sample_grad_norms=True, bookkeeping=bookkeeping) as mon:
            mon.begin_step(0, batch_size=4)
            lm_loss(m(x), y).backward()
            metrics[bookkeeping] = mon.end_step()
    assert metrics[True].keys() == metrics[False].keys()
    assert "gap/activation_grads/blocks.0.mlp.up/norm" in metrics[True]
    for key, want in metrics[False].items():
        assert metrics[True][key] == pytest.approx(want, rel=1e-9, abs=1e-12), key
    want = loop_per_sample_norms(model, lm_loss, x, y)
    assert metrics[True]["gap/per_sample_grad_norm/max"] == pytest.approx(want.max().item(), rel=1e-10)


def test_flags_and_second_backward_are_refused():
    model = seeded_gpt(CFG)
    with pytest.raises(ValueError, match="per_sample_grad_norms=True"):
        gapmon.GAPMonitor(model, bookkeeping=True)
    with pytest.raises(TypeError, match="bookkeeping"):
        gapmon.PerSampleGradNorms(model, bookkeeping="yes")
    psn = gapmon.PerSampleGradNorms(model, bookkeeping=True)
    x, y = synthetic_batch(CFG, 2, 0)
    loss = lm_loss(model(x), y)
    loss.backward(retain_graph=True)
    loss.backward()  # the user's backward completes; the norms are refused when read
    with pytest.raises(RuntimeError, match="backward ran twice"):
        psn.local_norms()
    psn.close()


def test_vmap_reference_in_float32():
    """float32 norms equal torch.func's per-sample gradients' (the reference the hook path meets)."""
    model = seeded_gpt(CFG)
    x, y = synthetic_batch(CFG, 6, 4)
    norms, _, bookkept, _ = _run(model, [(x, y)], bookkeeping=True)
    assert bookkept == _linears(model)
    torch.testing.assert_close(norms, vmap_per_sample_norms(model, lm_loss, x, y), rtol=1e-4, atol=1e-6)


def test_book_kept_output_can_be_modified_in_place():
    """`h = proj(x); h += x`: the book-kept output is a fresh output, not a view, so an in-place
    residual works as with a plain Linear, with exact gradients and norms."""

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            h = self.proj(x)
            h += x
            return self.head(h)

    torch.manual_seed(0)
    model = Residual().double()
    x, y = torch.randn(3, 20, 8, dtype=torch.float64), torch.randn(3, 20, 2, dtype=torch.float64)
    _check_exact(model, [(x, y)], _mse, bookkept=2)


def test_a_bookkept_weight_used_outside_its_layer_is_still_caught():
    """The use check of a book-kept call sketches the weight gradient it formed: a use of the weight
    outside the layer's forward still shows (left out, named; strict=True refuses)."""
    import torch.nn.functional as F

    class Reused(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 4)

        def forward(self, x):
            return self.b(self.a(x) + F.linear(x, self.a.weight))

    torch.manual_seed(0)
    model = Reused()
    x = torch.randn(3, 100, 64)
    norms = gapmon.PerSampleGradNorms(model, bookkeeping=True)  # T=100 > dp/(d+p): the direct form, book-kept
    model(x).sum().backward()
    with pytest.warns(RuntimeWarning, match=r"layer 'a' is not per-sample \(the gradient of a.weight"):
        norms.local_norms()
    assert set(norms.coverage()["uncovered"]) == {"a.weight", "a.bias"}
    norms.close()
    norms = gapmon.PerSampleGradNorms(model, bookkeeping=True, strict=True)
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="a.weight"):
        norms.local_norms()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_the_book_keeping_op_against_float64_per_sample_gradients(dtype, cpu_isa):
    """gapmon::direct_norm_sq_and_grad, direct_norm_sq and linear_norm_sq_and_grads (with the bias): on the CPU the
    per-sample gradients formed a tile of
    rows at a time and read once for their sum and their squared norms (a kernel per instruction set):
    per-sample gradients of 4,100 and 37 elements (chunks of 4,096 with a tail, rows shorter than a vector),
    of 200,000 (tiles of 43 rows of 100), batches formed whole or one and two samples at a time
    (max_elements), one sample, none, and non-contiguous operands, against float64 einsum; 1 and 2 threads
    give the same bits."""
    g = torch.Generator().manual_seed(11)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-6}[dtype]
    for b, t, d, p in ((5, 7, 41, 100), (3, 4, 37, 1), (3, 5, 2000, 100), (1, 3, 16, 16), (0, 3, 8, 4)):
        a = torch.randn(b, t, d, generator=g, dtype=torch.float64).to(dtype)
        gr = torch.randn(b, t, p, generator=g, dtype=torch.float64).to(dtype)
        per_sample = torch.einsum("btp,btd->bpd", gr.double(), a.double())
        for operands in ((a, gr), (a.transpose(0, 1).contiguous().transpose(0, 1), gr)):
            for max_elements in (1 << 26, d * p, 2 * d * p):
                sq, summed = torch.ops.gapmon.direct_norm_sq_and_grad(*operands, max_elements)
                torch.testing.assert_close(sq.double(), per_sample.square().sum((1, 2)), rtol=tol, atol=0)
                torch.testing.assert_close(summed.double(), per_sample.sum(0), rtol=tol, atol=tol * (float(per_sample.abs().max()) if b else 1.0))
                assert summed.shape == (p, d) and sq.shape == (b,)
                torch.testing.assert_close(torch.ops.gapmon.direct_norm_sq(*operands, max_elements).double(),
                                           per_sample.square().sum((1, 2)), rtol=tol, atol=0)
                # with the bias: its per-sample gradients sum_t g_bt added to the norms, and their sum
                sq_b, summed_b, bias_grad = torch.ops.gapmon.linear_norm_sq_and_grads(*operands, max_elements)
                per_sample_bias = gr.double().sum(1)
                torch.testing.assert_close(sq_b.double(), per_sample.square().sum((1, 2)) + per_sample_bias.square().sum(1),
                                           rtol=tol, atol=0)
                assert torch.equal(summed_b, summed) and bias_grad.shape == (p,)
                assert bias_grad.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
                torch.testing.assert_close(bias_grad.double(), per_sample_bias.sum(0), rtol=tol, atol=tol * max(1.0, b * t))
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = torch.ops.gapmon.direct_norm_sq_and_grad(a, gr)
            torch.set_num_threads(2)
            two = torch.ops.gapmon.direct_norm_sq_and_grad(a, gr)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


class _LinearThenReadAgain(nn.Module):
    """Two book-kept Linears; with `extra`, the first one's weight is read once more outside it (F.linear)."""

    def __init__(self, extra: bool):
        super().__init__()
        self.a, self.b, self.extra = nn.Linear(6, 6), nn.Linear(6, 3), extra

    def forward(self, x):
        h = self.a(x)
        if self.extra:
            h = h + 1e-3 * torch.nn.functional.linear(x, self.a.weight)
        return self.b(torch.tanh(h))


@pytest.mark.parametrize("extra", [False, True], ids=["alone", "read-again"])
def test_a_returned_gradient_that_reaches_its_hook_unchanged_is_not_sketched(extra):
    """The use check knows the gradients a book-kept layer hands to autograd when they reach the parameters' hooks as
    the same tensors: no sketch on either side (4 matrix-vector ops per Linear saved, each a launch on a GPU). A weight
    also read outside its layer gets the sum of both uses there: both sides are sketched and the use is refused."""
    torch.manual_seed(0)
    model = _LinearThenReadAgain(extra).double()
    x, y = torch.randn(5, 8, 6, dtype=torch.float64), torch.randn(5, 8, 3, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(model, bookkeeping=True, strict=True)  # (refused each step, not left out from then on)
    for _ in range(2):  # the first step makes the probes; the second is counted
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _mse(model(x), y).backward()
        sketches = sum(e.count for e in prof.key_averages() if e.key == "aten::addmv_")
        if extra:
            with pytest.raises(RuntimeError, match=r"a\.weight \(relative difference"):
                psn.local_norms()
        else:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                got = psn.local_norms()
            # nothing was sketched, so nothing is compared
            assert not any(e.key == "aten::_foreach_sub" for e in prof.key_averages())
        model.zero_grad(set_to_none=True)
    psn.close()
    assert sketches == (2 if extra else 0), sketches  # read again: a.weight's total and its returned gradient
    if not extra:
        want = loop_per_sample_norms(model, _mse, x, y)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
