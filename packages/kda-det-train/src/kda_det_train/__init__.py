"""Legacy: deterministic Kimi Delta Attention (per-channel decay) training."""

__version__ = "0.9.0"
