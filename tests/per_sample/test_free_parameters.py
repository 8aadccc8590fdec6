"""Parameters a model uses itself, outside any layer (gapmon.per_sample.free_parameters): a learned position embedding
added to the batch, a class token expanded over the batch and concatenated to it, as vision transformers use them.
Exact against a float64 loop (one backward per sample) where every use is one the batch tracking follows; left out,
named, where one is not; refused where a use happens where no hook sees it."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import loop_per_sample_norms, norms_and_coverage

import gapmon

BOOKKEEPING = pytest.mark.parametrize("bookkeeping", [False, True], ids=["hooks", "bookkeeping"])


def _loss(out, t):
    return ((out - t) ** 2).flatten(1).sum(1).sum()


class TinyViT(nn.Module):
    """Patches, a class token, position embeddings, one encoder layer and a head on the class token. `use`: how the
    position embedding joins the batch."""

    def __init__(self, cls_token=True, use="add"):
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 8) * 0.1) if cls_token else None
        n = 4 + (1 if cls_token else 0)
        shape = {"add": (1, n, 8), "add_2d": (n, 8), "flat": (n * 8,), "sub": (1, n, 8), "in_place": (1, n, 8),
                 "scaled": (1, n, 8), "cumsum": (1, n, 8), "stack": (1, n, 8)}[use]
        self.pos_embed = nn.Parameter(torch.randn(*shape) * 0.1)
        self.use = use
        self.encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        if self.use in ("add", "add_2d"):
            x = x + self.pos_embed
        elif self.use == "flat":  # a flat parameter viewed as the embedding: the same elements in order
            x = x + self.pos_embed.view(1, x.shape[1], 8)
        elif self.use == "sub":
            x = x - self.pos_embed.to(x.dtype)
        elif self.use == "in_place":
            x = x.clone()
            x += self.pos_embed
        elif self.use == "scaled":  # by numbers, and subtracted from a constant: still followed
            x = x + (1.0 - self.pos_embed / 4) * 2
        elif self.use == "cumsum":  # an op of the parameter alone, followed through its vector-Jacobian product
            x = x + self.pos_embed.cumsum(1)
        else:  # stack: it meets the batch in an op no rule reads (not an add, a product, a concatenation, a contraction
            x = torch.stack([x, self.pos_embed.expand_as(x)], -1).amax(-1)  # or a pointwise op)
        return self.head(self.encoder(x)[:, 0])


def _norms(model, x, y, **kwargs):
    return norms_and_coverage(model, _loss, x, y, **kwargs)


@BOOKKEEPING
@pytest.mark.parametrize("use, cls_token", [("add", True), ("add_2d", True), ("flat", True), ("sub", True),
                                            ("in_place", True), ("scaled", True), ("add", False), ("cumsum", True)])
def test_position_embedding_and_class_token_are_exact(use, cls_token, bookkeeping):
    torch.manual_seed(0)
    model = TinyViT(cls_token, use).double()
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    got, cov = _norms(model, x, y, strict=True, bookkeeping=bookkeeping)
    assert set(cov["covered"]) == {n for n, _ in model.named_parameters()}
    want = loop_per_sample_norms(model, _loss, x, y)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_micro_batches_accumulate_each_their_own_samples():
    torch.manual_seed(1)
    model = TinyViT().double()
    xs = [torch.randn(3, 3, 8, 8, dtype=torch.float64), torch.randn(2, 3, 8, 8, dtype=torch.float64)]
    ys = [torch.randn(3, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)]
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True)
    for x, y in zip(xs, ys):
        _loss(model(x), y).backward()
    got = psn.local_norms()
    psn.close()
    want = torch.cat([loop_per_sample_norms(model, _loss, x, y) for x, y in zip(xs, ys)])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_use_the_tracking_cannot_follow_leaves_the_parameter_out_by_name():
    """torch.stack([x, pos_embed.expand_as(x)]): the parameter meets the batch in an op no rule reads. It is left out
    (warned, and refused under strict=True), and the rest, the class token among it, is exact."""
    torch.manual_seed(2)
    model = TinyViT(use="stack").double()
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match=r"'pos_embed' is not per-sample \(the model uses this parameter in stack"):
        got, cov = _norms(model, x, y)
    assert "pos_embed" in cov["uncovered"] and "cls_token" in cov["covered"]
    want = loop_per_sample_norms(model, _loss, x, y, params=set(cov["covered"]))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    with pytest.raises(RuntimeError, match="'pos_embed' is not per-sample"):
        _norms(TinyViT(use="stack").double(), x, y, strict=True)


def test_a_use_outside_the_forward_pass_is_left_out_by_name():
    """The position embedding also read by the loss (a regulariser): its gradient gets a part no hook saw, which the
    use check finds: it is left out, named, and the rest is exact (strict=True refuses)."""
    torch.manual_seed(3)
    model = TinyViT().double()
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    for strict in (False, True):
        psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=strict)
        model.zero_grad(set_to_none=True)
        (_loss(model(x), y) + model.pos_embed.square().sum()).backward()
        if strict:
            with pytest.raises(RuntimeError, match="pos_embed"):
                psn.local_norms()
        else:
            with pytest.warns(RuntimeWarning, match=r"'pos_embed' is not per-sample \(the gradient of pos_embed"):
                got = psn.local_norms()
            covered = set(psn.coverage()["covered"])
            assert "pos_embed" not in covered and "cls_token" in covered
            torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y, params=covered), rtol=1e-10,
                                       atol=1e-12)
        psn.close()


def test_a_class_token_concatenated_along_the_batch_is_left_out():
    class AlongBatch(nn.Module):  # the token as one more "sample": not per-sample
        def __init__(self):
            super().__init__()
            self.token = nn.Parameter(torch.randn(1, 4))
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            return self.lin(torch.cat([x, self.token], dim=0))[: x.shape[0]]

    model = AlongBatch().double()
    psn = gapmon.PerSampleGradNorms(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
        psn.local_norms()
    assert "token" in psn.coverage()["uncovered"]
    assert any("'token' is not per-sample" in str(w.message) for w in caught)
    psn.close()


def test_with_gram_the_free_parameters_stay_uncovered():
    """gram() and per_sample_gradients() are formed from the layers' positions: a free parameter is left out there,
    as a parameter of a module without a rule."""
    with pytest.warns(RuntimeWarning, match="pos_embed"):
        psn = gapmon.PerSampleGradNorms(TinyViT(), gram=True)
    assert {"pos_embed", "cls_token"} <= set(psn.coverage()["uncovered"])
    psn.close()


@pytest.mark.parametrize("reentrant", [False, True])
def test_under_activation_checkpointing(reentrant):
    """The embedding step checkpointed: non-reentrant checkpointing keeps the forward's graph (exact); the reentrant
    kind runs the forward without grad, so no hook can be placed there: the parameters are then left out by the use
    check (named), and the rest is exact. The batch is followed on either way."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(TinyViT):
        def forward(self, x):
            def embed(x):
                x = self.patch(x).flatten(2).transpose(1, 2)
                return torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed

            return self.head(self.encoder(checkpoint(embed, x, use_reentrant=reentrant))[:, 0])

    torch.manual_seed(4)
    model = Checkpointed().double()
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64, requires_grad=reentrant), torch.randn(4, 3, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, cov = _norms(model, x, y)
    assert ("pos_embed" in cov["covered"]) is not reentrant
    assert any("'pos_embed' is not per-sample (it got a gradient where no use of it was followed" in str(w.message)
               for w in caught) is reentrant
    assert "head.weight" in cov["covered"]
    want = []  # by backward() one sample at a time (reentrant checkpointing does not work with autograd.grad)
    for i in range(x.shape[0]):
        model.zero_grad()
        _loss(model(x[i:i + 1]), y[i:i + 1]).backward()
        want.append(torch.sqrt(sum(p.grad.square().sum() for n, p in model.named_parameters() if n in cov["covered"])))
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-10, atol=1e-12)


