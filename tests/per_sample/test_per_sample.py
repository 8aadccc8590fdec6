"""PerSampleGradNorms against exact per-sample gradients from torch.func.vmap(grad(...))."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import Autocast, loop_per_sample_norms, seeded_gpt, vmap_per_sample_norms

import gapmon
import gapmon.per_sample.rules.linear as linear_rule
from gapmon.apps.examples import GPTConfig, TinyGPT, lm_loss, synthetic_batch


def _gpt(seq_len=8, norm="rms"):
    torch.manual_seed(0)
    return TinyGPT(GPTConfig(vocab_size=37, seq_len=seq_len, d_model=24, n_heads=2, n_layers=2, norm=norm))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("seq_len, regime", [(8, "ghost"), (64, "direct")])
def test_transformer_matches_vmap(monkeypatch, reduction, norm, seq_len, regime):
    calls = {"ghost": 0, "direct": 0}
    for fn, name in (("_ghost", "ghost"), ("_direct", "direct"), ("_direct_and_grad", "direct")):
        real = getattr(linear_rule, fn)
        monkeypatch.setattr(linear_rule, fn, lambda a, g, *more, real=real, name=name: (
            calls.__setitem__(name, calls[name] + 1), real(a, g, *more))[1])
    model = _gpt(seq_len, norm)
    x, y = synthetic_batch(model.cfg, 5, 1)
    psn = gapmon.PerSampleGradNorms(model, loss_reduction=reduction, strict=True)
    lm_loss(model(x), y, reduction=reduction).backward()
    got = psn.local_norms()
    want = vmap_per_sample_norms(model, lambda o, t: lm_loss(o, t, reduction=reduction), x, y)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert calls[regime] > 0, calls  # the cost rule picked the expected form for the attention/MLP layers
    assert psn.coverage()["uncovered_numel"] == 0
    psn.close()


def test_embedding_padding_and_repeated_tokens():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 6, padding_idx=0), nn.LayerNorm(6), nn.Linear(6, 3))
    x = torch.tensor([[1, 1, 0, 2, 1], [0, 0, 0, 3, 3], [5, 6, 7, 8, 9]])
    y = torch.randn(3, 5, 3)

    def loss(out, t):
        return ((out - t) ** 2).sum(dim=(1, 2)).mean()

    psn = gapmon.PerSampleGradNorms(model)
    loss(model(x), y).backward()
    torch.testing.assert_close(psn.local_norms(), vmap_per_sample_norms(model, loss, x, y), rtol=1e-4, atol=1e-6)


def test_two_dim_linear_inputs_and_micro_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 2))
    x, y = torch.randn(6, 7), torch.randn(6, 2)

    def loss(out, t):
        return ((out - t) ** 2).sum(1).mean()

    psn = gapmon.PerSampleGradNorms(model)
    for sl in (slice(0, 2), slice(2, 6)):  # gradient accumulation: two micro-batches of the same step
        loss(model(x[sl]), y[sl]).backward()
    got = psn.local_norms()
    want = torch.cat([vmap_per_sample_norms(model, loss, x[sl], y[sl]) for sl in (slice(0, 2), slice(2, 6))])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    # The next forward after reading starts a new accumulation.
    loss(model(x[:3]), y[:3]).backward()
    assert psn.local_norms().shape == (3,)


def test_unsupported_layers_warn_and_strict_raises():
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Flatten(), nn.Linear(3 * 4, 2))
    with pytest.warns(RuntimeWarning, match="0.weight"):
        psn = gapmon.PerSampleGradNorms(model)
    cov = psn.coverage()
    assert cov["uncovered"] == {"0.weight": 3, "0.bias": 3}
    assert "BatchNorm1d" in cov["uncovered_reasons"]["0.weight"]
    assert cov["covered"] == {"2.weight": 24, "2.bias": 2}
    with pytest.raises(ValueError, match="strict"):
        gapmon.PerSampleGradNorms(model, strict=True)


class _TiedLM(nn.Module):
    """An embedding whose table is also the output head's weight (tie_word_embeddings)."""

    def __init__(self, head_bias=False, **embedding):
        super().__init__()
        self.emb, self.mix = nn.Embedding(10, 4, **embedding), nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=head_bias)
        self.head.weight = self.emb.weight

    def forward(self, ids, second=None):
        h = self.emb(ids)
        if second is not None:  # the table read again (a second input): two calls of the embedding
            h = h + self.emb(second).mean(1, keepdim=True)
        return self.head(torch.tanh(self.mix(h)))


def _tied_loss(model, ids, *more):
    logits = model(ids, *more)
    return F.cross_entropy(logits.reshape(-1, 10), ((ids + 1) % 10).reshape(-1), reduction="sum")


