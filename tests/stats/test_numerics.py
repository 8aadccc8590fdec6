"""Low-precision numerics (gapmon.numerics): exponent histograms and moments against frexp/bincount
and float64 references on edge values, format shares against direct float64 comparisons, merging
pieces, and the compiled kernel against the pure-PyTorch reference."""
import functools
import json
import math
import warnings

import pytest
import torch
from helpers import cpu_isas

import gapmon
from gapmon import numerics as nm
from gapmon import reference

EDGES = [0.0, -0.0, 2.0 ** -149, 2.0 ** -127, 2.0 ** -126, -(2.0 ** -126), 2.0 ** -125, 0.5, 1.0, 1.5, 2.0 ** 127,
         float(torch.finfo(torch.float32).max), float("inf"), -float("inf"), float("nan"),
         2.0 ** -14, 2.0 ** -15, 2.0 ** -24, 2.0 ** -6, 2.0 ** -7, 448.0, 480.0, 512.0, 57344.0, 65504.0, 65536.0]


def _frexp_bins(values: list[float]) -> torch.Tensor:
    """The histogram by definition, one value at a time with math.frexp (independent of torch)."""
    hist = torch.zeros(nm.NUM_BINS, dtype=torch.int64)
    for v in values:
        if math.isnan(v):
            name = "nan"
        elif math.isinf(v):
            name = "inf"
        elif v == 0:
            name = "zero"
        elif abs(v) < 2.0 ** -149:
            name = "tiny"
        elif abs(v) < 2.0 ** -126:
            name = "subnormal"
        elif abs(v) >= 2.0 ** 128:
            name = "huge"
        else:
            name = f"e{math.frexp(abs(v))[1]}"
        hist[nm.BIN_NAMES.index(name)] += 1
    return hist


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_histogram_of_edge_values_matches_frexp(dtype):
    x = torch.tensor(EDGES, dtype=torch.float64).to(dtype)
    values = x.double().tolist()
    assert torch.equal(gapmon.exponent_histogram(x), _frexp_bins(values))
    # every exponent bin edge and the value just below it
    edges = torch.tensor([2.0 ** e for e in range(-125, 128)], dtype=torch.float32)
    below = torch.nextafter(edges, torch.zeros_like(edges))
    both = torch.cat((edges, below, -edges))
    assert torch.equal(gapmon.exponent_histogram(both), _frexp_bins(both.double().tolist()))


def test_float64_beyond_float32_range_has_its_own_bins_and_exact_unscaled_shares():
    """float64 values at or above 2^128 overflow every format (bf16's cast makes them Inf), and those below
    2^-149 underflow every format (the cast flushes them): counted so, unscaled, against the real casts."""
    x = torch.tensor([1e-300, 5e-324, 2.0 ** 128, 1e300, -1e308, 2.0 ** -150, 2.0 ** -149, 1.0], dtype=torch.float64)
    h = gapmon.exponent_histogram(x)
    assert (h[nm.BIN["tiny"]], h[nm.BIN["huge"]], h[nm.BIN["subnormal"]], h[nm.BIN["e1"]]) == (3, 3, 1, 1)
    result = gapmon.multi_tensor_numerics([x], formats=["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"])
    bf16 = x.to(torch.bfloat16).double()
    assert result.shares["bf16"]["overflow"].item() == torch.isinf(bf16).sum().item() / 8 == 3 / 8
    assert result.shares["bf16"]["underflow"].item() == 4 / 8  # the tiny ones and 2^-149: below bf16's normals
    for fmt in ("fp16", "fp8_e4m3", "fp8_e5m2"):
        assert result.shares[fmt]["overflow"].item() == 3 / 8, fmt
        assert result.shares[fmt]["underflow"].item() == 4 / 8, fmt
    # Scaled: the largest value is >= 2^128, so the scale takes it into the top binade: nothing overflows.
    assert result.shares["bf16"]["overflow_scaled"].item() == 0


def test_subnormals_of_each_format_underflow_and_normals_do_not():
    for fmt, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16),
                       ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        info = torch.finfo(dtype)
        smallest_normal, smallest_sub = float(info.tiny), float(info.smallest_normal) * float(info.eps)
        x = torch.tensor([smallest_normal, smallest_normal / 2, smallest_sub, 0.0, float(info.max)], dtype=torch.float32)
        shares = gapmon.multi_tensor_numerics([x], formats=[fmt]).shares[fmt]
        assert shares["underflow"].item() == pytest.approx(2 / 5), fmt  # the two subnormals; 0 is not underflow
        assert shares["overflow"].item() == 0, fmt


def _direct_shares(x: torch.Tensor, fmt: str, k: int) -> tuple[float, float]:
    """Underflow/overflow shares by direct float64 comparison with the documented thresholds."""
    f = nm.FORMATS[fmt]
    a = x.double().abs() * 2.0 ** k
    finite = torch.isfinite(a)
    under = (finite & (a != 0) & (a < 2.0 ** f.min_normal_exp)).sum().item()
    over = (finite & (a >= 2.0 ** f.top_exp)).sum().item()
    return under / x.numel(), over / x.numel()


