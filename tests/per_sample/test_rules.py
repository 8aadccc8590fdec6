"""Per-sample norms are exact or refused: frozen parameters, modules called twice, embeddings that
scale by frequency, modules that bypass their submodules, the batch dimension, and the layer rules
that Opacus users expect (Conv, GroupNorm, InstanceNorm). References: a float64 loop over samples."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import loop_per_sample_norms

import gapmon
from gapmon.per_sample.rules import register_norm_rule


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


def test_transformer_encoder_layer_is_fully_covered_and_exact():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    cov = _check(layer, torch.randn(3, 5, 8), torch.randn(3, 5, 8), strict=True)
    assert {"self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight"} <= set(cov["covered"])
    assert cov["uncovered_numel"] == 0


class _Attention(nn.Module):
    """MultiheadAttention with masks derived from the input, self- or cross-attention, either layout."""

    def __init__(self, batch_first=True, cross=False, masks=False, causal=False, twice=False):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=batch_first)
        self.memory = nn.Linear(8, 8)
        self.batch_first, self.cross, self.masks, self.causal, self.twice = batch_first, cross, masks, causal, twice

    def forward(self, x):
        kv = self.memory(x[:, :3]) if self.cross else x
        kwargs = {}
        if self.masks:
            kwargs["key_padding_mask"] = kv[..., 0] > 1.0  # True: ignored (never a whole row here)
            kwargs["key_padding_mask"][:, 0] = False
        if self.causal:
            kwargs["attn_mask"] = torch.ones(x.shape[1], kv.shape[1], dtype=torch.bool).triu(1)
        elif self.masks:
            kwargs["attn_mask"] = torch.randn(x.shape[1], kv.shape[1], generator=torch.Generator().manual_seed(1))
            kwargs["attn_mask"] = kwargs["attn_mask"].to(x.dtype)
        q, k = (x, kv) if self.batch_first else (x.transpose(0, 1), kv.transpose(0, 1))
        out = self.mha(q, k, k, **kwargs)[0]
        if self.twice:
            out = self.mha(out, out, out)[0]
        return out if self.batch_first else out.transpose(0, 1)


@pytest.mark.parametrize("kwargs", [{}, {"batch_first": False}, {"cross": True, "masks": True}, {"causal": True},
                                    {"masks": True, "batch_first": False}, {"twice": True}])
def test_multihead_attention_is_exact(kwargs):
    torch.manual_seed(0)
    cov = _check(_Attention(**kwargs), torch.randn(3, 5, 8), torch.randn(3, 5, 8), strict=True)
    assert "mha.out_proj.weight" in cov["covered"] and "mha.in_proj_weight" in cov["covered"]


def test_multihead_attention_with_frozen_in_proj_and_dropout():
    torch.manual_seed(0)
    model = _Attention()
    model.mha.in_proj_weight.requires_grad_(False)
    cov = _check(model, torch.randn(3, 5, 8), torch.randn(3, 5, 8), strict=True)
    assert "mha.in_proj_weight" not in cov["covered"] and "mha.in_proj_bias" in cov["covered"]
    # Attention dropout is off in eval mode: covered and exact (in training mode it is refused when it runs:
    # test_norms_vs_reference.test_multihead_attention_dropout_in_training_is_refused_by_name).
    model = _Attention()
    model.mha.dropout = 0.1
    model.eval()
    cov = _check(model, torch.randn(3, 5, 8), torch.randn(3, 5, 8), strict=True)
    assert "mha.in_proj_weight" in cov["covered"]


class _Bags(nn.Module):
    """EmbeddingBag over [B, L] ids (-1 marks an unused slot), as 2-D bags or as 1-D ids + offsets."""

    def __init__(self, flat, weighted=False, last_offset=False, **bag_kwargs):
        super().__init__()
        self.bag = nn.EmbeddingBag(9, 4, include_last_offset=last_offset, **bag_kwargs)
        self.head = nn.Linear(4, 2)
        self.flat, self.weighted, self.last_offset = flat, weighted, last_offset

    def forward(self, x):
        ids = x.clamp(min=0)
        weights = (ids.to(torch.get_default_dtype()) + 1) / 7 if self.weighted else None
        if not self.flat:
            out = self.bag(ids, per_sample_weights=None if weights is None else weights.to(self.head.weight.dtype))
            return self.head(out)
        keep = x >= 0
        lengths = keep.sum(1)
        offsets = torch.cat((lengths.new_zeros(1), lengths.cumsum(0)[:-1]))
        if self.last_offset:
            offsets = torch.cat((offsets, lengths.sum().reshape(1)))
        flat_weights = None if weights is None else weights[keep].to(self.head.weight.dtype)
        return self.head(self.bag(ids[keep], offsets, per_sample_weights=flat_weights))


@pytest.mark.parametrize("flat, kwargs", [
    (False, {"mode": "sum"}), (False, {"mode": "mean"}), (False, {"mode": "sum", "weighted": True}),
    (False, {"mode": "mean", "padding_idx": 2}),
    (True, {"mode": "sum"}), (True, {"mode": "mean", "last_offset": True}), (True, {"mode": "sum", "weighted": True}),
    (True, {"mode": "mean", "padding_idx": 2}),
])
def test_embedding_bag_is_exact(flat, kwargs):
    torch.manual_seed(0)
    x = torch.tensor([[1, 2, 2, 5, 2], [3, 3, -1, -1, -1], [8, 0, 2, 7, -1], [4, -1, -1, -1, -1]])
    if not flat:
        x = x.clamp(min=0)
    cov = _check(_Bags(flat, **kwargs), x, torch.randn(4, 2), strict=True)
    assert "bag.weight" in cov["covered"]


@pytest.mark.parametrize("kwargs, why", [({"mode": "max"}, "max"), ({"scale_grad_by_freq": True}, "scale_grad_by_freq")])
def test_embedding_bag_max_mode_and_frequency_scaling_are_uncovered(kwargs, why):
    with pytest.warns(RuntimeWarning, match=why):
        cov = gapmon.PerSampleGradNorms(nn.EmbeddingBag(5, 3, **kwargs)).coverage()
    assert cov["uncovered"] == {"weight": 15}


def test_module_reused_under_two_names_is_exact():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    model = nn.Sequential(block, block, nn.Linear(4, 2))  # one block object, registered twice
    _check(model, torch.randn(5, 4), torch.randn(5, 2), strict=True)


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
def test_position_ids_without_batch_dim_are_followed_to_the_batch(b, t):
    """nanoGPT's positions [T]: every sample shares them; their embedding's output joins the batch in an add, where
    its per-sample gradient is read (T == B too: the add's broadcast says which dim is the batch)."""
    torch.manual_seed(0)
    idx, y = torch.randint(0, 11, (b, t)), torch.randn(b, t, 3)
    cov = _check(_NanoGPT(t), idx, y, strict=True)
    assert set(cov["covered"]) == {"tok.weight", "pos.weight", "head.weight", "head.bias"}


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
    # (the mean over the shared rows, unbatched, is followed through its own vector-Jacobian product: `query` exact too)
    cov = _check(SharedFirst(), torch.randn(5, 4), torch.randn(5, 4), strict=True)
    assert set(cov["covered"]) == {"query.weight", "lin.weight", "lin.bias"}


@pytest.mark.parametrize("conv, shape", [
    (lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1), (3, 4, 11)),
    (lambda: nn.Conv1d(4, 6, 3, dilation=2, groups=2, padding="same"), (3, 4, 9)),
    (lambda: nn.Conv2d(3, 4, (3, 2), stride=(1, 2), padding=(1, 0)), (2, 3, 6, 7)),
    (lambda: nn.Conv2d(4, 4, 3, groups=4, bias=False), (3, 4, 5, 5)),
    (lambda: nn.Conv3d(2, 3, 2, stride=(1, 2, 1)), (2, 2, 4, 5, 3)),
    # padding modes other than zeros: the patches are cut from the input padded as the layer's forward pads it
    (lambda: nn.Conv1d(4, 6, 3, padding=2, dilation=2, padding_mode="circular"), (3, 4, 9)),
    (lambda: nn.Conv2d(3, 4, 3, padding=(1, 2), stride=2, padding_mode="reflect"), (2, 3, 6, 7)),
    (lambda: nn.Conv2d(4, 4, 3, padding="same", groups=2, padding_mode="replicate"), (3, 4, 5, 5)),
    (lambda: nn.Conv3d(2, 3, 3, padding=1, padding_mode="circular"), (2, 2, 4, 5, 3)),
    (lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1), (3, 4, 7)),
    (lambda: nn.ConvTranspose1d(4, 6, 3, dilation=2, groups=2), (3, 4, 5)),
    (lambda: nn.ConvTranspose2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 0)), (2, 3, 4, 5)),
    (lambda: nn.ConvTranspose2d(4, 8, 3, stride=2, groups=4, bias=False, output_padding=1), (3, 4, 3, 3)),
    (lambda: nn.ConvTranspose3d(2, 3, 2, stride=(1, 2, 1), dilation=(1, 1, 2)), (2, 2, 3, 2, 3)),
    # output_padding ≥ stride (allowed below the dilation): the output gradient has patch positions no input reads
    (lambda: nn.ConvTranspose1d(4, 6, 3, dilation=2, output_padding=1), (3, 4, 4)),
    (lambda: nn.ConvTranspose2d(4, 6, 3, dilation=2, padding=1, output_padding=1, groups=2), (3, 4, 4, 3)),
    (lambda: nn.ConvTranspose3d(2, 3, 3, stride=(1, 2, 1), dilation=2, output_padding=(1, 1, 1)), (2, 2, 3, 2, 3)),
])
def test_convolutions_and_transposed_convolutions_are_exact(conv, shape):
    torch.manual_seed(0)
    layer = conv()
    x = torch.randn(*shape)
    y = torch.randn_like(layer(x))
    _check(layer, x, y, strict=True)


