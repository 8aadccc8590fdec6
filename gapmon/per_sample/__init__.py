"""Per-sample gradient norms without per-sample gradients.

- norms.py: PerSampleGradNorms (the hooks, the accumulator, the use check);
- rules/: one rule per layer family (linear, conv, embedding, norms, attention), registered by type;
- batch_provenance.py: which dim of each tensor holds the batch, followed op by op;
- bookkeeping.py: Linear weight gradients formed from the per-sample gradients.
"""
from .grad_norms import PerSampleGradNorms
from .rules import NormRule, register_norm_rule

__all__ = ["PerSampleGradNorms", "NormRule", "register_norm_rule"]