@pytest.mark.parametrize("fmt", sorted(nm.FORMATS))
def test_shares_match_direct_comparison_unscaled_and_at_the_mx_scale(fmt):
    torch.manual_seed(0)
    x = torch.cat((torch.randn(5000) * 10.0 ** torch.randint(-30, 30, (5000,)).float(), torch.tensor([0.0, float("nan")])))
    r = gapmon.multi_tensor_numerics([x], formats=[fmt], margin=0)
    s = r.shares[fmt]
    assert (s["underflow"].item(), s["overflow"].item()) == pytest.approx(_direct_shares(x, fmt, 0), abs=1e-12)
    amax = x[torch.isfinite(x)].abs().max().item()
    k = nm.FORMATS[fmt].top_exp - math.frexp(amax)[1]  # amax lands in the format's top binade
    assert (s["underflow_scaled"].item(), s["overflow_scaled"].item()) == pytest.approx(_direct_shares(x, fmt, k), abs=1e-12)
    assert s["overflow_scaled"].item() == 0
    assert 2.0 ** (nm.FORMATS[fmt].top_exp - 1) <= amax * 2.0 ** k < 2.0 ** nm.FORMATS[fmt].top_exp
    margin = gapmon.multi_tensor_numerics([x], formats=[fmt], margin=2).shares[fmt]
    assert margin["underflow_scaled"].item() == pytest.approx(_direct_shares(x, fmt, k - 2)[0], abs=1e-12)


def test_e4m3_values_at_the_format_limits():
    # 448 is e4m3's largest value: it and 480 share the binade [256, 512), not counted as overflow
    x = torch.tensor([448.0, 480.0, 511.0, 512.0, 1000.0, 2.0 ** -6, 2.0 ** -7, 2.0 ** -9, 2.0 ** -10])
    s = gapmon.multi_tensor_numerics([x], formats=["fp8_e4m3"]).shares["fp8_e4m3"]
    assert s["overflow"].item() == pytest.approx(2 / 9)  # 512 and 1000
    assert s["underflow"].item() == pytest.approx(3 / 9)  # 2^-7, 2^-9, 2^-10 (2^-6 is the smallest normal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_moments_and_kurtosis_match_float64(dtype, cpu_isa):
    torch.manual_seed(1)
    x = (torch.distributions.StudentT(5.0).sample((70_001,)) * 3 + 1000).to(dtype)
    row = gapmon.numerics_states([x])[0]
    xd = x.double()
    d = xd - xd.mean()
    want = torch.stack((torch.tensor(float(x.numel()), dtype=torch.float64), xd.mean(), (d ** 2).sum(), (d ** 3).sum(),
                        (d ** 4).sum()))
    torch.testing.assert_close(row[nm.NUM_BINS:], want, rtol=1e-9, atol=1e-6)
    kurt = nm.kurtosis(row.unsqueeze(0))[0]
    assert kurt.item() == pytest.approx((x.numel() * (d ** 4).sum() / (d ** 2).sum() ** 2).item(), rel=1e-9)


def test_layouts_and_empty_and_expanded_tensors():
    torch.manual_seed(0)
    base = torch.randn(6, 5)
    for x in (base.t(), base[:, ::2], base.unsqueeze(1).expand(6, 3, 5), torch.empty(0, 4),
              torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), torch.tensor(2.5)):
        got = gapmon.numerics_states([x])[0]
        want = reference.numerics_states([x.contiguous()])[0]
        assert torch.equal(got[:nm.NUM_BINS], want[:nm.NUM_BINS])
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    empty = gapmon.numerics_states([torch.empty(0)])[0]
    assert empty.abs().sum() == 0 and math.isnan(nm.kurtosis(empty.unsqueeze(0))[0].item())


def test_merging_pieces_equals_the_whole_and_is_deterministic():
    torch.manual_seed(0)
    x = torch.randn(300_000) * 5 + 3
    pieces = [x[:0], x[:1], x[1:100_000], x[100_000:]]  # empty and one-element pieces too
    parts = torch.stack([gapmon.numerics_states([p])[0] for p in pieces]).unsqueeze(1)
    whole = gapmon.numerics_states([x])[0]
    for merge in (nm.merge_numerics_states, reference.merge_numerics_states):
        merged = merge(parts)[0]
        assert torch.equal(merged[:nm.NUM_BINS], whole[:nm.NUM_BINS])
        torch.testing.assert_close(merged, whole, rtol=1e-9, atol=1e-6)
    torch.set_num_threads(1)
    try:
        one = gapmon.numerics_states([x])
    finally:
        torch.set_num_threads(2)
    assert torch.equal(one[0], whole)  # same bits whatever the thread count


