"""tensor_stats against a float64 oracle: dtypes, layouts, edge values, every CPU code path."""
import os

import pytest
import torch
from helpers import assert_stats_match, float64_stats

import gapmon

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def test_compiled_backend_in_use():
    """CI must exercise the kernels, not the fallback (unless the fallback is asked for)."""
    if os.environ.get("GAPMON_BACKEND") == "torch":
        pytest.skip("fallback backend requested")
    assert gapmon.backend() in ("cpu", "cuda"), "gapmon._C failed to load: the suite would only test the fallback"


def _layouts(dtype):
    """(name, tensor) pairs covering dense, permuted, strided, expanded and odd-size tensors."""
    g = torch.Generator().manual_seed(1)
    base = (torch.randn(67, 129, generator=g) * 3 + 5).to(dtype)
    img = torch.randn(3, 5, 7, 11, generator=g).to(dtype)
    return [
        ("contiguous", base),
        ("transposed", base.t()),
        ("inner_stride", base[:, ::3]),
        ("outer_slice", base[7:40]),
        ("channels_last", img.to(memory_format=torch.channels_last)),
        ("expanded", torch.randn(1, 33, generator=g).to(dtype).expand(9, 33)),
        ("expanded_middle", torch.randn(4, 1, 5, generator=g).to(dtype).expand(4, 6, 5)),
        ("many_chunks", torch.randn(200_003, generator=g).to(dtype)),
        ("strided_many_chunks", torch.randn(3000, 70, generator=g).to(dtype)[:, 1::2]),
        ("deep_permuted", torch.randn(2, 3, 2, 3, 2, 3, 2, 3, 2, 3, generator=g).to(dtype).permute(9, 1, 8, 2, 7, 3, 6, 4, 5, 0)[..., ::2]),
        ("single", torch.tensor([2.5]).to(dtype)),
        ("zero_dim", torch.tensor(-1.5).to(dtype)),
        ("tail", torch.randn(37, generator=g).to(dtype)),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64(cpu_isa, dtype):
    for name, x in _layouts(dtype):
        for correction in (0, 1):
            assert_stats_match(gapmon.tensor_stats(x, correction=correction), float64_stats(x, correction),
                               where=f"{cpu_isa}/{dtype}/{name}/c{correction}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_matches_float64(dtype):
    for name, x in _layouts(dtype):
        assert_stats_match(gapmon.reference.tensor_stats(x), float64_stats(x), where=f"reference/{dtype}/{name}")


def test_numerical_cancellation_2_26():
    """SPEC: var rel. error <= 1e-5 for 2^26 float32 elements whose mean is 1000x their std."""
    x = torch.randn(2**26) + 1000.0
    want = torch.var(x.double()).item()
    got = gapmon.tensor_stats(x).var.item()
    assert abs(got - want) / want <= 1e-5, (got, want)
    assert abs(gapmon.tensor_stats(x).mean.item() - x.double().mean().item()) <= 1e-4


def test_cancellation_on_every_isa(cpu_isa):
    x = (torch.randn(1_000_003) * 1e-3 + 1e4).float()
    want = torch.var(x.double()).item()
    assert abs(gapmon.tensor_stats(x).var.item() - want) / want <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_and_inf(cpu_isa, dtype):
    for pos in (0, 5, 4095, 70_000):
        x = torch.randn(80_000).to(dtype)
        x[pos] = float("nan")
        s = gapmon.tensor_stats(x)
        assert all(torch.isnan(v) for v in (s.mean, s.var, s.max_abs, s.norm)), (pos, s)
        assert s.nonfinite.item() == 1
    x = torch.randn(10_000).to(dtype)
    x[17] = float("inf")
    x[9000] = float("inf")
    assert_stats_match(gapmon.tensor_stats(x), float64_stats(x), where="+inf")
    x[123] = -float("inf")
    s = gapmon.tensor_stats(x)
    assert torch.isnan(s.mean) and s.norm.item() == float("inf") and s.nonfinite.item() == 3
    only_inf = torch.full((100,), float("inf")).to(dtype)
    assert_stats_match(gapmon.tensor_stats(only_inf), float64_stats(only_inf), where="all +inf")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zeros_counted_and_max_abs_of_a_negative_extreme(cpu_isa, dtype):
    """Zeros and max|x| (16-bit floats take both from their raw bits in the vector loop): a sparse
    tensor, one whose only zero is -0.0 deep inside a block, and a largest magnitude that is negative."""
    x = torch.randn(50_000).to(dtype)
    x[::7] = 0.0
    x[3] = -0.0
    x[20_001] = -300.0
    s = gapmon.tensor_stats(x)
    assert s.zeros.item() == float((x == 0).sum()) and s.max_abs.item() == 300.0
    y = (torch.rand(9000) + 0.5).to(dtype)
    y[4321] = -0.0
    assert gapmon.tensor_stats(y).zeros.item() == 1
    assert gapmon.tensor_stats(torch.zeros(5000, dtype=dtype)).zeros.item() == 5000


def test_empty_tensor(cpu_isa):
    for x in (torch.empty(0), torch.empty(3, 0, 4), torch.empty(0, dtype=torch.bfloat16)):
        s = gapmon.tensor_stats(x)
        assert s.count.item() == 0 and s.max_abs.item() == 0 and s.norm.item() == 0
        assert torch.isnan(s.mean) and torch.isnan(s.var)
        assert s.nonfinite.item() == 0 and s.zeros.item() == 0


@pytest.mark.parametrize("correction", [0, 1, 2, 5])
def test_correction_like_torch(correction):
    for n in (1, 2, 3, 10):
        x = torch.randn(n)
        want = torch.var_mean(x.double(), correction=correction)[0]
        got = gapmon.tensor_stats(x, correction=correction).var
        torch.testing.assert_close(got, want, equal_nan=True)


def test_huge_magnitudes_near_float32_max(cpu_isa):
    x = torch.tensor([3.0e38, -3.0e38, 1.0e38, 2.5e38] * 300, dtype=torch.float32)
    assert_stats_match(gapmon.tensor_stats(x), float64_stats(x), where="huge")
    y = torch.randn(5000) * 1e25
    assert_stats_match(gapmon.tensor_stats(y), float64_stats(y), where="1e25")


@pytest.mark.parametrize(
    "bad, what",
    [
        (torch.arange(10), "torch.int64"),
        (torch.ones(3, dtype=torch.bool), "torch.bool"),
        (torch.ones(3, dtype=torch.complex64), "torch.complex64"),
        (torch.ones(3, dtype=torch.int8), "torch.int8"),
    ],
)
def test_bad_dtype_raises_type_error(bad, what):
    for fn in (gapmon.tensor_stats, gapmon.instance_stats, lambda t: gapmon.multi_tensor_stats([t]),
               gapmon.reference.tensor_stats):
        with pytest.raises(TypeError, match=what.replace("torch.", "")):
            fn(bad)


def test_sparse_and_quantized_raise_type_error():
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(TypeError, match="(?i)sparse"):
        gapmon.tensor_stats(sparse)
    with pytest.raises(TypeError, match="(?i)sparse"):
        gapmon.reference.tensor_stats(sparse)
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError, match="(?i)quantized"):
        gapmon.tensor_stats(q)


def test_deterministic_across_thread_counts():
    x = torch.randn(3_000_001) * 2 + 7
    torch.set_num_threads(1)
    one = gapmon.tensor_stats(x).rows()
    torch.set_num_threads(2)
    two = gapmon.tensor_stats(x).rows()
    assert torch.equal(one.view(torch.int32), two.view(torch.int32))


def test_requires_grad_input_is_not_tracked():
    x = torch.randn(100, requires_grad=True)
    s = gapmon.tensor_stats(x * 2)
    assert not s.mean.requires_grad


def test_fields_are_float64_on_input_device():
    for dtype in DTYPES:
        s = gapmon.tensor_stats(torch.randn(10).to(dtype))
        assert all(f.dtype == torch.float64 and f.shape == () and f.device.type == "cpu" for f in s), dtype


@pytest.mark.parametrize("backend", ["compiled", "reference"])
def test_counts_exact_above_2_24(backend):
    """Counts are exact up to 2^53: float32 rows would round 16,777,219 to 16,777,220."""
    stats = gapmon.tensor_stats if backend == "compiled" else gapmon.reference.tensor_stats
    n = 2**24 + 3
    x = torch.ones(n)
    x[:5] = 0.0
    x[5] = float("nan")
    s = stats(x)
    assert (s.count.item(), s.zeros.item(), s.nonfinite.item()) == (n, 5, 1)
    # Expanded (stride-0) dims multiply the counts: 3 * (2^33 + 1) elements, no memory read twice.
    wide = torch.tensor([0.0, float("inf"), 2.0]).expand(2**33 + 1, 3)
    s = stats(wide) if backend == "compiled" else None
    if s is not None:
        assert (s.count.item(), s.zeros.item(), s.nonfinite.item()) == (3 * (2**33 + 1), 2**33 + 1, 2**33 + 1)


def test_float64_input_keeps_its_precision():
    x = torch.tensor([1.0 + 2**-40, 1.0], dtype=torch.float64)
    s = gapmon.tensor_stats(x)
    assert s.max_abs.item() == 1.0 + 2**-40 and s.mean.item() == 1.0 + 2**-41


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_16_bit_pattern(cpu_isa, dtype):
    """All 65,536 bit patterns of a 16-bit float through each load path (F16C on AVX2/AVX-512, the bit
    manipulation of the baseline, bfloat16's paired load): the finite ones match float64, shuffled so
    that every value visits every lane; the non-finite ones are counted."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = bits[torch.isfinite(bits)]
    finite = finite[torch.randperm(finite.numel(), generator=torch.Generator().manual_seed(0))]
    assert_stats_match(gapmon.tensor_stats(finite), float64_stats(finite), where=f"{cpu_isa}/{dtype}/finite patterns")
    s = gapmon.tensor_stats(bits)
    assert s.nonfinite.item() == (~torch.isfinite(bits)).sum().item()
    assert s.zeros.item() == 2  # +0 and -0
