"""Random parameters of the small conv → GDN → projection blocks of the shared
compile suites (:mod:`single_rank_compile`, :mod:`single_rank_compile_gpu`,
:mod:`kcp_compile_block`)."""

from __future__ import annotations

import torch


def block_params(T: int, D: int, HV: int, V: int, W: int, *, seed: int, proj_rows: int,
                 proj_scale: float) -> dict[str, torch.Tensor]:
    """``x [1,T,D]``, gates ``g``, ``beta`` ``[1,T,HV]``, conv weight ``w [D,W]`` and
    bias ``b``, projection ``P [proj_rows, HV*V]``: fp32 on the CPU, drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(1, T, D, generator=gen),
        g=-0.5 * torch.rand(1, T, HV, generator=gen),
        beta=torch.rand(1, T, HV, generator=gen),
        w=torch.randn(D, W, generator=gen) * 0.4,
        b=torch.randn(D, generator=gen) * 0.1,
        P=torch.randn(proj_rows, HV * V, generator=gen) * proj_scale,
    )