def test_bad_input_and_unknown_format_raise_clearly():
    with pytest.raises(TypeError, match="floating-point"):
        gapmon.numerics_states([torch.arange(3)])
    with pytest.raises(ValueError, match="unknown format"):
        gapmon.multi_tensor_numerics([torch.ones(3)], formats=["fp4"])


def test_numerics_op_passes_opcheck():
    if gapmon.backend() == "torch":
        pytest.skip("compiled extension not built")
    torch.library.opcheck(torch.ops.gapmon.numerics_states.default, ([torch.randn(5, 3), torch.randn(7).double()],))
    torch.library.opcheck(torch.ops.gapmon.merge_numerics_states.default,
                          (torch.zeros(2, 3, len(nm.NUMERICS_COLUMNS), dtype=torch.float64),))


def test_monitor_reports_shares_and_kurtosis_and_alerts_by_name():
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        model[0].weight.mul_(1e-6)  # below e4m3's smallest normal 2^-6
    plain = gapmon.GAPMonitor(model)
    plain.begin_step(0, 3)
    model(torch.randn(3, 4)).sum().backward()
    assert not any("underflow" in k or "kurtosis" in k for k in plain.end_step())  # off by default
    plain.close()
    mon = gapmon.GAPMonitor(model, numerics=("bf16", "fp8_e4m3"), numerics_alert=0.5)
    mon.begin_step(1, 3)
    model.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    with pytest.warns(RuntimeWarning, match=r"step 1: .*params/0.weight: fp8_e4m3_underflow 1"):
        metrics = mon.end_step()
    mon.close()
    for kind, tensor in (("params", model[2].weight), ("grads", model[2].weight.grad), ("params", model[0].weight)):
        under, over = _direct_shares(tensor, "fp8_e4m3", 0)
        assert metrics[f"gap/{kind}/{'2' if tensor is not model[0].weight else '0'}.weight/fp8_e4m3_underflow"] == pytest.approx(under)
        assert metrics[f"gap/{kind}/{'2' if tensor is not model[0].weight else '0'}.weight/fp8_e4m3_overflow"] == pytest.approx(over)
    g = model[2].weight.grad.double().flatten()
    d = g - g.mean()
    assert metrics["gap/grads/2.weight/kurtosis"] == pytest.approx((g.numel() * (d ** 4).sum() / (d ** 2).sum() ** 2).item())
    assert "gap/grads/2.weight/fp16_underflow" not in metrics  # only the formats asked for
    with pytest.raises(ValueError, match="unknown format"):
        gapmon.GAPMonitor(model, numerics=("fp4",))
    with pytest.raises(ValueError, match="numerics_alert"):
        gapmon.GAPMonitor(model, numerics_alert=0.1)


def _frexp_named_bins(tensors) -> dict:
    """Reference exponent histogram by torch.frexp (float32 normals and zeros only)."""
    out: dict[str, int] = {}
    for t in tensors:
        x = t.detach().double().abs().flatten()
        zeros = int((x == 0).sum())
        if zeros:
            out["zero"] = out.get("zero", 0) + zeros
        exps = torch.frexp(x[x > 0]).exponent
        for e, c in zip(*torch.unique(exps, return_counts=True)):
            out[f"e{int(e)}"] = out.get(f"e{int(e)}", 0) + int(c)
    return out


def test_monitor_histograms_per_kind_and_layer_type_reach_jsonl_tensorboard_and_wandb(tmp_path, monkeypatch):
    import json
    import sys

    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    with torch.no_grad():
        model[2].bias.zero_()  # zeros have a bin of their own
    sinks = [gapmon.JSONLSink(tmp_path / "m.jsonl")]
    tb = pytest.importorskip("tensorboard")
    sinks.append(gapmon.TensorBoardSink(tmp_path / "tb"))
    logged = []
    wandb = pytest.importorskip("wandb")

    class FakeWandb:  # wandb.init rebinds wandb.log: a stand-in module with wandb's own Histogram
        run, Histogram = object(), wandb.Histogram

        @staticmethod
        def log(data, step=None):
            logged.append((step, data))

    monkeypatch.setitem(sys.modules, "wandb", FakeWandb)
    sinks.append(gapmon.WandbSink(project="gapmon-test"))
    with gapmon.GAPMonitor(model, numerics=("bf16",), sinks=sinks) as mon:
        mon.begin_step(7, 3)
        model(torch.randn(3, 4)).square().sum().backward()
        mon.end_step()
    record = json.loads((tmp_path / "m.jsonl").read_text())
    hists = record["numerics_histograms"]
    linears = [model[0].weight, model[0].bias, model[2].weight, model[2].bias]
    assert hists["params/Linear"] == _frexp_named_bins(linears)
    assert hists["params/LayerNorm"] == _frexp_named_bins([model[1].weight, model[1].bias])
    assert hists["grads/Linear"] == _frexp_named_bins([p.grad for p in linears])
    assert set(hists) == {f"{kind}/{layer}" for kind in ("params", "grads", "activations", "activation_grads")
                          for layer in ("Linear", "LayerNorm")}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"histograms": 0})
    acc.Reload()
    tag = "gap/numerics/grads/Linear/log2_abs"
    event = acc.Histograms(tag)[0]
    want = _frexp_named_bins([p.grad for p in linears])
    assert event.step == 7
    assert sum(event.histogram_value.bucket) == sum(v for k, v in want.items() if k != "zero")
    top = max(int(k[1:]) for k in want if k != "zero")
    assert event.histogram_value.max == top and event.histogram_value.bucket_limit[-1] == top

    step, data = logged[-1]
    assert step == 7
    h = data[tag]
    assert sum(h.histogram) == sum(v for k, v in want.items() if k != "zero") and h.bins[-1] == top
    del tb


