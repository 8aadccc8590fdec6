"""instance_stats and multi_tensor_stats against float64 oracles, and mergeable states."""
import pytest
import torch
from helpers import assert_stats_match, float64_stats

import gapmon


def _row(stats, i):
    return gapmon.Stats(*(f[i] for f in stats))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_instance_stats_matches_rows(cpu_isa, dtype):
    cases = [
        torch.randn(8, 3, 5),
        torch.randn(4, 70_000) * 2 + 3,          # rows spanning several chunks
        torch.randn(300, 2),                      # many tiny rows
        torch.randn(6, 9).t(),                    # batch dim not outermost in memory
        torch.randn(5, 4, 6).permute(1, 2, 0),
        torch.randn(1, 17).expand(3, 17),         # batch of identical (stride-0) instances
        torch.randn(7),                           # instances are scalars
        torch.randn(0, 5),                        # no instances
        torch.randn(3, 0),                        # empty instances
    ]
    for x in cases:
        x = x.to(dtype)
        got = gapmon.instance_stats(x)
        assert got.mean.shape == (x.shape[0],)
        for b in range(x.shape[0]):
            assert_stats_match(_row(got, b), float64_stats(x[b]), where=f"{tuple(x.shape)}[{b}]")


def test_instance_stats_needs_batch_dim():
    with pytest.raises(ValueError, match="batch"):
        gapmon.instance_stats(torch.tensor(1.0))


def test_instance_reference_matches():
    x = torch.randn(6, 4, 5)
    ref = gapmon.reference.instance_stats(x)
    for b in range(6):
        assert_stats_match(_row(ref, b), float64_stats(x[b]))


def test_multi_tensor_stats_mixed(cpu_isa):
    xs = [
        torch.randn(100, 30),
        torch.randn(5).half(),
        torch.randn(70_001).bfloat16(),
        torch.randn(3, 4, dtype=torch.float64).t(),
        torch.empty(0),
        torch.tensor(3.0),
        torch.randn(2, 1).expand(2, 9),
    ]
    got = gapmon.multi_tensor_stats(xs)
    assert got.count.shape == (len(xs),)
    for i, x in enumerate(xs):
        assert_stats_match(_row(got, i), float64_stats(x), where=f"tensor {i}")


def test_multi_tensor_stats_empty_list():
    assert gapmon.multi_tensor_stats([]).mean.shape == (0,)


def test_multi_equals_single_bitwise():
    xs = [torch.randn(n) for n in (1, 100, 65536, 65537, 300_000)]
    rows = gapmon.multi_tensor_stats(xs).rows()
    for i, x in enumerate(xs):
        assert torch.equal(rows[i].view(torch.int32), gapmon.tensor_stats(x).rows().view(torch.int32))


def test_states_of_pieces_merge_to_whole(cpu_isa):
    """Partial states of uneven (and empty) pieces merge to the statistics of the whole tensor."""
    x = torch.randn(100_000) * 0.01 + 300.0
    x[50] = 0.0
    bounds = [0, 0, 17, 40_000, 40_000, 99_999, 100_000]
    pieces = [x[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    states = gapmon.multi_tensor_states(pieces)           # [P, 7]
    merged = gapmon.merge_states(states.unsqueeze(1))     # [P, 1, 7] -> [1, 7]
    assert_stats_match(_row(gapmon.finalize_states(merged), 0), float64_stats(x))
    ref = gapmon.reference.merge_states(gapmon.reference.multi_tensor_states(pieces).unsqueeze(1))
    assert_stats_match(_row(gapmon.Stats.from_rows(gapmon.reference.finalize_states(ref)), 0), float64_stats(x))


def test_merge_states_propagates_nan_and_counts():
    a, b = torch.randn(10), torch.randn(20)
    b[3] = float("nan")
    states = gapmon.multi_tensor_states([a, b]).unsqueeze(1)
    s = gapmon.finalize_states(gapmon.merge_states(states))
    assert torch.isnan(s.max_abs[0]) and torch.isnan(s.var[0]) and s.nonfinite[0] == 1 and s.count[0] == 30


def test_merge_states_rejects_bad_input():
    with pytest.raises(ValueError, match="float64"):
        gapmon.merge_states(torch.zeros(2, 3, 7))
    with pytest.raises(ValueError, match="float64"):
        gapmon.finalize_states(torch.zeros(3, 7))
    with pytest.raises(ValueError, match=r"\[parts, tensors, 7\]"):
        gapmon.merge_states(torch.zeros(3, 7, dtype=torch.float64))
    with pytest.raises(TypeError, match="list"):
        gapmon.merge_states([[1.0]])


def test_mixed_devices_and_meta_are_refused():
    """A meta tensor has no data: refused, never statistics of uninitialised memory."""
    with pytest.raises(ValueError, match="meta"):
        gapmon.multi_tensor_stats([torch.ones(1000), torch.ones(3, device="meta")])
    with pytest.raises(ValueError, match="meta"):
        gapmon.tensor_stats(torch.ones(3, device="meta"))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="one device"):
            gapmon.multi_tensor_stats([torch.ones(10), torch.ones(3, device="cuda")])
