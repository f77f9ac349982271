"""Triton kernels, fp32 references and context-parallel state math for Gated DeltaNet training (the one shared package)."""

__version__ = "0.1.0"
