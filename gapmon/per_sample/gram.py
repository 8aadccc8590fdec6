"""Per-sample gradient Gram matrices K[i, j] = <g_i, g_j> over the covered parameters, without materialising
per-sample gradients where a cheaper exact form exists (PerSampleGradNorms(gram=True).gram()).

Each covered layer keeps its calls' positions (gapmon.per_sample.rules.base) per micro-batch; every pair of
micro-batches is one block of K, computed by the layer's rule (NormRule.gram_block): Linear by the ghost
product sum_{t,s} (a_it . a_js)(g_it . g_js) or by materialising the per-sample weight gradients, whichever
costs fewer FLOPs (as its norms choose); Embedding by pairing positions with equal ids; any other rule by
polarisation, (|g_i + g_j|^2 - |g_i|^2 - |g_j|^2) / 2, where |g_i + g_j|^2 is the rule's own norm of the two
samples' positions concatenated (as it adds two calls of a layer). The blocks are those of the gradients of
the weighted loss the backward ran on (w_i g_i); K is of each sample's own loss: divided by w_i w_j."""
from __future__ import annotations

import torch

from .micro_batch import MicroBatch


def own_loss_scale(k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """K of the weighted gradients w_i g_i -> K of the own-loss gradients g_i (0 where a weight is 0)."""
    w = weights.to(k.device, torch.float64)
    safe = torch.where(w != 0, w, torch.ones_like(w))
    return torch.where((w[:, None] != 0) & (w[None, :] != 0), k / (safe[:, None] * safe[None, :]), torch.zeros_like(k))


def gram_by_layer(layers: list, micro: list[MicroBatch], weights: torch.Tensor, enabled: bool) -> dict[str, torch.Tensor]:
    """{layer name: [B, B] float64 Gram of its parameters' own-loss per-sample gradients} over the micro-batches
    `micro` (B samples in all, in local_norms() order); `layers`: (name, module, rule) of the covered layers."""
    if not enabled:
        raise RuntimeError("PerSampleGradNorms.gram: the layers' inputs and output gradients were not kept; make it with "
                           "gram=True (PerSampleConfig(gram=True))")
    offsets, total = [], 0
    for mb in micro:
        offsets.append(total)
        total += mb.batch
    out: dict[str, torch.Tensor] = {}
    for index, (name, module, rule) in enumerate(layers):
        held = [(offsets[m], mb.batch, mb.positions[index]) for m, mb in enumerate(micro) if index in mb.positions]
        if not held:
            continue
        device = next(t.device for t in held[0][2] if isinstance(t, torch.Tensor))
        k = torch.zeros(total, total, dtype=torch.float64, device=device)
        with torch.no_grad():
            for x, (oa, ba, pa) in enumerate(held):
                for ob, bb, pb in held[x:]:
                    block = rule.gram_block(module, pa, pb).double()
                    k[oa:oa + ba, ob:ob + bb] = block
                    k[ob:ob + bb, oa:oa + ba] = block.T
        out[name] = own_loss_scale(k, weights)
    return out


def _blocks_gram(layers: list, blocks: dict[int, list[tuple[int, int, tuple]]], total: int,
                 device: torch.device) -> torch.Tensor:
    """Sum over layers of the [total, total] Gram assembled from each layer's (offset, batch, positions) blocks."""
    k = torch.zeros(total, total, dtype=torch.float64, device=device)
    with torch.no_grad():
        for index, held in blocks.items():
            _, module, rule = layers[index]
            for x, (oa, ba, pa) in enumerate(held):
                for ob, bb, pb in held[x:]:
                    block = rule.gram_block(module, pa, pb).double().to(device)
                    k[oa:oa + ba, ob:ob + bb] += block
                    if ob != oa:
                        k[ob:ob + bb, oa:oa + ba] += block.T
    return k


def global_gram(layers: list, micro: list[MicroBatch], weights: torch.Tensor, ids: torch.Tensor, group,
                enabled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, K): the Gram of every rank's samples, ordered by sample id, each id once. Every rank's kept positions
    are all-gathered (the layers' inputs and output gradients of the step: the cost of exactness across
    ranks) and every rank computes the same K."""
    import torch.distributed as dist

    if not enabled:
        gram_by_layer(layers, micro, weights, enabled)  # raises the same error
    mine = {"ids": ids.cpu(), "weights": weights.cpu(), "batches": [mb.batch for mb in micro],
            "positions": [{i: tuple(t.cpu() for t in pos) for i, pos in mb.positions.items()} for mb in micro]}
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    parts = [mine] if world == 1 else [None] * world
    if world > 1:
        dist.all_gather_object(parts, mine, group=group)
    device = next((t.device for mb in micro for pos in mb.positions.values() for t in pos), torch.device("cpu"))
    blocks: dict[int, list[tuple[int, int, tuple]]] = {}
    offset = 0
    for part in parts:
        for batch, positions in zip(part["batches"], part["positions"]):
            for index, pos in positions.items():
                blocks.setdefault(index, []).append((offset, batch, tuple(t.to(device) for t in pos)))
            offset += batch
    all_ids = torch.cat([p["ids"] for p in parts])
    k = own_loss_scale(_blocks_gram(layers, blocks, offset, device), torch.cat([p["weights"] for p in parts]))
    order = torch.argsort(all_ids, stable=True)
    sorted_ids = all_ids[order]
    keep = torch.ones_like(sorted_ids, dtype=torch.bool)
    keep[1:] = sorted_ids[1:] != sorted_ids[:-1]
    rows = order[keep].to(k.device)
    return sorted_ids[keep], k[rows][:, rows]


def cosine(k: torch.Tensor) -> torch.Tensor:
    """Cosine similarity K[i, j] / (|g_i| |g_j|) from a Gram matrix (0 where a norm is 0)."""
    norms = k.diagonal().clamp(min=0).sqrt()
    outer = norms[:, None] * norms[None, :]
    return torch.where(outer > 0, k / torch.where(outer > 0, outer, torch.ones_like(outer)), torch.zeros_like(k))


def per_sample_gradients(layers: list, micro: list[MicroBatch], weights: torch.Tensor, param_names: dict[int, str],
                         chunk: int):
    """Yields (layer name, first sample, count, {parameter name: [count, *shape] float64}) of the own-loss
    per-sample gradients of every layer whose positions were kept, `chunk` samples at a time (only one chunk
    is materialised at once)."""
    offset = 0
    for mb in micro:
        w = weights[offset:offset + mb.batch]
        for index, pos in mb.positions.items():
            name, module, rule = layers[index]
            for start in range(0, mb.batch, chunk):
                c = min(chunk, mb.batch - start)
                piece = tuple(t[start * (t.shape[0] // mb.batch):(start + c) * (t.shape[0] // mb.batch)]
                              if isinstance(t, torch.Tensor) else t for t in pos)
                scale = w[start:start + c]
                safe = torch.where(scale != 0, scale, torch.ones_like(scale))
                grads = {}
                with torch.no_grad():
                    for param, g in rule.per_sample_grads(module, piece, c):
                        s = safe.to(g.device).reshape(-1, *([1] * (g.dim() - 1)))
                        grads[param_names[id(param)]] = torch.where(s != 0, g / s, torch.zeros_like(g)) * (
                            scale.to(g.device) != 0).reshape(s.shape)
                yield name, offset + start, c, grads
        offset += mb.batch


def reference_dots(layers: list, micro: list[MicroBatch], weights: torch.Tensor, reference: dict[int, torch.Tensor],
                   chunk: int) -> torch.Tensor:
    """[B] float64 <g_i, g_ref> of the own-loss per-sample gradients over the layers whose positions were kept and
    the parameters `reference` holds (id(parameter) -> its reference gradient), `chunk` samples at a time."""
    total = sum(mb.batch for mb in micro)
    out = torch.zeros(total, dtype=torch.float64)
    offset = 0
    for mb in micro:
        for index, pos in mb.positions.items():
            _, module, rule = layers[index]
            for start in range(0, mb.batch, chunk):
                c = min(chunk, mb.batch - start)
                piece = tuple(t[start * (t.shape[0] // mb.batch):(start + c) * (t.shape[0] // mb.batch)]
                              if isinstance(t, torch.Tensor) else t for t in pos)
                with torch.no_grad():
                    out[offset + start:offset + start + c] += rule.reference_dots(module, piece, c, reference).cpu()
        offset += mb.batch
    w = weights.to(torch.float64)
    return torch.where(w != 0, out / torch.where(w != 0, w, torch.ones_like(w)), torch.zeros_like(out))
