"""Per-block formats (gapmon.stats.block_formats): the compiled one-pass op against the float64 reference
written from the specifications, the reference's element casts against torch's float8 casts and hand-worked
e2m1 values, every format's edge values (subnormals, the largest finite value, ties, an all-zero block, a
block with one huge value, scale under/overflow, non-finite elements), the metrics, and DTensors."""
import math

import pytest
import torch
import torch.distributed as dist
from helpers import run_distributed

import gapmon
from gapmon.stats import block_formats as bf
from gapmon.stats import reference
from gapmon.stats.layout import BLOCK_COLUMNS
from gapmon.stats.numerics import states_and_numerics

ALL = bf.BLOCK_FORMATS
COL = {name: i for i, name in enumerate(BLOCK_COLUMNS)}
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _assert_rows_equal(got, want, what):
    """Counts equal exactly; sums within 1e-12 relative; infinities where the reference has them."""
    assert got.shape == want.shape, what
    both_inf = torch.isinf(got) & torch.isinf(want) & (torch.sign(got) == torch.sign(want))
    close = (got - want).abs() <= 1e-12 * want.abs()
    assert bool((both_inf | close).all()), (what, got[~(both_inf | close)], want[~(both_inf | close)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 70), (5,), (2, 3, 33), (4, 64), (1, 17), (), (0, 32), (2, 0), (2100, 40)])
def test_op_matches_the_reference(dtype, shape):
    g = torch.Generator().manual_seed(len(shape) * 7 + sum(shape))
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * torch.exp(3 * torch.randn(shape, generator=g,
                                                                                         dtype=torch.float64))).to(dtype)
    got = bf.block_numerics([x], ALL)
    amax = bf.finite_amaxes([x])
    _assert_rows_equal(got, reference.block_numerics([x], list(range(len(ALL))), amax.tolist()), (dtype, shape))


def _grid(dtype):
    """Every finite non-negative value of a float8 format, as float64."""
    bits = torch.arange(256, dtype=torch.uint8).view(dtype).double()
    return torch.unique(bits[torch.isfinite(bits) & (bits >= 0)])