@pytest.mark.parametrize("variant", ["plain", "head-bias", "padding-idx", "scale-grad-by-freq", "two-calls",
                                     "one-sample", "bookkeeping"])
def test_a_tied_embedding_and_head_is_exact(variant):
    """||E_i + H_i||: the embedding's and the head's parts of the tied table's gradient, and their cross term."""
    torch.manual_seed(0)
    embedding = {"padding-idx": {"padding_idx": 3}, "scale-grad-by-freq": {"scale_grad_by_freq": True}}.get(variant, {})
    model = _TiedLM(head_bias=variant == "head-bias", **embedding).double()
    batch = 1 if variant == "one-sample" else 4
    ids = torch.randint(0, 10, (batch, 6))
    ids[0, :3] = 3  # repeated ids (and the padding id)
    more = (torch.randint(0, 10, (batch, 2)),) if variant == "two-calls" else ()
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True, bookkeeping=variant == "bookkeeping",
                                    batch_inputs=[0, 1] if more else None)
    _tied_loss(model, ids, *more).backward()
    got = psn.local_norms()
    assert "emb.weight" in psn.coverage()["covered"]
    psn.close()
    want = []
    for i in range(batch):
        model.zero_grad()
        _tied_loss(model, ids[i:i + 1], *(m[i:i + 1] for m in more)).backward()
        want.append(torch.sqrt(sum(p.grad.square().sum() for p in model.parameters())))
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("with_head", [True, False], ids=["two-embeddings-and-head", "two-embeddings"])
def test_one_table_in_two_embeddings_and_a_head_is_exact(with_head):
    """T5's layout: the encoder's and the decoder's embeddings are two modules of one table, the head a third user
    (and a fourth module holding it that is never called): every pair's cross term counts."""
    class EncoderDecoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = nn.Embedding(10, 4)
            self.enc, self.dec = nn.Embedding(10, 4), nn.Embedding(10, 4, padding_idx=0)
            self.enc.weight = self.dec.weight = self.shared.weight
            self.mix, self.head = nn.Linear(4, 4), nn.Linear(4, 10, bias=False)
            if with_head:
                self.head.weight = self.shared.weight

        def forward(self, source, target):
            memory = torch.tanh(self.mix(self.enc(source))).mean(1, keepdim=True)
            return self.head(self.dec(target) + memory)

    torch.manual_seed(0)
    model = EncoderDecoder().double()
    source, target = torch.randint(0, 10, (3, 5)), torch.randint(0, 10, (3, 4))
    target[0, :2] = source[0, :2]  # ids in common between the two embeddings of a sample

    def loss_of(s, t):
        return F.cross_entropy(model(s, t).reshape(-1, 10), ((t + 1) % 10).reshape(-1), reduction="sum")

    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True, batch_inputs=[0, 1])
    loss_of(source, target).backward()
    got = psn.local_norms()
    assert "shared.weight" in psn.coverage()["covered"]
    psn.close()
    want = []
    for i in range(3):
        model.zero_grad()
        loss_of(source[i:i + 1], target[i:i + 1]).backward()
        want.append(torch.sqrt(sum(p.grad.square().sum() for p in model.parameters() if p.grad is not None)))
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-10, atol=1e-12)


def test_a_tied_table_counts_under_one_layer_type():
    """Every part of a tied table's per-sample gradient (each layer's own square and the cross terms, which may be
    negative) counts under the type of its first layer, so each type's norm is that of its parameters' gradients."""
    torch.manual_seed(0)
    model = _TiedLM().double()
    ids = torch.randint(0, 10, (4, 6))
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True)
    _tied_loss(model, ids).backward()
    by_type = psn.local_norms_by_layer_type()
    types = psn.covered_layer_types()
    psn.close()
    assert types["emb.weight"] == "Embedding" and types["mix.weight"] == "Linear"
    for layer_type, params in (("Embedding", ["emb.weight"]), ("Linear", ["mix.weight", "mix.bias"])):
        want = []
        for i in range(4):
            model.zero_grad()
            _tied_loss(model, ids[i:i + 1]).backward()
            want.append(torch.sqrt(sum(p.grad.square().sum() for n, p in model.named_parameters() if n in params)))
        torch.testing.assert_close(by_type[layer_type], torch.stack(want), rtol=1e-10, atol=1e-12)


def test_a_tied_head_not_per_sample_leaves_out_its_embedding_too():
    """Half of a tied table's gradient has no norm of its own: both layers are excluded, the rest stays exact."""
    class Reversed(_TiedLM):
        def forward(self, ids, second=None):
            h = torch.tanh(self.mix(self.emb(ids)))
            return self.head(h.detach().flip(0)), h  # the head reads the samples in reverse order (no gradient back)

    torch.manual_seed(0)
    model = Reversed().double()
    ids = torch.randint(0, 10, (3, 5))
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum")
    with pytest.warns(RuntimeWarning, match=r"'head' is not per-sample .* with \['emb'\]"):
        logits, h = model(ids)
        (F.cross_entropy(logits.reshape(-1, 10), ((ids + 1) % 10).reshape(-1), reduction="sum") + h.square().sum()).backward()
    got, cov = psn.local_norms(), psn.coverage()
    assert set(cov["covered"]) == {"mix.weight", "mix.bias"} and cov["skipped_layers"] == ["emb", "head"]
    assert got.shape == (3,) and torch.isfinite(got).all()


