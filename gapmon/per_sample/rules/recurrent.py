"""Per-sample norms of nn.RNN, nn.LSTM and nn.GRU: per time step, every weight gradient is an outer product.

For layer l and direction d, with the input sequence x_t, the previous hidden state h_{t-1} and the
gradients δi_t = dL/d(x_t W_ihᵀ + b_ih) and δh_t = dL/d(h_{t-1} W_hhᵀ + b_hh) of the cell's two
pre-activations, a sample's gradients are
    W_ih: Σ_t δi_t x_tᵀ,   W_hh: Σ_t δh_t h_{t-1}ᵀ,   b_ih: Σ_t δi_t,   b_hh: Σ_t δh_t
(δi = δh for RNN and LSTM; GRU's candidate gate multiplies its hidden part by the reset gate, so they
differ), Linear products whose norms take the ghost or the direct form. The δ's come from the loss's
gradients of the layer's outputs (the sequence and the final states, whichever the loss uses): the rule
replays the layer unrolled, with the module's weights, and backpropagates them through it (one more
backward of this layer alone; no per-sample gradient is formed). An LSTM with proj_size projects each step's
m_t = o_t ⊙ tanh(c_t) by W_hr to the state h_t it carries: W_hr: Σ_t δr_t m_tᵀ, δr_t = dL/dh_t, one more Linear
product. Packed sequences are refused (their time steps interleave the samples); so is dropout between layers in
training mode (it cannot be replayed).

nn.RNNCell, nn.LSTMCell and nn.GRUCell are one time step of the same: a loop that calls the cell once per step
is a layer called several times, whose calls' positions concatenate along T (each call replays its step alone).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ... import _torch_compat
from .base import NormRule, register_norm_rule, sum_of_terms
from .linear import weight_and_bias_sketches, weight_and_bias_terms


def _directions(module: nn.RNNBase) -> list[tuple[int, int, str]]:
    """(layer, direction, parameter suffix) of every cell, in torch's order."""
    dirs = 2 if module.bidirectional else 1
    return [(layer, d, f"_l{layer}" + ("_reverse" if d else "")) for layer in range(module.num_layers) for d in range(dirs)]


def _cell(mode: str, gi: torch.Tensor, gh: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None,
          h_from_c: bool = True):
    """One time step of torch's cells from the two pre-activations: (h, c). `h_from_c` False: an LSTM's h without a
    path back into c (see RecurrentCellRule)."""
    if mode == "LSTM":
        i, f, g, o = (gi + gh).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c if h_from_c else c.detach()), c
    if mode == "GRU":
        ri, zi, ni = gi.chunk(3, -1)
        rh, zh, nh = gh.chunk(3, -1)
        r, z = torch.sigmoid(ri + rh), torch.sigmoid(zi + zh)
        n = torch.tanh(ni + r * nh)
        return (1 - z) * n + z * h, None
    pre = gi + gh
    return (torch.tanh(pre) if mode == "RNN_TANH" else torch.relu(pre)), None


