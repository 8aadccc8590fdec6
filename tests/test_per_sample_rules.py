"""Per-sample norms are exact or refused: frozen parameters, modules called twice, embeddings that
scale by frequency, modules that bypass their submodules, the batch dimension, and the layer rules
that Opacus users expect (Conv, GroupNorm, InstanceNorm). References: a float64 loop over samples."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gapmon
from helpers import loop_per_sample_norms


def _sq_loss(out, t):
    return ((out - t) ** 2).flatten(1).sum(1).mean()


def _check(model, x, y, loss=_sq_loss, **kwargs):
    """Norms of the float64 model against the loop reference over the covered parameters."""
    model = model.double()
    x = x.double() if x.is_floating_point() else x
    y = y.double() if y.is_floating_point() else y
    psn = gapmon.PerSampleGradNorms(model, **kwargs)
    loss(model(x), y).backward()
    got = psn.local_norms()
    cov = psn.coverage()
    want = loop_per_sample_norms(model, loss, x, y, params=set(cov["covered"]))
    assert got.dtype == torch.float64 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    psn.close()
    return cov


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3))


@pytest.mark.parametrize("frozen", ["0.weight", "0.bias", "1.weight", "1.bias", "0.weight,3.weight"])
def test_frozen_parameters_count_only_trainable(frozen):
    model = _mlp()
    for name, p in model.named_parameters():
        if name in frozen.split(","):
            p.requires_grad_(False)
    x, y = torch.randn(5, 4, 8), torch.randn(5, 4, 3)
    cov = _check(model, x, y, strict=True)
    assert not set(frozen.split(",")) & set(cov["covered"])


def test_bias_only_linear_matches_the_repro():
    lin = nn.Linear(8, 4).double()
    lin.weight.requires_grad_(False)
    _check(lin, torch.randn(6, 8), torch.randn(6, 4), strict=True)


class _Reused(nn.Module):
    """The same Linear, LayerNorm and Embedding called several times in one forward pass."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.lin = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 2)

    def forward(self, ids):
        h = self.emb(ids) + self.emb(ids.flip(1))
        h = self.lin(torch.tanh(self.lin(h)))
        for _ in range(3):  # a shared block applied in a loop
            h = h + torch.tanh(self.lin(self.norm(h)))
        return self.head(h)


def test_module_called_several_times_is_exact():
    torch.manual_seed(0)
    ids, y = torch.randint(0, 10, (4, 5)), torch.randn(4, 5, 2)
    _check(_Reused(), ids, y, strict=True)


def test_call_without_gradient_adds_nothing():
    class Partial(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            unused = self.lin(x)  # noqa: F841  (its output never reaches the loss)
            return self.lin(torch.tanh(x))

    torch.manual_seed(0)
    _check(Partial(), torch.randn(5, 4), torch.randn(5, 4), strict=True)


def test_embedding_scale_grad_by_freq_is_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 4, scale_grad_by_freq=True, padding_idx=0), nn.Linear(4, 2))
    ids = torch.tensor([[1, 1, 1, 2, 0], [3, 4, 3, 3, 5], [0, 0, 2, 2, 2]])
    _check(model, ids, torch.randn(3, 5, 2), strict=True)


def test_multihead_attention_is_uncovered_not_wrong():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    with pytest.warns(RuntimeWarning, match="MultiheadAttention"):
        cov = _check(layer, torch.randn(3, 5, 8), torch.randn(3, 5, 8))
    assert {"self_attn.in_proj_weight", "self_attn.out_proj.weight", "self_attn.out_proj.bias"} <= set(cov["uncovered"])
    assert not any(name.startswith("self_attn") for name in cov["covered"])
    assert "linear1.weight" in cov["covered"] and "norm1.weight" in cov["covered"]
    with pytest.raises(ValueError, match="MultiheadAttention"):
        gapmon.PerSampleGradNorms(nn.MultiheadAttention(8, 2), strict=True)


class _NanoGPT(nn.Module):
    """Position ids of shape [T] (shared by every sample), as nanoGPT writes them."""

    def __init__(self, t):
        super().__init__()
        self.tok = nn.Embedding(11, 6)
        self.pos = nn.Embedding(t, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, idx):
        return self.head(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))


@pytest.mark.parametrize("b, t", [(4, 4), (3, 7)])
def test_position_ids_without_batch_dim_are_not_per_sample(b, t):
    torch.manual_seed(0)
    idx, y = torch.randint(0, 11, (b, t)), torch.randn(b, t, 3)
    with pytest.warns(RuntimeWarning, match="'pos'"):
        cov = _check(_NanoGPT(t), idx, y)
    assert cov["skipped_layers"] == ["pos"] and "pos.weight" in cov["uncovered"]
    assert set(cov["covered"]) == {"tok.weight", "head.weight", "head.bias"}
    with pytest.raises(RuntimeError, match="'pos'"):
        _check(_NanoGPT(t), idx, y, strict=True)


def test_batch_size_comes_from_the_model_input_even_if_the_first_layer_differs():
    class SharedFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.query = nn.Embedding(7, 4)  # called first, on ids of shape [7]
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            q = self.query(torch.arange(7)).mean(0)
            return self.lin(x + q)

    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match="'query'"):
        cov = _check(SharedFirst(), torch.randn(5, 4), torch.randn(5, 4))
    assert set(cov["covered"]) == {"lin.weight", "lin.bias"}


@pytest.mark.parametrize("conv, shape", [
    (lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1), (3, 4, 11)),
    (lambda: nn.Conv1d(4, 6, 3, dilation=2, groups=2, padding="same"), (3, 4, 9)),
    (lambda: nn.Conv2d(3, 4, (3, 2), stride=(1, 2), padding=(1, 0)), (2, 3, 6, 7)),
    (lambda: nn.Conv2d(4, 4, 3, groups=4, bias=False), (3, 4, 5, 5)),
    (lambda: nn.Conv3d(2, 3, 2, stride=(1, 2, 1)), (2, 2, 4, 5, 3)),
])
def test_convolutions_are_exact(conv, shape):
    torch.manual_seed(0)
    layer = conv()
    x = torch.randn(*shape)
    y = torch.randn_like(layer(x))
    _check(layer, x, y, strict=True)


@pytest.mark.parametrize("norm, shape", [
    (lambda: nn.GroupNorm(2, 4), (3, 4, 5)),
    (lambda: nn.GroupNorm(2, 6), (3, 6, 4, 3)),
    (lambda: nn.InstanceNorm1d(4, affine=True), (3, 4, 6)),
    (lambda: nn.InstanceNorm2d(3, affine=True), (2, 3, 4, 5)),
])
def test_group_and_instance_norm_are_exact(norm, shape):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(shape[1], shape[1], 1) if len(shape) == 3 else nn.Conv2d(shape[1], shape[1], 1),
                          norm())
    x = torch.randn(*shape)
    _check(model, x, torch.randn_like(x), strict=True)


def test_cnn_classifier_end_to_end():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2),
                          nn.Flatten(), nn.Linear(4 * 2 * 2, 3))
    x, y = torch.randn(5, 1, 8, 8), torch.randint(0, 3, (5,))
    _check(model, x, y, loss=lambda out, t: F.cross_entropy(out, t), strict=True)


def test_float32_inputs_give_float32_norms():
    model = _mlp()
    psn = gapmon.PerSampleGradNorms(model)
    _sq_loss(model(torch.randn(3, 8)), torch.randn(3, 3)).backward()
    assert psn.local_norms().dtype == torch.float32