def mon_alerts(seen) -> list[str]:
    """The 'kind/name: field value' entries of GAPMonitor's numerics alert warnings."""
    import ast

    found = []
    for w in seen:
        text = str(w.message)
        if "numerics_alert" in text:
            found += ast.literal_eval(text[text.index("["):].removesuffix(" ..."))
    return found


def test_report_shows_a_bf16_run_whose_gradients_flush_to_zero(tmp_path):
    """The README's worked example: a bf16 model whose loss scale drops 2^-15 a step. The gradients
    walk down the exponent line, reach bf16's subnormals at step 8 (alert) and are zero at step 9."""
    import torch.nn as nn

    pytest.importorskip("matplotlib")
    from gapmon.apps.report import make_report, numerics_series

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).to(torch.bfloat16)
    x, y = torch.randn(32, 64, dtype=torch.bfloat16), torch.randn(32, 8, dtype=torch.bfloat16)
    # Which tensors cross the alert depends on the bf16 arithmetic of the CPU (AVX-512 BF16 rounds the
    # backward GEMMs differently): the expected alerts are computed from the tensors themselves.
    captured: dict[str, torch.Tensor] = {}

    def keep_output_grad(name, module, args, out):
        out.register_hook(lambda g: captured.__setitem__(f"activation_grads/{name}", g.detach().clone()))

    for name, module in model.named_children():
        module.register_forward_hook(functools.partial(keep_output_grad, name))

    def underflow_share(t: torch.Tensor) -> float:  # bf16's smallest normal is 2^-126 (float64 reference)
        a = t.double().abs()
        return float(((a > 0) & (a < 2.0 ** -126)).sum()) / t.numel()

    alerts, expected, group_share = {}, {}, []
    # oneDNN's bf16 GEMMs on CPUs with AVX-512 BF16 flush subnormal results to zero (the gradients would
    # skip bf16's subnormal range); torch's own GEMMs keep gradual underflow on every CPU.
    with torch.backends.mkldnn.flags(enabled=False), \
            gapmon.GAPMonitor(model, numerics=("bf16",), numerics_alert=0.05,
                              sinks=[gapmon.JSONLSink(tmp_path / "metrics.jsonl"),
                                     lambda step, m: None]) as mon:
        for step in range(10):
            mon.begin_step(step, batch_size=32)
            captured.clear()
            (nn.functional.mse_loss(model(x), y) * 2.0 ** (-15 * step)).backward()
            tensors = {**captured, **{f"grads/{n}": p.grad for n, p in model.named_parameters()},
                       **{f"params/{n}": p.detach() for n, p in model.named_parameters()}}
            expected[step] = sorted(k for k, t in tensors.items() if underflow_share(t) > 0.05)
            grads_flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            group_share.append(underflow_share(grads_flat))  # every parameter is a Linear's
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                mon.end_step()
            alerts[step] = sorted(a.split(":")[0] for a in mon_alerts(seen))
            model.zero_grad()
    assert alerts == expected
    assert [s for s, a in alerts.items() if a] == [8]  # the step where the gradients reach bf16's subnormals
    series = numerics_series([json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()])
    grads = series["grads/Linear"]
    under = grads["shares"]["bf16"]["underflow"]
    assert under == pytest.approx(group_share, abs=1e-12)
    assert under[:8] == [0.0] * 8 and under[8] > 0.0 and under[9] == 0.0
    zero_share = [h[0] / sum(h) for h in grads["histograms"]]
    assert zero_share[:8] == [0.0] * 8 and zero_share[9] == 1.0
    # the heat map's mass moves down 15 binades a step: the top exponent bin by step
    tops = [max(i for i, c in enumerate(h) if c) for h in grads["histograms"][:8]]
    assert all(a - b == 15 for a, b in zip(tops, tops[1:]))
    text = make_report(tmp_path).read_text()
    assert "| grads/Linear (steps 0..9) | bf16 | 0.00% → 100.00% | 0.00% → 0.00% | 0.00% |" in text
    assert (tmp_path / "report" / "numerics.png").stat().st_size > 1000