def _pre_activation(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """a Wᵀ (+ b) of detached operands, as a tensor whose gradient autograd.grad can be asked for (δi or δh)."""
    z = a @ weight.T
    if bias is not None:
        z = z + bias
    return z if z.requires_grad else z.requires_grad_()


def _projected(module: nn.RNNBase) -> bool:
    """Whether an LSTM projects its hidden state (proj_size > 0: weight_hr)."""
    return getattr(module, "proj_size", 0) > 0


def _merged_sequences(x: torch.Tensor, batch_first: bool) -> tuple[torch.Tensor, int]:
    """(the sequences, batch first [B·R, T, d], and B) of an input whose batch is merged with R rows of sequences, as
    the hooks give it with the batch split out first ([B, R, T, d] when batch_first, else [B, T, R, d]): row b·R + r is
    sample b's, as in the merged input."""
    rows = x if batch_first else x.transpose(1, 2)
    return rows.flatten(0, 1), x.shape[0]


@register_norm_rule(nn.RNN, nn.LSTM, nn.GRU)
class RecurrentRule(NormRule):
    param_names = None  # weight_ih_l0, ..._reverse: checked in unsupported
    merged_rows = True  # (each sequence runs on its own: Sequencer's LSTMs over an image's rows merged with the batch)

    def unsupported(self, module):
        kinds = ("weight_ih", "weight_hh", "bias_ih", "bias_hh") + (("weight_hr",) if _projected(module) else ())
        known = {f"{kind}{sfx}" for _, _, sfx in _directions(module) for kind in kinds}
        extra = sorted(set(dict(module.named_parameters(recurse=False))) - known)
        if extra:
            return f"it has parameters {extra} that the recurrent rule does not know"
        return None

    def batch_operands(self, module, call):
        return [(call.arg(0, "input"), 0 if module.batch_first else 1)]

    def graded_outputs(self, module, output):
        out, state = output
        return [out, *(state if isinstance(state, tuple) else (state,))]

    def not_per_sample(self, module, call, output, batch, model_inputs):
        x = call.arg(0, "input")
        if isinstance(x, nn.utils.rnn.PackedSequence):
            return "its input is a packed sequence (its time steps interleave the samples); pad it instead"
        if not isinstance(x, torch.Tensor) or x.dim() not in (3, 4):
            return "its input is unbatched"
        if x.shape[0 if module.batch_first or x.dim() == 4 else 1] != batch:  # (4-D: merged rows, the batch first)
            return f"its input {list(x.shape)} has no batch of {batch} on dim {0 if module.batch_first else 1}"
        if module.training and module.dropout > 0 and module.num_layers > 1:
            return "dropout between its layers in training mode (random: it cannot be replayed)"
        return None

    def positions(self, module, call, g, acc):
        """(x, δi, h_prev, δh) of every cell, and (m, δr) after them with proj_size; batch first: [B, T, ·] each."""
        x, hx = call.arg(0, "input"), call.arg(1, "hx")
        grads = list(g) + [None] * (3 - len(g))
        x, samples = (x, None) if x.dim() == 3 else _merged_sequences(x, module.batch_first)
        x = x.to(acc)
        if not module.batch_first:
            x = x if samples is not None else x.transpose(0, 1)
            grads[0] = None if grads[0] is None else grads[0].transpose(0, 1)
        b, steps = x.shape[0], x.shape[1]
        dirs, hidden = (2 if module.bidirectional else 1), module.hidden_size
        lstm, projected = module.mode == "LSTM", _projected(module)
        if hx is None:
            h0 = x.new_zeros(module.num_layers * dirs, b, module.proj_size if projected else hidden)
            c0 = x.new_zeros(module.num_layers * dirs, b, hidden) if lstm else None
        else:
            h0, c0 = (hx[0].to(acc), hx[1].to(acc)) if lstm else (hx.to(acc), None)
        params = {n: p.detach().to(acc) for n, p in module.named_parameters(recurse=False)}
        pos: list[torch.Tensor] = []
        wrt: list[torch.Tensor] = []  # the pre-activations whose gradients are δi and δh
        with torch.enable_grad():
            layer_in, h_n, c_n = x, [], []
            for layer in range(module.num_layers):
                outs = []
                for d in range(dirs):
                    sfx = f"_l{layer}" + ("_reverse" if d else "")
                    seq = layer_in.flip(1) if d else layer_in
                    gi = _pre_activation(seq, params[f"weight_ih{sfx}"], params.get(f"bias_ih{sfx}"))
                    h, c = h0[layer * dirs + d], (c0[layer * dirs + d] if lstm else None)
                    prev, ghs, hs, ms = [], [], [], []
                    for t in range(steps):
                        gh = _pre_activation(h, params[f"weight_hh{sfx}"], params.get(f"bias_hh{sfx}"))
                        prev.append(h.detach())
                        ghs.append(gh)
                        h, c = _cell(module.mode, gi[:, t], gh, h, c)
                        if projected:  # h_t = W_hr m_t: its gradient is δr_t
                            ms.append(h.detach())
                            h = h @ params[f"weight_hr{sfx}"].T
                        hs.append(h)
                    out = torch.stack(hs, 1)
                    outs.append(out.flip(1) if d else out)
                    h_n.append(h)
                    c_n.append(c)
                    wrt += [gi, *ghs, *(hs if projected else ())]
                    pos += [seq.detach(), None, torch.stack(prev, 1), None]  # δ's filled in below
                    if projected:
                        pos += [torch.stack(ms, 1), None]
                layer_in = torch.cat(outs, -1) if dirs > 1 else outs[0]
            produced = [layer_in, torch.stack(h_n)] + ([torch.stack(c_n)] if lstm else [])
            targets = [(t, gr.to(acc)) for t, gr in zip(produced, grads) if gr is not None]
            found = torch.autograd.grad([t for t, _ in targets], wrt, [gr for _, gr in targets], allow_unused=True)
        found = [torch.zeros_like(w) if d is None else d for w, d in zip(wrt, found)]
        per_cell, width = (1 + 2 * steps, 6) if projected else (1 + steps, 4)
        for k in range(len(pos) // width):
            cell = found[k * per_cell:(k + 1) * per_cell]
            pos[width * k + 1] = cell[0].detach()
            pos[width * k + 3] = torch.stack(cell[1:1 + steps], 1).detach()
            if projected:
                pos[width * k + 5] = torch.stack(cell[1 + steps:], 1).detach()
        if samples is not None:  # each sample's sequences' steps as its positions: [B·R, T, ·] -> [B, R·T, ·]
            pos = [t.reshape(samples, -1, t.shape[-1]) for t in pos]
        return tuple(pos)

    @staticmethod
    def _pairs(module, pos):
        """(a, δ, weight, bias) of every Linear product of the cells' positions."""
        width = 6 if _projected(module) else 4
        for k, (_, _, sfx) in enumerate(_directions(module)):
            cell = pos[width * k:width * (k + 1)]
            for a, d, kind in ((cell[0], cell[1], "ih"), (cell[2], cell[3], "hh")):
                yield a, d, getattr(module, f"weight_{kind}{sfx}"), getattr(module, f"bias_{kind}{sfx}", None)
            if width == 6:
                yield cell[4], cell[5], getattr(module, f"weight_hr{sfx}"), None

    def norm_sq(self, module, pos):
        terms = [t for a, d, w, bias in self._pairs(module, pos) for t in weight_and_bias_terms(a, d, w, bias)]
        return sum_of_terms(terms, pos[0].shape[0], pos[0].dtype, pos[0].device)

    def grad_sketch(self, module, pos, probe):
        return [sk for a, d, w, bias in self._pairs(module, pos) for sk in weight_and_bias_sketches(a, d, w, bias, probe)]


def _cell_mode(module: nn.RNNCellBase) -> str:
    if isinstance(module, nn.LSTMCell):
        return "LSTM"
    if isinstance(module, nn.GRUCell):
        return "GRU"
    return "RNN_TANH" if module.nonlinearity == "tanh" else "RNN_RELU"


def _fused_lstm_cell(x: torch.Tensor) -> bool:
    """Whether torch computes an LSTM cell on x's device as one fused op (see _torch_compat.fuses_lstm_cell)."""
    return _torch_compat.fuses_lstm_cell(x.device)


@register_norm_rule(nn.RNNCell, nn.LSTMCell, nn.GRUCell)
class RecurrentCellRule(NormRule):
    """One step of a cell: W_ih: δi xᵀ, W_hh: δh h_prevᵀ, b_ih: δi, b_hh: δh, with the δ's of its two
    pre-activations found by replaying the step with the module's weights and backpropagating the gradients of
    its outputs (h', and c' for an LSTM cell) through it.

    An LSTM cell's c' gradient is what autograd accumulated for it, and that depends on the graph torch built: where
    the cell is composed of ops (the CPU), h' = o·tanh(c') is computed from c', so c' arrives with h''s part already
    added and the replay must not add it again; where it is one fused op (CUDA), c' gets the loss's own part only."""

    param_names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")

    def graded_outputs(self, module, output):
        return list(output) if isinstance(output, tuple) else [output]

    def not_per_sample(self, module, call, output, batch, model_inputs):
        x = call.arg(0, "input")
        if isinstance(x, torch.Tensor) and x.dim() == 1:
            return "its input is unbatched"
        if isinstance(module, nn.LSTMCell) and isinstance(x, torch.Tensor) and output.grad_fn is not None:
            fused = "FusedLstmCell" in output.grad_fn.name()
            if fused != _fused_lstm_cell(x):
                return (f"its autograd graph ({output.grad_fn.name()}) is not the one torch builds for an LSTM cell on "
                        f"{x.device.type}: the gradient c' receives cannot be told apart from h''s part")
        return super().not_per_sample(module, call, output, batch, model_inputs)

    def positions(self, module, call, g, acc):
        """(x, δi, h_prev, δh), each [B, 1, ·]."""
        x, hx = call.arg(0, "input").to(acc), call.arg(1, "hx")
        mode = _cell_mode(module)
        lstm = mode == "LSTM"
        if hx is None:
            h = x.new_zeros(x.shape[0], module.hidden_size)
            c = h if lstm else None
        else:
            h, c = (hx[0].to(acc), hx[1].to(acc)) if lstm else (hx.to(acc), None)
        grads = g if isinstance(g, tuple) else (g,)
        with torch.enable_grad():
            pre = [_pre_activation(a, getattr(module, f"weight_{kind}").detach().to(acc),
                                   None if getattr(module, f"bias_{kind}") is None
                                   else getattr(module, f"bias_{kind}").detach().to(acc))
                   for a, kind in ((x, "ih"), (h, "hh"))]
            # (see the class docstring: h''s path into c' replayed only where autograd keeps it apart)
            produced = _cell(mode, pre[0], pre[1], h, c, h_from_c=not lstm or _fused_lstm_cell(x))
            targets = [(t, gr.to(acc)) for t, gr in zip(produced, grads) if t is not None and gr is not None]
            di, dh = torch.autograd.grad([t for t, _ in targets], pre, [gr for _, gr in targets], allow_unused=True)
        di = torch.zeros_like(pre[0]) if di is None else di
        dh = torch.zeros_like(pre[1]) if dh is None else dh
        return x[:, None], di.detach()[:, None], h[:, None], dh.detach()[:, None]

    def norm_sq(self, module, pos):
        x, di, prev, dh = pos
        terms = weight_and_bias_terms(x, di, module.weight_ih, module.bias_ih)
        terms += weight_and_bias_terms(prev, dh, module.weight_hh, module.bias_hh)
        return sum_of_terms(terms, x.shape[0], x.dtype, x.device)

    def grad_sketch(self, module, pos, probe):
        x, di, prev, dh = pos
        return (weight_and_bias_sketches(x, di, module.weight_ih, module.bias_ih, probe)
                + weight_and_bias_sketches(prev, dh, module.weight_hh, module.bias_hh, probe))
