"""Per-fragment state summaries ``(M, S_ext)`` for context parallelism.

A run of chunks is an affine map of the state it starts from (docs/context-parallel.md)::

    S_out = M S_in + S_ext,   M = Π_c M_c,   M_c = exp(G_last) I − (K_c ⊙ exp(G_last − G))ᵀ W_c

with ``S_ext`` the state reached from zero. :func:`fragment_summary` computes
both for one fragment ``[start, stop)`` of a rank's shard (chunks restart at
``start``, exactly as the local forward chunks that fragment), on either
backend:

* ``"triton"`` — :func:`~gdn_core.ops.cumsum.chunk_cumsum_fwd`,
  :func:`~gdn_core.ops.wy.wy_fwd`, then
  :func:`~gdn_core.ops.chunk_state.chunk_state_fwd` twice: with ``U`` for
  ``S_ext`` (zero initial state), and with ``U = 0 [T,HV,K]`` and the identity
  as initial state for ``M``. q/k normalisation uses the forward's own
  :func:`~gdn_core.ops.l2norm.l2norm_fwd`, so the summary sees the very keys
  the local forward uses.
* ``"reference"`` — the same with the fp32 stage functions of
  :mod:`gdn_core.reference` (fp64 for fp64 inputs).

Both return fp32 (fp64) ``M: [HV,K,K]`` and ``S_ext: [HV,K,V]``.
"""

from __future__ import annotations

import torch

from gdn_core.chunking import CHUNK_SIZE, ChunkIndex, chunk_index
from gdn_core.reference import chunk_cumsum_ref, chunk_states_ref, l2_normalize, wy_ref

__all__ = ["fragment_summary", "state_dtype"]


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of states, summaries and the fold: fp32 (fp64 for fp64 inputs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reference_summary(k, v, g, beta, need_M, use_qk_l2norm_in_kernel):
    dt = state_dtype(k.dtype)
    k, v, g, beta = (x.to(dt) for x in (k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        k = l2_normalize(k)
    T, H, K = k.shape
    HV = v.shape[1]
    if HV != H:
        k = k.repeat_interleave(HV // H, dim=1)
    bounds = [(0, T)]
    G = chunk_cumsum_ref(g, bounds, CHUNK_SIZE)
    _, W, U = wy_ref(k, v, beta, G, bounds, CHUNK_SIZE)
    _, _, final = chunk_states_ref(k, W, U, G, bounds, None, CHUNK_SIZE)
    M = None
    if need_M:
        eye = torch.eye(K, dtype=dt, device=k.device).expand(1, HV, K, K)
        _, _, M = chunk_states_ref(k, W, torch.zeros_like(W), G, bounds, eye, CHUNK_SIZE)
        M = M[0]
    return M, final[0]


def _triton_summary(k, v, g, beta, need_M, use_qk_l2norm_in_kernel, index):
    from gdn_core.ops import gluon
    from gdn_core.ops.chunk_state import chunk_state_fwd
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.l2norm import l2norm_fwd
    from gdn_core.ops.wy import wy_fwd

    T, H, K = k.shape
    HV = v.shape[1]
    group = HV // H
    if use_qk_l2norm_in_kernel:
        k, _ = l2norm_fwd(k)
    G = chunk_cumsum_fwd(g, index)
    # the WY stage follows the switch (its W, U feed the segment path too); the two state
    # passes stay Triton: the segment path's summaries are the Triton [E | M] launch, and
    # the E columns here must be its bits (partition invariance)
    wy = gluon.pick("wy", wy_fwd, k, v, index)
    _, W, U = wy(k, v, beta, G, index, group, output_A_inv=False)
    _, _, final = chunk_state_fwd(k, W, U, G, index, group, output_final_state=True,
                                  store_states=False)
    M = None
    if need_M:
        eye = torch.eye(K, dtype=torch.float32, device=k.device).expand(1, HV, K, K)
        _, _, M = chunk_state_fwd(k, W, torch.zeros_like(W), G, index, group,
                                  initial_state=eye, output_final_state=True,
                                  store_states=False)
        M = M[0]
    return M, final[0]


def fragment_summary(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    start: int,
    stop: int,
    *,
    need_M: bool,
    backend: str,
    use_qk_l2norm_in_kernel: bool = False,
    index: ChunkIndex | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(M, S_ext)`` of the fragment ``[start, stop)`` of a shard (``0 <= start < stop``).

    ``k: [1,T,H,K]`` (raw: normalised here when ``use_qk_l2norm_in_kernel``),
    ``v: [1,T,HV,V]``, ``g, beta: [1,T,HV]``. ``M`` is ``None`` unless
    ``need_M``. ``index``: the :class:`ChunkIndex` of ``[0, stop - start]`` on
    k's device (triton backend; built here when ``None``).
    """
    if not 0 <= start < stop <= k.shape[1]:
        raise ValueError(f"fragment [{start}, {stop}) is not a non-empty range of the shard")
    k, v, g, beta = (x[0, start:stop] for x in (k, v, g, beta))
    if backend == "reference":
        return _reference_summary(k, v, g, beta, need_M, use_qk_l2norm_in_kernel)
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'reference', got {backend!r}")
    if index is None:
        index = chunk_index((0, stop - start), k.device)
    elif index.offsets != (0, stop - start):
        raise ValueError(f"index covers {index.offsets}, expected (0, {stop - start})")
    return _triton_summary(k, v, g, beta, need_M, use_qk_l2norm_in_kernel, index)
