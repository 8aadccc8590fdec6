"""Reparametrised Linear and convolution layers (gapmon/per_sample/rules/reparametrized.py), weight_norm,
spectral_norm, orthogonal and chains of parametrizations: exact against a float64 per-sample loop, for torch's
parametrizations and their older hook-based forms, every `dim`, with and without a bias, frozen parts, several calls
and micro-batches; wav2vec 2's positional convolution whole."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_kept_under_bf16_autocast, loop_per_sample_norms

import gapmon
from gapmon.per_sample.rules import ReparametrizedRule, rule_for
from gapmon.per_sample.rules.reparametrized import spectral_norm_grads, weight_norm_grads


def _weight_norm(module, dim, old):
    if old:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return nn.utils.weight_norm(module, dim=dim)
    return nn.utils.parametrizations.weight_norm(module, dim=dim)


def _loss(out, y):
    return ((out - y) ** 2).sum()


def _norms(model, x, y, **kwargs):
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True, **kwargs)
    _loss(model(x), y).backward()
    got, cov = psn.local_norms(), psn.coverage()
    psn.close()
    model.zero_grad()
    return got, cov


def _assert_exact_in_a_model(layer, shape):
    """`layer` followed by a head, one summed-loss step in training mode: every parameter covered and its norms equal
    to a float64 loop run in eval mode after the step (a spectral_norm'd layer's u and v as the step left them)."""
    assert isinstance(rule_for(layer), ReparametrizedRule)
    model = nn.Sequential(layer, nn.Tanh(), nn.Flatten(), nn.LazyLinear(2)).double()
    x = torch.randn(*shape, dtype=torch.float64)
    model.eval()(x)  # (the lazy layer's shape, without a power iteration)
    model.train()
    y = torch.randn(shape[0], 2, dtype=torch.float64)
    got, cov = _norms(model, x, y)
    assert not cov["uncovered"] and not cov["skipped_layers"]
    model.eval()
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y), rtol=1e-10, atol=1e-12)


def test_the_closed_form_is_autograds():
    """dg and dv of W = g v / ||v|| for a batch of gradients of W equal torch.autograd's, one gradient at a time."""
    torch.manual_seed(0)
    for dim in (0, 1, 2, -1):
        v = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
        g = torch.randn(*(1 if i != dim else n for i, n in enumerate(v.shape)), dtype=torch.float64,
                        requires_grad=True) if dim != -1 else torch.randn((), dtype=torch.float64, requires_grad=True)
        d = torch.randn(6, *v.shape, dtype=torch.float64)
        dg, dv = weight_norm_grads(d, g.detach(), v.detach(), dim)
        for i in range(6):
            want_g, want_v = torch.autograd.grad(torch._weight_norm(v, g, dim), (g, v), d[i])
            torch.testing.assert_close(dg[i], want_g, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(dv[i], want_v, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("old", [False, True], ids=["parametrization", "hook-based"])
@pytest.mark.parametrize("dim", [0, 1, None])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("seq", [1, 6, 40], ids=["T=1", "T=6", "T=40"])
def test_a_weight_normalised_linear_is_exact(old, dim, bias, seq):
    torch.manual_seed(0)
    layer = _weight_norm(nn.Linear(5, 7, bias=bias), dim, old)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), layer).double()
    assert isinstance(rule_for(layer), ReparametrizedRule)
    x, y = torch.randn(3, seq, 4, dtype=torch.float64), torch.randn(3, seq, 7, dtype=torch.float64)
    got, cov = _norms(model, x, y)
    assert not cov["uncovered"] and not cov["skipped_layers"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("old", [False, True], ids=["parametrization", "hook-based"])
@pytest.mark.parametrize("conv, shape, dim, groups", [
    (nn.Conv1d, (3, 4, 20), 2, 2),  # wav2vec 2's positional convolution: dim=2, grouped
    (nn.Conv1d, (3, 4, 20), 0, 1),
    (nn.Conv2d, (3, 4, 6, 6), 0, 4),
    (nn.Conv2d, (3, 4, 6, 6), 1, 1),
])
def test_a_weight_normalised_convolution_is_exact(old, conv, shape, dim, groups):
    torch.manual_seed(0)
    _assert_exact_in_a_model(_weight_norm(conv(4, 8, 3, padding=1, groups=groups), dim, old), shape)


def test_frozen_parts_two_calls_micro_batches_and_book_keeping():
    """g frozen (v trains), the layer called twice a forward, two micro-batches, book-keeping on (the layer keeps
    autograd's backward): exact; coverage() names g as not trainable and v as covered."""
    torch.manual_seed(0)
    layer = nn.utils.parametrizations.weight_norm(nn.Linear(5, 5))
    layer.parametrizations.weight.original0.requires_grad_(False)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), layer).double()

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = model

        def forward(self, x):
            h = self.body(x)
            return layer(torch.tanh(h))

    twice = Twice()
    x, y = torch.randn(5, 4, 3, dtype=torch.float64), torch.randn(5, 4, 5, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(twice, loss_reduction="sum", strict=True, bookkeeping=True)
    for part in (slice(0, 2), slice(2, 5)):
        _loss(twice(x[part]), y[part]).backward()
    got, cov = psn.local_norms(), psn.coverage()
    psn.close()
    assert "body.2.parametrizations.weight.original1" in cov["covered"]
    assert "body.2.parametrizations.weight.original0" not in cov["covered"] and not cov["uncovered"]
    want = torch.cat([loop_per_sample_norms(twice, _loss, x[part], y[part]) for part in (slice(0, 2), slice(2, 5))])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("parametrization", ["weight_norm", "orthogonal"])
def test_under_bf16_autocast_the_use_check_keeps_it(parametrization):
    torch.manual_seed(0)
    wrap = getattr(nn.utils.parametrizations, parametrization)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), wrap(nn.Linear(16, 4)))
    assert_kept_under_bf16_autocast(model, _loss, torch.randn(4, 10, 8), torch.randn(4, 10, 4))