def test_under_bf16_autocast_within_its_rounding():
    """The output gradients are bfloat16: the free parameters' per-sample gradients are summed in float32, and the
    norms agree with a loop over the samples under the same autocast within bf16's rounding (2^-8 a product, a few of
    them along the chain)."""
    torch.manual_seed(5)
    got, want, _ = _autocast_norms(TinyViT(), torch.randn(4, 3, 8, 8), torch.randn(4, 3))
    torch.testing.assert_close(got, want, rtol=1e-2, atol=0)


def _autocast_norms(model, x, y):
    """(gapmon's norms, a loop's over the samples, coverage) with the model run under CPU bf16 autocast (strict)."""
    def loss(xs, ys):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(xs)
        return _loss(out.float(), ys)

    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True)
    loss(x, y).backward()
    got, cov = psn.local_norms(), psn.coverage()
    psn.close()
    want = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss(x[i:i + 1], y[i:i + 1]),
                                                                              list(model.parameters()))]).norm()
                        for i in range(x.shape[0])])
    return got, want, cov


class ScaledBlock(nn.Module):
    """A ConvNeXt-style block with its own layer scale: the residual branch times gamma (per channel), as
    `x * gamma.reshape(1, -1, 1, 1)` on [B, C, H, W] or `gamma * x` on channels-last activations."""

    def __init__(self, channels_last):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.gamma = nn.Parameter(torch.rand(4) + 0.5)
        self.channels_last = channels_last
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        branch = self.conv(x)
        if self.channels_last:
            branch = (self.gamma * branch.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        else:
            branch = branch * self.gamma.reshape(1, -1, 1, 1)
        return self.head((x + branch).mean((2, 3)))


@BOOKKEEPING
@pytest.mark.parametrize("channels_last", [False, True])
def test_a_layer_scale_is_exact(channels_last, bookkeeping):
    torch.manual_seed(6)
    model = ScaledBlock(channels_last).double()
    x, y = torch.randn(3, 4, 5, 5, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    got, cov = _norms(model, x, y, strict=True, bookkeeping=bookkeeping)
    assert "gamma" in cov["covered"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y), rtol=1e-10, atol=1e-12)


def test_a_parameter_still_sharded_in_its_modules_forward_is_left_out_by_name(monkeypatch):
    """Under a sharding wrapper whose pre-forward hook ran after gapmon's, the module would still hold a DTensor when
    its forward begins: that parameter is left out, named (here a plain one is taken for a DTensor)."""
    from gapmon.per_sample import free_parameters

    torch.manual_seed(7)
    model = TinyViT().double()
    monkeypatch.setattr(free_parameters, "is_dtensor", lambda p: p is model.pos_embed)
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="'pos_embed' is not per-sample .*while it is still sharded"):
        got, cov = _norms(model, x, y)
    assert "pos_embed" in cov["uncovered"] and "cls_token" in cov["covered"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y, params=set(cov["covered"])),
                               rtol=1e-10, atol=1e-12)


