"""Per-sample norms are exact or refused, round 2 (issue 22): subclasses of covered layers,
weight_norm and parametrizations, batch-mixing layers, layers unfrozen or frozen after
construction, MultiheadAttention with book-keeping. Reference: a float64 loop, one backward per
sample, over the parameters coverage() lists."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import loop_per_sample_norms

import gapmon
from gapmon.per_sample.rules import LinearRule, register_norm_rule

BOOKKEEPING = pytest.mark.parametrize("bookkeeping", [False, True], ids=["hooks", "bookkeeping"])


def _loss(out, t):
    return ((out - t) ** 2).flatten(1).sum(1).mean()


def _norms(model, x, y, bookkeeping, **kwargs):
    """(gapmon's norms, the loop's norms over the parameters coverage() lists, coverage)."""
    psn = gapmon.PerSampleGradNorms(model, bookkeeping=bookkeeping, **kwargs)
    try:
        model.zero_grad()
        _loss(model(x), y).backward()
        got = psn.local_norms()
        cov = psn.coverage()
    finally:
        psn.close()
    want = loop_per_sample_norms(model, _loss, x, y, params=set(cov["covered"]))
    return got, want, cov


def _assert_exact(got, want):
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


class LoRALinear(nn.Linear):
    """A Linear with a low-rank update in its forward: the Linear rule does not see lora_A/lora_B."""

    def __init__(self, d, p, r=2):
        super().__init__(d, p)
        self.lora_A = nn.Parameter(torch.randn(r, d) * 0.3)
        self.lora_B = nn.Parameter(torch.randn(p, r) * 0.3)

    def forward(self, x):
        return super().forward(x) + x @ self.lora_A.T @ self.lora_B.T


class ScaledEmbedding(nn.Embedding):
    """Hugging Face's scaled word embeddings: the output is scaled after the lookup."""

    def forward(self, ids):
        return super().forward(ids) * 3.0


class PlainSubclass(nn.Linear):
    """A subclass that does not override forward: Linear's math holds."""