@pytest.mark.parametrize("orthogonal_map", ["matrix_exp", "cayley", "householder"])
@pytest.mark.parametrize("layer", ["linear", "wide linear", "conv1d"])
def test_orthogonal_parametrizations_are_exact(orthogonal_map, layer):
    """torch's orthogonal parametrization (no closed form here: each sample's gradient taken back through the chain by
    a vector-Jacobian product), every map, tall and wide weights, a convolution."""
    torch.manual_seed(0)
    if layer == "conv1d":
        module, shape = nn.Conv1d(3, 4, 2), (3, 3, 6)  # a weight [4, 3, 2]: householder needs its rows <= its columns
        if orthogonal_map == "householder":
            module, shape = nn.Conv1d(2, 3, 2), (3, 2, 6)
    else:
        module, shape = (nn.Linear(4, 3), (3, 5, 4)) if layer == "linear" else (nn.Linear(3, 5), (3, 5, 3))
    _assert_exact_in_a_model(nn.utils.parametrizations.orthogonal(module, orthogonal_map=orthogonal_map), shape)


class _Scaled(nn.Module):
    """A user's parametrization with a buffer it reads and one it counts its forwards in."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor(1.5, dtype=torch.float64))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, w):
        self.calls += 1
        return torch.tanh(w) * self.scale


def test_chains_of_parametrizations_are_exact_and_their_buffers_left_alone():
    """weight_norm stacked with a user's parametrization (two originals into the chain, a buffer it updates at each
    forward): exact, and the chain formed again for the per-sample gradients leaves the model's buffers as they were."""
    torch.manual_seed(0)
    layer = nn.utils.parametrizations.weight_norm(nn.Linear(4, 3))
    nn.utils.parametrize.register_parametrization(layer, "weight", _Scaled())
    counter = layer.parametrizations["weight"][1].calls
    model = nn.Sequential(layer, nn.Tanh(), nn.Linear(3, 2)).double()
    x, y = torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 2, dtype=torch.float64)
    before = counter.item()
    got, cov = _norms(model, x, y)
    assert counter.item() == before + 1  # the model's one forward
    assert not cov["uncovered"] and not cov["skipped_layers"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y), rtol=1e-10, atol=1e-12)


