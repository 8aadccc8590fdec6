"""gapmon.stats.ops.update_rows (the fused optimizer-update pass, torch.ops.gapmon.update_sums) against
float64 torch computations: every weight and gradient dtype, non-contiguous and empty tensors, parameters
over several chunks, bits independent of the thread count, and clear refusals."""
import pytest
import torch

import gapmon
from gapmon.stats import ops
from gapmon.stats.layout import UPDATE_COLUMNS

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _expected(before, after, grads):
    rows = []
    for b, a, g in zip(before, after, grads):
        b, a, g = b.double(), a.double(), g.double()
        d = a - b
        rows.append([(d * d).sum().item(), (b * b).sum().item(), (g * g).sum().item(), (d * g).sum().item(), b.numel()])
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, len(UPDATE_COLUMNS))


def _params(weight_dtype, grad_dtype, shapes=((300, 70), (1,), (0,), (3 * 65536 + 5,), (4, 5))):
    g = torch.Generator().manual_seed(0)
    before = [torch.randn(s, generator=g).to(weight_dtype) for s in shapes]
    after = [(b.double() - 0.01 * torch.randn(s, generator=g)).to(weight_dtype) for b, s in zip(before, shapes)]
    grads = [torch.randn(s, generator=g).to(grad_dtype) for s in shapes]
    return before, after, grads


@pytest.mark.parametrize("weight_dtype", DTYPES)
@pytest.mark.parametrize("grad_dtype", (torch.float32, torch.bfloat16, torch.float64))
def test_rows_match_float64(weight_dtype, grad_dtype):
    before, after, grads = _params(weight_dtype, grad_dtype)
    got = ops.update_rows(before, after, grads)
    torch.testing.assert_close(got, _expected(before, after, grads), rtol=1e-12, atol=1e-12)


def test_non_contiguous_inputs():
    before, after, grads = _params(torch.float32, torch.float32, ((64, 48),))
    b, a, g = before[0].t(), after[0].t(), grads[0].t()  # transposed views
    got = ops.update_rows([b, a], [a, b], [g, g])
    torch.testing.assert_close(got, _expected([b, a], [a, b], [g, g]), rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(gapmon.backend() == "torch", reason="needs the compiled extension")
def test_bits_do_not_depend_on_threads():
    before, after, grads = _params(torch.float32, torch.float32, ((5 * 65536 + 3,), (65536,), (17,)))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.update_rows(before, after, grads)
        torch.set_num_threads(max(2, threads))
        many = ops.update_rows(before, after, grads)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_refusals_name_the_problem():
    x = torch.randn(3)
    with pytest.raises(ValueError, match="as many"):
        ops.update_rows([x], [x, x], [x])
    with pytest.raises(ValueError, match="parameter 0: shapes differ"):
        ops.update_rows([x], [x], [torch.randn(4)])
    with pytest.raises(TypeError, match="floating-point"):
        ops.update_rows([x], [x], [torch.ones(3, dtype=torch.int64)])
    if gapmon.backend() != "torch":
        with pytest.raises(ValueError, match="differ in dtype"):
            torch.ops.gapmon.update_sums([x], [x.double()], [x])
    assert ops.update_rows([], [], []).shape == (0, len(UPDATE_COLUMNS))