class SameMathLinear(nn.Linear):
    """Overrides forward with Linear's own math: covered only once its user registers it."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def _mlp(first: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(first, nn.Tanh(), nn.Linear(6, 3)).double()
    return model


@BOOKKEEPING
@pytest.mark.parametrize("make, covered", [
    (lambda: LoRALinear(5, 6), True),  # its parameters followed through its own forward's ops (free_parameters)
    (lambda: torch.nn.utils.weight_norm(nn.Linear(5, 6)), True),  # its g and v through the normalisation (rules/reparametrized.py)
    # through the chain by a vector-Jacobian product (rules/reparametrized.py's Chain)
    (lambda: torch.nn.utils.parametrizations.orthogonal(nn.Linear(6, 6)), True),
    # spectral_norm in a chain: its power iteration would form another W if run again
    (lambda: torch.nn.utils.parametrizations.spectral_norm(torch.nn.utils.parametrizations.orthogonal(nn.Linear(6, 6))),
     False),
    (lambda: PlainSubclass(5, 6), True),
], ids=["lora-subclass", "weight_norm", "parametrization", "spectral-norm-in-a-chain", "plain-subclass"])
def test_a_rule_applies_only_where_its_math_holds(make, covered, bookkeeping):
    torch.manual_seed(1)
    first = make()
    if isinstance(first, nn.Linear) and hasattr(first, "weight_g"):
        with torch.no_grad():
            first.weight_g.mul_(1.7)  # weight_g no longer equals ||v||: the derived weight is not v
    model = _mlp(first)
    x, y = torch.randn(7, 4, first.in_features, dtype=torch.float64), torch.randn(7, 4, 3, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="excluded") if not covered else _no_warning():
        got, want, cov = _norms(model, x, y, bookkeeping)
    _assert_exact(got, want)
    first_params = {f"0.{n}" for n, _ in first.named_parameters()}
    assert (first_params <= set(cov["covered"])) == covered, cov
    if not covered:
        assert first_params <= set(cov["uncovered"])
        assert not first_params & set(cov["covered"])


class _no_warning:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error", RuntimeWarning)

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)


@BOOKKEEPING
def test_scaled_embedding_subclass_is_followed_by_id_and_exact(bookkeeping):
    """An Embedding subclass with a forward of its own (a lookup, then a scale) has no rule: its table is followed as
    a model's own parameter, looked up by the batch's ids (kept by id), and exact."""
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = ScaledEmbedding(11, 6)
            self.head = nn.Linear(6, 3)

        def forward(self, ids):
            return self.head(self.tok(ids))

    model = Model().double()
    ids, y = torch.randint(0, 11, (5, 4)), torch.randn(5, 4, 3, dtype=torch.float64)
    with _no_warning():
        got, want, cov = _norms(model, ids, y, bookkeeping)
    _assert_exact(got, want)
    assert not cov["uncovered"] and {"tok.weight", "head.weight"} <= set(cov["covered"])


@BOOKKEEPING
def test_a_table_tied_to_a_subclass_without_a_rule_is_left_out_with_it(bookkeeping):
    """BART's layout before its scaled embeddings had a rule: a plain Embedding (never called) and a Linear head share
    their weight with an Embedding subclass that overrides forward. The tied layers are left out with the subclass,
    named, and the rest is exact (the use check refused every norm here, as the subclass's use was no rule's)."""
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared, self.tok = nn.Embedding(11, 6), ScaledEmbedding(11, 6)
            self.mid, self.head = nn.Linear(6, 6), nn.Linear(6, 11, bias=False)
            self.tok.weight = self.head.weight = self.shared.weight

        def forward(self, ids):
            return self.head(self.mid(self.tok(ids)))

    model = Model().double()
    ids, y = torch.randint(0, 11, (5, 4)), torch.randn(5, 4, 11, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="its parameters are also tok's, which no rule covers"):
        got, want, cov = _norms(model, ids, y, bookkeeping)
    _assert_exact(got, want)
    assert set(cov["uncovered"]) == {"shared.weight"} and set(cov["covered"]) == {"mid.weight", "mid.bias"}


@BOOKKEEPING
def test_a_registered_subclass_is_covered_and_exact(bookkeeping):
    register_norm_rule(SameMathLinear)(LinearRule)
    model = _mlp(SameMathLinear(5, 6))
    x, y = torch.randn(6, 3, 5, dtype=torch.float64), torch.randn(6, 3, 3, dtype=torch.float64)
    got, want, cov = _norms(model, x, y, bookkeeping, strict=True)
    _assert_exact(got, want)
    assert {"0.weight", "0.bias"} <= set(cov["covered"])


@BOOKKEEPING
@pytest.mark.parametrize("affine", [False, True])
def test_batch_norm_in_training_mode_is_refused_and_fine_in_eval(affine, bookkeeping):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6, affine=affine), nn.Linear(6, 3)).double()
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(model, bookkeeping=bookkeeping)
    _loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"1 \(BatchNorm1d\) normalises with statistics of the whole batch"):
        psn.local_norms()
    psn.close()
    model.eval()  # running statistics: every sample on its own
    got, want, cov = _norms(model, x, y, bookkeeping)
    _assert_exact(got, want)
    assert {"0.weight", "2.weight"} <= set(cov["covered"])


@BOOKKEEPING
def test_coverage_follows_requires_grad_at_each_step(bookkeeping):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    for p in model[0].parameters():
        p.requires_grad_(False)
    x, y = torch.randn(6, 4, 5, dtype=torch.float64), torch.randn(6, 4, 3, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(model, bookkeeping=bookkeeping, strict=True)
    try:
        for step, trainable in enumerate([("2",), ("0", "2"), ("0",)]):
            for name, p in model.named_parameters():
                p.requires_grad_(name.split(".")[0] in trainable)
            model.zero_grad()
            _loss(model(x), y).backward()
            got = psn.local_norms()
            cov = psn.coverage()
            expected = {f"{layer}.{kind}" for layer in trainable for kind in ("weight", "bias")}
            assert set(cov["covered"]) == expected and not cov["uncovered"], (step, cov)
            psn.pause()  # the reference loop's forward passes are not samples of the next step
            _assert_exact(got, loop_per_sample_norms(model, _loss, x, y, params=expected))
            psn.start()
    finally:
        psn.close()


class _Scale(nn.Module):
    """A leaf layer without a rule: its parameter multiplies the batch (followed: free_parameters), its cumulative sum
    does (followed through the sum's vector-Jacobian product: followed_through), or it meets the batch in a stack (left
    out, named)."""

    def __init__(self, use: str):
        super().__init__()
        self.s, self.use = nn.Parameter(torch.ones(3, dtype=torch.float64), requires_grad=False), use

    def forward(self, x):
        if self.use == "stack":
            return torch.stack([x, self.s.expand_as(x)], -1).amax(-1)
        return x * (self.s.cumsum(0) if self.use == "cumsum" else self.s)


@pytest.mark.parametrize("use", ["multiplied", "cumsum", "stack"])
def test_unfreezing_a_parameter_no_rule_covers_is_followed_or_warned_at_the_next_step(use):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), _Scale(use)).double()
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(model)
    model[1].s.requires_grad_(True)
    _loss(model(x), y).backward()
    left_out = use == "stack"
    if left_out:
        with pytest.warns(RuntimeWarning, match=r"layer '1.s' is not per-sample \(the model uses this parameter in stack"):
            got = psn.local_norms()
    else:
        with _no_warning():
            got = psn.local_norms()
    cov = psn.coverage()
    assert set(cov["uncovered"]) == ({"1.s"} if left_out else set())
    assert set(cov["covered"]) == {"0.weight", "0.bias"} | (set() if left_out else {"1.s"})
    _assert_exact(got, loop_per_sample_norms(model, _loss, x, y, params=set(cov["covered"])))
    psn.close()


@BOOKKEEPING
def test_a_leaf_layer_scale_and_response_normalisation_are_exact(bookkeeping):
    """Leaf layers without a rule whose parameters only multiply and add to the batch (DINOv2's layer scale, ConvNeXt
    V2's global response normalisation) are followed as a model's own parameters."""

    class LayerScale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gamma = nn.Parameter(torch.randn(6, dtype=torch.float64))

        def forward(self, x):
            return x * self.gamma

    class ResponseNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(1, 1, 6, dtype=torch.float64))
            self.bias = nn.Parameter(torch.randn(1, 1, 6, dtype=torch.float64))

        def forward(self, x):
            norms = torch.linalg.vector_norm(x, ord=2, dim=1, keepdim=True)
            return self.weight * (x * norms / (norms.mean(dim=-1, keepdim=True) + 1e-6)) + self.bias + x

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), LayerScale(), ResponseNorm(), nn.Linear(6, 3)).double()
    x, y = torch.randn(4, 7, 5, dtype=torch.float64), torch.randn(4, 7, 3, dtype=torch.float64)
    with _no_warning():
        got, want, cov = _norms(model, x, y, bookkeeping, strict=True)
    assert {"1.gamma", "2.weight", "2.bias"} <= set(cov["covered"]) and not cov["uncovered"]
    _assert_exact(got, want)


@BOOKKEEPING
def test_multihead_attention_model(bookkeeping):
    """Book-keeping on a model with nn.MultiheadAttention: it crashed reading MHA's `weight`."""
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(4, 8)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.out = nn.Linear(8, 3)

        def forward(self, x):
            h = self.inp(x)
            return self.out(self.attn(h, h, h, need_weights=False)[0])

    model = Model().double()
    x, y = torch.randn(5, 6, 4, dtype=torch.float64), torch.randn(5, 6, 3, dtype=torch.float64)
    got, want, cov = _norms(model, x, y, bookkeeping, strict=True)
    _assert_exact(got, want)
    assert "attn.in_proj_weight" in cov["covered"]


class _AttentionVariant(nn.Module):
    """nn.MultiheadAttention as its users configure it: separate key/value widths (kdim/vdim: q/k/v_proj_weight),
    add_bias_kv (bias_k/bias_v appended to every sample's keys and values), add_zero_attn, masks, sequence-first."""

    def __init__(self, batch_first=True, masks=(), need_weights=False, **kwargs):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first, **kwargs)
        self.kv = nn.Linear(4, kwargs.get("kdim") or 8), nn.Linear(4, kwargs.get("vdim") or 8)
        self.key_in, self.value_in = self.kv
        self.masks, self.need_weights, self.batch_first = masks, need_weights, batch_first
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h, k, v = self.inp(x), self.key_in(x), self.value_in(x)
        t = x.shape[1]
        extra = {}
        if "causal" in self.masks:  # the hint with its mask; torch takes SDPA's causal path without weights
            extra = {"attn_mask": nn.Transformer.generate_square_subsequent_mask(t, dtype=x.dtype), "is_causal": True}
        if "bool" in self.masks:
            extra["attn_mask"] = torch.ones(t, t, dtype=torch.bool).triu(2)
        if "padding" in self.masks:  # from each sample's own data (its first key never masked)
            extra["key_padding_mask"] = (x[..., 0] > 0.5) & (torch.arange(t) > 0)
        if not self.batch_first:
            h, k, v = (y.transpose(0, 1) for y in (h, k, v))
        out = self.attn(h, k, v, need_weights=self.need_weights, **extra)[0]
        return self.out(out if self.batch_first else out.transpose(0, 1))


