"""Context-parallel (KCP) Gated DeltaNet training over torch.distributed, bitwise deterministic."""

__version__ = "0.1.0"
