"""Single-rank Gated DeltaNet training with bitwise-deterministic gradients."""

__version__ = "0.1.0"