@BOOKKEEPING
@pytest.mark.parametrize("kwargs", [
    {"kdim": 3, "vdim": 5},
    {"kdim": 3, "vdim": 5, "bias": False, "batch_first": False},
    {"add_bias_kv": True},
    {"add_zero_attn": True, "masks": ("padding",)},
    {"add_bias_kv": True, "add_zero_attn": True, "masks": ("bool", "padding"), "need_weights": True},
    {"add_bias_kv": True, "masks": ("causal",)},  # the appended key masked causally, as SDPA's hint path does
    {"add_bias_kv": True, "masks": ("causal",), "need_weights": True},  # the mask padded: the appended key seen
    {"kdim": 6, "add_bias_kv": True, "add_zero_attn": True, "batch_first": False, "masks": ("padding",)},
    {"dropout": 0.3, "eval": True},  # dropout is off in eval mode
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_multihead_attention_variants_are_exact(kwargs, bookkeeping):
    kwargs = dict(kwargs)
    evaluate = kwargs.pop("eval", False)
    torch.manual_seed(0)
    model = _AttentionVariant(**kwargs).double()
    if evaluate:
        model.eval()
    x, y = torch.randn(4, 5, 4, dtype=torch.float64), torch.randn(4, 5, 3, dtype=torch.float64)
    got, want, cov = _norms(model, x, y, bookkeeping, strict=True)
    _assert_exact(got, want)
    assert set(cov["covered"]) == {n for n, _ in model.named_parameters()}


def test_multihead_attention_dropout_in_training_is_refused_by_name():
    model = _AttentionVariant(dropout=0.3).double()
    psn = gapmon.PerSampleGradNorms(model)
    with pytest.warns(RuntimeWarning, match="'attn' is not per-sample.*dropout 0.3 in training mode"):
        _loss(model(torch.randn(4, 5, 4, dtype=torch.float64)), torch.zeros(4, 5, 3, dtype=torch.float64)).backward()
    assert "attn.in_proj_weight" in psn.coverage()["uncovered"]
    psn.close()


# ---------------------------------------------------------------- uses of a parameter outside its layer
class LayerBypassed(nn.Module):
    """A Linear whose parameters are used through F.linear: its forward (and hook) never runs."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.b(torch.tanh(F.linear(x, self.a.weight, self.a.bias)))


class UsedTwice(nn.Module):
    """A Linear called once and its weight read once more outside it (a small share of the gradient)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.tanh(h) + 1e-2 * F.linear(h, self.a.weight))


@BOOKKEEPING
@pytest.mark.parametrize("make, inputs, named", [
    (UsedTwice, lambda: (torch.randn(5, 4, 5), torch.randn(5, 4, 3)), ["a.weight"]),
], ids=["weight-used-twice"])  # (an embedding's table used as the head by F.linear is exact: test_functional_tied_head)
def test_a_parameter_used_outside_its_layer_is_left_out_by_name_and_the_rest_is_exact(make, inputs, named, bookkeeping):
    """Its layer (and what it is tied to) is left out, what it added taken back out, named; the other layers' norms
    are exact (every norm was refused here); strict=True refuses."""
    torch.manual_seed(0)
    model = make().double()
    x, y = inputs()
    x = x.double() if x.is_floating_point() else x
    psn = gapmon.PerSampleGradNorms(model, bookkeeping=bookkeeping)
    for _ in range(2):  # two micro-batches
        _loss(model(x), y.double()).backward()
    with pytest.warns(RuntimeWarning, match="no per-sample rule saw") as caught:
        got = psn.local_norms()
    cov = psn.coverage()
    psn.close()
    message = " ".join(str(w.message) for w in caught)
    assert all(f"{n} (relative difference" in message for n in named), message
    others = {n for n, _ in model.named_parameters()} - set(named)
    assert not any(f"{n} (relative" in message for n in others), message
    assert set(named) <= set(cov["uncovered"]) and cov["covered"]
    want = loop_per_sample_norms(model, _loss, x, y.double(), params=set(cov["covered"]))
    _assert_exact(got, torch.cat([want, want]))
    strict = gapmon.PerSampleGradNorms(model, bookkeeping=bookkeeping, strict=True)
    _loss(model(x), y.double()).backward()
    with pytest.raises(RuntimeError, match="no per-sample rule saw"):
        strict.local_norms()
    strict.close()


@BOOKKEEPING
def test_a_layer_used_only_through_its_parameters_is_exact(bookkeeping):
    """A Linear whose forward never runs while its parent passes its weights to F.linear (torchvision's Swin): its
    parameters are followed outside its forward (functional_layers), and its norms are exact."""
    torch.manual_seed(0)
    model = LayerBypassed().double()
    x, y = torch.randn(5, 4, 5, dtype=torch.float64), torch.randn(5, 4, 3, dtype=torch.float64)
    got, want, cov = _norms(model, x, y, bookkeeping, strict=True)
    assert not cov["uncovered"] and not cov["skipped_layers"]
    _assert_exact(got, want)


class LayerFused(nn.Module):
    """A Linear whose weights go into an op the batch tracking does not follow (Mamba's fused kernel taking its
    projections' weights; here addmm): its forward never runs."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.b(torch.tanh(torch.addmm(self.a.bias, x, self.a.weight.t())))


@BOOKKEEPING
def test_a_layer_used_only_in_an_op_not_followed_is_left_out_and_the_rest_is_exact(bookkeeping):
    """Its norms cannot be read, so it is left out with a warning naming the op (strict=True refuses), and the norms of
    the rest are exact, not refused."""
    torch.manual_seed(0)
    model = LayerFused().double()
    x, y = torch.randn(5, 5, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(model, bookkeeping=bookkeeping)
    _loss(model(x), y).backward()
    with pytest.warns(RuntimeWarning, match=r"layer 'a' is not per-sample .*passes its parameters to addmm"):
        got = psn.local_norms()
    cov = psn.coverage()
    psn.close()
    assert set(cov["covered"]) == {"b.weight", "b.bias"} and cov["skipped_layers"] == ["a"]
    want = loop_per_sample_norms(model, _loss, x, y, params={"b.weight", "b.bias"})
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    strict = gapmon.PerSampleGradNorms(model, strict=True)
    _loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match="passes its parameters to addmm"):
        strict.local_norms()
    strict.close()


class KeyBias(nn.Module):
    """Attention whose key projection has a bias: softmax ignores it, so its gradient is rounding noise."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.out = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        att = (self.q(x) @ self.k(x).transpose(1, 2)).softmax(-1)
        return self.out(att @ self.v(x))


def test_a_gradient_that_cancels_to_rounding_noise_is_no_unseen_use():
    """A key bias's gradient is ~1e-17 of its weight's: the check judges it against its layer's size, not its own
    (it refused every model with key biases: HF ViT)."""
    torch.manual_seed(0)
    model = KeyBias().double()
    x, y = torch.randn(4, 5, 6, dtype=torch.float64), torch.randn(4, 5, 3, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(model, strict=True)
    _loss(model(x), y).backward()
    got = psn.local_norms()
    psn.close()
    assert model.k.bias.grad.norm() < 1e-12 * model.k.weight.grad.norm()  # the cancellation this is about
    want = loop_per_sample_norms(model, _loss, x, y)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


class SometimesUsedTwice(UsedTwice):
    """UsedTwice on the steps `twice` says, a plain two-layer net on the others."""

    twice = True

    def forward(self, x):
        return super().forward(x) if self.twice else self.b(torch.tanh(self.a(x)))


def _step_refused(psn, model, twice: bool, x, y, refusal: str) -> bool:
    """One step of a model whose `twice` reads a weight outside its layer: on those steps local_norms() must raise
    `refusal` (True returned); on the others it is left to the caller (False)."""
    psn.reset()
    model.zero_grad(set_to_none=True)
    model.twice = twice
    _loss(model(x), y).backward()
    if twice:
        with pytest.raises(RuntimeError, match=refusal):
            psn.local_norms()
    return twice


def test_the_use_check_starts_over_every_step():
    """The checks are kept from step to step for their parameters (sums zeroed): a clean step after a refused one is
    exact, a bad step after a clean one is refused, and a parameter resized between steps is checked at its new shape."""
    torch.manual_seed(0)
    model = SometimesUsedTwice().double()
    psn = gapmon.PerSampleGradNorms(model, strict=True)  # (refused, not left out from then on)
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    for twice in (True, False, True, False):
        if _step_refused(psn, model, twice, x, y, r"a\.weight \(relative difference"):
            continue
        _assert_exact(psn.local_norms(), loop_per_sample_norms(model, _loss, x, y))
    with torch.no_grad():  # the layers resized in place (the parameter objects kept): 7 hidden units
        model.a.weight.data = torch.randn(7, 5, dtype=torch.float64)
        model.a.bias.data = torch.randn(7, dtype=torch.float64)
        model.b.weight.data = torch.randn(3, 7, dtype=torch.float64)
    for twice in (False, True):
        psn.reset()
        model.zero_grad(set_to_none=True)
        model.twice = twice
        if twice:  # a.weight is no longer square: b's weight read outside b instead
            model.twice = False
            _loss(model(x) + 1e-2 * F.linear(torch.tanh(model.a(x)), model.b.weight), y).backward()
            with pytest.raises(RuntimeError, match=r"b\.weight \(relative difference"):
                psn.local_norms()
        else:
            _loss(model(x), y).backward()
            _assert_exact(psn.local_norms(), loop_per_sample_norms(model, _loss, x, y))
    psn.close()


class MixedPrecisionUsedTwice(nn.Module):
    """A float64 layer and a float32 one, the float32 layer's weight read once more outside it on the steps `twice`
    says."""

    twice = False

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 6).double(), nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x)).to(self.b.weight.dtype)  # (the float64 reference copy: float64 throughout)
        out = self.b(h)
        return out + 1e-2 * F.linear(h, self.b.weight) if self.twice else out


