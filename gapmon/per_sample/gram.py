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

import fnmatch
from typing import Sequence

import torch

from ..utils import check_int, cosine_from_gram, first_of_each_id
from .micro_batch import MicroBatch
from .sample_ids import sample_ids as checked_sample_ids


def own_loss_scale(k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """K of the weighted gradients w_i g_i -> K of the own-loss gradients g_i (0 where a weight is 0)."""
    return own_loss_rows(own_loss_rows(k, weights).T, weights).T


def _layer_gram(module, rule, held: list[tuple[int, int, tuple]], total: int, device: torch.device) -> torch.Tensor:
    """[total, total] Gram of one layer's parameters from its (row offset, samples, positions) blocks: every pair
    of blocks once, by the layer's rule."""
    k = torch.zeros(total, total, dtype=torch.float64, device=device)
    with torch.no_grad():
        for x, (oa, ba, pa) in enumerate(held):
            for ob, bb, pb in held[x:]:
                block = rule.gram_block(module, pa, pb).double().to(device)
                k[oa:oa + ba, ob:ob + bb] = block
                k[ob:ob + bb, oa:oa + ba] = block.T
    return k


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
        held = [(offsets[m], mb.batch, mb.kept_positions()[index]) for m, mb in enumerate(micro) if index in mb.positions]
        if held:
            device = next(t.device for t in held[0][2] if isinstance(t, torch.Tensor))
            out[name] = own_loss_scale(_layer_gram(module, rule, held, total, device), weights)
    return out


def global_gram(layers: list, micro: list[MicroBatch], weights: torch.Tensor, ids: torch.Tensor, group,
                enabled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, K): the Gram of every rank's samples, ordered by sample id, each id once. Every rank's kept positions
    are all-gathered (the layers' inputs and output gradients of the step: the cost of exactness across
    ranks) and every rank computes the same K."""
    import torch.distributed as dist

    if not enabled:
        gram_by_layer(layers, micro, weights, enabled)  # raises the same error
    mine = {"ids": ids.cpu(), "weights": weights.cpu(), "batches": [mb.batch for mb in micro],
            "positions": [{i: tuple(t.cpu() for t in pos) for i, pos in mb.kept_positions().items()} for mb in micro]}
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    parts = [mine] if world == 1 else [None] * world
    if world > 1:
        dist.all_gather_object(parts, mine, group=group)
    device = next((t.device for mb in micro for pos in mb.kept_positions().values() for t in pos), torch.device("cpu"))
    blocks: dict[int, list[tuple[int, int, tuple]]] = {}
    offset = 0
    for part in parts:
        for batch, positions in zip(part["batches"], part["positions"]):
            for index, pos in positions.items():
                blocks.setdefault(index, []).append((offset, batch, tuple(t.to(device) for t in pos)))
            offset += batch
    k = sum((_layer_gram(layers[i][1], layers[i][2], held, offset, device) for i, held in blocks.items()),
            torch.zeros(offset, offset, dtype=torch.float64, device=device))
    k = own_loss_scale(k, torch.cat([p["weights"] for p in parts]))
    ids, rows = first_of_each_id(torch.cat([p["ids"] for p in parts]))
    rows = rows.to(k.device)
    return ids, k[rows][:, rows]


def own_loss_rows(g: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-sample gradients of the weighted loss, g[i] = w_i grad loss_i -> grad loss_i (0 where w_i is 0)."""
    w = weights.to(g.device, torch.float64).reshape(-1, *([1] * (g.dim() - 1)))
    return torch.where(w != 0, g / torch.where(w != 0, w, torch.ones_like(w)), torch.zeros_like(g))


def _kept_chunks(micro: list[MicroBatch], chunk: int):
    """Yields (offset of the micro-batch, it, layer index, first sample in it, count, positions of those
    samples) over the kept positions, `chunk` samples at a time (a position tensor may hold k rows a sample)."""
    offset = 0
    for mb in micro:
        for index, pos in mb.kept_positions().items():
            for start in range(0, mb.batch, chunk):
                c = min(chunk, mb.batch - start)
                yield offset, mb, index, start, c, tuple(
                    t[start * (t.shape[0] // mb.batch):(start + c) * (t.shape[0] // mb.batch)]
                    if isinstance(t, torch.Tensor) else t for t in pos)
        offset += mb.batch


def per_sample_gradients(layers: list, micro: list[MicroBatch], weights: torch.Tensor, param_names: dict[int, str],
                         chunk: int):
    """Yields (layer name, first sample, count, {parameter name: [count, *shape] float64}) of the own-loss
    per-sample gradients of every layer whose positions were kept, `chunk` samples at a time (only one chunk
    is materialised at once)."""
    for offset, _, index, start, c, piece in _kept_chunks(micro, chunk):
        name, module, rule = layers[index]
        w = weights[offset + start:offset + start + c]
        grads = {}
        with torch.no_grad():
            for param, g in rule.per_sample_grads(module, piece, c):
                grads[param_names[id(param)]] = own_loss_rows(g, w)
        yield name, offset + start, c, grads


def reference_dots(layers: list, micro: list[MicroBatch], weights: torch.Tensor, reference: dict[int, torch.Tensor],
                   chunk: int) -> torch.Tensor:
    """[B] float64 <g_i, g_ref> of the own-loss per-sample gradients over the layers whose positions were kept and
    the parameters `reference` holds (id(parameter) -> its reference gradient), `chunk` samples at a time."""
    out = torch.zeros(sum(mb.batch for mb in micro), dtype=torch.float64)
    for offset, _, index, start, c, piece in _kept_chunks(micro, chunk):
        _, module, rule = layers[index]
        with torch.no_grad():
            out[offset + start:offset + start + c] += rule.reference_dots(module, piece, c, reference).cpu()
    return own_loss_rows(out, weights)


class GradientProducts:
    """What PerSampleGradNorms gives beyond the norms from the positions it keeps (gram=True, or keep_layers):
    Gram matrices, similarities, inner products with a reference gradient and the per-sample gradients
    themselves. A mixin: it reads the norms' own state (coverage, micro-batches, weights, parameter names)."""

    def gram(self) -> torch.Tensor:
        """[B_local, B_local] float64 Gram matrix K[i, j] = <g_i, g_j> of this rank's samples' own-loss gradients
        over the covered parameters (gram=True; gapmon.per_sample.gram): its diagonal is local_norms()**2."""
        layers = self.gram_by_layer()
        if layers:
            return torch.stack(list(layers.values())).sum(0)
        b = sum(mb.batch for mb in self._state.micro)  # no covered layer was per-sample: zeros, as local_norms()
        return torch.zeros(b, b, dtype=torch.float64)

    def gram_by_layer(self) -> dict[str, torch.Tensor]:
        """gram() of each covered layer's parameters, by module name."""
        self._collect()
        return gram_by_layer(self._coverage.layers, self._state.micro, self.loss_weights(), self.config.gram)

    def global_gram(self, sample_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, K) of every rank's samples, ordered by global sample id, each id once (as global_norms):
        `sample_ids` are this rank's samples' ids in local_norms() order. Gathers every rank's kept layer
        inputs and output gradients; every rank gets the same K."""
        ids = checked_sample_ids(sample_ids, "PerSampleGradNorms.global_gram")
        self._collect()
        if ids.numel() != sum(mb.batch for mb in self._state.micro):
            raise ValueError(f"PerSampleGradNorms.global_gram: {ids.numel()} sample ids for "
                             f"{sum(mb.batch for mb in self._state.micro)} samples")
        return global_gram(self._coverage.layers, self._state.micro, self.loss_weights(), ids,
                           self.config.process_group, self.config.gram)

    def reference_dots(self, reference: dict[str, torch.Tensor], chunk: int = 8) -> torch.Tensor:
        """[B_local] float64 <g_i, g_ref>: each sample's own-loss gradient against a reference gradient (e.g. a
        validation batch's), {parameter name: tensor}, over the covered parameters it names (gram=True). Names
        that are not the model's parameters are refused."""
        if not self.config.gram:
            gram_by_layer(self._coverage.layers, self._state.micro, self.loss_weights(), False)  # raises
        by_name = {name: p for name, p in self.model.named_parameters()}
        unknown = sorted(set(reference) - set(by_name))
        if unknown:
            raise ValueError(f"PerSampleGradNorms.reference_dots: {unknown[:5]} are not parameters of the model")
        self._collect()
        ref = {id(by_name[name]): r.detach() for name, r in reference.items()}
        return reference_dots(self._coverage.layers, self._state.micro, self.loss_weights(), ref,
                              check_int(chunk, "PerSampleGradNorms.reference_dots", "chunk", 1))

    def keep_layers(self, patterns: Sequence[str]) -> list[str]:
        """Keeps the inputs and output gradients of the covered layers whose module names match one of the
        glob `patterns` ("*.attn.*"), for per_sample_gradients(); returns their names (ValueError if none)."""
        names = [name for name, _, _ in self._coverage.layers]
        chosen = {i for i, n in enumerate(names) if any(fnmatch.fnmatchcase(n, p) for p in patterns)}
        if not chosen:
            raise ValueError(f"PerSampleGradNorms.keep_layers: no covered layer matches {list(patterns)}; "
                             f"covered: {names[:20]}{' ...' if len(names) > 20 else ''}")
        if self._layer_hooks.keep_positions is not True:
            self._layer_hooks.keep_positions = chosen
        return [names[i] for i in sorted(chosen)]

    def per_sample_gradients(self, chunk: int = 8):
        """Yields (layer, first sample, count, {parameter name: [count, *shape] float64}): the per-sample
        gradients of each sample's own loss for the layers keep_layers() (or gram=True) kept, `chunk` samples
        at a time, materialised one chunk at once (Linear by a per-sample product, other layers from their
        rule's gradient sketch against identity probes)."""
        self._collect()
        return per_sample_gradients(self._coverage.layers, self._state.micro, self.loss_weights(),
                                    self._param_names, check_int(chunk, "PerSampleGradNorms.per_sample_gradients",
                                                                 "chunk", 1))

    def similarity(self) -> torch.Tensor:
        """[B_local, B_local] cosine similarity of the samples' gradients, from gram() (0 where a norm is 0)."""
        return cosine_from_gram(self.gram())