class Tokens(nn.Module):
    """A class token copied over the batch by `repeat` (the same as an expansion), or a token table tiled along its own
    rows (not an expansion: each row then has two uses at once, which is not followed)."""

    def __init__(self, tile):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.tokens = nn.Parameter(torch.randn(1, 2 if tile else 1, 4))
        self.tile = tile

    def forward(self, x):
        h = self.lin(x)
        extra = self.tokens.repeat(x.shape[0], 2, 1) if self.tile else self.tokens.repeat(x.shape[0], 1, 1)
        return torch.cat([extra, h], dim=1).tanh().sum(1)


def test_a_token_repeated_over_the_batch_is_exact_and_a_tiled_one_left_out():
    torch.manual_seed(8)
    x, y = torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    model = Tokens(tile=False).double()
    got, cov = _norms(model, x, y, strict=True)
    assert "tokens" in cov["covered"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y), rtol=1e-10, atol=1e-12)
    model = Tokens(tile=True).double()
    # (the tile, of the parameter alone, is followed; its copies along the batch then meet a concatenation no rule reads)
    with pytest.warns(RuntimeWarning, match="'tokens' is not per-sample .*concatenation that does not expand it"):
        got, cov = _norms(model, x, y)
    assert "tokens" in cov["uncovered"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y, params=set(cov["covered"])),
                               rtol=1e-10, atol=1e-12)


class SlicedPositions(nn.Module):
    """A position table longer than the sequence, sliced to it as minGPT does (`pos_emb[:, :t]`); `use` picks the
    slice: a prefix, an int index (the leading dim dropped), a stepped slice of a slice, two overlapping slices (their
    gradients add where they overlap), its last rows as register tokens expanded over the batch and concatenated, rows
    picked by an index tensor every sample shares (some twice), or by the batch's own ids (not followed)."""

    def __init__(self, use):
        super().__init__()
        self.tok = nn.Embedding(11, 8)
        self.pos = nn.Parameter(torch.randn(1, 12, 8) * 0.1)
        self.block = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)
        self.use = use

    def forward(self, idx):
        n = idx.shape[1]
        x = self.tok(idx)
        if self.use == "prefix":
            x = x + self.pos[:, :n]
        elif self.use == "int":
            x = x + self.pos[0, :n]
        elif self.use == "step":
            x = x + self.pos[:, 1::2][:, :n]
        elif self.use == "overlap":
            x = x + self.pos[:, :n] - self.pos[..., 2:n + 2, :]
        elif self.use == "register":
            x = torch.cat([self.pos[:, -2:].expand(x.shape[0], -1, -1), x + self.pos[:, :n]], dim=1)
        elif self.use == "index":
            x = x + self.pos[:, torch.arange(n) // 2]
        else:
            x = x + self.pos[0, idx % 12]
        return self.head(self.block(x)[:, 0])


@BOOKKEEPING
@pytest.mark.parametrize("use", ["prefix", "int", "step", "overlap", "register", "index"])
def test_a_sliced_position_table_is_exact(use, bookkeeping):
    torch.manual_seed(9)
    model = SlicedPositions(use).double()
    x, y = torch.randint(0, 11, (4, 5)), torch.randn(4, 3, dtype=torch.float64)
    got, cov = _norms(model, x, y, strict=True, bookkeeping=bookkeeping)
    assert set(cov["covered"]) == {n for n, _ in model.named_parameters()}
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y), rtol=1e-10, atol=1e-12)


def test_a_position_table_indexed_by_the_batch_is_left_out_by_name():
    torch.manual_seed(10)
    model = SlicedPositions("by ids").double()
    x, y = torch.randint(0, 11, (4, 5)), torch.randn(4, 3, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match=r"'pos' is not per-sample \(the model uses this parameter in __getitem__"):
        got, cov = _norms(model, x, y)  # (pos[:, ids]: each sample's rows picked by the samples' ids)
    assert set(cov["uncovered"]) == {"pos"}  # the rows it picks are each sample's: the layers after it stay covered
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y, params=set(cov["covered"])),
                               rtol=1e-10, atol=1e-12)