def test_the_use_check_arena_holds_the_kept_checks_by_dtype():
    """From the second step on the kept checks' sums are slices of one buffer per dtype (zeroed in one op, compared in
    one pass): the same norms as the float64 loop step after step, and a use outside the layer is still refused by name
    after clean steps, and a clean step after it is exact again."""
    torch.manual_seed(0)
    model = MixedPrecisionUsedTwice()
    psn = gapmon.PerSampleGradNorms(model, strict=True)  # (refused, not left out from then on)
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3)
    for step, twice in enumerate((False, False, True, False)):
        if _step_refused(psn, model, twice, x, y, r"b\.weight \(relative difference"):
            continue
        want = loop_per_sample_norms(model, lambda out, t: _loss(out.double(), t.double()), x, y)
        torch.testing.assert_close(psn.local_norms().double(), want, rtol=1e-5, atol=0)
        arena = psn._checker._arena
        if step:
            assert arena is not None and sorted(str(b.dtype) for b, _, _ in arena.buffers) == ["torch.float32",
                                                                                                 "torch.float64"]
    psn.close()


class DeepUsedTwice(nn.Module):
    """`depth` Linear layers, the weight of the middle one read once more outside it."""

    def __init__(self, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(5, 5) for _ in range(depth))

    def forward(self, x):
        mid = len(self.layers) // 2
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == mid:
                x = x + 1e-3 * F.linear(x, layer.weight)
        return x


