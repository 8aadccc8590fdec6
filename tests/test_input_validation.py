"""Every public numeric (and format) argument is validated where it enters: a wrong type or a value out
of range raises TypeError/ValueError whose message names the argument and what it must be, before any
work is done (no share that matches no definition, no negative batch size, no false disk-full report)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import gapmon
from gapmon import analysis, numerics
from gapmon.apps.report import anomalies


def _monitor():
    mon = gapmon.GAPMonitor(nn.Linear(3, 2), sinks=[])
    mon.begin_step(0, batch_size=1)
    return mon


def _norms():
    model = nn.Linear(3, 2)
    psn = gapmon.PerSampleGradNorms(model)
    model(torch.randn(4, 3))
    return psn


ROWS = numerics.numerics_states([torch.randn(10)])
X = [torch.randn(10)]

# (what is called, the exception, words the message must hold)
CASES = {
    "MonitorConfig numerics=None": (lambda: gapmon.MonitorConfig(numerics=None), TypeError, "formats"),
    "MonitorConfig numerics='bf17'": (lambda: gapmon.MonitorConfig(numerics=("bf17",)), ValueError, "unknown format"),
    "MonitorConfig numerics_alert=2": (lambda: gapmon.MonitorConfig(numerics=("bf16",), numerics_alert=2.0), ValueError,
                                       "numerics_alert"),
    "MonitorConfig correction=-1": (lambda: gapmon.MonitorConfig(correction=-1), ValueError, "correction"),
    "GAPMonitor.add_samples(2.5)": (lambda: _monitor().add_samples(2.5), TypeError, "n must be a non-negative integer"),
    "GAPMonitor.add_samples(-5)": (lambda: _monitor().add_samples(-5), ValueError, "n must be a non-negative integer"),
    "GAPMonitor.add_samples(True)": (lambda: _monitor().add_samples(True), TypeError, "n must be"),
    "GAPMonitor.begin_step(-1)": (lambda: _monitor().begin_step(-1), ValueError, "step"),
    "GAPMonitor.begin_step(batch_size=2.5)": (lambda: _monitor().begin_step(1, batch_size=2.5), TypeError, "batch_size"),
    "JSONLSink max_pending=-1": (lambda: gapmon.JSONLSink("unused.jsonl", max_pending=-1), ValueError, "max_pending"),
    "JSONLSink max_pending=1.5": (lambda: gapmon.JSONLSink("unused.jsonl", max_pending=1.5), TypeError, "max_pending"),
    "multi_tensor_numerics margin=1.5": (lambda: gapmon.multi_tensor_numerics(X, margin=1.5), TypeError, "margin"),
    "multi_tensor_numerics margin=-0.5": (lambda: gapmon.multi_tensor_numerics(X, margin=-0.5), TypeError, "margin"),
    "multi_tensor_numerics margin=-1": (lambda: gapmon.multi_tensor_numerics(X, margin=-1), ValueError, "margin"),
    "multi_tensor_numerics formats=None": (lambda: gapmon.multi_tensor_numerics(X, formats=None), TypeError, "formats"),
    "numerics_from_rows margin=2.5": (lambda: numerics.numerics_from_rows(ROWS, margin=2.5), TypeError, "margin"),
    "mx_scale_exp margin=-2": (lambda: numerics.mx_scale_exp(ROWS, "bf16", margin=-2), ValueError, "margin"),
    "anomaly_scan max_norm=-1": (lambda: analysis.anomaly_scan({"w": torch.ones(2)}, max_norm=-1.0), ValueError, "max_norm"),
    "anomaly_scan max_norm=nan": (lambda: analysis.anomaly_scan({"w": torch.ones(2)}, max_norm=math.nan), ValueError,
                                  "max_norm"),
    "anomaly_scan min_norm > max_norm": (lambda: analysis.anomaly_scan({"w": torch.ones(2)}, max_norm=1.0, min_norm=2.0),
                                         ValueError, "min_norm"),
    "anomaly_scan max_norm='big'": (lambda: analysis.anomaly_scan({"w": torch.ones(2)}, max_norm="big"), TypeError,
                                    "max_norm"),
    "report anomalies spike=0.5": (lambda: anomalies([], spike=0.5), ValueError, "spike"),
    "tensor_stats correction=1.5": (lambda: gapmon.tensor_stats(torch.ones(3), correction=1.5), TypeError, "correction"),
    "multi_tensor_stats correction=True": (lambda: gapmon.multi_tensor_stats([torch.ones(3)], correction=True), TypeError,
                                           "correction"),
    "Schedule every=0": (lambda: gapmon.Schedule(every=0), ValueError, "every"),
    "Schedule start=1.5": (lambda: gapmon.Schedule(start=1.5), TypeError, "start"),
    "DumpConfig timeout=0": (lambda: gapmon.DumpConfig(timeout=0), ValueError, "timeout"),
    "DumpConfig save_first_n=0": (lambda: gapmon.DumpConfig(mode="sampled", save_first_n=0), ValueError, "save_first_n"),
    "PerSampleConfig batch_dim=-1": (lambda: gapmon.PerSampleConfig(batch_dim=-1), ValueError, "batch_dim"),
    "set_loss_weights nan": (lambda: _norms().set_loss_weights(math.nan), ValueError, "finite"),
    "set_loss_weights wrong count": (lambda: _norms().set_loss_weights(torch.ones(3)), ValueError, "4 samples"),
}
# A bare tensor where a list of tensors is asked for would be measured row by row (each row a tensor of its
# own): refused, as torch's _foreach ops refuse it.
M = torch.randn(4, 32)
for _name, _call in {
    "multi_tensor_stats": lambda: gapmon.multi_tensor_stats(M),
    "multi_tensor_states": lambda: gapmon.multi_tensor_states(M),
    "multi_tensor_numerics": lambda: gapmon.multi_tensor_numerics(M),
    "numerics_states": lambda: numerics.numerics_states(M),
    "states_and_numerics": lambda: numerics.states_and_numerics(M),
    "block_numerics": lambda: gapmon.block_numerics(M, ["mxfp4"]),
    "block_format_metrics": lambda: gapmon.block_format_metrics(M, ["mxfp4"]),
    "states_numerics_blocks": lambda: gapmon.states_numerics_blocks(M, ["mxfp4"]),
    "update_sums": lambda: gapmon.stats.ops.update_rows(M, M, M),
}.items():
    CASES[f"{_name} of a bare tensor"] = (_call, TypeError, f"gapmon.{_name}: expected a list of tensors")


@pytest.mark.parametrize("case", sorted(CASES))
def test_public_argument_is_validated(case):
    call, error, words = CASES[case]
    with pytest.raises(error) as raised:
        call()
    assert words in str(raised.value), str(raised.value)


def test_valid_values_pass():
    mon = _monitor()
    mon.add_samples(0)
    mon.add_samples(3)
    assert mon.end_step()["gap/global_batch_size"] == 4
    assert gapmon.JSONLSink("unused.jsonl", max_pending=0).max_pending == 0
    assert gapmon.multi_tensor_numerics(X, formats=["bf16"], margin=2).shares["bf16"]["underflow"].shape == (1,)
    assert analysis.anomaly_scan({"w": torch.ones(2)}, max_norm=10, min_norm=0) == []
