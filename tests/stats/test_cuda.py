"""The CUDA kernels against float64 oracles (skipped without a GPU and CUDA kernels)."""
import math

import pytest
import torch
from helpers import assert_stats_match, float64_stats
from test_tensor_stats import DTYPES, _layouts

import gapmon

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or gapmon.backend() != "cuda", reason="needs a GPU and CUDA kernels"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_stats_matches_float64(dtype):
    for name, x in _layouts(dtype):
        x = x.cuda()
        for correction in (0, 1):
            got = gapmon.tensor_stats(x, correction=correction)
            assert got.mean.device.type == "cuda"
            assert_stats_match(got, float64_stats(x.cpu(), correction), where=f"cuda/{dtype}/{name}/c{correction}")


def test_bad_dtype_raises_type_error():
    for x in (torch.arange(5, device="cuda"), torch.ones(3, dtype=torch.bool, device="cuda")):
        with pytest.raises(TypeError, match=str(x.dtype).replace("torch.", "")):
            gapmon.tensor_stats(x)


def test_states_of_pieces_merge_to_whole():
    """The DTensor path's building blocks on CUDA: partial states of pieces, merged, finalised."""
    x = torch.randn(300_000, device="cuda") * 0.01 + 300.0
    x[50] = 0.0
    bounds = [0, 0, 17, 140_000, 140_000, 299_999, 300_000]
    pieces = [x[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    states = gapmon.multi_tensor_states(pieces)
    assert states.device.type == "cuda" and states.dtype == torch.float64
    merged = gapmon.merge_states(states.unsqueeze(1))
    got = gapmon.finalize_states(merged)
    assert_stats_match(gapmon.Stats(*(f[0] for f in got)), float64_stats(x.cpu()))
    cpu = gapmon.merge_states(gapmon.multi_tensor_states([p.cpu() for p in pieces]).unsqueeze(1))
    torch.testing.assert_close(merged.cpu(), cpu, rtol=1e-5, atol=1e-6)  # float32 group sums differ in order


def test_numerical_cancellation_2_26():
    x = torch.randn(2**26, device="cuda") + 1000.0
    want = torch.var(x.double()).item()
    assert abs(gapmon.tensor_stats(x).var.item() - want) / want <= 1e-5


def test_outlying_first_elements():
    x = torch.randn(1_000_000, device="cuda") * 1e-3 + 1e4
    x[::4096] = 0.0  # every chunk and many threads start on an outlier
    assert_stats_match(gapmon.tensor_stats(x), float64_stats(x.cpu()))


def test_nan_inf_empty():
    x = torch.randn(100_000, device="cuda")
    x[77] = float("nan")
    s = gapmon.tensor_stats(x)
    assert torch.isnan(s.mean) and torch.isnan(s.max_abs) and s.nonfinite.item() == 1
    e = gapmon.tensor_stats(torch.empty(0, device="cuda"))
    assert e.count.item() == 0 and torch.isnan(e.mean) and e.norm.item() == 0


def test_instance_and_multi():
    x = torch.randn(300, 70, device="cuda").bfloat16()
    got = gapmon.instance_stats(x)
    for b in (0, 150, 299):
        assert_stats_match(gapmon.Stats(*(f[b] for f in got)), float64_stats(x[b].cpu()))
    xs = [torch.randn(n, device="cuda") for n in (1, 5, 70_000, 200_001)] + [torch.empty(0, device="cuda")]
    m = gapmon.multi_tensor_stats(xs)
    for i, t in enumerate(xs):
        assert_stats_match(gapmon.Stats(*(f[i] for f in m)), float64_stats(t.cpu()))


def test_float32_overflow_is_redone_in_double():
    """Finite float32 values whose squares overflow float: var and norm stay finite and exact."""
    x = torch.randn(300_000, device="cuda") * 1e20
    x[5] = 0.0
    assert_stats_match(gapmon.tensor_stats(x), float64_stats(x.cpu()))
    for rows in (x[: 299_997].view(3, -1), x.view(3000, 100)):  # a block per chunk, then a warp per chunk
        got = gapmon.instance_stats(rows)
        for b in (0, 1, rows.shape[0] - 1):
            assert_stats_match(gapmon.Stats(*(f[b] for f in got)), float64_stats(rows[b].cpu()), where=f"row {b}")


def test_instance_rows_tiny_and_long():
    # (10000, 3) and the transposed (3000, 4100) take the warp-per-chunk path, the others a block per chunk.
    for shape, transpose in [((10_000, 3), False), ((4100, 3000), True), ((3, 1_500_007), False), ((5, 1), False)]:
        x = torch.randn(*shape, device="cuda") * 2 - 1
        x = x.t() if transpose else x
        got = gapmon.instance_stats(x)
        for b in {0, x.shape[0] // 2, x.shape[0] - 1}:
            assert_stats_match(gapmon.Stats(*(f[b] for f in got)), float64_stats(x[b].cpu()), where=f"{shape} row {b}")


def _many_tensors():
    """More tensors than travel inline in the kernel parameters, of every dtype and several layouts."""
    g = torch.Generator().manual_seed(3)
    xs = []
    for i in range(40):
        dtype = DTYPES[i % len(DTYPES)]
        t = (torch.randn(17 * i + 1, 31, generator=g) * (i + 1)).to(dtype)
        xs.append(t.cuda().t() if i % 3 == 0 else t.cuda())
    return xs


def test_multi_tensor_long_table():
    xs = _many_tensors()
    m = gapmon.multi_tensor_stats(xs)
    for i, t in enumerate(xs):
        assert_stats_match(gapmon.Stats(*(f[i] for f in m)), float64_stats(t.cpu()), where=f"tensor {i}")


def test_cuda_graph_capture_and_replay():
    """Captured ops read their view tables from the graph, not from recycled host buffers."""
    xs = _many_tensors()
    w = torch.randn(1000, 300, device="cuda")

    def ops():
        return (torch.ops.gapmon.multi_tensor_stats(xs, 1), torch.ops.gapmon.tensor_stats(w, 1),
                torch.ops.gapmon.instance_stats(w, 1))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops()  # warm-up outside the capture, as torch.cuda.graph expects
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops()
    for trial in range(3):
        with torch.no_grad():
            for x in xs:
                x.copy_(torch.randn_like(x) * (trial + 2) - trial)
            w.copy_(torch.randn_like(w) + trial)
        # Churn the pinned host allocator: a captured host-to-device copy would now read other bytes.
        for _ in range(4):
            gapmon.multi_tensor_stats([torch.randn(5 + k, device="cuda") for k in range(30)])
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, ops()):
            assert torch.equal(got, want), f"replay {trial} differs from eager"


def test_deterministic_bits():
    x = torch.randn(50_000_001, device="cuda")
    a = gapmon.tensor_stats(x).rows().view(torch.int32)
    b = gapmon.tensor_stats(x).rows().view(torch.int32)
    assert torch.equal(a, b)


def test_matches_cpu_kernels():
    x = torch.randn(3_000_000) * 5 + 2
    torch.testing.assert_close(gapmon.tensor_stats(x.cuda()).rows().cpu(), gapmon.tensor_stats(x).rows(), rtol=1e-5, atol=1e-6)


def test_compile_reduce_overhead():
    def f(w, a, ps):
        return (gapmon.tensor_stats(w).norm + gapmon.instance_stats(a).max_abs.sum()
                + gapmon.multi_tensor_stats(ps).var.sum())

    w, a = torch.randn(1024, 512, device="cuda"), torch.randn(8, 4096, device="cuda")
    ps = [torch.randn(64 + i, device="cuda") for i in range(12)]
    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    for step in range(4):
        for t in (w, a, *ps):
            t.normal_()  # new values every step: replays must read them
        torch.testing.assert_close(compiled(w, a, ps), f(w, a, ps), msg=f"step {step}")


def test_opcheck_cuda():
    x = torch.randn(6, 5, device="cuda")
    torch.library.opcheck(torch.ops.gapmon.tensor_stats.default, (x, 1))
    torch.library.opcheck(torch.ops.gapmon.multi_tensor_stats.default, ([x, x.t().half()], 1))
    torch.library.opcheck(torch.ops.gapmon.instance_stats.default, (x, 1))


def test_update_sums_cuda_match_float64_and_the_cpu():
    """The fused optimizer-update pass on CUDA: every dtype pair, parameters over several chunks and an empty
    one, against float64 torch sums and the CPU kernel; the same bits on a second run; opcheck passes."""
    from gapmon.stats import ops

    g = torch.Generator().manual_seed(0)
    shapes = ((300, 70), (0,), (3 * 65536 + 5,), (1,))
    for wd in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for gd in (torch.float32, torch.bfloat16):
            before = [torch.randn(s, generator=g).to(wd) for s in shapes]
            after = [(b.double() + 0.01 * torch.randn(s, generator=g)).to(wd) for b, s in zip(before, shapes)]
            grads = [torch.randn(s, generator=g).to(gd) for s in shapes]
            cpu = ops.update_rows(before, after, grads)
            dev = [[t.cuda() for t in ts] for ts in (before, after, grads)]
            got = ops.update_rows(*dev)
            assert torch.equal(got, ops.update_rows(*dev)), (wd, gd)
            torch.testing.assert_close(got.cpu(), cpu, rtol=1e-12, atol=1e-12, msg=f"{wd} {gd}")
    x = torch.randn(6, 5, device="cuda")
    torch.library.opcheck(torch.ops.gapmon.update_sums.default, ([x, x[0].half()], [x * 2, x[1].half()], [x.t().contiguous().t(), x[2]]))


def test_block_numerics_cuda_match_the_cpu():
    """The per-block format kernel on CUDA: every format and dtype, partial blocks, several chunks, non-finite
    values; counts, minima and maxima equal to the CPU kernel's, sums within 1e-12; the same bits twice."""
    from gapmon.stats import block_formats as bf

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        xs = [(torch.randn(shape, generator=g, dtype=torch.float64) * 4).to(dtype) for shape in ((3, 70), (2100, 40), (5,), ())]
        xs[1][7, 3] = float("inf")
        cpu = bf.block_numerics(xs, bf.BLOCK_FORMATS)
        dev = [x.cuda() for x in xs]
        got = bf.block_numerics(dev, bf.BLOCK_FORMATS)
        assert torch.equal(got, bf.block_numerics(dev, bf.BLOCK_FORMATS)), dtype
        sums = [bf.BLOCK_COLUMNS.index(c) for c in ("error_sq", "signal_sq")]
        exact = [i for i in range(len(bf.BLOCK_COLUMNS)) if i not in sums]
        assert torch.equal(got.cpu()[..., exact], cpu[..., exact]), dtype
        torch.testing.assert_close(got.cpu()[..., sums], cpu[..., sums], rtol=1e-12, atol=0, msg=str(dtype))
        # the one-pass function on CUDA (one launch: each chunk re-read from L2 and cast), a transposed tensor
        # cast apart: the same rows as the CPU's one pass, the same bits twice
        states, numerics, blocks = bf.states_numerics_blocks(dev + [dev[1].t()], bf.BLOCK_FORMATS)
        again = bf.states_numerics_blocks(dev + [dev[1].t()], bf.BLOCK_FORMATS)
        assert all(torch.equal(a.nan_to_num(7), b.nan_to_num(7)) for a, b in zip((states, numerics, blocks), again))
        cpu_states, cpu_numerics, cpu_blocks = bf.states_numerics_blocks(xs + [xs[1].t()], bf.BLOCK_FORMATS)
        # the statistics states are the CUDA statistics pass's bits; against the CPU, float32 group sums differ in
        # order (as in test_multi_chunk_merge); the numerics moments are float64 sums, in another order too
        torch.testing.assert_close(states, gapmon.multi_tensor_states(dev + [dev[1].t()]), rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(states.cpu(), cpu_states, rtol=1e-5, atol=1e-6, equal_nan=True)
        torch.testing.assert_close(numerics.cpu(), cpu_numerics, rtol=1e-9, atol=1e-9, equal_nan=True)
        assert torch.equal(blocks.cpu()[..., exact], cpu_blocks[..., exact]), dtype
    x = torch.randn(6, 40, device="cuda")
    torch.library.opcheck(torch.ops.gapmon.block_numerics.default,
                          ([x, x[0].bfloat16()], [0, 3], torch.tensor([3.0, 2.0], dtype=torch.float64, device="cuda")))
    for with_numerics in (True, False):
        torch.library.opcheck(torch.ops.gapmon.states_numerics_blocks.default,
                              ([x, x[0].bfloat16(), x.t()], with_numerics, [0, 3],
                               torch.tensor([3.0, 2.0, 3.0], dtype=torch.float64, device="cuda")))


def test_monitor_on_cuda():
    from helpers import assert_metrics_close, brute_force_gap_metrics

    from gapmon.apps.examples import GPTConfig, TinyGPT, lm_loss, synthetic_batch

    cfg = GPTConfig(vocab_size=37, seq_len=8, d_model=24, n_heads=2, n_layers=2)
    torch.manual_seed(0)
    model = TinyGPT(cfg).cuda()
    x, y = synthetic_batch(cfg, 6, 0, device="cuda")
    want = brute_force_gap_metrics(model, lambda: lm_loss(model(x), y, reduction="sum").backward())
    model.zero_grad()
    with gapmon.GAPMonitor(model, sinks=[]) as mon:
        mon.begin_step(0, batch_size=6)
        lm_loss(model(x), y, reduction="sum").backward()
        got = mon.end_step()
    assert_metrics_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ops_follow_the_tensor_device_not_the_current_one():
    x = torch.randn(4, 1000, device="cuda:1")
    acc = torch.zeros(1, 6, dtype=torch.float64, device="cuda:1")
    with torch.cuda.device(0):
        got = gapmon.instance_stats(x)
        gapmon.accumulate_instance_stats(x, acc, 0)
    assert got.mean.device == x.device
    torch.testing.assert_close(acc[0, 1].item(), got.mean.double().sum().item(), rtol=1e-6, atol=1e-9)


def _cuda_work(fn) -> list[str]:
    """Names of the kernels and memsets fn() queues on the GPU (profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_one_launch_per_call():
    """One statistics kernel per call and nothing else (no memset), multi-chunk merge and monitor
    fold included: the counters are reused, left zeroed by every launch."""
    x = torch.randn(1 << 20, device="cuda")
    a = torch.randn(8, 70_000, device="cuda", dtype=torch.bfloat16)
    acc = torch.zeros(3, len(gapmon.stats.ACC_NAMES), dtype=torch.float64, device="cuda")
    for name, fn in [("tensor_stats 2^20", lambda: torch.ops.gapmon.tensor_stats(x, 1)),
                     ("instance_stats [8, 70000]", lambda: torch.ops.gapmon.instance_stats(a, 1)),
                     ("accumulate_instance_stats", lambda: torch.ops.gapmon.accumulate_instance_stats(a, acc, 1, 1))]:
        fn()  # warm-up: the first call on a stream allocates (and zeroes) its counters
        work = _cuda_work(fn)
        assert len(work) == 1 and "stats_kernel" in work[0], f"{name}: {work}"
    # float32 sums in the kernel (SPEC: at least float32): each of the 16 means folded (8 rows, twice) within 4
    # float32 ulps of the data's scale (std 1) of the float64 reference
    want = gapmon.reference.instance_stats(a.double())
    torch.testing.assert_close(acc[1, 1], 2 * want.mean.sum(), rtol=0, atol=16 * 4 * 2**-24)


def test_reused_counters_across_streams_and_growth():
    """Counters are kept per stream and grow with the rows: interleaved calls on two streams, and
    a call with more rows than any before, match the float64 oracle."""
    small = torch.randn(4, 200_000, device="cuda")
    many = torch.randn(3000, 70_000, device="cuda", dtype=torch.bfloat16)  # 3001 counters: the buffer grows
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    got = []
    for _ in range(3):
        got.append(gapmon.instance_stats(small))
        with torch.cuda.stream(side):
            got.append(gapmon.instance_stats(many))
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for stats, x in zip(got, [small, many] * 3):
        want = gapmon.reference.instance_stats(x.double())
        torch.testing.assert_close(stats.mean, want.mean, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(stats.norm, want.norm, rtol=1e-5, atol=1e-7)
        assert torch.equal(stats.count, want.count)


def test_multi_tensor_stats_bits_repeat():
    """The list that once gave different mean/var bits run to run (chunk partials merged in
    completion order)."""
    shapes = [(768, 768), (3072, 768), (768,), (50257, 768), (1,), (0,), (1024, 768)]
    xs = [torch.randn(s, device="cuda") for s in shapes]
    first = gapmon.ops.multi_tensor_rows(xs).view(torch.int64)
    for _ in range(5):
        assert torch.equal(gapmon.ops.multi_tensor_rows(xs).view(torch.int64), first)


def test_16bit_norm_products_on_tensor_cores_without_copies():
    """bfloat16 Grams and products with float32 results: no widening copy of the operands, and the
    float64 products of the same values within 1e-5."""
    if not gapmon.stats._backend.COMPILED:
        pytest.skip("needs the compiled ops")
    a = torch.randn(4, 128, 64, device="cuda").bfloat16()
    g = torch.randn(4, 128, 48, device="cuda").bfloat16()
    want = torch.bmm(g.double().transpose(1, 2), a.double()).square().sum((1, 2))
    for op in (torch.ops.gapmon.ghost_norm_sq, torch.ops.gapmon.direct_norm_sq):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got = op(a, g)
        copies = [e.key for e in prof.key_averages() if e.key == "aten::_to_copy"]  # a widening .to()
        assert got.dtype == torch.float32 and not copies, (op, copies)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)


def test_large_grams_are_built_in_bands_on_cuda():
    """From 2^33 multiply-adds of a chunk's Grams (8 x 1024^2 x 1024 here) the CUDA ops build the upper triangle in 4
    bands of rows, as on the CPU: the float64 norms of the per-sample gradients, for Linear and Embedding."""
    if not gapmon.stats._backend.COMPILED:
        pytest.skip("needs the compiled ops")
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, t = 8, 1024
    a = torch.randn(b, t, 512, device="cuda", generator=gen)
    g = torch.randn(b, t, 512, device="cuda", generator=gen)
    ids = torch.randint(0, 50, (b, t), device="cuda", generator=gen)
    ids[0, :9] = 3  # the padding id
    g_table = torch.randn(b, t, 1024, device="cuda", generator=gen)
    a64, g64 = a.double(), g.double()
    want = (a64 @ a64.transpose(1, 2) * (g64 @ g64.transpose(1, 2))).sum((1, 2))
    one_hot = torch.nn.functional.one_hot(ids, 50).double() * ids.ne(3).unsqueeze(-1)
    want_table = torch.bmm(one_hot.transpose(1, 2), g_table.double()).square().sum((1, 2))
    for op, args, expected in ((torch.ops.gapmon.ghost_norm_sq, (a, g), want),
                               (torch.ops.gapmon.embedding_norm_sq, (ids, g_table, 3), want_table)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got = op(*args)
        products = sum(e.count for e in prof.key_averages() if e.key == "aten::bmm")
        assert products == (8 if op is torch.ops.gapmon.ghost_norm_sq else 4), (op, products)
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=0)
    # without a padding id the pairs need no mask of valid positions (three launches fewer)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = torch.ops.gapmon.embedding_norm_sq(ids, g_table)
    ops = {e.key for e in prof.key_averages()}
    assert not {"aten::ones_like", "aten::logical_and_", "aten::zeros"} & ops, ops
    one_hot = torch.nn.functional.one_hot(ids, 50).double()
    want_all = torch.bmm(one_hot.transpose(1, 2), g_table.double()).square().sum((1, 2))
    torch.testing.assert_close(got.double(), want_all, rtol=1e-4, atol=0)


def test_bookkeeping_under_bf16_autocast_on_cuda():
    """Book-keeping on CUDA under bf16 autocast: the norms of the hook path and torch.func's within
    4e-3 (see test_per_sample's autocast test), the gradients autocast's up to its bf16 rounding."""
    import copy

    from helpers import Autocast, seeded_gpt, vmap_per_sample_norms

    from gapmon.apps.examples import GPTConfig, lm_loss, synthetic_batch

    cfg = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=2, n_layers=2)
    def loss(out, target):
        return lm_loss(out.float(), target)

    base = Autocast(seeded_gpt(cfg).cuda(), "cuda")
    x, y = synthetic_batch(cfg, 4, 0, device="cuda")
    plain = copy.deepcopy(base)
    loss(plain(x), y).backward()
    runs = {}
    for bookkeeping in (False, True):
        model = copy.deepcopy(base)
        psn = gapmon.PerSampleGradNorms(model, bookkeeping=bookkeeping)
        loss(model(x), y).backward()
        runs[bookkeeping] = (psn.local_norms(), model)
        psn.close()
    want = vmap_per_sample_norms(base, loss, x, y)
    for bookkeeping, (norms, model) in runs.items():
        torch.testing.assert_close(norms, want.float(), rtol=4e-3, atol=0, msg=f"bookkeeping={bookkeeping}")
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=1e-4, msg=f"bookkeeping={bookkeeping} {name}")


def test_counters_outlive_cudagraph_tree_pools():
    """torch.compile(mode="reduce-overhead"): cudagraph trees route warm-up allocations into a private
    pool and rewind it. Counters first made during warm-up come from cudaMalloc, outside that pool, so
    tensors the pool hands out later never overlap them: eager calls after many compiled steps (new
    shapes: new warm-ups and recordings) still match the float64 oracle, also on a stream made after
    another was destroyed (its handle may be reused: the counters are keyed by stream id)."""
    torch._dynamo.reset()

    def step(x):
        return gapmon.instance_stats(x * 2.0).norm

    compiled = torch.compile(step, mode="reduce-overhead")
    for rows in (3, 5, 7):  # each new shape warms up and records again
        x = torch.randn(rows, 300_000, device="cuda")
        for _ in range(3):
            got = compiled(x).clone()
            torch.testing.assert_close(got, (x.double() * 2).norm(dim=1), rtol=1e-5, atol=1e-6)
    for _ in range(2):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            y = torch.randn(9, 250_000, device="cuda")
            stats = gapmon.instance_stats(y)
            filler = torch.full((1 << 20,), 7.0, device="cuda")  # reuses whatever memory the pools free
        stream.synchronize()
        torch.testing.assert_close(stats.norm, y.double().norm(dim=1), rtol=1e-5, atol=1e-6)
        assert bool((filler == 7.0).all())
        del stream


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_numerics_kernel_matches_cpu_kernel_and_is_deterministic(dtype):
    """The CUDA numerics rows: bins equal the CPU kernel's exactly (every layout, edge values, several
    chunks), moments within float64 rounding; the same bits on every call; pieces merge to the whole."""
    from gapmon import numerics as nm

    xs = [x for _, x in _layouts(dtype)]
    edges = torch.tensor([0.0, -0.0, 2.0**-126, 2.0**-127, 1e-45, float("inf"), float("nan"), 448.0, 65504.0],
                         dtype=torch.float64).to(dtype)
    xs += [edges, torch.randn(300_000, dtype=torch.float64).to(dtype) * 3 + 1, torch.empty(0, dtype=dtype)]
    got = nm.numerics_states([x.cuda() for x in xs])
    assert got.device.type == "cuda" and got.dtype == torch.float64
    want = nm.numerics_states(xs)
    got = got.cpu()
    assert torch.equal(got[:, :nm.NUM_BINS], want[:, :nm.NUM_BINS])
    torch.testing.assert_close(got[:, nm.NUM_BINS:], want[:, nm.NUM_BINS:], rtol=1e-9, atol=1e-9, equal_nan=True)
    again = nm.numerics_states([x.cuda() for x in xs]).cpu()
    assert torch.equal(again.nan_to_num(7.0), got.nan_to_num(7.0))
    big = xs[-2].cuda()
    parts = nm.numerics_states([big[:1000], big[1000:]])
    merged = nm.merge_numerics_states(parts.unsqueeze(1)).cpu()
    assert torch.equal(merged[0, :nm.NUM_BINS], want[-2, :nm.NUM_BINS])
    torch.testing.assert_close(merged[0, nm.NUM_BINS:], want[-2, nm.NUM_BINS:], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_states_and_numerics_in_one_launch_equal_the_two_ops(dtype):
    """The fused kernel (each chunk read once for both) gives the bits of multi_tensor_states and of
    numerics_states, over every layout, edge values, several chunks and an empty tensor; a long list
    (a view table in device memory) too; one kernel and nothing else per call; opcheck passes."""
    from gapmon import numerics as nm

    xs = [x.cuda() for _, x in _layouts(dtype)]
    edges = torch.tensor([0.0, -0.0, 2.0**-126, 1e-45, float("inf"), float("nan"), 448.0, 65504.0], dtype=torch.float64)
    xs += [edges.to(dtype).cuda(), (torch.randn(300_000, dtype=torch.float64) * 3 + 1).to(dtype).cuda(),
           torch.empty(0, dtype=dtype, device="cuda")]
    for tensors in (xs, xs * 3):
        states, rows = torch.ops.gapmon.multi_tensor_states_and_numerics(tensors)
        torch.testing.assert_close(states, gapmon.multi_tensor_states(tensors), rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(rows, nm.numerics_states(tensors), rtol=0, atol=0, equal_nan=True)
    want = nm.numerics_states([x.cpu() for x in xs])
    assert torch.equal(rows[:len(xs), :nm.NUM_BINS].cpu(), want[:, :nm.NUM_BINS])
    few = [xs[-2], xs[0]]
    torch.ops.gapmon.multi_tensor_states_and_numerics(few)  # warm-up: counters of this stream
    work = _cuda_work(lambda: torch.ops.gapmon.multi_tensor_states_and_numerics(few))
    assert len(work) == 1 and "stats_numerics_kernel" in work[0], work
    torch.library.opcheck(torch.ops.gapmon.multi_tensor_states_and_numerics.default, (few,))


@pytest.mark.parametrize("shape", [(3, 70_001), (4096, 64), (5, 7, 9)], ids=str)
def test_activation_fold_with_numerics_equals_the_separate_ops(shape):
    """accumulate_instance_stats_and_numerics on CUDA: the accumulator gets the bits of
    accumulate_instance_stats; the numerics row is the merge of what it held and numerics_states([x])
    (bins exact; moments the same bits where x is read as one tensor, i.e. many short instances, else
    within float64 rounding). Instances read by blocks: one kernel per call; by warps: two."""
    from gapmon import numerics as nm

    x = (torch.randn(shape, device="cuda") * 3).bfloat16()
    acc = torch.zeros(2, len(gapmon.stats.ACC_NAMES), dtype=torch.float64, device="cuda")
    table = torch.zeros(3, len(nm.NUMERICS_COLUMNS), dtype=torch.float64, device="cuda")
    table[1] = nm.numerics_states([torch.randn(100, device="cuda")])[0]
    want_acc, old = acc.clone(), table[1].clone()
    gapmon.ops.accumulate_instance_stats(x, want_acc, 1)
    want_row = nm.merge_numerics_states(torch.stack((old, nm.numerics_states([x])[0])).unsqueeze(1))[0]
    gapmon.ops.accumulate_instance_stats_and_numerics(x, acc, 1, 1, table, 1)
    by_warps = shape == (4096, 64)
    assert torch.equal(acc, want_acc) and torch.equal(table[1, :nm.NUM_BINS], want_row[:nm.NUM_BINS])
    if by_warps:
        assert torch.equal(table[1], want_row)
    torch.testing.assert_close(table[1], want_row, rtol=1e-12, atol=1e-12)
    assert bool((table[[0, 2]] == 0).all())
    cpu_table = torch.zeros(1, len(nm.NUMERICS_COLUMNS), dtype=torch.float64)
    gapmon.ops.accumulate_instance_stats_and_numerics(x.cpu(), acc.cpu(), 1, 1, cpu_table, 0)
    assert torch.equal(nm.numerics_states([x])[0][:nm.NUM_BINS].cpu(), cpu_table[0, :nm.NUM_BINS])
    work = _cuda_work(lambda: gapmon.ops.accumulate_instance_stats_and_numerics(x, acc, 1, 1, table, 1))
    if by_warps:
        assert len(work) == 2 and "stats_kernel" in work[0] and "stats_numerics_kernel" in work[1], work
    else:
        assert len(work) == 1 and "stats_numerics_kernel" in work[0], work


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("given_amax", [True, False], ids=["amax-given", "amax-measured"])
@pytest.mark.parametrize("numerics_on", [True, False])
def test_activation_fold_with_blocks_equals_the_separate_ops(numerics_on, given_amax, layout):
    """accumulate_instance_stats_numerics_blocks on CUDA: the accumulator and numerics row get the bits of the ops
    without blocks; the block row, merged twice over what it held, equals the CPU op's (counts exact, sums 1e-12),
    with the amax given or measured by the op. A contiguous activation is read once: one fused statistics launch and
    the merge of its chunk rows, no block kernel; a transposed one takes the instance op, then the block kernel."""
    from gapmon import numerics as nm
    from gapmon.stats import _backend
    from gapmon.stats import block_formats as bf
    from gapmon.stats.layout import BLOCK_COLUMNS

    x = (torch.randn(4, 100, 96, device="cuda") * 3).bfloat16()
    if layout == "transposed":
        x = x.transpose(1, 2)
    codes = bf.format_codes(bf.BLOCK_FORMATS)
    amax = bf.finite_amaxes([x]).to("cuda") if given_amax else None

    def tables(device):
        blocks = torch.zeros(3, len(codes), len(BLOCK_COLUMNS), dtype=torch.float64, device=device)
        blocks[..., BLOCK_COLUMNS.index("min_nonzero")] = math.inf
        return (torch.zeros(2, len(gapmon.stats.ACC_NAMES), dtype=torch.float64, device=device),
                torch.zeros(2, len(nm.NUMERICS_COLUMNS), dtype=torch.float64, device=device), blocks)

    (acc, table, blocks), (want_acc, want_table, _), (cpu_acc, cpu_table, cpu_blocks) = tables("cuda"), tables("cuda"), tables("cpu")
    for _ in range(2):
        _backend.accumulate_instance_stats_numerics_blocks(x, acc, 1, 1, table if numerics_on else None, 1, codes, amax,
                                                           blocks, 2)
        _backend.accumulate_instance_stats_numerics_blocks(x.cpu(), cpu_acc, 1, 1, cpu_table if numerics_on else None, 1,
                                                           codes, None if amax is None else amax.cpu(), cpu_blocks, 2)
        if numerics_on:
            gapmon.ops.accumulate_instance_stats_and_numerics(x, want_acc, 1, 1, want_table, 1)
        else:
            gapmon.ops.accumulate_instance_stats(x, want_acc, 1)
    assert torch.equal(acc, want_acc) and torch.equal(table, want_table)
    got, want = blocks.cpu(), cpu_blocks
    assert torch.equal(got[..., :BLOCK_COLUMNS.index("error_sq")], want[..., :BLOCK_COLUMNS.index("error_sq")])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    work = _cuda_work(lambda: _backend.accumulate_instance_stats_numerics_blocks(
        x, acc, 1, 1, table if numerics_on else None, 1, codes, amax, blocks, 2))
    fused = sum("stats_numerics_kernel" in w for w in work)
    if layout == "contiguous":
        assert fused == 1 and sum("accumulate_block_rows_kernel" in w for w in work) == 1, work
        assert not any("block_chunk_kernel" in w for w in work), work
    else:
        assert any("block_chunk_kernel" in w for w in work), work


def test_a_tensors_bits_do_not_depend_on_the_list():
    """Warp or block per chunk is chosen per tensor (many short instance rows: warps), so a tensor's
    row has the same bits alone and in any list: 2100 small tensors (which a list used to read by
    warps, alone by blocks) and a long one."""
    small = [torch.randn(37, device="cuda") for _ in range(2100)]
    long = torch.randn(300_000, device="cuda")
    together = gapmon.multi_tensor_states([long, *small])
    for i in (0, 1, 1000, 2100):
        alone = gapmon.multi_tensor_states([([long, *small])[i]])
        assert torch.equal(together[i], alone[0]), i
    # one kernel; the 2101 views' table (past the kernel parameters' room) is copied from pinned memory
    work = _cuda_work(lambda: torch.ops.gapmon.multi_tensor_states([long, *small]))
    kernels = [w for w in work if not w.startswith("Memcpy")]
    assert len(kernels) == 1 and "stats_kernel" in kernels[0] and len(work) <= 2, work


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_affine_norm_sums_on_cuda_match_float64_and_the_cpu_kernel(rms):
    """gapmon.affine_norm_sums on CUDA (from ATen's own normalisation) gives each sample's LayerNorm / RMSNorm weight
    and bias gradients: float64's, and the CPU kernel's within float32 rounding, for float32 and bf16 inputs."""
    if not gapmon.stats._backend.COMPILED:
        pytest.skip("needs the compiled ops")
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(4, 33, 96, generator=gen, dtype=torch.float64) * 2 + 1).to(dtype)
        g = torch.randn(4, 33, 96, generator=gen, dtype=torch.float64).to(dtype)
        x64, g64 = x.double(), g.double()
        xhat = torch.nn.functional.rms_norm(x64, (96,), eps=1e-5) if rms else torch.nn.functional.layer_norm(x64, (96,), eps=1e-5)
        got = torch.ops.gapmon.affine_norm_sums(x.cuda(), g.cuda(), 1e-5, rms)
        cpu = torch.ops.gapmon.affine_norm_sums(x, g, 1e-5, rms)
        for part, want, on_cpu in zip(got, ((g64 * xhat).sum(1), g64.sum(1)), cpu):
            assert part.device.type == "cuda" and part.dtype == torch.float32
            torch.testing.assert_close(part.cpu().double(), want, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(part.cpu(), on_cpu, rtol=1e-4, atol=1e-4)


def test_linear_norm_sq_and_grads_on_cuda_match_float64():
    """Book-keeping of a Linear with a bias on CUDA (gapmon.linear_norm_sq_and_grads): per-sample squared norms of the
    weight and bias gradients, the weight gradient and the bias gradient, against float64, float32 and bf16 inputs."""
    if not gapmon.stats._backend.COMPILED:
        pytest.skip("needs the compiled ops")
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(4, 9, 24, generator=gen, dtype=torch.float64).to(dtype)
        g = torch.randn(4, 9, 40, generator=gen, dtype=torch.float64).to(dtype)
        per_sample = torch.einsum("btp,btd->bpd", g.double(), a.double())
        bias = g.double().sum(1)
        sq, grad_w, grad_b = torch.ops.gapmon.linear_norm_sq_and_grads(a.cuda(), g.cuda())
        assert sq.device.type == grad_w.device.type == grad_b.device.type == "cuda"
        torch.testing.assert_close(sq.cpu().double(), per_sample.square().sum((1, 2)) + bias.square().sum(1), rtol=1e-4, atol=0)
        torch.testing.assert_close(grad_w.cpu().double(), per_sample.sum(0), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(grad_b.cpu().double(), bias.sum(0), rtol=1e-4, atol=1e-4)
        r, rb = torch.randn(24, generator=gen).cuda(), torch.randn(1, generator=gen).cuda()
        sketch_w, sketch_b = torch.ops.gapmon.linear_grad_sketch(a.cuda(), g.cuda(), r, rb)  # the use check's sketches
        torch.testing.assert_close(sketch_w.cpu().double(), per_sample.sum(0) @ r.cpu().double(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(sketch_b.cpu().double(), bias.sum(0) * rb.cpu().double(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["LSTMCell", "GRUCell"])
def test_recurrent_cells_looped_on_cuda_are_exact(kind):
    """On CUDA torch runs the cells as fused ops: an LSTM cell's c' then gets the loss's own gradient only, which the
    cell rule replays differently from the CPU's composed cell (its c' gradient includes h''s part)."""

    class Loop(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = getattr(torch.nn, kind)(4, 5)

        def forward(self, x):
            state, out = None, 0.0
            for t in range(x.shape[1]):
                state = self.cell(x[:, t], state)
                h = state[0] if isinstance(state, tuple) else state
                out = out + h.square().sum(-1)
            return out + (state[1].sum(-1) if isinstance(state, tuple) else 0.0)

    torch.manual_seed(0)
    model = Loop().double().cuda()
    x = torch.randn(3, 4, 4, dtype=torch.float64, device="cuda")
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True)
    model(x).sum().backward()
    got = psn.local_norms()
    psn.close()
    want = []
    for i in range(3):
        grads = torch.autograd.grad(model(x[i:i + 1]).sum(), list(model.parameters()))
        want.append(torch.stack([g.square().sum() for g in grads]).sum().sqrt())
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-10, atol=1e-12)


def test_a_table_used_as_the_head_on_cuda_is_exact_and_kept_under_bf16_autocast():
    """The functional tied head (functional_head) on CUDA tensors: float64 exact against a loop; under bf16 autocast
    the use check keeps the table (bf16's tolerance) and the norms match the loop within bf16's rounding."""
    import torch.nn as nn
    import torch.nn.functional as F
    from helpers import assert_kept_under_bf16_autocast, loop_per_sample_norms

    class HeadByTable(nn.Module):
        def __init__(self, transposed: bool):
            super().__init__()
            self.wte, self.mix, self.transposed = nn.Embedding(13, 6), nn.Linear(6, 6), transposed

        def forward(self, ids):
            h = torch.tanh(self.mix(self.wte(ids)))
            return h @ self.wte.weight.T if self.transposed else F.linear(h, self.wte.weight)

    def lm_loss(logits, targets):
        return F.cross_entropy(logits.reshape(-1, 13), targets.reshape(-1), reduction="sum")

    torch.manual_seed(0)
    ids = torch.randint(0, 13, (4, 7), device="cuda")
    targets = (ids * 3 + 1) % 13
    for transposed in (False, True):
        model = HeadByTable(transposed).double().cuda()
        psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True)
        lm_loss(model(ids), targets).backward()
        got = psn.local_norms()
        psn.close()
        torch.testing.assert_close(got, loop_per_sample_norms(model, lm_loss, ids, targets), rtol=1e-10, atol=1e-12)
    assert_kept_under_bf16_autocast(HeadByTable(False).cuda(), lm_loss, ids, targets, "cuda")


def test_weight_normalised_layers_on_cuda_are_exact():
    """weight_norm'd Linear (dim=0) and grouped Conv1d (dim=2, wav2vec 2's) on CUDA: float64 exact against a loop,
    with the norm torch's fused kernel forms (single-precision square roots: the exact one was 2e-8 off)."""
    import torch.nn as nn
    from helpers import loop_per_sample_norms

    from gapmon.per_sample.rules.reparametrized import torch_norms

    torch.manual_seed(0)
    v = torch.randn(7, 5, dtype=torch.float64, device="cuda")
    g = torch.rand(7, 1, dtype=torch.float64, device="cuda") + 0.5
    torch.testing.assert_close(g * v / torch_norms(g, v, 0), torch._weight_norm(v, g, 0), rtol=1e-14, atol=0)

    def loss(out, y):
        return ((out - y) ** 2).sum()

    conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 8, 3, padding=1, groups=2), dim=2)
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(8 * 10, 6),
                          nn.utils.parametrizations.weight_norm(nn.Linear(6, 3))).double().cuda()
    x, y = torch.randn(5, 4, 10, dtype=torch.float64, device="cuda"), torch.randn(5, 3, dtype=torch.float64, device="cuda")
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True)
    loss(model(x), y).backward()
    got = psn.local_norms()
    assert not psn.coverage()["uncovered"]
    psn.close()
    torch.testing.assert_close(got, loop_per_sample_norms(model, loss, x, y), rtol=1e-10, atol=1e-12)