@pytest.mark.parametrize("depth", [3, 40], ids=["few-checks", "many-checks-one-pass"])
def test_the_use_check_names_the_one_parameter_among_many(depth):
    """Few checks take multi-tensor norms, many (>= 64 parameters) one statistics pass: either way the parameter
    read outside its layer is named, and the same model without that read is exact."""
    torch.manual_seed(0)
    model = DeepUsedTwice(depth).double()
    x, y = torch.randn(4, 3, 5, dtype=torch.float64), torch.randn(4, 3, 5, dtype=torch.float64)
    psn = gapmon.PerSampleGradNorms(model, strict=True)
    _loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match="no per-sample rule saw") as info:
        psn.local_norms()
    message = str(info.value)
    assert f"layers.{depth // 2}.weight (relative difference" in message and message.count("(relative difference") == 1
    psn.close()
    plain = nn.Sequential(*[m for layer in model.layers for m in (layer, nn.Tanh())])
    psn = gapmon.PerSampleGradNorms(plain)
    _loss(plain(x), y).backward()
    _assert_exact(psn.local_norms(), loop_per_sample_norms(plain, _loss, x, y))
    psn.close()


def test_a_parameter_unfrozen_after_construction_and_used_outside_its_layer_is_seen():
    """Frozen when built, unfrozen later and used only through F.linear: followed from the first micro-batch in
    which it trains, so the norms stay exact before and after."""
    torch.manual_seed(0)
    model = LayerBypassed().double()
    for p in model.a.parameters():
        p.requires_grad_(False)
    psn = gapmon.PerSampleGradNorms(model)
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    _loss(model(x), y).backward()
    got = psn.local_norms()
    psn.pause()  # the reference's own passes are not samples of the next step
    _assert_exact(got, loop_per_sample_norms(model, _loss, x, y))  # a is frozen: exact
    psn.start()
    for p in model.a.parameters():
        p.requires_grad_(True)
    _loss(model(x), y).backward()
    with _no_warning():
        got = psn.local_norms()
    assert {"a.weight", "a.bias"} <= set(psn.coverage()["covered"])
    psn.close()
    _assert_exact(got, loop_per_sample_norms(model, _loss, x, y))


