"""Linear layers whose parent passes their parameters to F.linear itself, never calling them (torchvision's Swin,
timm's BEiT and EVA): followed outside their own forward (gapmon.per_sample.functional_layers), exact against a
float64 loop (one backward per sample), with and without book-keeping."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import Autocast, loop_per_sample_norms, micro_batch_norms, norms_and_coverage

import gapmon

BOOKKEEPING = pytest.mark.parametrize("bookkeeping", [False, True], ids=["hooks", "bookkeeping"])


def _loss(out, t):
    return ((out - t) ** 2).flatten(1).sum(1).sum()


class WindowAttention(nn.Module):
    """torchvision's Swin: the projections' weights handed to a function that runs attention in windows merged with the
    batch (`shifted_window_attention(x, self.qkv.weight, self.proj.weight, ..., qkv_bias=self.qkv.bias, ...)`)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj, self.head = nn.Linear(4, 12), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):  # [B, 2 windows · 3 tokens, 4]
        b = x.shape[0]
        windows = x.reshape(b * 2, 3, 4)
        q, k, v = F.linear(windows, self.qkv.weight, self.qkv.bias).reshape(b * 2, 3, 3, 2, 2).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b * 2, 3, 4)
        out = F.linear(out, self.proj.weight, self.proj.bias).reshape(b, 6, 4)
        return self.head(torch.tanh(out))


class SplitBiasAttention(nn.Module):
    """timm's BEiT and EVA: a query and a value bias of the attention's own, the key's a buffer of zeros, concatenated
    into the projection's bias (`F.linear(x, weight=self.qkv.weight, bias=torch.cat((q_bias, k_bias, v_bias)))`)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.head = nn.Linear(4, 12, bias=False), nn.Linear(4, 3)
        self.q_bias, self.v_bias = nn.Parameter(0.3 * torch.randn(4)), nn.Parameter(0.3 * torch.randn(4))
        self.register_buffer("k_bias", torch.zeros(4), persistent=False)

    def forward(self, x):  # [B, T, 4]
        b, t, _ = x.shape
        bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        q, k, v = F.linear(x, weight=self.qkv.weight, bias=bias).reshape(b, t, 3, 2, 2).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, 4)
        return self.head(out)


class ClearedBiasAttention(WindowAttention):
    """torchvision's Swin V2: the key's third of the projection's bias zeroed in place in a clone before F.linear
    (`qkv_bias = qkv_bias.clone(); qkv_bias[length:2 * length].zero_()`); `fill`: a number written there instead."""

    def __init__(self, fill=None):
        super().__init__()
        self.fill = fill

    def forward(self, x):
        b = x.shape[0]
        bias = self.qkv.bias.clone()
        part = bias[4:8]
        part.zero_() if self.fill is None else part.fill_(self.fill)
        windows = x.reshape(b * 2, 3, 4)
        q, k, v = F.linear(windows, self.qkv.weight, bias).reshape(b * 2, 3, 3, 2, 2).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b * 2, 3, 4)
        out = F.linear(out, self.proj.weight, self.proj.bias).reshape(b, 6, 4)
        return self.head(torch.tanh(out))


def _norms(model, x, y, **kwargs):
    return norms_and_coverage(model, _loss, x, y, **kwargs)


@BOOKKEEPING
@pytest.mark.parametrize("make", [WindowAttention, SplitBiasAttention, ClearedBiasAttention,
                                  lambda: ClearedBiasAttention(0.25)], ids=["swin", "beit", "swin-v2", "filled"])
def test_a_linear_used_only_through_its_parameters_is_exact(make, bookkeeping):
    torch.manual_seed(0)
    model = make().double()
    x, y = torch.randn(3, 6, 4, dtype=torch.float64), torch.randn(3, 6, 3, dtype=torch.float64)
    got, cov = _norms(model, x, y, strict=True, bookkeeping=bookkeeping)
    assert not cov["uncovered"] and "qkv.weight" in cov["covered"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y), rtol=1e-10, atol=1e-12)


def test_micro_batches_of_a_functional_layer_each_keep_their_own_samples():
    torch.manual_seed(1)
    model = WindowAttention().double()
    x, y = torch.randn(5, 6, 4, dtype=torch.float64), torch.randn(5, 6, 3, dtype=torch.float64)
    got = micro_batch_norms(model, _loss, x, y, (slice(0, 2), slice(2, 5)))
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y), rtol=1e-10, atol=1e-12)


def test_a_concatenation_of_parameters_and_constants_keeps_each_parameters_rows():
    """The buffer's rows are holes: the bias's gradient reaches each piece only where it sits, times its factor."""
    from gapmon.per_sample.batch_provenance import BatchTracker, Shared
    from gapmon.per_sample.free_parameters import ParameterUses

    torch.manual_seed(2)
    model = SplitBiasAttention().double()
    tracker, uses = BatchTracker(3), ParameterUses(3)
    uses.follow(model.q_bias, tracker, type("NoChecks", (), {"watch": lambda *args: None})(), "q_bias")
    with tracker:
        joined = torch.cat((model.q_bias, model.k_bias, model.q_bias * 2))
    status = tracker.status(joined)
    assert type(status) is Shared
    pieces = status.owner.pieces
    assert [p.positions.tolist() for p in pieces] == [[0, 1, 2, 3] + [4] * 8, [4] * 8 + [0, 1, 2, 3]]
    assert [p.factor for p in pieces] == [1.0, 2.0]


class Switching(nn.Module):
    """Calls its projection in one step and hands its weights to F.linear in another."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(4, 4), nn.Linear(4, 3)
        self.functional = False

    def forward(self, x):
        h = F.linear(x, self.proj.weight, self.proj.bias) if self.functional else self.proj(x)
        return self.head(torch.tanh(h))