class _Noisy(nn.Module):
    """A parametrization that forms another W at each forward."""

    def forward(self, w):
        return w * (1 + 1e-3 * torch.randn_like(w))


def test_a_chain_that_forms_another_weight_is_caught_and_spectral_norm_in_a_chain_left_out():
    """Formed again, a random chain's W is not the forward's: the use check finds the sums differ and leaves the layer
    out (strict refuses) rather than give its norms. A chain with spectral_norm in it (its power iteration moves u and
    v at each forward) is not formed again: left out by name."""
    torch.manual_seed(0)
    noisy = nn.utils.parametrize.register_parametrization(nn.Linear(4, 3), "weight", _Noisy())
    model = nn.Sequential(noisy, nn.Tanh(), nn.Linear(3, 2)).double()
    x, y = torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 2, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum")
    with pytest.warns(RuntimeWarning, match="contributions that no per-sample rule saw"):
        _loss(model(x), y).backward()
        psn.local_norms()
    assert psn.coverage()["skipped_layers"] == ["0"]
    psn.close()

    stacked = nn.utils.parametrizations.spectral_norm(nn.utils.parametrizations.orthogonal(nn.Linear(4, 4)))
    assert not isinstance(rule_for(stacked), ReparametrizedRule)
    with pytest.warns(RuntimeWarning, match="computed from other parameters"):
        psn = gapmon.PerSampleGradNorms(nn.Sequential(stacked, nn.Tanh(), nn.Linear(4, 2)))
    assert set(psn.coverage()["covered"]) == {"2.weight", "2.bias"}
    psn.close()


def test_wav2vec2_is_whole_and_exact():
    """wav2vec 2's positional convolution (weight_norm over dim 2, 16 groups in the real model) was the one layer it
    left out: now every trainable parameter is covered, exact against a float64 loop."""
    transformers = pytest.importorskip("transformers", reason="needs transformers (CI installs it)")
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24, conv_dim=(8, 8),
        conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
        mask_time_prob=0.0, feat_extract_norm="layer", do_stable_layer_norm=True)
    model = transformers.Wav2Vec2Model(config).double().train()
    audio = torch.randn(3, 200, dtype=torch.float64)

    def loss_of(m, x):
        return m(x).last_hidden_state.square().sum()

    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True)
    loss_of(model, audio).backward()
    got, cov = psn.local_norms(), psn.coverage()
    psn.close()
    assert not cov["uncovered"] and not cov["skipped_layers"]
    assert any("pos_conv_embed.conv.parametrizations.weight.original1" in n for n in cov["covered"])
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    want = []
    for i in range(3):
        grads = torch.autograd.grad(loss_of(model, audio[i:i + 1]), [p for n, p in model.named_parameters() if n in names],
                                    allow_unused=True)
        want.append(torch.sqrt(sum(g.square().sum() for g in grads if g is not None)))
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-9, atol=1e-12)


def test_the_weight_normalised_layer_is_not_followed_as_a_functional_linear():
    """F.linear(x, layer.weight) beside the layer's own call: the use check refuses it as for any layer (no silent
    number)."""
    layer = nn.utils.parametrizations.weight_norm(nn.Linear(4, 4))

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return self.layer(x) + F.linear(x, self.layer.weight)

    model = Twice().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True)
    _loss(model(x), torch.zeros(3, 4, dtype=torch.float64)).backward()
    with pytest.raises(RuntimeError, match="layer"):
        psn.local_norms()
    psn.close()


def _spectral_norm(module, dim, old):
    kwargs = {} if dim is None else {"dim": dim}
    if old:
        return nn.utils.spectral_norm(module, **kwargs)
    return nn.utils.parametrizations.spectral_norm(module, **kwargs)