class MaskedAutoencoderEmbeddings(nn.Module):
    """MAE's encoder embeddings: the patches get the position table's rows after the first, the class token the first
    row (`cls_token + pos_embed[:, :1]`, two free parameters added), expanded over the batch and concatenated. With
    `frozen`, the table is a fixed buffer-like parameter (requires_grad=False, as Hugging Face's ViTMAE): the class
    token plus a constant. `minus` subtracts the row instead."""

    def __init__(self, frozen=False, minus=False):
        super().__init__()
        self.patch = nn.Linear(6, 8)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 8) * 0.1)
        self.pos_embed = nn.Parameter(torch.randn(1, 6, 8) * 0.1, requires_grad=not frozen)
        self.head = nn.Linear(8, 3)
        self.minus = minus

    def forward(self, x):
        x = self.patch(x) + self.pos_embed[:, 1:, :]
        cls = self.cls_token - self.pos_embed[:, :1, :] if self.minus else self.cls_token + self.pos_embed[:, :1, :]
        x = torch.cat((cls.expand(x.shape[0], -1, -1), x), dim=1)
        return self.head(torch.tanh(x).mean(1))


@BOOKKEEPING
@pytest.mark.parametrize("frozen, minus", [(False, False), (False, True), (True, False)],
                         ids=["trained", "subtracted", "frozen"])
def test_a_class_token_plus_a_position_row_is_exact(frozen, minus, bookkeeping):
    torch.manual_seed(11)
    model = MaskedAutoencoderEmbeddings(frozen, minus).double()
    x, y = torch.randn(4, 5, 6, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    got, cov = _norms(model, x, y, strict=True, bookkeeping=bookkeeping)
    assert set(cov["covered"]) == {n for n, p in model.named_parameters() if p.requires_grad}
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("how", ["meta + to_empty", "load_state_dict(assign=True)"])
def test_free_parameters_follow_replaced_parameter_objects(how):
    """PerSampleGradNorms made on a model whose parameter objects are then replaced, as large models are built (on the
    meta device, then to_empty and an init; or an assign=True load): the free parameters followed are the new objects,
    with their values."""
    torch.manual_seed(12)
    fresh = MaskedAutoencoderEmbeddings().double()
    if how == "meta + to_empty":
        with torch.device("meta"):
            model = MaskedAutoencoderEmbeddings().double()
    else:
        model = MaskedAutoencoderEmbeddings().double()
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True)
    if how == "meta + to_empty":
        model.to_empty(device="cpu")
        model.load_state_dict(fresh.state_dict())
    else:
        model.load_state_dict(fresh.state_dict(), assign=True)
    x, y = torch.randn(4, 5, 6, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    _loss(model(x), y).backward()
    got = psn.local_norms()
    assert {"cls_token", "pos_embed"} <= set(psn.coverage()["covered"])
    psn.close()
    torch.testing.assert_close(got, loop_per_sample_norms(fresh, _loss, x, y), rtol=1e-10, atol=1e-12)


class CastSkip(nn.Module):
    """Mamba's skip connection: a float64 model's own parameter cast to float32 and sliced into a product with the
    batch (`h * self.D.float()[None, :]`): autograd rounds its gradient to float32 at the cast."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.D = nn.Parameter(torch.randn(6))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = self.lin(x)
        return self.head(torch.tanh(h + h * self.D.float()[None, :]))


def test_a_parameter_cast_to_a_narrower_dtype_is_checked_at_that_dtypes_rounding():
    """The use check allows the cast's rounding (a float64 parameter's gradient rounded to float32 on the way back),
    rather than refusing the norms as if a use had gone unseen; the norms match the loop to float32's rounding."""
    torch.manual_seed(13)
    model = CastSkip().double()
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    got, cov = _norms(model, x, y, strict=True)
    assert "D" in cov["covered"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y), rtol=1e-6, atol=1e-9)


class RelativeBias(nn.Module):
    """Swin's window attention, its relative position bias table looked up by an index every sample shares, reshaped,
    permuted and added to the scores of windows merged with the batch ([B·windows, heads, N, N]), alone or plus a
    mask over the windows (shifted windows), written out as eager attention."""

    def __init__(self, masked: bool):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(4, 4) for _ in range(4))
        self.table = nn.Parameter(torch.randn(5, 2) * 0.5)  # (2·3 - 1) relative positions, 2 heads
        self.register_buffer("index", (torch.arange(3)[:, None] - torch.arange(3)[None, :] + 2).reshape(-1))
        self.masked = masked

    def forward(self, x):  # x [B, 2 windows · 3 tokens, 4]
        b = x.shape[0]
        windows = x.view(b, 2, 3, 4).reshape(b * 2, 3, 4)
        q, k, v = (layer(windows).view(b * 2, 3, 2, 2).transpose(1, 2) for layer in (self.q, self.k, self.v))
        bias = self.table[self.index].view(3, 3, -1).permute(2, 0, 1).contiguous().unsqueeze(0)  # [1, heads, 3, 3]
        if self.masked:
            mask = torch.tensor([[0.0, -2.0, 0.0], [0.0, 0.0, 1.0], [-1.0, 0.0, 0.0]], dtype=x.dtype)
            mask = torch.stack([mask, mask.T]).unsqueeze(1).unsqueeze(0).expand(b, -1, -1, -1, -1).reshape(-1, 1, 3, 3)
            bias = bias + mask
        scores = (q @ k.transpose(-1, -2)) / 2 ** 0.5 + bias
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, 2, 3, 4).reshape(b, 6, 4)
        return self.out(out).sum(1)