def test_monitor_numerics_of_activations_and_their_gradients_over_micro_batches(tmp_path):
    """Activations and activation gradients get kurtosis, shares and histograms over all their
    elements and micro-batches, against the captured tensors (frexp, float64); alerts name them."""
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    seen: dict[str, list] = {"0": [], "2": [], "g2": []}

    def capture_first(module, args, out):
        seen["0"].append(out.detach().clone())

    def capture_last(module, args, out):
        seen["2"].append(out.detach().clone())
        out.register_hook(lambda g: seen["g2"].append(g.clone()))

    model[0].register_forward_hook(capture_first)
    model[2].register_forward_hook(capture_last)
    with gapmon.GAPMonitor(model, params=False, grads=False, numerics=("fp8_e4m3",), numerics_alert=0.9,
                           sinks=[gapmon.JSONLSink(tmp_path / "m.jsonl")]) as mon:
        mon.begin_step(0, 6)
        for mb in range(2):
            model(torch.randn(3, 4) * (1e-3 if mb else 1.0)).square().sum().mul(1e-4).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            metrics = mon.end_step()
    for key, name, kind in (("0", "0", "activations"), ("2", "2", "activations"), ("g2", "2", "activation_grads")):
        x = torch.cat([t.flatten() for t in seen[key]])
        under, over = _direct_shares(x, "fp8_e4m3", 0)
        assert metrics[f"gap/{kind}/{name}/fp8_e4m3_underflow"] == pytest.approx(under), key
        assert metrics[f"gap/{kind}/{name}/fp8_e4m3_overflow"] == pytest.approx(over), key
        d = x.double() - x.double().mean()
        assert metrics[f"gap/{kind}/{name}/kurtosis"] == pytest.approx((x.numel() * (d ** 4).sum() / (d ** 2).sum() ** 2).item())
    assert "gap/activations/1/kurtosis" in metrics  # the Tanh's own output
    assert any("activation_grads/2: fp8_e4m3_underflow" in str(w.message) for w in caught)
    hists = json.loads((tmp_path / "m.jsonl").read_text())["numerics_histograms"]
    assert hists["activations/Linear"] == _frexp_named_bins(seen["0"] + seen["2"])
    assert set(hists) == {"activations/Linear", "activations/Tanh", "activation_grads/Linear", "activation_grads/Tanh"}