def test_the_spectral_closed_form_is_autograds():
    """dW₀ of W = W₀ / uᵀ M v (u, v constants) for a batch of gradients of W equals torch.autograd's, for a weight
    normalised along its first and its second dim."""
    torch.manual_seed(0)
    for dim in (0, 1, 2):
        w0 = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
        order = (dim, *(i for i in range(3) if i != dim))
        rows, cols = w0.shape[dim], w0.numel() // w0.shape[dim]
        u = torch.nn.functional.normalize(torch.randn(rows, dtype=torch.float64), dim=0)
        v = torch.nn.functional.normalize(torch.randn(cols, dtype=torch.float64), dim=0)
        w = w0 / torch.vdot(u, torch.mv(w0.permute(order).flatten(1), v))
        d = torch.randn(6, *w0.shape, dtype=torch.float64)
        got = spectral_norm_grads(d, w0.detach(), u, v, dim)
        for i in range(6):
            (want,) = torch.autograd.grad(w, w0, d[i], retain_graph=True)
            torch.testing.assert_close(got[i], want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("old", [False, True], ids=["parametrization", "hook-based"])
@pytest.mark.parametrize("make, shape, dim", [
    (lambda: nn.Linear(5, 7), (3, 6, 5), None),
    (lambda: nn.Linear(5, 7, bias=False), (3, 5), None),
    (lambda: nn.Conv2d(5, 6, 3, padding=1, groups=1), (3, 5, 6, 6), None),
    (lambda: nn.Conv1d(5, 6, 3, padding=1), (3, 5, 8), 1),
], ids=["linear", "linear-2d-no-bias", "conv2d", "conv1d-dim1"])
def test_a_spectrally_normalised_layer_is_exact(old, make, shape, dim):
    """A discriminator's layers in training mode (the power iteration runs in the forward): exact against a float64
    loop that uses the same u and v (run in eval mode after the step, as the step left them)."""
    torch.manual_seed(0)
    _assert_exact_in_a_model(_spectral_norm(make(), dim, old), shape)


def test_monitoring_leaves_the_power_iteration_and_the_gradients_as_they_are():
    """Reading a parametrised weight forms it again, and spectral_norm's power iteration runs at each read in training
    mode: gapmon never reads it, so a monitored step leaves u, v and every gradient as an unmonitored one does."""
    import copy

    torch.manual_seed(0)
    plain = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(5, 6)), nn.Tanh(), nn.Linear(6, 2)).double()
    watched = copy.deepcopy(plain)
    x, y = torch.randn(4, 3, 5, dtype=torch.float64), torch.randn(4, 3, 2, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(watched, loss_reduction="sum", strict=True)
    for model in (plain, watched):
        _loss(model(x), y).backward()
    psn.local_norms()
    psn.close()
    for name, buffer in plain.named_buffers():
        assert torch.equal(buffer, watched.get_buffer(name)), name
    for (name, p), q in zip(plain.named_parameters(), watched.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("norm", ["weight_norm", "spectral_norm"])
@pytest.mark.parametrize("conv, shape, groups", [
    (nn.ConvTranspose1d, (3, 4, 7), 1),  # HiFi-GAN's upsampling: weight_norm(ConvTranspose1d(..., stride, padding))
    (nn.ConvTranspose1d, (3, 4, 7), 2),
    (nn.ConvTranspose2d, (3, 4, 5, 5), 1),
])
def test_a_reparametrised_transposed_convolution_is_exact(norm, conv, shape, groups):
    torch.manual_seed(0)
    layer = conv(4, 6, 4, stride=2, padding=1, groups=groups)
    layer = (nn.utils.parametrizations.weight_norm(layer) if norm == "weight_norm"
             else nn.utils.parametrizations.spectral_norm(layer))  # (spectral_norm's dim 1 for a transposed one)
    _assert_exact_in_a_model(layer, shape)