def test_other_ties_are_left_out_by_name():
    """Two Linear layers sharing a weight: not covered (strict: refused at construction), the rest exact."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2))
    model[2].weight = model[0].weight
    with pytest.warns(RuntimeWarning, match="0.weight is tied"):
        psn = gapmon.PerSampleGradNorms(model)
    cov = psn.coverage()
    assert set(cov["covered"]) == {"3.weight", "3.bias"}
    assert "shared by ['0', '2']" in cov["uncovered_reasons"]["0.weight"]
    with pytest.raises(ValueError, match="tied"):
        gapmon.PerSampleGradNorms(model, strict=True)


def test_gram_with_a_tied_embedding_is_refused():
    with pytest.raises(ValueError, match="gram=True"):
        gapmon.PerSampleGradNorms(_TiedLM(), gram=True)


def test_bad_arguments():
    with pytest.raises(ValueError, match="loss_reduction"):
        gapmon.PerSampleGradNorms(nn.Linear(2, 2), loss_reduction="avg")
    psn = gapmon.PerSampleGradNorms(nn.Linear(2, 2))
    nn.Linear(2, 2)
    with pytest.raises(ValueError, match="sample ids"):
        psn.global_norms(torch.arange(3))


def test_monitor_reports_per_sample_norms():
    model = _gpt()
    x, y = synthetic_batch(model.cfg, 4, 0)
    with gapmon.GAPMonitor(model, per_sample_grad_norms=True, sinks=[]) as mon:
        mon.begin_step(0, batch_size=4)
        lm_loss(model(x), y).backward()
        m = mon.end_step()
    want = vmap_per_sample_norms(model, lm_loss, x, y)
    assert m["gap/per_sample_grad_norm/max"] == pytest.approx(want.max().item(), rel=1e-4)
    assert m["gap/per_sample_grad_norm/min"] == pytest.approx(want.min().item(), rel=1e-4)
    assert m["gap/per_sample_grad_norm/mean"] == pytest.approx(want.mean().item(), rel=1e-4)


def _twice(model, x):
    loss = model(x).square().sum()
    loss.backward(retain_graph=True)
    loss.backward()


def _gradient_penalty(model, x, penalty_only=False):
    """A critic's loss with an R1-style penalty: a gradient taken through the model (create_graph=True)."""
    x = x.clone().requires_grad_()
    out = model(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (g.square().sum() if penalty_only else out.sum() + g.square().sum()).backward()


@pytest.mark.parametrize("run", [_twice, _gradient_penalty], ids=["retain_graph", "gradient_penalty"])
def test_second_backward_through_same_graph_is_refused_when_read_and_backward_is_untouched(run):
    """Backward run twice through one forward pass: the user's backward completes with the gradients it has without
    gapmon (bit for bit), and the norms are refused when read, saying why; the next step starts over."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    plain = copy.deepcopy(model)
    x = torch.randn(5, 3, dtype=torch.float64)
    run(plain, x)
    psn = gapmon.PerSampleGradNorms(model, strict=True)
    run(model, x)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
    with pytest.raises(RuntimeError, match="backward ran twice through the forward pass of 1 micro-batch"):
        psn.local_norms()
    model.zero_grad()
    model(x).sum().backward()  # a plain step after it is measured
    assert psn.local_norms().shape == (5,)
    psn.close()


def test_a_penalty_through_a_linear_model_alone_is_caught_by_the_use_check():
    """A loss that is only a gradient penalty of a linear model: its backward never reaches the layers' outputs again,
    so the layers saw only the inner gradient's pass; the use check finds their gradients are not what they formed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)).double()
    psn = gapmon.PerSampleGradNorms(model, strict=True)
    _gradient_penalty(model, torch.randn(5, 3, dtype=torch.float64), penalty_only=True)
    with pytest.raises(RuntimeError, match="is not per-sample"):
        psn.local_norms()
    psn.close()


def _bmm_calls(fn):
    out, counts = _op_counts(fn)
    return out, counts.get("aten::bmm", 0)


def _op_counts(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, {e.key: e.count for e in prof.key_averages()}


def test_ghost_norm_is_one_product_per_layer_when_the_grams_fit():
    """The default tile builds small Grams whole: O(1) batched matmuls per layer (counted by the
    profiler), with the same result as the tiled form."""
    if gapmon.backend() == "torch":
        pytest.skip("needs the compiled ops")
    a, g = torch.randn(2, 300, 8, dtype=torch.float64), torch.randn(2, 300, 5, dtype=torch.float64)
    whole, n_whole = _bmm_calls(lambda: torch.ops.gapmon.ghost_norm_sq(a, g, None))
    tiled, n_tiled = _bmm_calls(lambda: torch.ops.gapmon.ghost_norm_sq(a, g, 64))
    assert n_whole == 2 and n_tiled == 2 * 15  # 5 tiles: 15 tile pairs
    want = torch.bmm(g.transpose(1, 2), a).square().sum((1, 2))
    torch.testing.assert_close(whole, want)
    torch.testing.assert_close(tiled, want)


@pytest.mark.parametrize("t", [4, 7, 128, 131])
def test_large_grams_are_built_as_bands_of_their_upper_triangle(t):
    """Grams whose products cost 2^25 multiply-adds or more are built from the diagonal on, in 4 bands of rows
    (5/8 of the products: the LM head of a d=128 model at T=128 5.9 -> 4.3 ms here), the rest of each band
    counted twice: the float64 per-sample gradients' norms, also for a last band shorter than the others."""
    if gapmon.backend() == "torch":
        pytest.skip("needs the compiled ops")
    gen = torch.Generator().manual_seed(t)
    b, width = 3, (1 << 25) // (3 * t * t) + 1  # just over the threshold
    a, g = torch.randn(b, t, width // 2, generator=gen), torch.randn(b, t, width - width // 2, generator=gen)
    a64, g64 = a.double(), g.double()  # float64 whole Grams (the per-sample gradients would be width^2 / 4)
    want = (a64 @ a64.transpose(1, 2) * (g64 @ g64.transpose(1, 2))).sum((1, 2))
    got, ops = _op_counts(lambda: torch.ops.gapmon.ghost_norm_sq(a, g))
    assert ops["aten::bmm"] == 2 * 4 and ops["aten::add_"] == 3 and "aten::zeros" not in ops, ops
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=0)  # float32 products of up to 2^23 terms
    torch.testing.assert_close(torch.ops.gapmon.ghost_norm_sq(a64, g64), want, rtol=1e-12, atol=0)
    small, ops = _op_counts(lambda: torch.ops.gapmon.ghost_norm_sq(a[:, :, :8], g[:, :, :8]))
    assert ops["aten::bmm"] == 2  # below the threshold: whole Grams, one product pair
    # the one chunk's sums are the result: no zeros to start from, no copy into them (on a GPU each is a launch)
    assert not {"aten::zeros", "aten::zero_", "aten::copy_", "aten::add_"} & set(ops), ops
    torch.testing.assert_close(small.double(), torch.bmm(g[:, :, :8].double().transpose(1, 2), a[:, :, :8].double())
                               .square().sum((1, 2)), rtol=1e-5, atol=0)


@pytest.mark.parametrize("tile", [None, 3])
@pytest.mark.parametrize("t, width", [(9, 8), (64, 3000)], ids=["whole", "bands"])
def test_ghost_norm_with_the_bias_adds_its_norm_in_the_grams(t, width, tile):
    """bias=True: Σ (AAᵀ + 1) ⊙ (GGᵀ), the squared norm of a Linear's weight and bias gradients together (the bias
    is the weight of an input that is 1 everywhere), against the float64 per-sample gradients of both; whole Grams,
    bands and tiles alike, and the pure-PyTorch form."""
    gen = torch.Generator().manual_seed(t)
    a = torch.randn(3, t, width // 2, generator=gen, dtype=torch.float64)
    g = torch.randn(3, t, width - width // 2, generator=gen, dtype=torch.float64)
    want = torch.bmm(g.transpose(1, 2), a).square().sum((1, 2)) + g.sum(1).square().sum(1)
    if gapmon.backend() != "torch":
        torch.testing.assert_close(torch.ops.gapmon.ghost_norm_sq(a, g, tile, True), want, rtol=1e-12, atol=0)
        torch.testing.assert_close(torch.ops.gapmon.ghost_norm_sq(a.float(), g.float(), tile, True).double(), want,
                                   rtol=1e-4, atol=0)
    if tile is None:
        from gapmon.stats import _backend
        compiled, _backend.COMPILED = _backend.COMPILED, False
        try:
            torch.testing.assert_close(_backend.ghost_norm_sq(a, g, bias=True), want, rtol=1e-12, atol=0)
        finally:
            _backend.COMPILED = compiled


def test_a_ghost_form_linear_takes_its_bias_norm_from_the_grams():
    """LinearRule in the ghost form (T (d + p) < d p): the bias's norm comes with the weight's from one ghost op (one sum,
    over the Gram products), not from a reduction of the output gradient of its own: on a GPU three launches fewer per
    Linear. The norms stay those of the float64 per-sample gradients."""
    if gapmon.backend() == "torch":
        pytest.skip("counts the compiled op's reductions")
    from gapmon.per_sample.rules import LinearRule
    layer = nn.Linear(64, 48).double()
    a, g = torch.randn(4, 6, 64, dtype=torch.float64), torch.randn(4, 6, 48, dtype=torch.float64)
    got, ops = _op_counts(lambda: LinearRule().norm_sq(layer, (a, g)))
    assert ops.get("gapmon::ghost_norm_sq") == 1 and ops.get("aten::sum") == 1, ops
    want = torch.bmm(g.transpose(1, 2), a).square().sum((1, 2)) + g.sum(1).square().sum(1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


@pytest.mark.slow
def test_grams_too_large_for_one_product_are_built_whole_in_chunks_of_samples():
    """B * T^2 above 2^24 with one sample's Gram below it: whole Grams for 4 samples at a time (2
    chunks of 5 samples: 2 products each, not 36 tile pairs) for Linear; Embedding on the CPU sums each
    sample's rows instead (no product at all)."""
    if gapmon.backend() == "torch":
        pytest.skip("needs the compiled ops")
    gen = torch.Generator().manual_seed(0)
    b, t = 5, 2048  # T^2 = 2^22: 4 samples per chunk
    a, g = torch.randn(b, t, 4, generator=gen), torch.randn(b, t, 3, generator=gen)
    got, calls = _bmm_calls(lambda: torch.ops.gapmon.ghost_norm_sq(a, g))
    # the first chunk's Grams in 4 bands of rows (4 * 2^22 * 7 multiply-adds: over 2^25), the last sample's whole
    assert calls == 2 * 4 + 2
    want = torch.bmm(g.double().transpose(1, 2), a.double()).square().sum((1, 2))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=0)
    ids = torch.randint(0, 50, (b, t), generator=gen)
    ids[0, :7] = 3  # the padding id
    got, calls = _bmm_calls(lambda: torch.ops.gapmon.embedding_norm_sq(ids, g, 3))
    assert calls == 0
    one_hot = torch.nn.functional.one_hot(ids, 50).double() * ids.ne(3).unsqueeze(-1)
    want = torch.bmm(one_hot.transpose(1, 2), g.double()).square().sum((1, 2))  # per-sample [vocab, d] grads
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_embedding_norms_by_rows_equal_the_gram_pairs_and_float64(dtype, cpu_isa):
    """On the CPU embedding_norm_sq sums each sample's positions of one id into its table row (sorted by sample
    and id) instead of pairing positions through Grams: the same norms as the Gram form (a tile given) and as
    float64 one-hot per-sample gradients, with a padding id, ids repeated within and across samples, one
    position, one id everywhere, no sample and no position; ids outside [0, 2^32) are refused."""
    if gapmon.backend() == "torch":
        pytest.skip("needs the compiled ops")
    gen = torch.Generator().manual_seed(4)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    cases = [(torch.randint(0, 7, (4, 50), generator=gen), 3), (torch.randint(0, 1000, (3, 40), generator=gen), -1),
             (torch.zeros(2, 30, dtype=torch.long), -1), (torch.zeros(2, 30, dtype=torch.long), 0),
             (torch.tensor([[5]]), -1), (torch.randint(0, 3, (5, 17), generator=gen).int(), 2)]
    for ids, pad in cases:
        g = torch.randn(*ids.shape, 6, generator=gen, dtype=torch.float64).to(dtype)
        one_hot = torch.nn.functional.one_hot(ids.long(), int(ids.max()) + 1).double()
        if pad >= 0:
            one_hot = one_hot * ids.ne(pad).unsqueeze(-1)
        want = torch.bmm(one_hot.transpose(1, 2), g.double()).square().sum((1, 2))
        got = torch.ops.gapmon.embedding_norm_sq(ids, g, pad)
        assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(torch.ops.gapmon.embedding_norm_sq(ids, g, pad, 8).double(), want, rtol=tol, atol=tol)
    assert torch.ops.gapmon.embedding_norm_sq(torch.zeros(0, 5, dtype=torch.long), torch.zeros(0, 5, 3), -1).shape == (0,)
    assert torch.equal(torch.ops.gapmon.embedding_norm_sq(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, 3), -1),
                       torch.zeros(2))
    for bad in (-1, 1 << 32):
        with pytest.raises(ValueError, match="ids must lie in"):
            torch.ops.gapmon.embedding_norm_sq(torch.tensor([[0, bad]]), torch.ones(1, 2, 3), -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_affine_norm_sums_equal_float64_per_sample_gradients(dtype, rms, cpu_isa):
    """gapmon.affine_norm_sums (on the CPU one read of x and g in float64) gives each sample's LayerNorm / RMSNorm
    weight and bias gradients: those of float64 x̂ from the same input values, for rows far from zero mean, one
    position, no position, no sample and a strided input; in float32 (float64 for float64 inputs)."""
    if gapmon.backend() == "torch":
        pytest.skip("needs the compiled ops")
    gen = torch.Generator().manual_seed(7)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    eps = 1e-5
    for b, t, n in ((3, 7, 10), (2, 1, 33), (2, 0, 4), (0, 3, 4), (4, 40, 128)):
        x = (torch.randn(b, t, n, generator=gen, dtype=torch.float64) * 3 + 5).to(dtype)
        g = torch.randn(b, t, n, generator=gen, dtype=torch.float64).to(dtype)
        x64, g64 = x.double(), g.double()
        xhat = torch.nn.functional.rms_norm(x64, (n,), eps=eps) if rms else torch.nn.functional.layer_norm(x64, (n,), eps=eps)
        want_w, want_b = (g64 * xhat).sum(1), g64.sum(1)
        for xs, gs in ((x, g), (x.transpose(0, 1).contiguous().transpose(0, 1), g)):  # strided x: the same sums
            got_w, got_b = torch.ops.gapmon.affine_norm_sums(xs, gs, eps, rms)
            assert got_w.dtype == got_b.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
            assert got_w.shape == got_b.shape == (b, n)
            torch.testing.assert_close(got_w.double(), want_w, rtol=tol, atol=tol)
            torch.testing.assert_close(got_b.double(), want_b, rtol=tol, atol=tol)
    meta_w, meta_b = torch.ops.gapmon.affine_norm_sums(torch.empty(2, 5, 3, device="meta"),
                                                      torch.empty(2, 5, 3, device="meta"), eps, rms)
    assert meta_w.shape == meta_b.shape == (2, 3)
    with pytest.raises(ValueError, match="expected x and g of one shape"):
        torch.ops.gapmon.affine_norm_sums(torch.ones(2, 3, 4), torch.ones(2, 3, 5), eps, rms)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_linear_grad_sketch_equals_the_float64_gradients_times_the_probe(dtype):
    """gapmon.linear_grad_sketch (the use check's sketch of a Linear): the weight gradient Σ g aᵀ times the probe, and the
    bias gradient Σ g times the bias probe, for [B, T, *] and [N, *] positions and probes of one column or several
    (an identity probe gives the gradients themselves), in the probe's dtype."""
    gen = torch.Generator().manual_seed(9)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    for shape_a, shape_g in (((3, 5, 7), (3, 5, 4)), ((6, 7), (6, 4)), ((0, 5, 7), (0, 5, 4))):
        a = torch.randn(*shape_a, generator=gen, dtype=torch.float64).to(dtype)
        g = torch.randn(*shape_g, generator=gen, dtype=torch.float64).to(dtype)
        grad_w = g.double().reshape(-1, 4).T @ a.double().reshape(-1, 7)  # [4, 7]
        grad_b = g.double().reshape(-1, 4).sum(0)
        for r, rb in ((torch.randn(7, generator=gen, dtype=wide), torch.randn(1, generator=gen, dtype=wide)),
                      (torch.eye(7, dtype=wide), torch.eye(1, dtype=wide))):
            w, b = gapmon.stats._backend.linear_grad_sketch(a, g, r, rb)
            assert w.dtype == b.dtype == wide
            torch.testing.assert_close(w.double(), grad_w @ r.double(), rtol=tol, atol=tol)
            torch.testing.assert_close(b.double(), grad_b.reshape(-1, 1) @ rb.double(), rtol=tol, atol=tol)
            only_w, none = gapmon.stats._backend.linear_grad_sketch(a, g, r)
            assert torch.equal(only_w, w) and none.numel() == 0
    if gapmon.backend() != "torch":
        with pytest.raises(ValueError, match="expected a probe of 7 rows"):
            torch.ops.gapmon.linear_grad_sketch(torch.ones(2, 7), torch.ones(2, 4), torch.ones(6), None)
        with pytest.raises(ValueError, match="same leading dims"):
            torch.ops.gapmon.linear_grad_sketch(torch.ones(2, 7), torch.ones(3, 4), torch.ones(7), None)



@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_add_sketch_adds_the_gradient_as_rows_times_the_probe(grad_dtype):
    """The use check's sketch of a gradient of any rank (a 0-dim scale, a bias, a weight, a 4-D kernel): acc += its
    [rows, -1] matrix times the probe, in the accumulator's dtype, as float64 gives it; added to what acc held."""
    from gapmon.per_sample.rules import add_sketch

    gen = torch.Generator().manual_seed(4)
    for acc_dtype in (torch.float32, torch.float64):
        tol = 1e-12 if acc_dtype == grad_dtype == torch.float64 else 1e-5
        for shape in ((), (5,), (1,), (5, 3), (4, 2, 3, 3)):
            grad = torch.randn(shape, generator=gen, dtype=torch.float64).to(grad_dtype)
            rows = shape[0] if shape else 1
            r = torch.randn(grad.numel() // rows, generator=gen, dtype=acc_dtype)
            held = torch.randn(rows, generator=gen, dtype=acc_dtype)
            acc = held.clone()
            add_sketch(acc, grad, r)
            assert acc.dtype == acc_dtype and acc.shape == (rows,)
            want = held.double() + grad.double().reshape(rows, -1) @ r.double()
            torch.testing.assert_close(acc.double(), want, rtol=tol, atol=tol)

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_products_sum_in_float32(dtype):
    """16-bit operands give float32 norms equal to the float64 products of the same 16-bit values:
    the ops widen them (tensor cores with float32 results on CUDA, tile by tile on the CPU), never
    summing in 16 bits. Tolerance 1e-5: float32 sums of a few hundred exact products."""
    torch.manual_seed(0)
    a, g = torch.randn(3, 40, 24).to(dtype), torch.randn(3, 40, 16).to(dtype)
    ids = torch.randint(0, 7, (3, 40))
    a64, g64 = a.double(), g.double()
    want = torch.bmm(g64.transpose(1, 2), a64).square().sum((1, 2))
    for got in (gapmon.stats._backend.ghost_norm_sq(a, g), gapmon.stats._backend.direct_norm_sq(a, g),
                gapmon.stats._backend.ghost_norm_sq(a, g64.float())):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)
    same = ids.unsqueeze(2) == ids.unsqueeze(1)
    want_emb = (torch.bmm(g64, g64.transpose(1, 2)) * same).sum((1, 2))
    got_emb = gapmon.stats._backend.embedding_norm_sq(ids, g)
    assert got_emb.dtype == torch.float32
    torch.testing.assert_close(got_emb.double(), want_emb, rtol=1e-5, atol=0)


def test_16bit_linear_operands_are_not_copied_to_float32():
    """A Linear layer's 16-bit input and output gradient reach the products as they are (no float32
    copy of the activations), and the norms match a float64 loop over the same bfloat16 model."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 6)).to(torch.bfloat16)
    x, y = torch.randn(5, 12).to(torch.bfloat16), torch.randint(0, 6, (5,))
    a = torch.randn(5, 7, 12).to(torch.bfloat16)
    call = gapmon.per_sample.rules.Call((a,), {})
    pos = gapmon.per_sample.rules.LinearRule().positions(model[0], call, torch.randn(5, 7, 20).to(torch.bfloat16), torch.float32)
    assert pos[0].dtype == torch.bfloat16 and pos[0].data_ptr() == a.data_ptr()
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum")
    F.cross_entropy(model(x).float(), y, reduction="sum").backward()
    got = psn.local_norms()
    psn.close()
    want = loop_per_sample_norms(model, lambda out, t: F.cross_entropy(out, t, reduction="sum"), x, y)
    # The reference runs the bfloat16 weights in float64 while the model's forward and backward ran
    # in bfloat16: the gradients themselves differ by bfloat16 rounding (2^-8 relative), not the norms' math.
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=0)


def test_direct_form_sums_squares_in_float64():
    """The direct form reduces the per-sample gradients with gapmon's own statistics kernel (float64
    sums, one read): float32 norms within 1e-6 of float64 at 2.4 million elements per sample (ATen's
    float32 vector_norm is off by ~1e-4 there)."""
    if gapmon.backend() == "torch":
        pytest.skip("needs the compiled ops")
    gen = torch.Generator().manual_seed(1)
    a, g = torch.randn(3, 16, 1536, generator=gen), torch.randn(3, 16, 1536, generator=gen) + 0.5
    got = torch.ops.gapmon.direct_norm_sq(a, g)
    want = torch.bmm(g.double().transpose(1, 2), a.double()).square().sum((1, 2))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


@pytest.mark.slow
def test_norms_under_torch_compile_match_eager():
    """A torch.compile'd model gives the eager per-sample norms, step after step (Dynamo graph-breaks
    where a hook's Python bookkeeping cannot be traced; the numbers stay exact)."""
    import torch._dynamo

    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=2)
    model = seeded_gpt(cfg)
    x, y = synthetic_batch(cfg, 3, 0)
    psn = gapmon.PerSampleGradNorms(model)
    lm_loss(model(x), y).backward()
    want = psn.local_norms()
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager")
    torch._dynamo.reset()
    for _ in range(3):
        lm_loss(compiled(x), y).backward()
        torch.testing.assert_close(psn.local_norms(), want, rtol=1e-5, atol=0)
        model.zero_grad()
    psn.close()


def test_the_batch_tracking_runs_untraced_in_compiled_regions_once_dynamo_is_loaded():
    """torch 2.11's Dynamo traces a TorchFunctionMode's __torch_function__ inside compiled regions, on fake tensors: the
    batch tracking's statuses never reached the real tensors (a compiled GPT's attention projection was left out, the
    frame recompiled past Dynamo's limit). Once Dynamo is loaded, the tracking of a forward pass runs untraced there
    (the compile tests above check the numbers; on torch 2.13 they pass either way), and plain elsewhere."""
    import torch._dynamo  # noqa: F401  (loaded: torch.compile imports it)

    from gapmon.per_sample.batch_provenance import UntracedInCompiledRegions, batch_tracker

    tracker = batch_tracker(3)
    assert isinstance(tracker, UntracedInCompiledRegions)
    x = torch.randn(3, 4)
    tracker.mark(x, 0)
    with tracker:
        y = (x * 2).sum(1)
    assert tracker.status(y) == 0


@pytest.mark.parametrize("dynamo_loaded", [False, True])
def test_a_deep_copy_of_the_model_adds_nothing_to_the_norms(dynamo_loaded, monkeypatch):
    """A deep copy of a watched model (an EMA copy, a reference loop's float64 copy) carries copies of the hooks; run,
    it must not add samples to the original's norms, also once the hooks' collecting parts are called through
    torch.compiler.disable (Dynamo loaded)."""
    import copy

    import gapmon._torch_compat as compat

    monkeypatch.setattr(compat, "dynamo_loaded", lambda: dynamo_loaded)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum")
    x = torch.randn(3, 4)
    model(x).square().sum().backward()
    twin = copy.deepcopy(model)
    twin(torch.randn(7, 4)).square().sum().backward()
    got = psn.local_norms()
    want = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(model(x[i:i + 1]).square().sum(),
                                                                  list(model.parameters()))]).norm() for i in range(3)]
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-5, atol=0)
    psn.close()