@BOOKKEEPING
@pytest.mark.parametrize("masked", [False, True], ids=["bias", "bias plus mask"])
def test_a_relative_position_table_added_to_windows_merged_with_the_batch_is_exact(masked, bookkeeping):
    torch.manual_seed(11)
    model = RelativeBias(masked).double()
    x, y = torch.randn(4, 6, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    got, cov = _norms(model, x, y, strict=True, bookkeeping=bookkeeping)
    assert "table" in cov["covered"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y), rtol=1e-10, atol=1e-12)


class Contracted(nn.Module):
    """A model's own weights contracted with the batch: a leaf layer calling F.linear on its weight (and its bias),
    `x @ W`, XLNet's sequence-first einsum ("ibh,hnd->ibnd"), and a router's F.linear over the tokens merged with the
    batch (gpt-oss's with a bias)."""

    def __init__(self, use: str):
        super().__init__()
        self.use = use
        shape = {"linear": (6, 4), "merged": (6, 4), "matmul": (4, 6), "einsum": (4, 2, 3), "linear_bias": (6, 4),
                 "merged_bias": (6, 4)}[use]  # (out, in), (in, out)
        self.w = nn.Parameter(torch.randn(shape) * 0.5)
        self.b = nn.Parameter(torch.randn(6) * 0.5) if use.endswith("bias") else None
        self.head = nn.Linear(6, 3)

    def forward(self, x):  # x [B, T, 4]
        if self.use in ("linear", "linear_bias"):
            return self.head(torch.tanh(F.linear(x, self.w, self.b)))
        if self.use == "matmul":
            return self.head(torch.tanh(x @ self.w))
        if self.use == "einsum":
            h = torch.einsum("ibh,hnd->ibnd", x.transpose(0, 1), self.w).transpose(0, 1)
            return self.head(torch.tanh(h.flatten(2)))
        rows = x.reshape(-1, x.shape[-1])  # "merged": a router over the tokens
        scores = F.linear(rows, self.w, self.b).softmax(-1).reshape(*x.shape[:2], -1)
        return self.head(scores * x.sum(-1, keepdim=True))


@BOOKKEEPING
@pytest.mark.parametrize("use", ["linear", "matmul", "einsum", "merged", "linear_bias", "merged_bias"])
def test_a_parameter_contracted_with_the_batch_is_exact(use, bookkeeping):
    torch.manual_seed(12)
    model = Contracted(use).double()
    x, y = torch.randn(4, 5, 4, dtype=torch.float64), torch.randn(4, 5, 3, dtype=torch.float64)
    got, cov = _norms(model, x, y, strict=True, bookkeeping=bookkeeping)
    assert "w" in cov["covered"] and ("b" in cov["covered"]) == use.endswith("bias")
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y, params=set(cov["covered"])),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("use", ["linear", "merged_bias"])
def test_a_contraction_under_bf16_autocast_is_checked_at_its_rounding(use):
    """Autocast runs the product in bfloat16 on a cast of the batched operand: each sample's gradient is formed from
    that cast, and the use check allows bfloat16's rounding of the parameter's gradient (float32's refused it falsely);
    the norms agree with a loop over the samples under the same autocast within it."""
    torch.manual_seed(12)
    got, want, cov = _autocast_norms(Contracted(use), torch.randn(4, 5, 4), torch.randn(4, 5, 3))
    assert not cov["uncovered"]
    torch.testing.assert_close(got, want, rtol=1e-2, atol=0)


def test_a_contracted_parameter_too_large_to_form_per_sample_is_left_out_by_name(monkeypatch):
    from gapmon.per_sample import free_parameters

    monkeypatch.setattr(free_parameters, "_MAX_FORMED", 4 * 24 - 1)  # batch 4 · 24 elements of w: one too many
    torch.manual_seed(12)
    model = Contracted("matmul").double()
    x, y = torch.randn(4, 5, 4, dtype=torch.float64), torch.randn(4, 5, 3, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match=r"'w' is not per-sample \(the model uses this parameter in a matrix product"):
        got, cov = _norms(model, x, y)
    assert "w" in cov["uncovered"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y, params=set(cov["covered"])),
                               rtol=1e-10, atol=1e-12)


