"""Per-sample gradient norm rules, one module per layer family; importing the package registers them.

A rule turns one call of a layer into per-sample squared norms of its trainable parameters
(gapmon.per_sample.rules.base says how). Register a rule for your own layer type with
``register_norm_rule(MyLayer)(MyRule)``.
"""
from . import activation, attention, conv, conv_transpose, embedding, linear, mixture_of_experts, recurrent, reparametrized
from . import normalization as norms
from .activation import PReLURule
from .attention import MultiheadAttentionRule
from .base import (
    Call,
    NormRule,
    Sketch,
    add_sketch,
    gradient_dtype,
    overrides_ruled_forward,
    register_norm_rule,
    rule_for,
    sketch,
    sketch_rows,
    why_no_rule,
)
from .conv import ConvRule, StandardisedConvRule
from .conv_transpose import ConvTransposeRule
from .embedding import EmbeddingBagRule, EmbeddingRule, NumberScaledEmbeddingRule, ScaledEmbeddingRule
from .linear import BilinearRule, LinearRule, TransposedLinearRule, product_norm_sq, use_ghost
from .normalization import (
    GroupNormRule,
    HFFloat32RMSNormRule,
    HFGemmaRMSNormRule,
    HFRMSNormRule,
    InstanceNormRule,
    LastDimsNormRule,
    OLMoCoreNormRule,
    T5LayerNormRule,
)
from .recurrent import RecurrentCellRule, RecurrentRule
from .reparametrized import ReparametrizedRule

RULE_MODULES = (linear, conv, conv_transpose, embedding, norms, attention, recurrent, activation, mixture_of_experts,
                reparametrized)

__all__ = [
    "Call", "NormRule", "Sketch", "gradient_dtype",
    "register_norm_rule", "rule_for", "why_no_rule", "overrides_ruled_forward", "sketch", "add_sketch",
    "sketch_rows", "LinearRule", "TransposedLinearRule", "ConvRule", "StandardisedConvRule", "ConvTransposeRule",
    "EmbeddingRule",
    "ScaledEmbeddingRule", "NumberScaledEmbeddingRule", "EmbeddingBagRule", "LastDimsNormRule", "HFRMSNormRule", "HFFloat32RMSNormRule",
    "HFGemmaRMSNormRule", "OLMoCoreNormRule", "T5LayerNormRule", "GroupNormRule", "InstanceNormRule", "MultiheadAttentionRule", "RecurrentRule",
    "RecurrentCellRule", "BilinearRule", "PReLURule", "ReparametrizedRule",
    "product_norm_sq", "use_ghost", "RULE_MODULES",
]