def test_torch_compile_keeps_a_skipped_step_whole_and_a_collected_one_quiet():
    """The hooks on 12 covered layers under torch.compile: while paused (a step the monitor skips) Dynamo traces them
    as nothing, so the model compiles into the one graph it has without gapmon; while collecting they run eagerly at
    graph breaks, without recompiling per layer (Dynamo's recompile limit, 8, and its warnings), and the norms are
    the eager ones."""
    import logging

    import torch._dynamo

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(12))

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x

    def graphs_of(model, x):
        sizes = []

        def counting(gm, example_inputs):
            sizes.append(sum(n.op == "call_function" or n.op == "call_method" for n in gm.graph.nodes))
            return gm.forward

        torch._dynamo.reset()
        compiled = torch.compile(model, backend=counting)
        compiled(x).square().sum().backward()
        return sizes, compiled

    torch.manual_seed(0)
    model, x = Deep(), torch.randn(3, 6)
    plain, _ = graphs_of(model, x)
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum")
    model(x).square().sum().backward()
    want = psn.local_norms()
    psn.pause()
    paused, _ = graphs_of(model, x)
    assert paused == plain and len(plain) == 1, (paused, plain)
    psn.start()
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    dynamo_log = logging.getLogger("torch._dynamo")  # torch's loggers do not propagate to the root (caplog)
    dynamo_log.addHandler(handler)
    try:
        _, compiled = graphs_of(model, x)
        got = psn.local_norms()
        for _ in range(2):
            compiled(x).square().sum().backward()
            torch.testing.assert_close(psn.local_norms(), want, rtol=1e-6, atol=0)
    finally:
        dynamo_log.removeHandler(handler)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert not [m for m in seen if "recompile" in m], seen
    psn.close()
    torch._dynamo.reset()


@pytest.mark.parametrize("bookkeeping", [False, True])
def test_bf16_autocast_norms_match_torch_func(bookkeeping):
    """Under bf16 autocast the norms equal torch.func's per-sample gradients of the same autocast
    computation within 4e-3: the reference's gradients come out of bf16 matmuls, each element rounded
    to bf16 (unit roundoff 2^-8 ~ 3.9e-3), so its norms carry up to that relative error; gapmon sums the
    products of the same bf16 operands in float32. T=16 >= d p / (d + p): Linear layers take the
    direct form (book-kept with bookkeeping=True)."""
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=16, n_heads=2, n_layers=2)
    model = Autocast(seeded_gpt(cfg), "cpu")
    x, y = synthetic_batch(cfg, 4, 5)

    def loss(out, target):
        return lm_loss(out.float(), target)

    psn = gapmon.PerSampleGradNorms(model, bookkeeping=bookkeeping)
    loss(model(x), y).backward()
    got = psn.local_norms()
    psn.close()
    want = vmap_per_sample_norms(model, loss, x, y)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), rtol=4e-3, atol=0)