class FusedAttentionBias(nn.Module):
    """A learned attention bias [heads, T, T] (Swin's and T5's kind) given to torch's fused attention as its mask; `use`:
    plain, with a scale of its own, grouped-query (two query heads per key/value head), the batch merged with windows
    ([B·2, heads, T/2, d], Swin's), or with attention dropout in training."""

    def __init__(self, use: str):
        super().__init__()
        self.use, heads, self.t = use, 4, 6
        self.qkv = nn.Linear(8, 8 * 3 if use != "gqa" else 8 + 2 * 4)
        n = self.t // 2 if use == "windows" else self.t
        self.bias = nn.Parameter(torch.randn(heads, n, n) * 0.5)
        self.head = nn.Linear(8, 3)

    def forward(self, x):  # x [B, T, 8]
        b = x.shape[0]
        h = self.qkv(x)
        q, rest = h[..., :8], h[..., 8:]
        kv_heads = 2 if self.use == "gqa" else 4
        k, v = rest.chunk(2, -1)
        q = q.reshape(b, self.t, 4, 2).transpose(1, 2)
        k, v = (u.reshape(b, self.t, kv_heads, 2).transpose(1, 2) for u in (k, v))
        kwargs = {"scale": 0.3} if self.use == "scale" else {"enable_gqa": True} if self.use == "gqa" else {}
        if self.use == "windows":  # [B, 4, T, 2] -> [B·2, 4, T/2, 2]: two windows per sample, the batch outermost
            q, k, v = (u.reshape(b, 4, 2, self.t // 2, 2).transpose(1, 2).reshape(b * 2, 4, self.t // 2, 2)
                       for u in (q, k, v))
        mask = self.bias
        if self.use == "causal":  # kept under a mask every sample shares (T5's decoder under fused attention)
            mask = torch.where(torch.ones(self.t, self.t, dtype=torch.bool).tril(), mask, torch.finfo(x.dtype).min)
        elif self.use == "padded":  # kept under each sample's padding mask: a batched mask, each its own
            keep = (x[:, None, None, :, 0] > -0.5).expand(b, 1, self.t, self.t)
            mask = torch.where(keep, mask, torch.finfo(x.dtype).min)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.3 if self.use == "dropout" else 0.0,
                                             **kwargs)
        if self.use == "windows":
            out = out.reshape(b, 2, 4, self.t // 2, 2).transpose(1, 2).reshape(b, 4, self.t, 2)
        return self.head(out.transpose(1, 2).reshape(b, self.t, 8))


@pytest.mark.parametrize("use", ["plain", "scale", "gqa", "windows", "causal", "padded"])
def test_a_bias_given_to_fused_attention_as_its_mask_is_exact(use):
    """Added to each sample's scores inside the fused op, which autograd never shows: each sample's gradient of the
    scores is recomputed from the call (q, k, v, the mask, the output's gradient) and handed to the bias as an add's
    (the bias was left out before); kept by `torch.where` under a causal mask first (its elements there only), or
    under each sample's own mask (a product with it, per sample, batched)."""
    torch.manual_seed(3)
    model = FusedAttentionBias(use).double()
    x, y = torch.randn(4, 6, 8, dtype=torch.float64), torch.randn(4, 6, 3, dtype=torch.float64)
    got, cov = _norms(model, x, y, strict=True)
    assert "bias" in cov["covered"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y, params=set(cov["covered"])),
                               rtol=1e-10, atol=1e-12)


def test_a_bias_given_to_fused_attention_with_dropout_is_left_out_by_name():
    torch.manual_seed(3)
    model = FusedAttentionBias("dropout").double()
    x, y = torch.randn(4, 6, 8, dtype=torch.float64), torch.randn(4, 6, 3, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match=r"'bias' is not per-sample \(the model uses this parameter in "
                                            r"scaled_dot_product_attention"):
        got, cov = _norms(model, x, y)
    assert "bias" in cov["uncovered"] and "qkv.weight" in cov["covered"]


class LookedUp(nn.Module):
    """A table a model holds itself and looks up by id with F.embedding (PEFT's LoRA on an embedding: A.T by id, then
    B), in one of several ways (`use`)."""

    def __init__(self, use="plain", vocab=7, rank=3, d=5):
        super().__init__()
        self.use = use
        self.a = nn.Parameter(torch.randn(rank, vocab) if use == "transposed" else torch.randn(vocab, rank))
        self.b = nn.Linear(rank, d)
        self.head = nn.Linear(d, 2)

    def forward(self, ids):  # [B, T] (or [T, B] with use="sequence_first")
        table = self.a.T if self.use == "transposed" else self.a
        if self.use == "repeated_rows":  # rows picked twice: not the parameter once over
            table = table[torch.tensor([0, 1, 1, 2, 3, 4, 5, 6, 6, 0])]
        kwargs = {"padding_idx": 2} if self.use == "padding" else {}
        kwargs = {"max_norm": 1.0} if self.use == "max_norm" else {"scale_grad_by_freq": True} if (
            self.use == "by_freq") else kwargs
        looked = F.embedding(ids, table, **kwargs)
        if self.use == "and_added":  # another use as well: a row of the table added to every position
            looked = looked + self.a[1]
        h = self.b(looked)
        if self.use == "twice":  # a second lookup of the same table: the per-sample gradients add
            h = h + self.b(F.embedding(ids.flip(-1), table))
        if self.use == "sequence_first":
            h = h.transpose(0, 1)
        return self.head(h.mean(1))


