"""Gradient dumps: the writer (GradientDumper), the on-disk format and its typed errors, the
reconstruction of full gradients, their export, and the offline analysis of dumps."""
from .dumper import GradientDumper
from .format import DumpCorruptError, DumpError, DumpIncompleteError, DumpInconsistentError, DumpMissingError
from .reconstruct import reconstruct_gradients

__all__ = ["GradientDumper", "DumpError", "DumpMissingError", "DumpIncompleteError", "DumpCorruptError",
           "DumpInconsistentError", "reconstruct_gradients"]