def test_report_numerics_keep_the_last_record_of_a_step_written_twice():
    """A resumed run appends steps it had written already: the numerics series has each step once,
    in step order, with the newer record's bins."""
    from gapmon.apps.report import numerics_series

    records = [{"step": s, "numerics_histograms": {"grads/Linear": {"e-3": 10}}} for s in (0, 1, 2)]
    records += [{"step": s, "numerics_histograms": {"grads/Linear": {"zero": 10}}} for s in (1, 2, 3)]
    series = numerics_series(records)["grads/Linear"]
    assert series["steps"] == [0, 1, 2, 3]
    assert [h[0] for h in series["histograms"]] == [0, 10, 10, 10]  # the zero bin: rewritten steps hold zeros


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_16_bit_pattern_against_the_reference(dtype, cpu_isa):
    """All 65,536 bit patterns of a 16-bit float, on every instruction set (the float16 path converts by
    F16C on AVX2/AVX-512, by its own bit conversion on the generic one): the bins equal the frexp/bincount
    reference exactly, the moments of the finite ones to 1e-9."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    bits = bits[torch.randperm(bits.numel(), generator=torch.Generator().manual_seed(0))]
    got, want = gapmon.numerics_states([bits])[0], reference.numerics_states([bits])[0]
    assert torch.equal(got[:nm.NUM_BINS], want[:nm.NUM_BINS])
    finite = bits[torch.isfinite(bits)]
    got, want = gapmon.numerics_states([finite])[0], reference.numerics_states([finite])[0]
    count, mean, m2, m3, m4 = range(nm.NUM_BINS, nm.NUM_BINS + 5)
    torch.testing.assert_close(got[[count, m2, m4]], want[[count, m2, m4]], rtol=1e-9, atol=0)
    # The set is symmetric: mean and M3 are 0, up to rounding at the scale of their terms.
    d = finite.double()
    assert abs(got[mean] - want[mean]) <= 1e-12 * d.abs().max()
    assert abs(got[m3] - want[m3]) <= 1e-12 * (d.abs() ** 3).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_zeros_subnormals_and_non_finite_values_in_scattered_blocks(dtype, cpu_isa):
    """Zero, subnormal, Inf and NaN values in some blocks and chunks of a long tensor and not in others
    (the CPU kernel tells zeros from subnormals and Inf from NaN only in blocks whose exponent-0 or
    exponent-255 counts grew): bins equal the reference exactly."""
    torch.manual_seed(3)
    x = torch.randn(300_000).to(dtype)
    tiny = torch.finfo(dtype).tiny / 4  # a subnormal of the dtype
    for at, value in ((5, 0.0), (1030, tiny), (2047, -0.0), (2048, tiny), (70_000, float("nan")),
                      (70_001, float("inf")), (140_000, -float("inf")), (200_000, tiny), (299_999, 0.0)):
        x[at] = value
    got, want = gapmon.numerics_states([x])[0], reference.numerics_states([x])[0]
    assert torch.equal(got[:nm.NUM_BINS], want[:nm.NUM_BINS])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_exponents_counted_in_pairs_over_odd_runs_and_calls_in_a_row(dtype, cpu_isa):
    """The CPU kernel counts the exponents of neighbouring elements in pairs, in a table per thread that each
    chunk must leave zero (blocks whose exponents would widen the chunk's range past 48 values, and short
    blocks, count each exponent alone), and a run's odd last element alone: rows of odd length (an edge value
    only in such a last element), exponents spread wide or all alike, a chunk that switches between the two
    ways, zeros and subnormals in pair-counted blocks, one call after another, equal the reference's bins
    exactly (a table left dirty, or a last element dropped or counted twice, changes them)."""
    g = torch.Generator().manual_seed(5)
    top = 100 if dtype != torch.float16 else 12
    spread = torch.randn(4097, generator=g) * torch.exp2(torch.randint(-top, top, (4097,), generator=g).double())
    base = torch.randn(37, 65, generator=g)
    base[3, 32], base[9, 32], base[20, 32] = 0.0, float("nan"), float("inf")  # only in runs' last elements
    # blocks whose exponents the pair table takes, then one it must not (the chunk's range would grow too wide),
    # then pairs again; values around the smallest normal (zeros and subnormals in pair-counted blocks)
    near = torch.randn(2048, generator=g, dtype=torch.float64)
    shifted = torch.cat((near, near * 2.0 ** (top // 2 + 8), near * 0.5)).to(dtype)
    tiny = (near * torch.finfo(dtype).tiny * 8).to(dtype)
    tiny[::97] = 0.0
    cases = [spread.to(dtype), base.to(dtype)[:, :33], torch.ones(2001, dtype=dtype), spread.to(dtype)[1:],
             base.to(dtype)[:, :33].t(), torch.full((1,), 3.0, dtype=dtype), shifted, tiny]
    for x in cases + cases[::-1]:
        got, want = gapmon.numerics_states([x])[0], reference.numerics_states([x])[0]
        assert torch.equal(got[:nm.NUM_BINS], want[:nm.NUM_BINS]), (x.shape, x.stride())
        fused = gapmon.states_numerics_blocks([x], ["mxfp8_e4m3"])[1][0]
        assert torch.equal(fused[:nm.NUM_BINS], want[:nm.NUM_BINS])


def test_every_instruction_set_gives_the_same_bits():
    """The numerics rows (bins and moments) of float32, bfloat16 and float16 tensors are the same bits on the
    generic, AVX2 and AVX-512 kernels (the AVX2 power sums once used FMA, which the generic build has not: the
    moments' last bits then depended on the machine), and so is the one pass with block formats."""
    if gapmon.backend() == "torch":
        pytest.skip("needs the compiled kernels")
    gen = torch.Generator().manual_seed(8)
    xs = [torch.randn(70001, generator=gen) * 3, torch.randn(30000, generator=gen).bfloat16(),
          torch.randn(333, 77, generator=gen).half(), torch.randn(5000, generator=gen) + 1e4]
    isas = cpu_isas()
    previous = gapmon.cpu_isa()
    try:
        rows = {}
        for isa in isas:
            gapmon.cpu_isa(isa)
            rows[isa] = ([gapmon.numerics_states([x])[0] for x in xs],
                         gapmon.states_numerics_blocks(xs, ["mxfp8_e4m3"])[1])
    finally:
        gapmon.cpu_isa(previous)
    for isa in isas[1:]:
        for got, want in zip(rows[isa][0], rows[isas[0]][0]):
            assert torch.equal(got, want), isa
        assert torch.equal(rows[isa][1], rows[isas[0]][1]), isa


def test_states_and_numerics_in_one_pass_equal_the_two_ops():
    """states_and_numerics (one pass on CPU) gives the bits of multi_tensor_states and numerics_states,
    over dtypes, layouts, empty and expanded tensors, one and many chunks."""
    torch.manual_seed(0)
    xs = [torch.randn(300_001) * 3 + 1, torch.randn(7, 5).t(), torch.randn(3).bfloat16(), torch.empty(0),
          torch.randn(2, 1).expand(2, 9), torch.randn(70_000).half(), torch.randn(4, 6).double()[:, ::2]]
    xs[0][17] = float("nan")
    states, rows = nm.states_and_numerics(xs)
    torch.testing.assert_close(states, gapmon.multi_tensor_states(xs), rtol=0, atol=0, equal_nan=True)  # the same bits
    torch.testing.assert_close(rows, gapmon.numerics_states(xs), rtol=0, atol=0, equal_nan=True)
    empty = nm.states_and_numerics([])
    assert empty[0].shape == (0, len(gapmon.stats.STATE_NAMES)) and empty[1].shape == (0, len(nm.NUMERICS_COLUMNS))


def test_monitor_takes_parameter_numerics_in_the_statistics_pass(monkeypatch):
    """With numerics on, the parameters and gradients are read once for both (no separate statistics
    op over them), and the metrics are those of the separate ops."""
    from gapmon.stats import _backend

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x = torch.randn(5, 6)
    calls = {"fused": 0, "rows": 0}
    fused, rows = _backend.states_and_numerics_rows, _backend.multi_rows
    monkeypatch.setattr(_backend, "states_and_numerics_rows", lambda xs: (calls.__setitem__("fused", calls["fused"] + 1), fused(xs))[1])
    monkeypatch.setattr(_backend, "multi_rows", lambda *a, **k: (calls.__setitem__("rows", calls["rows"] + 1), rows(*a, **k))[1])
    with gapmon.GAPMonitor(model, numerics=("bf16",), activations=False, activation_grads=False) as mon:
        mon.begin_step(0, batch_size=5)
        model(x).sum().backward()
        metrics = mon.end_step()
    assert calls == {"fused": 1, "rows": 0}
    tensors = [p.detach() for p in model.parameters()] + [p.grad for p in model.parameters()]
    want = gapmon.multi_tensor_stats(tensors)
    assert metrics["gap/grads/2.weight/norm"] == want.norm[6].item()
    assert metrics["gap/params/0.weight/max"] == want.max_abs[0].item()
    d = model[2].weight.grad.double().flatten()
    d = d - d.mean()
    assert metrics["gap/grads/2.weight/kurtosis"] == pytest.approx((d.numel() * (d ** 4).sum() / (d ** 2).sum() ** 2).item())


def _fold_inputs():
    """Activations as the monitor folds them: several chunks per instance (bf16), a transposed and an
    expanded layout, a NaN in one instance, a float64 one."""
    torch.manual_seed(5)
    big = (torch.randn(3, 70_001) * 4 + 2).bfloat16()
    nan = torch.randn(4, 9)
    nan[2, 3] = float("nan")
    return [big, torch.randn(7, 5, 6).transpose(0, 2), torch.randn(5, 1).expand(5, 40), nan,
            torch.randn(6, 300, dtype=torch.float64), torch.randn(2, 3).half()]


@pytest.mark.parametrize("case", range(6))
def test_activation_fold_with_numerics_in_one_op(case):
    """accumulate_instance_stats_and_numerics: the accumulator row gets the bits of
    accumulate_instance_stats; the numerics row becomes the merge of what it held and x's numerics
    (bins exact, against frexp; moments against float64), in place; other rows untouched."""
    x = _fold_inputs()[case]
    acc = torch.zeros(3, len(gapmon.stats.ACC_NAMES), dtype=torch.float64)
    gapmon.ops.accumulate_instance_stats(torch.randn(2, 8), acc, 1)  # the row already holds a micro-batch
    want_acc = acc.clone()
    gapmon.ops.accumulate_instance_stats(x, want_acc, 1)
    earlier = torch.randn(50) * 1e-3
    table = torch.zeros(4, len(nm.NUMERICS_COLUMNS), dtype=torch.float64)
    table[2] = reference.numerics_states([earlier])[0]
    table[0] = 7.0  # a row of another module: untouched
    gapmon.ops.accumulate_instance_stats_and_numerics(x, acc, 1, 1, table, 2)
    torch.testing.assert_close(acc, want_acc, rtol=0, atol=0, equal_nan=True)  # the same bits
    assert bool((table[0] == 7.0).all()) and bool((table[[1, 3]] == 0).all())
    values = torch.cat((earlier.double(), x.double().flatten()))
    assert torch.equal(table[2, :nm.NUM_BINS].long(), _frexp_bins(values.tolist()))
    count, mean, m2, m3, m4 = table[2, nm.NUM_BINS:].tolist()
    assert count == values.numel()
    if not values.isnan().any():
        d = values - values.mean()
        for got, want in ((mean, values.mean()), (m2, (d ** 2).sum()), (m4, (d ** 4).sum())):
            assert got == pytest.approx(want.item(), rel=1e-10, abs=1e-12)
        assert m3 == pytest.approx((d ** 3).sum().item(), rel=1e-8, abs=1e-9 * count * (m2 / count) ** 1.5)
    else:
        assert math.isnan(mean)


def test_activation_fold_with_numerics_checks_its_arguments():
    x = torch.randn(3, 4)
    acc = torch.zeros(2, len(gapmon.stats.ACC_NAMES), dtype=torch.float64)
    table = torch.zeros(2, len(nm.NUMERICS_COLUMNS), dtype=torch.float64)
    with pytest.raises(ValueError, match="numerics table"):
        gapmon.ops.accumulate_instance_stats_and_numerics(x, acc, 0, 1, table.float(), 0)
    with pytest.raises(ValueError, match="numerics table"):
        gapmon.ops.accumulate_instance_stats_and_numerics(x, acc, 0, 1, table[:, :10], 0)
    with pytest.raises(IndexError, match="numerics row 2 out of range"):
        gapmon.ops.accumulate_instance_stats_and_numerics(x, acc, 0, 1, table, 2)
    with pytest.raises(IndexError, match="row 5 out of range"):
        gapmon.ops.accumulate_instance_stats_and_numerics(x, acc, 5, 1, table, 0)
    assert bool((acc == 0).all()) and bool((table == 0).all())  # nothing written by a refused call
    table[1] = reference.numerics_states([torch.randn(9)])[0]
    held = table.clone()
    gapmon.ops.accumulate_instance_stats_and_numerics(torch.empty(0, 4), acc, 0, 1, table, 1)
    assert torch.equal(table, held)  # no instances: the row keeps what it held


def test_monitor_folds_activation_numerics_with_the_statistics(monkeypatch):
    """With numerics on, each activation hook is one op for statistics and numerics together (no
    separate numerics pass over the activation)."""
    from gapmon.stats import _backend

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    calls = {"fused": 0, "plain": 0, "numerics": 0}

    def counting(name, fn):
        return lambda *a, **k: (calls.__setitem__(name, calls[name] + 1), fn(*a, **k))[1]

    monkeypatch.setattr(gapmon.ops, "accumulate_instance_stats_and_numerics",
                        counting("fused", _backend.accumulate_instance_stats_and_numerics))
    monkeypatch.setattr(gapmon.ops, "accumulate_instance_stats", counting("plain", _backend.accumulate_instance_stats))
    monkeypatch.setattr(_backend, "numerics_rows", counting("numerics", _backend.numerics_rows))
    with gapmon.GAPMonitor(model, numerics=("bf16",), params=False, grads=False) as mon:
        mon.begin_step(0, batch_size=5)
        model(torch.randn(5, 6)).sum().backward()
        metrics = mon.end_step()
    assert calls == {"fused": 6, "plain": 0, "numerics": 0}  # 3 activations + 3 activation gradients
    assert "gap/activations/0/kurtosis" in metrics and "gap/activation_grads/2/bf16_underflow" in metrics


def test_report_shows_only_groups_with_data_and_the_scaled_shares(tmp_path):
    """A container whose output is its child's (read once) holds no numerics data: no group, no nan% row.
    The scaled shares (each tensor at the power of two that puts its max |x| in fp8 e4m3's top binade)
    are exact element counts, against a float64 reference."""
    import torch.nn as nn

    pytest.importorskip("matplotlib")
    from gapmon.apps.report import make_report

    class MLP(nn.Module):  # its output is fc's output: the monitor reads it once
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return self.fc(x)

    torch.manual_seed(0)
    model = nn.Sequential(MLP(), nn.Tanh(), nn.Linear(16, 4))
    records = []
    with gapmon.GAPMonitor(model, numerics=("fp8_e4m3",), sinks=[gapmon.JSONLSink(tmp_path / "metrics.jsonl"),
                                                                 lambda step, m: None]) as mon:
        mon.sinks.append(type("Keep", (gapmon.Sink,), {"write": lambda self, s, m, info: records.append(info)})())
        for step in range(3):
            mon.begin_step(step, batch_size=8)
            (model(torch.randn(8, 16)) * 1e-3).square().sum().backward()
            grads = [p.grad.double() for p in model.parameters()]
            mon.end_step()
            model.zero_grad()

            def scaled_underflow(t):  # fp8 e4m3: smallest normal 2^-6, top binade [2^8, 2^9)
                a = t.abs()
                k = 9 - math.frexp(a.max().item())[1]
                return int(((a > 0) & (a * 2.0 ** k < 2.0 ** -6)).sum())

            info = records[-1]
            assert "activations/MLP" not in info["numerics_histograms"]
            assert info["numerics_scaled"]["grads/Linear"]["fp8_e4m3"]["underflow"] == sum(map(scaled_underflow, grads))
    text = make_report(tmp_path).read_text()
    assert "nan%" not in text and "MLP" not in text
    total = sum(p.numel() for p in model.parameters())
    row = next(line for line in text.splitlines() if line.startswith("| grads/Linear"))
    last_scaled = float(row.split("|")[6].split("→")[1].strip().rstrip("%")) / 100
    assert last_scaled == pytest.approx(sum(map(scaled_underflow, grads)) / total, abs=5e-5)