def _ids(use, seed=0):
    ids = torch.randint(0, 7, (4, 6), generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = ids[:, 1]  # an id twice in each sample
    if use == "repeated_rows":
        ids = torch.randint(0, 10, (4, 6), generator=torch.Generator().manual_seed(seed))
    return ids.T.contiguous() if use == "sequence_first" else ids


@BOOKKEEPING
@pytest.mark.parametrize("use", ["plain", "transposed", "padding", "twice", "and_added", "repeated_rows",
                                 "sequence_first"])
def test_a_table_looked_up_by_id_is_exact(use, bookkeeping, monkeypatch):
    """Each sample's gradient of the table is its output gradient's rows summed by id. Looked up whole (every element
    once, in any order) and used nowhere else, its per-sample gradients are never formed (the norms come by id)."""
    from gapmon.per_sample import free_parameters

    if use in ("plain", "transposed", "padding", "twice", "sequence_first"):
        monkeypatch.setattr(free_parameters.TableRows, "dense", lambda *a: pytest.fail("per-sample tables formed"))
    torch.manual_seed(1)
    model = LookedUp(use).double()
    ids, y = _ids(use), torch.randn(4, 2, dtype=torch.float64)
    got, cov = norms_and_coverage(model, _loss, ids, y, strict=True, bookkeeping=bookkeeping,
                                  batch_dim=1 if use == "sequence_first" else 0)
    assert set(cov["covered"]) == {n for n, _ in model.named_parameters()}
    if use == "sequence_first":
        want = loop_per_sample_norms(_SampleFirst(model), _loss, ids.T.contiguous(), y)
    else:
        want = loop_per_sample_norms(model, _loss, ids, y)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


class _SampleFirst(nn.Module):
    """The sequence-first model fed one sample at a time as [B, T] ids (the loop's reference)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids.T)


@pytest.mark.parametrize("use, op", [("max_norm", "embedding"), ("by_freq", "embedding")])
def test_a_lookup_that_renormalises_or_counts_the_batch_is_left_out_by_name(use, op):
    """max_norm rescales the table's rows in place; scale_grad_by_freq scales each sample's gradient by the whole
    batch's counts of each id."""
    model = LookedUp(use).double()
    ids, y = _ids(use), torch.randn(4, 2, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match=rf"'a' is not per-sample \(the model uses this parameter in {op}"):
        got, cov = norms_and_coverage(model, _loss, ids, y)
    assert "a" in cov["uncovered"] and "b.weight" in cov["covered"]
    want = loop_per_sample_norms(model, _loss, ids, y, params=set(cov["covered"]))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


class LearnedQueries(nn.Module):
    """Learned queries expanded over the batch and run through layers of their own before they meet the batch
    (Perceiver's latents, BLIP-2's Q-Former query tokens): a LayerNorm and a projection on each sample's copy, then
    attention over the sample's features. `how`: how the copies are made, or (mixed) an op that mixes them."""

    def __init__(self, how="expand", d=6, n=3):
        super().__init__()
        self.how = how
        self.queries = nn.Parameter(torch.randn(n, d))
        self.norm, self.proj, self.kv = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d)
        self.head = nn.Linear(d, 2)

    def forward(self, x):  # [B, T, d] (sequence-first [T, B, d] with how="sequence_first")
        b = x.shape[1] if self.how == "sequence_first" else x.shape[0]
        if self.how == "repeat":
            q = self.queries.unsqueeze(0).repeat(b, 1, 1)
        elif self.how == "sequence_first":  # [n, B, d]: the batch on dim 1, as the features'
            q = self.queries.unsqueeze(1).expand(-1, b, -1)
        else:
            q = self.queries.expand(b, -1, -1)
        if self.how == "also_added":  # the copies also added to the batch before the layers: both uses count, once each
            x = torch.cat([x[:, :q.shape[1]] + q, x[:, q.shape[1]:]], 1)
        q = self.proj(self.norm(q))
        if self.how == "sequence_first":
            q, x = q.transpose(0, 1), x.transpose(0, 1)
        if self.how == "mixed":  # each sample's queries hold every sample's: not per-sample
            q = q - q.mean(0, keepdim=True)
        k = self.kv(x)
        out = torch.softmax(q @ k.transpose(1, 2), -1) @ k
        return self.head(out.mean(1))


@BOOKKEEPING
@pytest.mark.parametrize("how", ["expand", "repeat", "sequence_first", "also_added"])
@pytest.mark.parametrize("batch", [1, 4])
def test_learned_queries_expanded_over_the_batch_are_exact(how, batch, bookkeeping):
    """Each sample's copy of the queries joins the batch where a covered layer takes it: the layers on the copies are
    per-sample, and so is the queries' parameter (its gradient of each copy)."""
    torch.manual_seed(2)
    model = LearnedQueries(how).double()
    x, y = torch.randn(batch, 5, 6, dtype=torch.float64), torch.randn(batch, 2, dtype=torch.float64)
    inputs = x.transpose(0, 1).contiguous() if how == "sequence_first" else x
    got, cov = norms_and_coverage(model, _loss, inputs, y, strict=True, bookkeeping=bookkeeping,
                                  batch_dim=1 if how == "sequence_first" else 0)
    assert set(cov["covered"]) == {n for n, _ in model.named_parameters()}
    reference = _SampleFirstFeatures(model) if how == "sequence_first" else model
    torch.testing.assert_close(got, loop_per_sample_norms(reference, _loss, x, y), rtol=1e-10, atol=1e-12)


