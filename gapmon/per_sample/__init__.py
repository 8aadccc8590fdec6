"""Per-sample gradient norms without per-sample gradients, their Gram matrices, and collection.

- grad_norms.py: PerSampleGradNorms (the hooks, the accumulator, the use check);
- gram.py: Gram matrices and similarities of per-sample gradients (gram=True), and their materialisation;
- collection.py: PerSampleGradients, chosen layers' per-sample gradients written to disk (read them with
  load_gradients; the file format lives in gapmon.dump.per_sample_files);
- rules/: one rule per layer family (linear, conv, embedding, norms, attention, recurrent), registered by type;
- batch_provenance.py: which dim of each tensor holds the batch, followed op by op;
- bookkeeping.py: Linear weight gradients formed from the per-sample gradients.
"""
from ..dump.per_sample_files import collected_layers, collected_steps, load_gradients, similarity_from_files
from .collection import PerSampleGradients
from .grad_norms import PerSampleGradNorms
from .rules import NormRule, register_norm_rule

__all__ = ["PerSampleGradNorms", "PerSampleGradients", "NormRule", "register_norm_rule", "load_gradients",
           "collected_steps", "collected_layers", "similarity_from_files"]