def test_a_layer_called_once_then_used_through_its_parameters_is_left_out_by_name():
    """A layer whose forward ran is not followed outside it again (the layers models call cost nothing more per step):
    a later step's use through its parameters is found by the use check and the layer left out, the rest exact."""
    torch.manual_seed(3)
    model = Switching().double()
    x, y = torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 3, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=False)
    _loss(model(x), y).backward()
    first = psn.local_norms()
    psn.pause()
    torch.testing.assert_close(first, loop_per_sample_norms(model, _loss, x, y), rtol=1e-10, atol=1e-12)
    psn.start()
    model.functional = True
    _loss(model(x), y).backward()
    with pytest.warns(RuntimeWarning, match="layer 'proj' is not per-sample .*forward never ran"):
        got = psn.local_norms()
    cov = psn.coverage()
    psn.close()
    assert cov["skipped_layers"] == ["proj"]
    want = loop_per_sample_norms(model, _loss, x, y, params={"head.weight", "head.bias"})
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


class CausalConv(nn.Module):
    """Mamba's reference path: its Conv1d's weight, viewed [channels, width], passed to F.conv1d as a depthwise causal
    convolution (`F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=channels)[..., :L]`); `padding` as
    a string ("same"), which is not followed."""

    def __init__(self, padding=None):
        super().__init__()
        self.inp, self.conv, self.head = nn.Linear(4, 6), nn.Conv1d(6, 6, 3, groups=6, padding=2), nn.Linear(6, 3)
        self.padding = padding

    def forward(self, x):  # [B, L, 4]
        h = self.inp(x).transpose(1, 2)
        w = self.conv.weight.view(6, 3)
        padding = self.padding if self.padding is not None else 2
        h = F.conv1d(h, w.unsqueeze(1), self.conv.bias, padding=padding, groups=6)[..., :x.shape[1]]
        return self.head(F.silu(h).transpose(1, 2))


class StridedConv2d(nn.Module):
    """A Conv2d's weight and bias passed to F.conv2d with its own stride, padding, dilation and groups."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=1, groups=2), nn.Linear(6 * 3 * 3, 3)

    def forward(self, x):  # [B, 4, 6, 6]
        h = F.conv2d(x, self.conv.weight, self.conv.bias, stride=2, padding=1, dilation=1, groups=2)
        return self.head(torch.tanh(h).flatten(1))[:, None, :]


@BOOKKEEPING
@pytest.mark.parametrize("make, shape", [(CausalConv, (4, 7, 4)), (StridedConv2d, (4, 4, 6, 6))])
def test_a_convolution_used_only_through_its_parameters_is_exact(make, shape, bookkeeping):
    torch.manual_seed(0)
    model = make().double()
    x, y = torch.randn(*shape, dtype=torch.float64), torch.randn(shape[0], *((7, 3) if make is CausalConv else (1, 3)),
                                                                  dtype=torch.float64)
    got, cov = norms_and_coverage(model, _loss, x, y, bookkeeping=bookkeeping, strict=True)
    assert {"conv.weight", "conv.bias"} <= set(cov["covered"])
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y, params=set(cov["covered"])),
                               rtol=1e-10, atol=1e-12)


class DepthwiseConv(nn.Module):
    """A depthwise causal convolution of the input itself, its Conv1d's weight and bias passed to F.conv1d."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv1d(4, 4, 3, groups=4, padding=2), nn.Linear(4, 2)

    def forward(self, x):  # [B, L, 4]
        h = F.conv1d(x.transpose(1, 2), self.conv.weight, self.conv.bias, padding=2, groups=4)[..., :x.shape[1]]
        return self.head(h.transpose(1, 2))


def test_a_convolution_used_through_its_parameters_under_bf16_autocast_is_not_refused():
    """Under bf16 autocast F.conv1d's output, and so its bias's gradient, is bf16: each sample's bias gradient (its
    output gradient summed over the positions, in float32) differs from autograd's bf16 sum by bf16's rounding, which
    the use check allows (it took float32's tolerance and refused the layer). Close to a float64 loop, to bf16's
    rounding."""
    torch.manual_seed(0)
    model = DepthwiseConv()
    x, y = 3 * torch.randn(6, 16, 4), torch.randn(6, 16, 2)
    got, cov = norms_and_coverage(Autocast(model, "cpu"), _loss, x, y, strict=True)
    assert {"model.conv.weight", "model.conv.bias"} <= set(cov["covered"]) and not cov["uncovered"]
    torch.testing.assert_close(got.double(), loop_per_sample_norms(model, _loss, x, y), rtol=5e-2, atol=0)


def test_a_convolution_with_padding_named_by_a_string_is_left_out_by_name():
    torch.manual_seed(0)
    model = CausalConv(padding="same").double()
    x, y = torch.randn(4, 7, 4, dtype=torch.float64), torch.randn(4, 7, 3, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="layer 'conv' is not per-sample"):
        got, cov = norms_and_coverage(model, _loss, x, y)
    assert "conv.weight" in cov["uncovered"] and "inp.weight" in cov["covered"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y, params=set(cov["covered"])),
                               rtol=1e-10, atol=1e-12)
