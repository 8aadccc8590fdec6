"""Per-sample norms of the affine normalisation layers (LayerNorm, RMSNorm, GroupNorm, InstanceNorm):
weight ||Σ_t G_t ⊙ x̂_t||², bias ||Σ_t G_t||².
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...stats import _backend
from .base import Call, NormRule, Sketch, register_norm_rule, register_norm_rule_by_name, sketch, sum_of_terms, trainable


# -------------------------------------------------------------------- normalisation layers
def _per_position(xhat: torch.Tensor, g: torch.Tensor, acc: torch.dtype, n: int | None = None) -> tuple:
    """(x̂, g) as [B, positions, n] in `acc` (n: the normalised elements, the last dim's by default)."""
    b, n = g.shape[0], xhat.shape[-1] if n is None else n
    return xhat.to(acc).reshape(b, -1, n), g.to(acc).reshape(b, -1, n)


class _AffineNormRule(NormRule):
    """Layers y = x̂ ⊙ weight + bias with per-position x̂: positions are (x̂, g) as [B, T, n]."""

    def per_sample_sums(self, module, pos) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, [B, n] each sample's gradient, flat) of the trainable weight (Σ_t G_t ⊙ x̂_t) and bias (Σ_t G_t):
        what the norms square and the use check sums over samples, formed once. n is the parameter's numel (a
        LayerNorm over several trailing dims has a parameter of that shape: sums are reshaped to it)."""
        xhat, g = pos
        out = []
        for name, per_sample in (("weight", lambda: (g * xhat).sum(1)), ("bias", lambda: g.sum(1))):
            p = getattr(module, name, None)
            if trainable(p):
                out.append((p, per_sample()))
        return out

    def norm_sq(self, module, pos):
        return self.norm_sq_and_grads(module, pos)[0]

    def norm_sq_and_grads(self, module, pos):
        """The squares of each sample's gradients are the norms, their sums over samples the gradients the use check
        sketches (the positions are read once, not twice)."""
        g = pos[1]
        terms, grads = [], []
        for p, sums in self.per_sample_sums(module, pos):
            terms.append(sums.square().sum(1))
            grads.append((p, sums.sum(0).reshape(p.shape)))
        return sum_of_terms(terms, g.shape[0], g.dtype, g.device), grads

    def grad_sketch(self, module, pos, probe):
        return [Sketch(p, sketch(sums.sum(0).reshape(p.shape), probe(p))) for p, sums in self.per_sample_sums(module, pos)]


@register_norm_rule(nn.LayerNorm, nn.RMSNorm)
class LastDimsNormRule(_AffineNormRule):
    """torch's LayerNorm and RMSNorm over trailing dims. Positions are the raw input (not x̂: x̂ is per position, so
    positions still concatenate along T) and g, as [B, T, n]; each sample's sums come from one op that forms x̂ on the
    way (gapmon.affine_norm_sums: on the CPU one read of both in float64, instead of x̂, its product and the sums apart)."""

    moves_batch = True
    reads_shared_rows = True  # a call on rows every sample shares: followed where they join the batch (shared_input)

    def positions(self, module, call, g, acc):
        a = call.arg(0, "input")
        return _per_position(a, g, acc, math.prod(module.normalized_shape))

    def per_sample_sums(self, module, pos):
        x, g = pos
        rms = isinstance(module, nn.RMSNorm)
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps  # F.rms_norm's default, x's dtype
        weight, bias = (getattr(module, name, None) for name in ("weight", "bias"))
        if not (trainable(weight) or trainable(bias)):
            return []
        w_sums, b_sums = _backend.affine_norm_sums(x, g, float(eps), rms)
        return [(p, sums) for p, sums in ((weight, w_sums), (bias, b_sums)) if trainable(p)]


def _hf_names(*families: tuple[str, str]) -> list[str]:
    return [f"transformers.models.{module}.modeling_{module}.{cls}" for module, cls in families]


@register_norm_rule_by_name(*_hf_names(("convnext", "ConvNextLayerNorm"), ("convnextv2", "ConvNextV2LayerNorm")))
class ChannelsFirstLayerNormRule(LastDimsNormRule):
    """ConvNeXt's LayerNorm: nn.LayerNorm over the channels, last (`data_format="channels_last"`) or on dim 1 of
    [B, C, H, W] (`"channels_first"`: moved last for nn.LayerNorm, and back): positions with the channels last."""

    def unsupported(self, module):
        if getattr(module, "data_format", None) not in ("channels_last", "channels_first"):
            return "its data_format is neither channels_last nor channels_first"
        return None

    def positions(self, module, call, g, acc):
        x = call.arg(0, "features")
        if module.data_format == "channels_first":
            x, g = x.movedim(1, -1), g.movedim(1, -1)
        return super().positions(module, Call((x,), {}), g, acc)


@register_norm_rule_by_name(*_hf_names(
    ("llama", "LlamaRMSNorm"), ("mistral", "MistralRMSNorm"), ("mixtral", "MixtralRMSNorm"), ("qwen2", "Qwen2RMSNorm"),
    ("qwen2_moe", "Qwen2MoeRMSNorm"), ("qwen3", "Qwen3RMSNorm"), ("phi3", "Phi3RMSNorm"), ("granite", "GraniteRMSNorm"),
    ("smollm3", "SmolLM3RMSNorm"), ("deepseek_v3", "DeepseekV3RMSNorm")))
class HFRMSNormRule(_AffineNormRule):
    """Hugging Face's RMSNorm (LlamaRMSNorm and the families that copy its forward): x̂ = x·rsqrt(mean(x²) + eps)
    formed in float32 whatever the input's dtype, cast back to it, then times the weight. x̂ is formed here as the
    layer forms it, so the norms are those of the gradient autograd computes (a float64 model's x̂ is float32's)."""

    moves_batch = True

    # Whether x̂ is cast to the input's dtype before the weight multiplies it (Llama) or the product is float32's (OLMo 2).
    cast_before_weight = True

    def unsupported(self, module):
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            return "its weight is not one vector over the last dim"
        if not isinstance(self._eps(module), float):
            return "it has no variance_epsilon / eps this rule can read"
        return None

    @staticmethod
    def _eps(module) -> float | None:
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        return float(eps) if isinstance(eps, (int, float)) else None

    def positions(self, module, call, g, acc):
        a = call.arg(0, "hidden_states", call.kwargs.get("x"))
        h = a.to(torch.float32)
        xhat = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self._eps(module))
        if self.cast_before_weight:
            xhat = xhat.to(a.dtype)
        return _per_position(xhat, g, acc)


@register_norm_rule_by_name(*_hf_names(("olmo2", "Olmo2RMSNorm"), ("olmo3", "Olmo3RMSNorm"), ("gpt_oss", "GptOssRMSNorm")))
class HFFloat32RMSNormRule(HFRMSNormRule):
    """The copies that multiply x̂ by the weight before casting the product (OLMo 2 and 3, gpt-oss): x̂ stays float32."""

    cast_before_weight = False


@register_norm_rule_by_name(*_hf_names(("gemma", "GemmaRMSNorm")))
class HFGemmaRMSNormRule(HFFloat32RMSNormRule):
    """Gemma's x̂ · (1 + weight.float()): the same gradient as weight · x̂, formed in float32 whatever the model's dtype
    (autograd sums it over the positions in float32: the use check allows float32's rounding)."""

    compute_dtype = torch.float32


@register_norm_rule_by_name(*_hf_names(("t5", "T5LayerNorm"), ("mt5", "MT5LayerNorm")))
class T5LayerNormRule(HFRMSNormRule):
    """T5's RMSNorm: x times rsqrt(mean(x²) + eps) with the mean formed in float32 (x itself not cast: the product is
    the wider of the two), cast to the weight's dtype when that is 16-bit, then times the weight."""

    def positions(self, module, call, g, acc):
        a = call.arg(0, "hidden_states")
        xhat = a * torch.rsqrt(a.to(torch.float32).pow(2).mean(-1, keepdim=True) + self._eps(module))
        if module.weight.dtype in (torch.float16, torch.bfloat16):
            xhat = xhat.to(module.weight.dtype)
        return _per_position(xhat, g, acc)


@register_norm_rule_by_name("olmo_core.nn.layer_norm.RMSNorm", "olmo_core.nn.layer_norm.QwenRMSNorm",
                            "olmo_core.nn.layer_norm.LayerNorm")
class OLMoCoreNormRule(_AffineNormRule):
    """OLMo-core's LayerNorm, RMSNorm and QwenRMSNorm: x̂ formed in float32 (full_precision) or in the input's dtype,
    autocast off; the weight and bias cast to x̂'s dtype (their gradients formed in it: float32 by default, which the
    use check allows), QwenRMSNorm casting x̂ back to the input's dtype first."""

    moves_batch = True
    compute_dtype = torch.float32

    def unsupported(self, module):
        weight = getattr(module, "weight", None)
        if weight is not None and tuple(weight.shape) != tuple(module.normalized_shape):
            return f"a weight {list(weight.shape)} other than its normalized shape {list(module.normalized_shape)}"
        return None

    def positions(self, module, call, g, acc):
        a = call.arg(0, "x")
        x = a.float() if module.full_precision else a
        if type(module).__name__ == "LayerNorm":
            xhat = F.layer_norm(x, tuple(module.normalized_shape), eps=module.eps)
        else:
            xhat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps)
            if type(module).__name__ == "QwenRMSNorm":
                xhat = xhat.to(a.dtype)
        return _per_position(xhat, g.to(xhat.dtype), acc)


def _channels_last_positions(x: torch.Tensor) -> torch.Tensor:
    """[B, C, *spatial] -> [B, spatial, C]: the per-channel affine parameters sum over positions."""
    b, c = x.shape[0], x.shape[1]
    return x.reshape(b, c, -1).transpose(1, 2)


@register_norm_rule(nn.GroupNorm)
class GroupNormRule(_AffineNormRule):
    def positions(self, module, call, g, acc):
        xhat = F.group_norm(call.arg(0, "input").to(acc), module.num_groups, eps=module.eps)
        return _channels_last_positions(xhat), _channels_last_positions(g.to(acc))


@register_norm_rule(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
class InstanceNormRule(_AffineNormRule):
    def unsupported(self, module):
        if module.track_running_stats:
            return "track_running_stats=True (eval mode normalises with running statistics)"
        return None

    def positions(self, module, call, g, acc):
        xhat = F.instance_norm(call.arg(0, "input").to(acc), eps=module.eps)
        return _channels_last_positions(xhat), _channels_last_positions(g.to(acc))