@pytest.mark.parametrize("element,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_element_casts_match_torch_float8(element, dtype):
    """Every representable value, every midpoint between neighbours (ties: to even) and random float32
    values in range round as torch's float8 casts (from float32, which they take exactly)."""
    grid = _grid(dtype)
    mids = (grid[1:] + grid[:-1]) / 2
    rnd = torch.rand(100000, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * grid[-1]
    small = torch.exp2(-torch.rand(100000, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 20)
    a = torch.cat([grid, mids, rnd, small]).float().double()  # float32 values
    q, saturated = reference.cast_to_element(a, element)
    assert torch.equal(q, a.float().to(dtype).double())
    assert not saturated.any()


def test_e2m1_by_hand():
    """The e2m1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}, its ties (to the even neighbour) and saturation above 6
    (7 ties between 6 and 8: rounds to 8, so it is clamped; 6.9 rounds to 6)."""
    a = torch.tensor([0, 0.25, 0.5, 0.75, 1, 1.25, 1.75, 2.5, 3.5, 5, 6, 6.9, 7, 100], dtype=torch.float64)
    want = torch.tensor([0, 0, 0.5, 1, 1, 1, 2, 2, 4, 4, 6, 6, 6, 6], dtype=torch.float64)
    q, saturated = reference.cast_to_element(a, "e2m1")
    assert torch.equal(q, want)
    assert saturated.tolist() == [False] * 12 + [True, True]


def _row(x, fmt, dtype=torch.float32):
    return bf.block_numerics([x.to(dtype)], [fmt])[0, 0]


def test_mx_edges_exact_values_subnormals_and_saturation():
    # amax 1.875: X = 0 - 8 for e4m3, so x * 256 is cast. 2^-17 * 256 = 2^-9, e4m3's smallest subnormal (kept);
    # 2^-18 * 256 = 2^-10 ties between 0 and 2^-9 -> 0 (even); 1.8125 * 256 = 464 ties between 448 (even) and
    # 480 -> 448, rounded, not clamped; 1.875 * 256 = 480 is above 448: clamped (saturated).
    x = torch.tensor([1.0, 2.0 ** -17, 2.0 ** -18, 0.0, 1.8125, 1.875] + [0.5] * 26)
    row = _row(x, "mxfp8_e4m3")
    assert row[COL["nonzero"]] == 31
    assert row[COL["to_zero"]] == 1
    assert row[COL["subnormal"]] == 1
    assert row[COL["saturated"]] == 1
    assert row[COL["blocks"]] == 1 and row[COL["scale_underflow"]] == 0
    want_err = (2.0 ** -18) ** 2 + (1.8125 - 1.75) ** 2 + (1.875 - 1.75) ** 2
    assert row[COL["error_sq"]] == pytest.approx(want_err, rel=1e-15)
    assert row[COL["max_block_ratio"]] == 1.875 * 2.0 ** 18
    assert row[COL["min_nonzero"]] == 2.0 ** -18


def test_all_zero_block_and_one_huge_value():
    zero = _row(torch.zeros(32), "mxfp4")
    assert zero[COL["nonzero"]] == 0 and zero[COL["blocks"]] == 1 and zero[COL["error_sq"]] == 0
    assert zero[COL["scale_underflow"]] == 0 and zero[COL["max_block_ratio"]] == 0
    # One value 2^20 and 31 values 1: X = 20 - 2 = 18 for e2m1, so 1 * 2^-18 underflows to zero.
    x = torch.ones(32)
    x[5] = 2.0 ** 20
    row = _row(x, "mxfp4")
    assert row[COL["to_zero"]] == 31 and row[COL["nonzero"]] == 32
    m = bf.block_metrics(row.tolist(), 32)
    assert m["block_underflow"] == 31 / 32
    assert m["sqnr_db"] == pytest.approx(10 * math.log10((2.0 ** 40 + 31) / 31), rel=1e-12)


def test_scale_underflow_and_overflow():
    tiny = _row(torch.full((32,), 2.0 ** -140), "mxfp8_e4m3")  # float32 subnormals: X = -148 < -127
    assert tiny[COL["scale_underflow"]] == 1 and tiny[COL["to_zero"]] == 32
    huge = _row(torch.full((32,), 1e300, dtype=torch.float64), "mxfp8_e5m2", torch.float64)  # X = 981 > 127
    assert huge[COL["scale_overflow"]] == 1 and huge[COL["saturated"]] == 32
    # A float64 amax beyond float32 gives no per-tensor scale (1, as TransformerEngine): the values saturate.
    big = _row(torch.full((32,), 1e300, dtype=torch.float64), "fp8_e4m3_current", torch.float64)
    assert big[COL["saturated"]] == 32 and big[COL["to_zero"]] == 0
    # NVFP4: one large block sets the tensor scale; a block 2^-30 below it has a block scale below e4m3's
    # smallest subnormal: it casts to zero.
    x = torch.cat([torch.full((16,), 1.0), torch.full((16,), 2.0 ** -30)])
    row = _row(x, "nvfp4")
    assert row[COL["blocks"]] == 2 and row[COL["scale_underflow"]] == 1 and row[COL["to_zero"]] == 16


@pytest.mark.skipif(gapmon.backend() == "torch", reason="needs the compiled extension")
def test_values_scaled_far_beyond_the_format_saturate_on_every_instruction_set():
    """A caller's amax far below the tensor's scales its values beyond float32's binades of the grid (even to
    +inf): every element saturates, with finite errors, on every instruction set (the rounding's constant once
    overflowed to NaN there) as in the reference."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
    start = gapmon.cpu_isa()
    try:
        for isa in ("generic", "avx2", "avx512"):
            try:
                gapmon.cpu_isa(isa)
            except (RuntimeError, ValueError):
                continue
            for amax in (1e-30, 1e-38):
                amaxes = torch.tensor([amax], dtype=torch.float64)
                got = bf.block_numerics([x], ["fp8_e4m3_current", "fp8_e5m2_current"], amaxes)
                want = reference.block_numerics([x], [4, 5], [amax])
                _assert_rows_equal(got, want, (isa, amax))
                assert (got[0, :, COL["saturated"]] == x.numel()).all(), (isa, amax)
    finally:
        gapmon.cpu_isa(start)


def test_non_finite_elements_are_left_out_and_counted():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 40, generator=g)
    y = x.clone()
    y[0, 3], y[2, 39], y[3, 0] = math.inf, math.nan, -math.inf
    zeroed = x.clone()
    zeroed[0, 3] = zeroed[2, 39] = zeroed[3, 0] = 0
    got, want = bf.block_numerics([y], ALL), bf.block_numerics([zeroed], ALL)
    assert (got[..., COL["nonfinite"]] == 3).all()
    got[..., COL["nonfinite"]] = 0
    assert torch.equal(got, want)
    assert bf.finite_amaxes([y])[0] == zeroed.abs().max().item()


def test_exact_values_have_no_error_and_metrics_name_the_formats():
    x = torch.tensor([[1.0, -0.5, 2.0, 0.0] * 8])  # e2m1 values under the scale 2^(1-2): 4, 2, 8?: amax 2 -> X = -1
    rows = bf.block_numerics([x], ["mxfp8_e4m3", "mxfp4"])
    for f in range(2):
        m = bf.block_metrics(rows[0, f].tolist(), x.numel())
        assert m["mse"] == 0 and m["sqnr_db"] == math.inf and m["block_underflow"] == 0
    assert bf.range_bits(2.0, rows[0, 0].tolist()) == 2.0
    with pytest.raises(ValueError, match="unknown format"):
        bf.block_numerics([x], ["mxfp6"])
    with pytest.raises(ValueError, match="twice"):
        bf.check_block_formats(["nvfp4", "nvfp4"])


def _assert_same_states(got, want, what):
    assert torch.equal(torch.nan_to_num(got, nan=7.0), torch.nan_to_num(want, nan=7.0)), what


@pytest.mark.parametrize("numerics", [True, False])
@pytest.mark.parametrize("formats", [("mxfp8_e4m3",), ("nvfp4", "mxfp4", "fp8_e5m2_current"), ("fp8_e4m3_current",), ALL])
@pytest.mark.parametrize("given_amaxes", [True, False])
def test_one_pass_equals_the_statistics_numerics_and_block_passes(numerics, formats, given_amaxes):
    """states_numerics_blocks: the states and numerics rows bit for bit those of the one-pass statistics and
    numerics op, every count of the block rows that of block_numerics (groups split across the pass's chunks:
    rows of 70 over 3 chunks, a row longer than a chunk), sums within 1e-12; non-contiguous, 0-dim, empty,
    float64, bfloat16, float16 tensors and non-finite elements; formats in the order asked, whether the
    per-tensor scaled ones are cast in the pass (amaxes given) or after it."""
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(2000, 70, generator=g), torch.randn(5, generator=g), torch.randn(64, 96, generator=g).t(),
          torch.randn((), generator=g), torch.randn(0, 4), torch.randn(3, 100000, generator=g).bfloat16(),
          torch.randn(3, 33, generator=g).half(), torch.randn(4, 40, generator=g).double()]
    xs[0][3, 5], xs[6][1, 1] = math.inf, math.nan
    amaxes = bf.finite_amaxes(xs) if given_amaxes else None
    states, rows, blocks = bf.states_numerics_blocks(xs, formats, numerics=numerics, amaxes=amaxes)
    want_states, want_rows = states_and_numerics(xs)
    _assert_same_states(states, want_states, "states")
    if numerics:
        _assert_same_states(rows, want_rows, "numerics")
    else:
        assert rows is None
    want = bf.block_numerics(xs, formats)
    _assert_rows_equal(blocks, want, formats)
    sums = [COL["error_sq"], COL["signal_sq"]]
    counts = [c for c in range(len(BLOCK_COLUMNS)) if c not in sums]
    assert torch.equal(blocks[..., counts], want[..., counts])
    _assert_rows_equal(blocks, reference.block_numerics(xs, [bf.BLOCK_FORMATS.index(f) for f in formats],
                                                        bf.finite_amaxes(xs).tolist()), "reference")


def test_one_pass_gives_the_same_bits_whatever_the_threads():
    g = torch.Generator().manual_seed(12)
    xs = [torch.randn(300, 700, generator=g), torch.randn(50, 4096, generator=g).bfloat16(), torch.randn(9, 70, generator=g)]
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(torch.cat([r.reshape(3, -1) for r in bf.states_numerics_blocks(xs, ALL)], dim=1))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results[1:])


def test_one_pass_op_refusals_and_empty_lists():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="at least one format"):
        bf.states_numerics_blocks([x], ())
    with pytest.raises(ValueError, match="unknown format"):
        bf.states_numerics_blocks([x], ("mxfp6",))
    states, rows, blocks = bf.states_numerics_blocks([], ("mxfp4", "nvfp4"))
    assert states.shape == (0, 7) and rows.shape[0] == 0 and blocks.shape == (0, 2, len(BLOCK_COLUMNS))


def _edge_tensor(dtype, rows, cols, seed):
    """Random magnitudes over 40 binades with every edge mixed in: zeros, a zero block, subnormals of the
    dtype, the largest finite value, non-finite elements, a block of one huge value."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-20, 20, (rows, cols), generator=g))
    x = x.to(dtype)
    info = torch.finfo(dtype)
    flat = x.view(-1)
    n = flat.numel()
    flat[: min(n, 32)] = 0
    for k, v in enumerate([info.tiny / 4, info.max, -info.max, math.inf, math.nan, info.tiny, 2.0 ** 20]):
        flat[(97 * (k + 1)) % n] = v
    return x


@pytest.mark.skipif(gapmon.backend() == "torch", reason="needs the compiled extension")
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_every_cpu_instruction_set_gives_the_same_counts(dtype):
    """The AVX-512 kernel (16 groups at a time, its own order of the float64 sums) against the core's loops
    (the generic build) and the reference: every count equal, sums within 1e-12; whole and shorter groups,
    batches of fewer than 16 groups, a tensor so small that its per-tensor scales overflow float32 (clamped to
    its largest value, as TransformerEngine does)."""
    start = gapmon.cpu_isa()
    cases = [_edge_tensor(dtype, r, c, r * 1000 + c) for r, c in [(37, 64), (5, 70), (300, 32), (3, 1000)]]
    cases.append((torch.rand(4, 64, generator=torch.Generator().manual_seed(5)) * 1e-39).to(dtype))
    amaxes = bf.finite_amaxes(cases)
    try:
        gapmon.cpu_isa("generic")
        want = [bf.block_numerics([x], ALL, amaxes[i : i + 1]) for i, x in enumerate(cases)]
        for i, x in enumerate(cases):
            _assert_rows_equal(want[i], reference.block_numerics([x], list(range(len(ALL))), amaxes[i : i + 1].tolist()),
                               ("generic", dtype, tuple(x.shape)))
        for isa in ("avx2", "avx512"):
            try:
                gapmon.cpu_isa(isa)
            except (RuntimeError, ValueError):
                continue  # not on this CPU
            for i, x in enumerate(cases):
                got = bf.block_numerics([x], ALL, amaxes[i : i + 1])
                _assert_rows_equal(got, want[i], (isa, dtype, tuple(x.shape)))
                sums = [COL["error_sq"], COL["signal_sq"]]
                counts = [c for c in range(len(BLOCK_COLUMNS)) if c not in sums]
                assert torch.equal(got[..., counts], want[i][..., counts]), (isa, dtype, tuple(x.shape))
    finally:
        gapmon.cpu_isa(start)


@pytest.mark.skipif(gapmon.backend() == "torch", reason="needs the compiled extension")
def test_op_registration_and_refusals():
    x = torch.randn(6, 40)
    torch.library.opcheck(torch.ops.gapmon.block_numerics.default, ([x, x[0].bfloat16()], [0, 3],
                                                                    torch.tensor([3.0, 2.0], dtype=torch.float64)))
    for numerics in (True, False):
        torch.library.opcheck(torch.ops.gapmon.states_numerics_blocks.default,
                              ([x, x[0].bfloat16(), x.t()], numerics, [0, 3], torch.tensor([3.0, 2.0, 3.0], dtype=torch.float64)))
    with pytest.raises(ValueError, match="amax"):
        torch.ops.gapmon.states_numerics_blocks([x], True, [3], torch.zeros(0, dtype=torch.float64))
    with pytest.raises(ValueError, match="amax"):
        torch.ops.gapmon.block_numerics([x], [3], torch.zeros(0, dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown format code"):
        torch.ops.gapmon.block_numerics([x], [9], torch.zeros(1, dtype=torch.float64))


def _dtensor_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(5)
    cases = [torch.randn(7, 70, generator=g),  # Shard(0) rows: whole blocks, uneven shards
             torch.randn(101, generator=g),  # 1-D: Shard(0) cuts blocks: cast whole
             torch.randn(3, 128, generator=g)]  # Shard(1) into chunks of 64: whole blocks
    placements = [Shard(0), Shard(0), Shard(1)]
    dts = [distribute_tensor(x, mesh, [p]) for x, p in zip(cases, placements)]
    got = bf.block_numerics(dts, ALL)
    want = bf.block_numerics(cases, ALL)
    _assert_rows_equal(got, want, rank)
    # the one-pass op: states, numerics and blocks of the full tensors, one collective for the three
    states, numerics, blocks = bf.states_numerics_blocks(dts, ALL)
    sharded_states, sharded_numerics = states_and_numerics(dts)  # (tested against the full tensors elsewhere)
    assert torch.equal(states, sharded_states) and torch.equal(numerics, sharded_numerics)
    _assert_rows_equal(blocks, want, ("one pass", rank))
    dist.barrier()


@pytest.mark.multiprocess
def test_dtensor_rows_equal_the_full_tensors():
    run_distributed(_dtensor_worker, 2)


def _fresh_block_table(rows, formats):
    table = torch.zeros(rows, len(formats), len(BLOCK_COLUMNS), dtype=torch.float64)
    table[..., COL["min_nonzero"]] = math.inf
    return table


@pytest.mark.parametrize("numerics_on,amax_given", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("case", ["float32 [4, 100, 96]", "bfloat16 [3, 50, 70]", "float16 [2, 3, 33]",
                                  "float32 transposed [33, 5]", "float32 [2, 300000] (several chunks)",
                                  "float32 with inf and nan [6, 64]", "float32 [0, 32]", "float64 with inf [3, 40]"])
def test_activation_fold_with_blocks_in_one_pass(numerics_on, amax_given, case):
    """accumulate_instance_stats_numerics_blocks (GAPMonitor's activation hook with block formats on): the accumulator
    and the numerics row get the bits of the ops without blocks, and the block row, merged in place twice over what it
    held, equals the float64 reference's merge (counts exact, sums 1e-12); other rows untouched. The amax of the
    formats scaled per tensor given, or measured by the op (its largest finite |x|: Inf and NaN left out)."""
    from gapmon.stats import _backend
    from gapmon.stats.layout import ACC_NAMES, NUMERICS_COLUMNS

    g = torch.Generator().manual_seed(len(case))
    shapes = {"float32 [4, 100, 96]": (4, 100, 96), "bfloat16 [3, 50, 70]": (3, 50, 70), "float16 [2, 3, 33]": (2, 3, 33),
              "float32 transposed [33, 5]": (5, 33), "float32 [2, 300000] (several chunks)": (2, 300000),
              "float32 with inf and nan [6, 64]": (6, 64), "float32 [0, 32]": (0, 32), "float64 with inf [3, 40]": (3, 40)}
    x = torch.randn(shapes[case], generator=g, dtype=torch.float64) * torch.exp(2 * torch.randn(shapes[case], generator=g,
                                                                                               dtype=torch.float64))
    if "transposed" in case:
        x = x.t()
    if "nan" in case:
        x[1, 3], x[4, 60] = math.inf, math.nan
    elif "inf" in case:
        x[2, 7] = -math.inf
    x = x.to({"bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}.get(case.split()[0],
                                                                                                  torch.float32))
    codes = bf.format_codes(ALL)
    amax = (bf.finite_amaxes([x]) if x.numel() else torch.zeros(1, dtype=torch.float64)) if amax_given else None
    acc, want_acc = (torch.zeros(3, len(ACC_NAMES), dtype=torch.float64) for _ in range(2))
    table, want_table = (torch.zeros(2, len(NUMERICS_COLUMNS), dtype=torch.float64) for _ in range(2))
    blocks, want_blocks = _fresh_block_table(4, ALL), _fresh_block_table(4, ALL)
    for _ in range(2):
        _backend.accumulate_instance_stats_numerics_blocks(x, acc, 1, 1, table if numerics_on else None, 1, codes, amax,
                                                           blocks, 2)
        if numerics_on:
            _backend.accumulate_instance_stats_and_numerics(x, want_acc, 1, 1, want_table, 1)
        else:
            _backend.accumulate_instance_stats(x, want_acc, 1, 1)
        if x.numel():  # (the reference's instance statistics take no empty batch; no block, nothing to merge)
            reference.accumulate_instance_stats_numerics_blocks(x, acc.clone(), 1, 1, False, table.clone(), 1, codes,
                                                                amax, want_blocks, 2)
    torch.testing.assert_close(acc, want_acc, rtol=0, atol=0, equal_nan=True, msg=case)  # the same bits
    torch.testing.assert_close(table, want_table, rtol=0, atol=0, equal_nan=True, msg=case)
    _assert_rows_equal(blocks, want_blocks, case)
    assert bool((blocks[[0, 1, 3]] == _fresh_block_table(3, ALL)).all())


def test_activation_fold_with_blocks_refuses_a_wrong_table():
    """The block table is checked like the other tables: dtype, shape (formats and columns), device, row."""
    from gapmon.stats import _backend
    from gapmon.stats.layout import ACC_NAMES

    x, acc = torch.randn(2, 64), torch.zeros(1, len(ACC_NAMES), dtype=torch.float64)
    codes, amax = bf.format_codes(["mxfp8_e4m3", "nvfp4"]), torch.ones(1, dtype=torch.float64)
    for table, row, error in ((_fresh_block_table(2, ALL), 0, ValueError),  # six formats for two codes
                              (_fresh_block_table(2, ["a", "b"]).float(), 0, ValueError),
                              (_fresh_block_table(2, ["a", "b"]), 2, IndexError)):
        with pytest.raises(error, match="block"):
            _backend.accumulate_instance_stats_numerics_blocks(x, acc, 0, 1, None, 0, codes, amax, table, row)
    with pytest.raises(ValueError, match="unknown"):
        bf.format_codes(["mxfp9"])
