"""A tiny forward and backward on CPU: the import checker's smoke entry point."""

import torch

from gdn_core.compose import chunk_gdn_bwd, chunk_gdn_fwd


def run() -> None:
    """Run one small GDN forward+backward on the CPU reference backend."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 1, 16, generator=gen)
    k = torch.randn(1, 8, 1, 16, generator=gen)
    v = torch.randn(1, 8, 1, 16, generator=gen)
    g = -torch.rand(1, 8, 1, generator=gen)
    beta = torch.rand(1, 8, 1, generator=gen)
    o, _, saved = chunk_gdn_fwd(q, k, v, g, beta, deterministic=True, backend="reference")
    chunk_gdn_bwd(saved, torch.ones_like(o), deterministic=True)
