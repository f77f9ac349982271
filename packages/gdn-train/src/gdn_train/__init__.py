"""Single-rank Gated DeltaNet training, non-deterministic and as fast as possible."""

__version__ = "0.1.0"
