"""Layers that subclass a covered layer but override its forward (timm's LayerNorm, LayerNorm2d and GroupNorm1; a LoRA
Linear is in test_norms_vs_reference) and leaf modules of a library's own (timm's Affine): their parameters are followed
through the ops that forward runs (gapmon.per_sample.free_parameters), exact against a float64 loop (one backward per
sample) where every use is one the batch tracking follows, left out by name where one is not."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import loop_per_sample_norms, norms_and_coverage

BOOKKEEPING = pytest.mark.parametrize("bookkeeping", [False, True], ids=["hooks", "bookkeeping"])


def _loss(out, t):
    return ((out - t) ** 2).flatten(1).sum(1).sum()


class FunctionalLayerNorm(nn.LayerNorm):
    """timm's LayerNorm: nn.LayerNorm's math through F.layer_norm, in a forward of its own."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class LayerNorm2d(nn.LayerNorm):
    """timm's and torchvision's LayerNorm2d: over the channels of [B, C, H, W], moved last and back."""

    def forward(self, x):
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias,
                            self.eps).permute(0, 3, 1, 2)


class FunctionalGroupNorm(nn.GroupNorm):
    """timm's GroupNorm: through F.group_norm."""

    def forward(self, x):
        return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


class GroupNorm1(FunctionalGroupNorm):
    """timm's GroupNorm1 (PoolFormer's norm): one group."""

    def __init__(self, channels):
        super().__init__(1, channels)


class FunctionalRMSNorm(nn.RMSNorm):
    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class Affine(nn.Module):
    """timm's Affine (ResMLP's norm): alpha ⊙ x + beta in one torch.addcmul."""

    def __init__(self, dim):
        super().__init__()
        self.alpha = nn.Parameter(1 + 0.3 * torch.randn(1, 1, dim))
        self.beta = nn.Parameter(0.3 * torch.randn(1, 1, dim))

    def forward(self, x):
        return torch.addcmul(self.beta, self.alpha, x)


class StandardisedConv2d(nn.Conv2d):
    """NF-Net's weight standardisation: the weight goes through a mean and a std before the convolution."""

    def forward(self, x):
        w = self.weight
        w = (w - w.mean((1, 2, 3), keepdim=True)) / (w.std((1, 2, 3), keepdim=True) + 1e-5)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


def _affine(norm):
    """The norm's weight and bias made different from their initial ones (ones, zeros), so a wrong form shows."""
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return norm


class Tokens(nn.Module):
    """A token model [B, T, d] with `norm` before and after an MLP."""

    def __init__(self, norm):
        super().__init__()
        self.inp, self.norm, self.mlp, self.head = nn.Linear(4, 6), _affine(norm(6)), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.head(h + self.mlp(torch.tanh(self.norm(h))))


class PoolMixer(nn.Module):
    """A PoolFormer block: norm, then pool(y) - y. pool(c) = c for a constant c, so the norm's bias gets a gradient
    that cancels to rounding noise in every sample; its weight's does not."""

    def __init__(self, norm):
        super().__init__()
        self.stem, self.norm, self.head = nn.Conv2d(3, 6, 3, padding=1), _affine(norm(6)), nn.Linear(6, 3)
        self.pool = nn.AvgPool2d(3, 1, 1, count_include_pad=False)

    def forward(self, x):
        h = self.stem(x)
        y = self.norm(h)
        h = h + self.pool(y) - y
        return self.head(h.mean((2, 3)))


def _norms(model, x, y, **kwargs):
    return norms_and_coverage(model, _loss, x, y, **kwargs)


@BOOKKEEPING
@pytest.mark.parametrize("norm", [FunctionalLayerNorm, FunctionalRMSNorm, Affine],
                         ids=["layer_norm", "rms_norm", "addcmul"])
def test_a_token_layer_with_its_own_forward_is_exact(norm, bookkeeping):
    torch.manual_seed(0)
    model = Tokens(norm).double()
    x, y = torch.randn(4, 5, 4, dtype=torch.float64), torch.randn(4, 5, 3, dtype=torch.float64)
    got, cov = _norms(model, x, y, strict=True, bookkeeping=bookkeeping)
    assert not cov["uncovered"] and {f"norm.{n}" for n, _ in model.norm.named_parameters()} <= set(cov["covered"])
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y), rtol=1e-10, atol=1e-12)


@BOOKKEEPING
@pytest.mark.parametrize("norm", [LayerNorm2d, GroupNorm1, lambda c: FunctionalGroupNorm(3, c), lambda c: nn.GroupNorm(2, c)],
                         ids=["layer_norm_2d", "group_norm_1", "group_norm_3", "torch_group_norm"])
def test_a_channel_norm_before_a_pool_mixer_is_exact(norm, bookkeeping):
    """The bias's gradient cancels in each sample: judged against its layer's weight's, as a ruled layer's are (it was
    refused, its relative difference ~1, when each free parameter was judged alone)."""
    torch.manual_seed(1)
    model = PoolMixer(norm).double()
    x, y = torch.randn(3, 3, 5, 5, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    got, cov = _norms(model, x, y, strict=True, bookkeeping=bookkeeping)
    assert not cov["uncovered"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y), rtol=1e-10, atol=1e-12)


@BOOKKEEPING
def test_a_weight_transformed_before_its_use_is_exact(bookkeeping):
    """Weight standardisation written out in a forward of its own (mean, std, a quotient): each op on the weight alone
    is followed through its vector-Jacobian product (followed_through) to the convolution that meets the batch."""
    torch.manual_seed(2)
    model = nn.Sequential(StandardisedConv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 9, 2)).double()
    x, y = torch.randn(3, 3, 5, 5, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    got, cov = _norms(model, x, y, strict=True, bookkeeping=bookkeeping)
    assert not cov["uncovered"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y), rtol=1e-10, atol=1e-12)


def test_a_bf16_layer_norm_with_its_own_forward_is_within_its_rounding():
    """A bfloat16 model: x̂ formed again from the bfloat16 input in float32, as the op's backward forms it; the use check
    allows bfloat16's rounding (no false refusal), and the norms agree with a float64 loop over the same weights."""
    torch.manual_seed(3)
    model = Tokens(FunctionalLayerNorm)
    x, y = torch.randn(4, 5, 4), torch.randn(4, 5, 3)
    got, cov = _norms(model.bfloat16(), x.bfloat16(), y.bfloat16(), strict=True)
    assert not cov["uncovered"]
    want = loop_per_sample_norms(model.double(), _loss, x.bfloat16().double(), y.bfloat16().double())
    torch.testing.assert_close(got.double(), want, rtol=5e-2, atol=0)