class _SampleFirstFeatures(nn.Module):
    """The sequence-first model fed [B, T, d] features (the loop's reference)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x.transpose(0, 1))


def test_copies_of_learned_queries_mixed_across_the_batch_refuse_the_norms():
    model = LearnedQueries("mixed").double()
    x, y = torch.randn(4, 5, 6, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="mix"):
        norms_and_coverage(model, _loss, x, y)


class CumulativeScale(nn.Module):
    """A parameter through an op with no rule of its own (cumsum: followed through its vector-Jacobian product), whose
    output is then changed in place (`how`: an op no rule follows), or detached first: only a use no rule follows whose
    output gets a gradient leaves the parameter out."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.scale = nn.Parameter(torch.rand(6) + 0.5)
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        s = self.scale.cumsum(0)
        if self.how == "detached, then in place":
            s = s.detach()
        if self.how != "as it is":
            s.mul_(2)
        return self.lin(x * s)


@pytest.mark.parametrize("how", ["as it is", "in place", "detached, then in place"])
def test_a_use_no_rule_follows_leaves_the_parameter_out_only_if_a_gradient_comes_back(how):
    torch.manual_seed(3)
    model = CumulativeScale(how).double()
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, cov = norms_and_coverage(model, _loss, x, y)
    assert ("scale" in cov["covered"]) == (how != "in place")
    want = loop_per_sample_norms(model, _loss, x, y, params=set(cov["covered"]))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


class SelectiveScan(nn.Module):
    """Mamba's reference scan, its parameters used by the block itself: `dt_proj.weight @ dt` (a Linear's weight on the
    left of a matmul), `A[None, :, None, :] * dt[..., None]` (a parameter times a batched tensor, both broadcast)."""

    def __init__(self, d=5, n=3, r=2):
        super().__init__()
        self.inp, self.dt_proj, self.head = nn.Linear(4, r), nn.Linear(r, d), nn.Linear(d * n, 3)
        self.A_log = nn.Parameter(torch.randn(d, n) * 0.3)

    def forward(self, x):
        dt = self.inp(x).transpose(1, 2)  # [B, r, L]
        dt = F.softplus(self.dt_proj.weight @ dt + self.dt_proj.bias[:, None])  # [B, d, L]
        decay = torch.exp(-torch.exp(self.A_log)[None, :, None, :] * dt[:, :, :, None])  # [B, d, L, n]
        return self.head(decay.cumsum(2).transpose(1, 2).flatten(2))


@BOOKKEEPING
def test_a_weight_on_the_left_of_a_matmul_and_a_broadcast_product_are_exact(bookkeeping):
    torch.manual_seed(0)
    model = SelectiveScan().double()
    x, y = torch.randn(4, 6, 4, dtype=torch.float64), torch.randn(4, 6, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got, cov = _norms(model, x, y, bookkeeping=bookkeeping)
    assert not cov["uncovered"], cov["uncovered_reasons"]
    want = loop_per_sample_norms(model, _loss, x, y, params=set(cov["covered"]))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


class RelativeKernel(nn.Module):
    """Funnel's relative attention: its own kernel maps a table of relative positions every sample shares
    (`einsum("td,dnh->tnh", r, r_kernel)`), the result is contracted with the batch's queries, and a view of that is
    masked in place (`positional_attn *= cls_mask`: torch drops the hooks of a view changed in place)."""

    def __init__(self, masked):
        super().__init__()
        self.q, self.head = nn.Linear(4, 6), nn.Linear(5, 3)
        self.r_kernel = nn.Parameter(torch.randn(4, 2, 3) * 0.3)
        self.register_buffer("r", torch.randn(5, 4))
        self.masked = masked

    def forward(self, x):  # [B, L, 4]
        q = self.q(x).unflatten(-1, (2, 3))  # [B, L, n, h]
        scores = torch.einsum("binh,tnh->bnit", q, torch.einsum("td,dnh->tnh", self.r, self.r_kernel))[..., :5]
        if self.masked:
            scores *= torch.linspace(0.0, 1.0, 5, dtype=scores.dtype)
        return self.head(torch.tanh(scores).reshape(scores.shape[0], -1, 5))


@BOOKKEEPING
@pytest.mark.parametrize("masked", [False, True])
def test_a_parameter_mapped_by_a_constant_table_then_contracted_with_the_batch_is_exact(masked, bookkeeping):
    torch.manual_seed(0)
    model = RelativeKernel(masked).double()
    x, y = torch.randn(4, 6, 4, dtype=torch.float64), torch.randn(4, 12, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got, cov = _norms(model, x, y, bookkeeping=bookkeeping)
    assert not cov["uncovered"], cov["uncovered_reasons"]
    torch.testing.assert_close(got, loop_per_sample_norms(model, _loss, x, y, params=set(cov["covered"])),
                               rtol=1e-10, atol=1e-12)
