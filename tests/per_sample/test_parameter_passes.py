"""Backward passes that give no parameter its gradient (gapmon/per_sample/parameter_passes.py): adversarial
training's input gradients (FGSM, PGD: torch.autograd.grad(loss, x) or backward(inputs=[x])) leave the micro-batches
they ran through out, and the norms are those of the step's own backward, exact against a float64 loop over the
samples (each sample's own attack, then its own gradient), with and without book-keeping; a pass for the parameters'
gradients taken with torch.autograd.grad is measured."""
import pytest
import torch
import torch.nn as nn

import gapmon

B = 6
BOOKKEEPING = pytest.mark.parametrize("bookkeeping", [False, True], ids=["hooks", "bookkeeping"])


class PositionsAndNorm(nn.Module):
    """A Linear, a model's own position table added to the batch, a LayerNorm and a head."""

    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.head = nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3)
        self.pos = nn.Parameter(torch.randn(5, 8) * 0.1)

    def forward(self, x):
        return self.head(self.norm(torch.tanh(self.inp(x) + self.pos)).mean(1))


def _setup():
    torch.manual_seed(0)
    model = PositionsAndNorm().double()
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(B, 5, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (B,), generator=g)


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y, reduction="sum")


def _attack(model, x, y, steps: int, how: str):
    """PGD by the sign of the input gradient (FGSM for one step)."""
    x_adv = x.clone().requires_grad_()
    for _ in range(steps):
        loss = _loss(model, x_adv, y)
        if how == "autograd.grad":
            (g,) = torch.autograd.grad(loss, x_adv)
        else:
            loss.backward(inputs=[x_adv])
            g = x_adv.grad
        x_adv = (x_adv + 0.05 * g.sign()).detach().requires_grad_()
    return x_adv.detach()


def _own_norms(model, x, y, steps: int, how: str):
    norms = []
    for i in range(x.shape[0]):
        x_adv = _attack(model, x[i:i + 1], y[i:i + 1], steps, how)
        grads = torch.autograd.grad(_loss(model, x_adv, y[i:i + 1]), list(model.parameters()))
        norms.append(torch.sqrt(sum(g.square().sum() for g in grads)))
    return torch.stack(norms)


@BOOKKEEPING
@pytest.mark.parametrize("how", ["autograd.grad", "backward(inputs=)"])
@pytest.mark.parametrize("steps", [1, 3], ids=["fgsm", "pgd3"])
def test_adversarial_training_measures_the_step_on_the_attacked_batch(bookkeeping, how, steps):
    model, x, y = _setup()
    want = _own_norms(model, x, y, steps, how)
    norms = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True, bookkeeping=bookkeeping)
    model.zero_grad()
    _loss(model, _attack(model, x, y, steps, how), y).backward()
    got = norms.local_norms()
    assert got.shape == (B,)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    norms.close()


@BOOKKEEPING
def test_parameter_gradients_taken_with_autograd_grad_are_measured(bookkeeping):
    """torch.autograd.grad(loss, params) (a functional optimizer step, a meta-learning inner loop): the pass gives the
    parameters their gradients, so its per-sample norms are the samples' own."""
    model, x, y = _setup()
    want = torch.stack([torch.sqrt(sum(g.square().sum() for g in torch.autograd.grad(
        _loss(model, x[i:i + 1], y[i:i + 1]), list(model.parameters())))) for i in range(B)])
    norms = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True, bookkeeping=bookkeeping)
    torch.autograd.grad(_loss(model, x, y), list(model.parameters()))
    torch.testing.assert_close(norms.local_norms(), want, rtol=1e-12, atol=0)
    norms.close()


def test_a_forward_that_served_an_input_gradient_alone_has_no_samples_of_the_step():
    model, x, y = _setup()
    norms = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True)
    _attack(model, x, y, 1, "autograd.grad")
    assert norms.local_norms().shape == (0,)
    norms.close()
