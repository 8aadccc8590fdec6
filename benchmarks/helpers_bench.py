"""The torch.func per-sample gradient baseline used by bench_persample.py."""
import torch
from torch.func import functional_call, grad, vmap

from gapmon.examples import lm_loss


def vmap_norms(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Norms of per-sample gradients materialised with torch.func.vmap(grad(...))."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p, xi, yi):
        return lm_loss(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    grads = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    return torch.sqrt(sum(g.reshape(g.shape[0], -1).square().sum(1) for g in grads.values()))
