"""The benchmark scripts run end to end (on the CPU, tiny sizes): a GPU session must not lose its
device time to a script that fails; their JSON carries the targets beside the figures."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import gapmon

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(gapmon.backend() == "torch", reason="needs the compiled ops")]


def _run(script: str, *args: str, out: Path) -> dict:
    done = subprocess.run([sys.executable, str(BENCH / script), *args, "--out", str(out)], capture_output=True,
                          text=True, timeout=600, cwd=BENCH)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(out.read_text())


def test_bench_monitor_reports_floor_and_targets(tmp_path):
    result = _run("bench_monitor.py", "--small", "--steps", "2", "--rounds", "1", "--blocks", "1",
                  out=tmp_path / "monitor.json")
    modes = result["modes"]
    assert set(modes) == {"torch", "all four", "params+grads", "params+grads + updates", "interval=10"}
    # Timings only exist (their order is a machine's business: comparing them here would flake).
    assert modes["all four"]["floor_s"] > 0 and modes["params+grads"]["floor_s"] > 0
    assert modes["all four"]["target"] and isinstance(modes["all four"]["met"], bool)
    # Profiled op counts: a hook per module output and gradient plus end_step's list op; none when skipped.
    assert modes["all four"]["work"]["gapmon_ops"] > modes["params+grads"]["work"]["gapmon_ops"] >= 1
    assert modes["interval=10"]["work"]["gapmon_ops"] == 0


def test_bench_stats_reports_targets(tmp_path):
    result = _run("bench_stats.py", "--sizes", "10", "--numerics-sizes", "10", "--quick", out=tmp_path / "stats.json")
    cases = {r["case"] for r in result["results"]}
    assert {"tensor_stats", "host cost of one call", "multi_tensor_stats GPT-2 small (sizes / 16)", "numerics_states"} <= cases
    numerics = next(r for r in result["results"] if r["case"] == "numerics_states")
    assert numerics["gapmon_s"] > 0 and numerics["reference_s"] > 0 and numerics["on_over_off"] > 0
    hook = next(r for r in result["results"] if r["case"] == "activation hook with numerics")
    assert hook["one_op_s"] > 0 and hook["separate_ops_s"] > 0 and hook["fold_s"] > 0
    blocks = [r for r in result["results"] if r["case"].startswith("activation hook with block formats")]
    assert len(blocks) == 4 and all(r["one_op_s"] > 0 and r["separate_ops_s"] > 0 and r["numerics_op_s"] > 0
                                    for r in blocks)
    multi = next(r for r in result["results"] if r["case"].startswith("multi_tensor_stats"))
    assert multi["targets"] and all(isinstance(t["met"], bool) for t in multi["targets"])


def test_bench_persample_training_steps(tmp_path):
    result = _run("bench_persample.py", "--gpt2", "16", "--small", "--steps", "2", out=tmp_path / "persample.json")
    # on the CPU twice: glibc's allocator defaults, then freed memory kept (mallopt), the same keys each
    assert [r["allocator"] for r in result["results"]] == ["glibc default", "freed memory kept"]
    for r in result["results"]:
        _check_training_steps(r)


def _check_training_steps(r):
    assert r["seq_len"] == 16 and r["norms_s"] > 0 and r["skipped_s"] > 0 and isinstance(r["met"], bool)
    assert r["bookkeeping_s"] > 0 and isinstance(r["moonshot_met"], bool)
    # the floor: every Linear layer's products timed (2 blocks of 4 and the head)
    assert r["linear_layers"] == 9 and r["linear_products_s"] > 0 and r["norms_floor_ratio"] > 1


def test_bench_provenance_reports_the_cost_per_op(tmp_path):
    result = _run("bench_provenance.py", "--rounds", "3", out=tmp_path / "provenance.json")
    assert result["ops_per_forward_gpt2_small"] > 100 and result["forward_tracked_ms"] > 0
    assert isinstance(result["met"], bool) and result["target"]
    # the per-sample norms' host time per training step of GPT-2 small's structure: 12 blocks of qkv, proj, up, down
    # and two norms, the embeddings, the final norm and the head
    assert result["covered_layers"] == 12 * 6 + 4, result
    assert result["step_plain_ms"] > 0 and {"added_per_layer_us_norms", "added_per_layer_us_bookkeeping"} <= set(result)


def test_bench_followed_through_times_the_bias_mlp_frozen_and_trained(tmp_path):
    result = _run("bench_followed_through.py", "--blocks", "1", "--batch", "2", "--steps", "2",
                  out=tmp_path / "followed.json")
    for kind in ("frozen", "trained"):
        assert result[kind]["plain_ms"] > 0 and result[kind]["norms_ms"] > 0 and result[kind]["ratio"] > 0
    assert result["blocks"] == 1 and result["batch"] == 2 and result["device"].startswith("cpu")


def test_profile_persample_compares_a_norms_step_with_a_plain_one(tmp_path):
    result = _run("profile_persample.py", "--small", "--device", "cpu", out=tmp_path / "profile.json")
    plain, norms = result["plain"], result["norms"]
    assert plain["wall_ms"] > 0 and norms["wall_ms"] > 0 and plain["gpu_busy_ms"] is None
    # the monitor's hooks and products add ops to the step, and the top host ops are named with their calls
    assert norms["aten_and_gapmon_ops"] > plain["aten_and_gapmon_ops"] > 0
    assert norms["top_self_cpu"] and all(a["calls"] > 0 for a in norms["top_self_cpu"])
    # each phase timed as the host spends it and with the device drained; only a monitored step has an end_step
    for kind in (plain, norms):
        assert set(kind["phases_ms"]) == {"host", "drained"}
        assert all(set(p) == {"begin_step", "forward", "backward", "end_step", "optimizer"} for p in kind["phases_ms"].values())
    assert norms["phases_ms"]["host"]["end_step"] > plain["phases_ms"]["host"]["end_step"]
    assert norms["phases_ms"]["host"]["backward"] > 0 and plain["phases_ms"]["drained"]["forward"] > 0