class _HFConv1D(nn.Module):
    """Hugging Face's Conv1D as transformers 5 writes it (matched by its qualified name, so it is named so here): a
    Linear with its weight stored [nx, nf], whose forward merges the rows into one dim for addmm."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


_HFConv1D.__module__, _HFConv1D.__qualname__ = "transformers.pytorch_utils", "Conv1D"


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("bookkeeping", [False, True], ids=["hooks", "bookkeeping"])
@pytest.mark.parametrize("positions, width", [(5, 6), (2, 16)], ids=["direct-form", "ghost-form"])
def test_hugging_face_conv1d_is_a_transposed_linear(batch, bookkeeping, positions, width):
    """Its rows are merged and split inside the layer: the layers after it still see the batch (a LayerNorm, a second
    Conv1D), and each is exact (the ghost form's use check sketches the stored [nx, nf] layout)."""
    torch.manual_seed(0)
    model = nn.Sequential(_HFConv1D(width, 4), nn.LayerNorm(width), nn.Tanh(), _HFConv1D(3, width))
    x = torch.randn(batch, positions, 4)
    cov = _check(model, x, torch.randn(batch, positions, 3), strict=True, bookkeeping=bookkeeping)
    assert set(cov["covered"]) == {"0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"}


@pytest.mark.parametrize("stride, dilation, output_size", [(2, 1, (9, 7)), (2, 1, (10, 8)), (2, 1, (9, 8))])
def test_a_transposed_convolution_called_with_output_size_is_exact(stride, dilation, output_size):
    """forward(x, output_size) picks the output padding per call: the rows it adds pair with no input position."""
    class Up(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.ConvTranspose2d(3, 4, 3, stride=stride, dilation=dilation, padding=1)

        def forward(self, x):
            return self.up(x, output_size=output_size)

    torch.manual_seed(0)
    x = torch.randn(3, 3, 5, 4)
    _check(Up(), x, torch.randn(3, 4, *output_size), strict=True)


@pytest.mark.parametrize("norm", [lambda: nn.LayerNorm((5, 6)), lambda: nn.LayerNorm((5, 6), bias=False),
                                  lambda: nn.RMSNorm((5, 6))], ids=["layernorm", "layernorm-no-bias", "rmsnorm"])
def test_a_norm_over_several_trailing_dims_is_exact(norm):
    """normalized_shape of two dims: a [5, 6] weight, whose sums the use check sketches in its shape."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), norm())
    x = torch.randn(3, 5, 6)
    cov = _check(model, x, torch.randn(3, 5, 6), strict=True)
    assert "1.weight" in cov["covered"]


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


def test_a_decoder_of_convolutions_and_transposed_convolutions_end_to_end():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, stride=2, padding=1), nn.ReLU(),
                          nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, output_padding=1), nn.Tanh(),
                          nn.ConvTranspose2d(2, 1, 3, padding=1))
    x = torch.randn(4, 1, 8, 8)
    _check(model, x, torch.randn_like(x), strict=True)


class _StdConv2d(nn.Conv2d):
    """timm's StdConv2d (BiT's ResNetV2): the weight standardised per output channel by F.batch_norm, then used."""

    def __init__(self, *args, eps=1e-6, **kwargs):
        super().__init__(*args, **kwargs)
        self.eps = eps

    def standardised(self, weight=None):
        return F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, weight=weight, training=True,
                            momentum=0.0, eps=self.eps).reshape_as(self.weight)

    def forward(self, x):
        return F.conv2d(x, self.standardised(), self.bias, self.stride, self.padding, self.dilation, self.groups)


class _ScaledStdConv2d(_StdConv2d):
    """timm's ScaledStdConv2d (NF-Nets): times gain · gamma / sqrt(fan-in), gain a parameter per output channel."""

    def __init__(self, *args, gamma=1.7, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = gamma * self.weight[0].numel() ** -0.5
        self.gain = nn.Parameter(1 + 0.3 * torch.randn(self.out_channels, 1, 1, 1))

    def forward(self, x):
        weight = self.standardised((self.gain * self.scale).view(-1))
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


@pytest.mark.parametrize("kind", [_StdConv2d, _ScaledStdConv2d], ids=["std", "scaled"])
@pytest.mark.parametrize("groups, bias, stride", [(1, True, 1), (2, False, 2), (4, True, 1)])
def test_weight_standardised_convolutions_are_exact(kind, groups, bias, stride):
    """Registered (as timm's StdConv2d and ScaledStdConv2d are, by name) with the standardising rule: each sample's
    gradient of the standardised weight goes back through the standardisation; with the rule of a plain Conv2d the
    norms would be those of the standardised weight's gradient, which the use check refuses."""
    from gapmon.per_sample.rules import StandardisedConvRule
    from gapmon.per_sample.rules.base import registered_rules

    register_norm_rule(kind)(StandardisedConvRule)
    assert {"timm.layers.std_conv.StdConv2d", "timm.layers.std_conv.ScaledStdConv2d"} <= set(registered_rules())
    torch.manual_seed(0)
    model = nn.Sequential(kind(4, 8, 3, stride=stride, padding=1, groups=groups, bias=bias), nn.GELU(),
                          nn.Flatten(), nn.LazyLinear(3))
    x = torch.randn(3, 4, 5, 5)
    model(x)  # (the lazy head takes its shape)
    cov = _check(model, x, torch.randn(3, 3), strict=True)
    assert set(cov["covered"]) == {n for n, _ in model.named_parameters()}


def test_a_weight_standardised_convolution_in_float32_is_within_its_rounding():
    from gapmon.per_sample.rules import StandardisedConvRule

    register_norm_rule(_ScaledStdConv2d)(StandardisedConvRule)
    torch.manual_seed(1)
    model = nn.Sequential(_ScaledStdConv2d(3, 6, 3), nn.Tanh(), nn.Flatten(), nn.Linear(6 * 9, 2))
    x, y = torch.randn(4, 3, 5, 5), torch.randn(4, 2)
    psn = gapmon.PerSampleGradNorms(model, strict=True)
    _sq_loss(model(x), y).backward()
    got = psn.local_norms()
    psn.close()
    want = loop_per_sample_norms(model.double(), _sq_loss, x.double(), y.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=0)


class _Recurrent(nn.Module):
    """A recurrent layer and a Linear head; the loss reads the sequence and the final states."""

    def __init__(self, kind, batch_first, **kwargs):
        super().__init__()
        self.batch_first = batch_first
        self.rnn = getattr(nn, kind)(4, 5, batch_first=batch_first, **kwargs)
        dirs = 2 if kwargs.get("bidirectional") else 1
        self.head = nn.Linear((kwargs.get("proj_size") or 5) * dirs, 3)

    def forward(self, x):
        out, state = self.rnn(x)
        h = state[0] if isinstance(state, tuple) else state
        last = h[-1]  # [B, H]: the last layer's final state (of its last direction)
        extra = (state[1][-1].sum(-1) if isinstance(state, tuple) else 0.0)  # an LSTM's cell state too
        seq = out if self.batch_first else out.transpose(0, 1)
        return self.head(seq).mean(1) + last.sum(-1, keepdim=True) + torch.as_tensor(extra).reshape(-1, 1)


@pytest.mark.parametrize("kind", ["RNN", "LSTM", "GRU"])
@pytest.mark.parametrize("batch_first, kwargs", [
    (True, {}), (False, {"num_layers": 2}), (True, {"bidirectional": True, "bias": False}),
    (False, {"num_layers": 2, "bidirectional": True}),
    # an LSTM that projects its state (weight_hr), with the final c read by the loss too
    (True, {"proj_size": 2}), (False, {"proj_size": 3, "num_layers": 2, "bidirectional": True, "bias": False}),
])
def test_recurrent_layers_are_exact(kind, batch_first, kwargs):
    if kwargs.get("proj_size") and kind != "LSTM":
        pytest.skip("proj_size is an LSTM's")
    if kind == "RNN":
        kwargs = {**kwargs, "nonlinearity": "relu"} if kwargs.get("bias") is False else kwargs
    torch.manual_seed(0)
    model = _Recurrent(kind, batch_first, **kwargs)
    x = torch.randn(3, 6, 4) if batch_first else torch.randn(6, 3, 4)
    batch_dim = 0 if batch_first else 1
    model = model.double()
    psn = gapmon.PerSampleGradNorms(model, strict=True, batch_dim=batch_dim, loss_reduction="sum")
    y = torch.randn(3, 3, dtype=torch.float64)
    (model(x.double()) - y).square().sum().backward()
    got = psn.local_norms()
    want = []
    for i in range(3):
        model.zero_grad()
        xi = x[i:i + 1] if batch_first else x[:, i:i + 1]
        (model(xi.double()) - y[i:i + 1]).square().sum().backward()
        want.append(float(sum(p.grad.square().sum() for p in model.parameters())) ** 0.5)
    assert set(psn.coverage()["covered"]) == {n for n, _ in model.named_parameters()}
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    psn.close()


class _RowsAndColumns(nn.Module):
    """Sequencer's mixer: recurrent layers over an image's columns and rows, each a sequence of its own, the batch
    merged with the other axis ([B·W, H, C] batch first, or [H, B·W, C]); with `initial`, a state from the batch, merged
    the same way."""

    def __init__(self, kind, batch_first, initial, **kwargs):
        super().__init__()
        self.batch_first, self.initial = batch_first, initial
        self.rows = getattr(nn, kind)(4, 5, batch_first=batch_first, **kwargs)
        self.cols = getattr(nn, kind)(4, 5, batch_first=batch_first, **kwargs)
        self.state = nn.Linear(4, 5 * (2 if kwargs.get("bidirectional") else 1) * kwargs.get("num_layers", 1))
        self.head = nn.Linear(5 * (4 if kwargs.get("bidirectional") else 2), 3)

    def _run(self, rnn, seqs):  # seqs [B·R, L, C]
        x = seqs if self.batch_first else seqs.transpose(0, 1)
        h0 = None
        if self.initial:
            h0 = self.state(seqs.mean(1)).reshape(seqs.shape[0], -1, 5).transpose(0, 1).contiguous()
            h0 = (h0, torch.zeros_like(h0)) if isinstance(rnn, nn.LSTM) else h0
        out = rnn(x, h0)[0]
        return out if self.batch_first else out.transpose(0, 1)

    def forward(self, x):  # [B, H, W, C]
        b, h, w, c = x.shape
        cols = self._run(self.cols, x.permute(0, 2, 1, 3).reshape(-1, h, c)).reshape(b, w, h, -1).permute(0, 2, 1, 3)
        rows = self._run(self.rows, x.reshape(-1, w, c)).reshape(b, h, w, -1)
        return self.head(torch.cat([cols, rows], -1)).mean((1, 2))


@pytest.mark.parametrize("kind", ["RNN", "LSTM", "GRU"])
@pytest.mark.parametrize("batch_first, initial, kwargs", [
    (True, False, {}), (False, False, {"num_layers": 2}), (True, True, {"bidirectional": True}),
    (False, True, {"num_layers": 2, "bidirectional": True, "bias": False})])
def test_recurrent_layers_over_rows_merged_with_the_batch_are_exact(kind, batch_first, initial, kwargs):
    torch.manual_seed(0)
    model = _RowsAndColumns(kind, batch_first, initial, **kwargs)
    cov = _check(model, torch.randn(3, 2, 3, 4), torch.randn(3, 3), strict=True)
    assert set(cov["covered"]) == {n for n, _ in model.named_parameters()}


def test_recurrent_layers_refuse_what_they_cannot_replay():
    lstm = nn.LSTM(4, 5, num_layers=2, dropout=0.5)
    psn = gapmon.PerSampleGradNorms(lstm, batch_dim=1)
    with pytest.warns(RuntimeWarning, match="dropout"):
        lstm(torch.randn(6, 3, 4))[0].sum().backward()
    psn.close()

    class Packed(nn.Module):  # packs its padded batch: the GRU's time steps interleave the samples
        def __init__(self):
            super().__init__()
            self.gru = nn.GRU(4, 5, batch_first=True)

        def forward(self, x):
            packed = nn.utils.rnn.pack_padded_sequence(x, [6, 4, 2], batch_first=True)
            return nn.utils.rnn.pad_packed_sequence(self.gru(packed)[0], batch_first=True)[0]

    model = Packed()
    psn = gapmon.PerSampleGradNorms(model)
    with pytest.warns(RuntimeWarning, match="'gru' is not per-sample.*packed"):
        model(torch.randn(3, 6, 4)).sum().backward()
    assert psn.local_norms().tolist() == [0.0, 0.0, 0.0]


class _CellLoop(nn.Module):
    """A recurrent cell run over the steps of [B, T, 4] by a Python loop, from zeros or from an initial state computed
    from the batch; the loss reads every step's h and, for an LSTM cell, the last c as well."""

    def __init__(self, kind, bias, initial):
        super().__init__()
        extra = {"nonlinearity": "relu"} if kind == "RNNCell" and not bias else {}
        self.cell = getattr(nn, kind)(4, 5, bias=bias, **extra)
        self.init = nn.Linear(4, 5) if initial else None
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        state = None
        if self.init is not None:
            h0 = self.init(x[:, 0])
            state = (h0, h0.tanh()) if isinstance(self.cell, nn.LSTMCell) else h0
        hs = []
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
            hs.append(state[0] if isinstance(state, tuple) else state)
        last_c = state[1].sum(-1, keepdim=True) if isinstance(state, tuple) else 0.0
        return self.head(torch.stack(hs, 1)).mean(1) + last_c


@pytest.mark.parametrize("kind", ["RNNCell", "LSTMCell", "GRUCell"])
@pytest.mark.parametrize("bias, initial, steps", [(True, False, 4), (False, True, 3), (True, True, 1)])
@pytest.mark.parametrize("bookkeeping", [False, True], ids=["hooks", "bookkeeping"])
def test_recurrent_cells_looped_over_time_are_exact(kind, bias, initial, steps, bookkeeping):
    torch.manual_seed(0)
    model = _CellLoop(kind, bias, initial)
    cov = _check(model, torch.randn(3, steps, 4), torch.randn(3, 3), strict=True, bookkeeping=bookkeeping)
    assert set(cov["covered"]) == {n for n, _ in model.named_parameters()}


def test_an_lstm_cell_whose_graph_is_not_the_expected_one_is_refused(monkeypatch):
    """The LSTM cell's rule reads c''s gradient as the graph torch builds on the device gives it (with h''s part on
    the CPU, without it where the cell is one fused op); a graph of the other kind is refused, not counted twice."""
    from gapmon.per_sample.rules import recurrent

    monkeypatch.setattr(recurrent, "_fused_lstm_cell", lambda x: True)
    model = _CellLoop("LSTMCell", True, False)
    psn = gapmon.PerSampleGradNorms(model)
    with pytest.warns(RuntimeWarning, match="'cell' is not per-sample.*autograd graph"):
        model(torch.randn(3, 2, 4)).sum().backward()
    assert "cell.weight_ih" in psn.coverage()["uncovered"]
    psn.close()


class _TwoInputs(nn.Module):
    """nn.Bilinear on two inputs of one batch: a projection of x, and x."""

    def __init__(self, seq, bias):
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.bil = nn.Bilinear(3, 4, 2, bias=bias)
        self.seq = seq

    def forward(self, x):
        return self.bil(torch.tanh(self.proj(x)), x)


@pytest.mark.parametrize("seq, bias", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("bookkeeping", [False, True], ids=["hooks", "bookkeeping"])
def test_bilinear_is_exact(seq, bias, bookkeeping):
    torch.manual_seed(0)
    model = _TwoInputs(seq, bias)
    x = torch.randn(3, 5, 4) if seq else torch.randn(3, 4)
    cov = _check(model, x, torch.randn(*x.shape[:-1], 2), strict=True, bookkeeping=bookkeeping)
    assert set(cov["covered"]) == {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize("channels, shape", [(1, (3, 5)), (4, (3, 4)), (4, (3, 4, 6, 5)), (1, (3, 4, 6))])
def test_prelu_is_exact_and_a_reused_one_too(channels, shape):
    """One weight or one per channel (dim 1), on [B, C] and on feature maps; the second model calls it twice (its
    per-sample gradient is the sum over both calls)."""
    torch.manual_seed(0)
    width = shape[1]
    act = nn.PReLU(channels, init=0.3)
    model = nn.Sequential(nn.Linear(width, width) if len(shape) == 2 else nn.Conv1d(width, width, 1) if len(shape) == 3
                          else nn.Conv2d(width, width, 1), act)
    x = torch.randn(*shape)
    cov = _check(model, x, torch.randn(*shape), strict=True)
    assert "1.weight" in cov["covered"]

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.act = nn.Linear(4, 4), nn.PReLU(4, init=0.2)

        def forward(self, x):
            return self.act(self.lin(self.act(x)))

    _check(Twice(), torch.randn(3, 4), torch.randn(3, 4), strict=True)


def test_a_rule_reads_the_parameters_a_module_holds_now():
    """NormRule.params reads the module's registry at every call: what parameters(recurse=False) yields (each
    object once, also when registered under two names; None entries and frozen ones left out), and a swapped
    parameter object (as FSDP2 swaps them) is the one it gives next."""
    from gapmon.per_sample.rules import LinearRule

    layer, rule = nn.Linear(4, 3), LinearRule()
    assert [id(p) for p in rule.params(layer)] == [id(p) for p in layer.parameters(recurse=False)]
    layer.register_parameter("alias", layer.weight)  # one object under two names
    layer.register_parameter("absent", None)
    assert [id(p) for p in rule.params(layer)] == [id(layer.weight), id(layer.bias)]
    layer.bias.requires_grad_(False)
    assert [id(p) for p in rule.params(layer)] == [id(layer.weight)]
    swapped = nn.Parameter(torch.zeros(3, 4))
    layer.weight = swapped
    assert rule.params(layer)[0] is swapped


def test_covered_layer_types_follow_freezing_and_skipped_layers():
    """covered_layer_types() (read every step by GAPMonitor's noise scale) is computed again when a requires_grad
    flag or the skipped layers change, and when the parameters are replaced."""
    model = _mlp()
    psn = gapmon.PerSampleGradNorms(model)
    want = {"0.weight": "Linear", "0.bias": "Linear", "1.weight": "LayerNorm", "1.bias": "LayerNorm",
            "3.weight": "Linear", "3.bias": "Linear"}
    assert psn.covered_layer_types() == want
    model[1].weight.requires_grad_(False)
    assert psn.covered_layer_types() == {k: v for k, v in want.items() if k != "1.weight"}
    model[1].weight.requires_grad_(True)
    assert psn.covered_layer_types() == want
    psn._coverage.skip("3", "a test's reason")  # as a layer found not to be per-sample at run time
    assert psn.covered_layer_types() == {k: v for k, v in want.items() if not k.startswith("3.")}
    psn.close()


def test_a_transformers_layer_copying_a_registered_ones_code_takes_its_rule(tmp_path, monkeypatch):
    """transformers keeps `# Copied from ...LlamaRMSNorm` classes in sync: a copy (own name, comments, docstring) takes
    LlamaRMSNorm's rule, exact; one whose forward differs by a character has none."""
    pytest.importorskip("transformers", reason="needs transformers (CI installs it)")
    import importlib.util
    import inspect
    import sys

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from gapmon.per_sample.rules import HFRMSNormRule, rule_for

    original = inspect.getsource(LlamaRMSNorm)
    copy = original.replace("LlamaRMSNorm", "CopiedRMSNorm").replace("def forward", "# copied, as transformers does\n    def forward")
    changed = original.replace("LlamaRMSNorm", "ChangedRMSNorm").replace("+ self.variance_epsilon", "+ 2 * self.variance_epsilon")
    assert changed != original.replace("LlamaRMSNorm", "ChangedRMSNorm")
    path = tmp_path / "modeling_gapmon_copies.py"
    header = "import torch\nfrom torch import nn\nfrom transformers.integrations import use_kernel_forward_from_hub\n\n"
    path.write_text(header + copy + "\n\n" + changed + "\n")
    name = "transformers.models.gapmon_copies.modeling_gapmon_copies"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    assert isinstance(rule_for(module.CopiedRMSNorm(6)), HFRMSNormRule)
    assert rule_for(module.ChangedRMSNorm(6)) is None

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), module.CopiedRMSNorm(6), nn.Linear(6, 3)).double()
    nn.init.normal_(model[1].weight)
    x, y = torch.randn(4, 7, 5, dtype=torch.float64), torch.randn(4, 7, 3, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(model, strict=True)
    _loss = lambda out, target: ((out - target) ** 2).sum((1, 2)).mean()  # noqa: E731
    _loss(model(x), y).backward()
    got, cov = psn.local_norms(), psn.coverage()
    psn.close()
    assert set(cov["covered"]) == {"0.weight", "0.bias", "1.weight", "2.weight", "2.bias"}
    want = loop_per_sample_norms(model, _loss, x, y, params=set(cov["covered"]))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


class _TokenWiseExperts(nn.Module):
    """A mixture of two experts, each token routed to its best one (the rows gathered per expert, multiplied by the
    expert's weight, added back into a new tensor): the output's rows are the input's alone."""

    def __init__(self):
        super().__init__()
        self.router = nn.Parameter(torch.randn(6, 2, dtype=torch.float64))
        self.experts = nn.Parameter(torch.randn(2, 6, 6, dtype=torch.float64) * 0.3)

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        scores = (rows @ self.router).softmax(-1)
        weight, expert = scores.max(-1)
        out = torch.zeros_like(rows)
        for e in range(2):
            picked = (expert == e).nonzero().squeeze(1)
            out = out.index_add(0, picked, (rows[picked] @ self.experts[e]) * weight[picked, None])
        return out.reshape(x.shape)


@pytest.mark.parametrize("registered", [False, True])
def test_a_token_wise_mixture_of_experts_keeps_the_layers_after_it_covered(registered):
    """Its routing loses the batch in the tracking (a max over rows merged with the batch, index_add into a new
    tensor); declared token-wise (the rule of transformers' Mixtral, Qwen-MoE, OLMoE, DeepSeek-V3 blocks) its output
    gets it back: the head after it is covered and exact; the router (a product over the tokens merged with the batch)
    is covered, the experts (products of routed rows) are left out, named. Undeclared, the gradient that comes back
    through the routing may hold several samples' losses as far as gapmon can tell: the layers before it are left out
    too, named, with what to do (nothing is left covered)."""
    from gapmon.per_sample.rules.mixture_of_experts import TokenWiseBlockRule

    class Experts(_TokenWiseExperts):
        pass

    if registered:
        register_norm_rule(Experts)(TokenWiseBlockRule)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), Experts(), nn.LayerNorm(6), nn.Linear(6, 3)).double()
    x, y = torch.randn(4, 7, 5, dtype=torch.float64), torch.randn(4, 7, 3, dtype=torch.float64)
    loss = lambda out, target: ((out - target) ** 2).sum((1, 2)).mean()  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        psn = gapmon.PerSampleGradNorms(model)
        loss(model(x), y).backward()
        got, cov = psn.local_norms(), psn.coverage()
        psn.close()
    after = {"2.weight", "2.bias", "3.weight", "3.bias"}
    assert "1.experts" in cov["uncovered"] and ("1.router" in cov["covered"]) == registered  # (F.linear, merged rows)
    assert (after <= set(cov["covered"])) == registered and ("0.weight" in cov["covered"]) == registered
    assert any("'1.experts' is not per-sample" in str(w.message) for w in caught)
    if not registered:
        assert any("'0' is not per-sample (a gradient comes back to it through" in str(w.message)
                   and "TokenWiseBlockRule" in str(w.message) for w in caught)
        assert not cov["covered"] and got.shape == (4,) and not got.any()
        return
    want = loop_per_sample_norms(model, loss, x, y, params=set(cov["covered"]))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
