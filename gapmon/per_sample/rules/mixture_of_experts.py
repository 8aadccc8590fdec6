"""Mixture-of-experts blocks that route each token on its own (top-k of its own router scores, no capacity, no token
dropped or reweighted for another's sake): whatever their routing does inside (rows gathered per expert, grouped
matrix products, an index_add back), each row of their output is a function of the same row of their input alone.
Their rule covers no parameter: it says so, and the hooks put the batch back on their output, so that the layers
after them (the next block's attention and norms, the head) stay covered. The routers' and experts' weights, used
in matrix products of routed rows, are left out, named (free parameters a matrix product uses).

Switch Transformers' block is not one of these: its experts have a capacity, so a token may be dropped for the
tokens routed before it.
"""
from __future__ import annotations

from .base import NormRule, register_norm_rule_by_name

_TOKEN_WISE = ("mixtral.modeling_mixtral.MixtralSparseMoeBlock", "qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
               "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock", "olmoe.modeling_olmoe.OlmoeSparseMoeBlock",
               "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE", "gpt_oss.modeling_gpt_oss.GptOssMLP",
               "granitemoe.modeling_granitemoe.GraniteMoeMoE")


@register_norm_rule_by_name(*(f"transformers.models.{name}" for name in _TOKEN_WISE))
class TokenWiseBlockRule(NormRule):
    """A block whose output rows are its input rows' alone (see the module's docstring): no parameter of its own."""

    keeps_rows_only = True
    moves_batch = True
    param_names = ()

    def params(self, module):
        return []