@pytest.mark.parametrize("dtype, autocast", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)],
                         ids=["float32", "bf16-autocast", "bf16"])
@BOOKKEEPING
def test_the_use_check_raises_no_false_alarm_in_low_precision(dtype, autocast, bookkeeping):
    """A GPT whose every parameter is used inside its layer: the check passes where the gradients are
    rounded (bf16 GEMM results, bf16 embedding rows summed 64 times), over two micro-batches."""
    from gapmon.apps.examples import GPTConfig, TinyGPT, lm_loss, synthetic_batch

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, seq_len=64, d_model=32, n_heads=2, n_layers=2)
    model = TinyGPT(cfg).to(dtype)
    x, y = synthetic_batch(cfg, 64, 0)
    psn = gapmon.PerSampleGradNorms(model, bookkeeping=bookkeeping)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        lm_loss(out, y).backward()
    norms = psn.local_norms()
    psn.close()
    assert norms.shape == (128,) and torch.isfinite(norms).all()


def test_sparse_embedding_gradients_are_checked():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 6, sparse=True), nn.Linear(6, 3)).double()
    ids, y = torch.randint(0, 11, (5, 4)), torch.randn(5, 4, 3, dtype=torch.float64)
    got, want, cov = _norms(model, ids, y, False, strict=True)
    _assert_exact(got, want)

    class SparseTied(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(11, 6, sparse=True)

        def forward(self, ids):
            return self.tok(ids) + F.embedding((ids + 1) % 11, self.tok.weight, sparse=True)  # a lookup no rule sees

    model = SparseTied().double()
    psn = gapmon.PerSampleGradNorms(model, strict=True)
    _loss(model(ids), torch.randn(5, 4, 6, dtype=torch.float64)).backward()
    with pytest.raises(RuntimeError, match=r"'tok' is not per-sample \(its table is used .* by embedding"):
        psn.local_norms()
    psn.close()
