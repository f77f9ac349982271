"""fp32 reference implementations of Gated DeltaNet: the oracles for every test.

Two independent formulations of the same recurrence (docs/math.md):

* :func:`naive_recurrent_gdn` — token by token, straight from the equations.
* :func:`chunk_gdn_reference` — the chunked algorithm (chunk size 64) in plain
  vectorised torch, built from the per-stage functions below. The Triton
  kernels in :mod:`gdn_core.ops` are tested stage by stage against those
  functions, and the training packages use it as their CPU fallback.

Everything is computed in float32 (or float64 when the inputs are float64, for
``gradcheck``) and is differentiable by autograd. Layout is ``[B, T, H, D]``;
``v``, ``g`` and ``beta`` carry ``HV`` heads, a multiple of ``H``.
A fixed-length batch is handled as ``B`` documents of length ``T`` laid end to
end (see :func:`gdn_core.chunking.flatten_batch`).
"""

from __future__ import annotations

import torch

from gdn_core.chunking import CHUNK_SIZE, MIN_LOG_DECAY, document_bounds

__all__ = [
    "naive_recurrent_gdn",
    "chunk_gdn_reference",
    "l2_normalize",
    "chunk_cumsum_ref",
    "wy_ref",
    "chunk_states_ref",
    "chunk_output_ref",
    "entry_state_queries_ref",
]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x²) + eps)`` over the last dimension (the in-kernel L2 norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """Cast to the compute dtype, normalise q/k if asked, expand q/k to HV heads."""
    dt = _compute_dtype(q)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    group = v.shape[2] // q.shape[2]
    if group > 1:
        q = q.repeat_interleave(group, dim=2)
        k = k.repeat_interleave(group, dim=2)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return q, k, v, g, beta, scale


def naive_recurrent_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token GDN recurrence in fp32.

    Shapes: ``q, k: [B,T,H,K]``, ``v: [B,T,HV,V]``, ``g, beta: [B,T,HV]``,
    ``initial_state: [N,HV,K,V]`` (N = number of sequences), ``cu_seqlens: [N+1]``
    (requires ``B == 1``). Returns ``o: [B,T,HV,V]`` (fp32) and the final state
    ``[N,HV,K,V]`` (fp32) if ``output_final_state`` else ``None``.
    """
    B, T = q.shape[:2]
    q, k, v, g, beta, scale = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    HV, K, V = v.shape[2], k.shape[-1], v.shape[-1]
    q, k, v, g, beta = (x.reshape(B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
    outputs, finals = [], []
    for n, (bos, eos) in enumerate(document_bounds(cu_seqlens, B, T)):
        if initial_state is not None:
            S = initial_state[n].to(q.dtype)
        else:
            S = q.new_zeros(HV, K, V)
        for t in range(bos, eos):
            S = S * g[t].exp()[:, None, None]
            kt, bt = k[t], beta[t]
            v_err = v[t] - torch.einsum("hkv,hk->hv", S, kt)
            S = S + torch.einsum("hk,hv->hkv", kt, v_err * bt[:, None])
            outputs.append(torch.einsum("hkv,hk->hv", S, q[t]) * scale)
        finals.append(S)
    if outputs:
        o = torch.stack(outputs).reshape(B, T, HV, V)
    else:
        o = q.new_zeros(B, T, HV, V)
    final = torch.stack(finals) if output_final_state else None
    return o, final


# ----------------------------------------------------------------------------
# Stage functions. Inputs are flat over tokens: x[t] for t in [0, T_total),
# documents given by ``bounds`` (a list of (bos, eos)); k already expanded to
# HV heads. Chunks restart at every document start.
# ----------------------------------------------------------------------------


def _doc_chunks(
    x: torch.Tensor, bos: int, eos: int, chunk_size: int, edge_pad: bool = False
) -> torch.Tensor:
    """Slice one document and pad it to whole chunks: ``[NT, C, *rest]``.

    Padding is zeros, or with ``edge_pad`` the document's last row repeated.
    The cumulative log-decay ``G`` must be edge-padded: it is non-increasing
    within a chunk, so ``exp(G_pad − G_j)`` stays ≤ 1, where a zero pad would
    overflow to ``inf`` for strong decay and turn ``0 · inf`` into NaN
    gradients.
    """
    seg = x[bos:eos]
    n_tok = eos - bos
    n_chunks = -(-n_tok // chunk_size)
    pad = n_chunks * chunk_size - n_tok
    if pad:
        fill = seg[-1:].expand(pad, *seg.shape[1:]) if edge_pad else seg.new_zeros(
            pad, *seg.shape[1:])
        seg = torch.cat([seg, fill])
    return seg.reshape(n_chunks, chunk_size, *seg.shape[1:])


def _unchunk(x: torch.Tensor, n_tok: int) -> torch.Tensor:
    return x.reshape(-1, *x.shape[2:])[:n_tok]


def chunk_cumsum_ref(g: torch.Tensor, bounds, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """Within-chunk inclusive cumulative sum of ``g: [T, HV]`` → ``[T, HV]``.

    ``g`` below :data:`~gdn_core.chunking.MIN_LOG_DECAY` (``-inf``: a full reset) counts
    as that value, as in the kernels (its gradient there is 0; NaN stays NaN)."""
    g = g.clamp_min(MIN_LOG_DECAY)
    parts = []
    for bos, eos in bounds:
        if eos > bos:
            parts.append(_unchunk(_doc_chunks(g, bos, eos, chunk_size).cumsum(1), eos - bos))
    return torch.cat(parts) if parts else g.new_zeros(0, *g.shape[1:])


def wy_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    G: torch.Tensor,
    bounds,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """WY representation per chunk.

    ``k: [T,HV,K]``, ``v: [T,HV,V]``, ``beta, G: [T,HV]``. Returns
    ``A_inv: [T,HV,C]`` (row ``t`` of ``(I + A)^{-1}`` of its chunk, columns
    indexed within the chunk), ``W: [T,HV,K]`` and ``U: [T,HV,V]``.
    """
    A_parts, W_parts, U_parts = [], [], []
    C = chunk_size
    for bos, eos in bounds:
        if eos == bos:
            continue
        kc = _doc_chunks(k, bos, eos, C)  # [NT, C, HV, K]
        vc = _doc_chunks(v, bos, eos, C)
        bc = _doc_chunks(beta, bos, eos, C)  # [NT, C, HV]
        Gc = _doc_chunks(G, bos, eos, C, edge_pad=True)
        kk = torch.einsum("nihk,njhk->nhij", kc, kc)
        decay = (Gc.transpose(1, 2)[..., :, None] - Gc.transpose(1, 2)[..., None, :])
        strict = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(-1)
        A = (kk * decay.masked_fill(~strict, 0).exp() * bc.transpose(1, 2)[..., :, None])
        A = A.masked_fill(~strict, 0)
        eye = torch.eye(C, dtype=k.dtype, device=k.device)
        Tinv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False,
                                             unitriangular=True)  # [NT, HV, C, C]
        bk = kc * (bc * Gc.exp())[..., None]
        bv = vc * bc[..., None]
        W = torch.einsum("nhij,njhk->nihk", Tinv, bk)
        U = torch.einsum("nhij,njhv->nihv", Tinv, bv)
        n_tok = eos - bos
        A_parts.append(_unchunk(Tinv.transpose(1, 2), n_tok))  # [n_tok, HV, C]
        W_parts.append(_unchunk(W, n_tok))
        U_parts.append(_unchunk(U, n_tok))
    if not W_parts:
        HV = k.shape[1]
        return k.new_zeros(0, HV, C), k.new_zeros(0, *k.shape[1:]), v.new_zeros(0, *v.shape[1:])
    return torch.cat(A_parts), torch.cat(W_parts), torch.cat(U_parts)


def chunk_states_ref(
    k: torch.Tensor,
    W: torch.Tensor,
    U: torch.Tensor,
    G: torch.Tensor,
    bounds,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunk-state recurrence.

    Returns ``h: [NT_total, HV, K, V]`` (the state entering each chunk, chunks
    of all documents in order), ``v_new: [T, HV, V]`` (``U − W S_c``) and the
    final states ``[N, HV, K, V]``.
    """
    HV, K, V = k.shape[1], k.shape[2], U.shape[2]
    h_parts, vn_parts, finals = [], [], []
    for n, (bos, eos) in enumerate(bounds):
        S = initial_state[n].to(k.dtype) if initial_state is not None else k.new_zeros(HV, K, V)
        if eos > bos:
            kc, Wc, Uc = (_doc_chunks(x, bos, eos, chunk_size) for x in (k, W, U))
            Gc = _doc_chunks(G, bos, eos, chunk_size, edge_pad=True)
            n_tok = eos - bos
            last = [min(chunk_size, n_tok - c * chunk_size) - 1 for c in range(kc.shape[0])]
            vns = []
            for c in range(kc.shape[0]):
                h_parts.append(S)
                vn = Uc[c] - torch.einsum("ihk,hkv->ihv", Wc[c], S)
                g_last = Gc[c, last[c]]  # [HV]
                kd = kc[c] * (g_last[None] - Gc[c]).exp()[..., None]
                # padded rows: vn is zero there (U = W = 0), so they add nothing.
                S = S * g_last.exp()[:, None, None] + torch.einsum("ihk,ihv->hkv", kd, vn)
                vns.append(vn)
            vn_parts.append(_unchunk(torch.stack(vns), n_tok))
        finals.append(S)
    h = torch.stack(h_parts) if h_parts else k.new_zeros(0, HV, K, V)
    v_new = torch.cat(vn_parts) if vn_parts else U.new_zeros(0, HV, V)
    final = torch.stack(finals) if finals else k.new_zeros(0, HV, K, V)
    return h, v_new, final


def _causal_attention(qc: torch.Tensor, kc: torch.Tensor, Gc: torch.Tensor,
                      causal: torch.Tensor) -> torch.Tensor:
    """``Q_c K_cᵀ ⊙ exp(G_i − G_j) ⊙ [i ≥ j]`` per chunk: ``qc, kc: [NT, C, HV, K]``,
    ``Gc: [NT, C, HV]`` (edge-padded), ``causal: [C, C]`` → ``[NT, HV, C, C]``."""
    Gt = Gc.transpose(1, 2)
    decay = (Gt[..., :, None] - Gt[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    return torch.einsum("nihk,njhk->nhij", qc, kc) * decay


def chunk_output_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v_new: torch.Tensor,
    h: torch.Tensor,
    G: torch.Tensor,
    scale: float,
    bounds,
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """``O_c = scale (diag(Γ) Q_c S_c + (Q_c K_cᵀ ⊙ exp(G_i − G_j) ⊙ [i ≥ j]) V'_c)``.

    ``q, k: [T,HV,K]``, ``v_new: [T,HV,V]``, ``h: [NT_total,HV,K,V]``,
    ``G: [T,HV]`` → ``o: [T,HV,V]``.
    """
    C = chunk_size
    parts, chunk0 = [], 0
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    for bos, eos in bounds:
        if eos == bos:
            continue
        qc, kc, vc = (_doc_chunks(x, bos, eos, C) for x in (q, k, v_new))
        Gc = _doc_chunks(G, bos, eos, C, edge_pad=True)
        n_chunks = qc.shape[0]
        hc = h[chunk0 : chunk0 + n_chunks]
        chunk0 += n_chunks
        inter = torch.einsum("nihk,nhkv->nihv", qc * Gc.exp()[..., None], hc)
        attn = _causal_attention(qc, kc, Gc, causal)
        intra = torch.einsum("nhij,njhv->nihv", attn, vc)
        parts.append(_unchunk((inter + intra) * scale, eos - bos))
    if not parts:
        return v_new.new_zeros(0, *v_new.shape[1:])
    return torch.cat(parts)


def entry_state_queries_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    W: torch.Tensor,
    G: torch.Tensor,
    scale: float,
    bounds,
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """The queries of each document's entry state, ``q̃: [T,HV,K]``.

    The outputs are affine in the state ``S_in`` a document starts from, row by row:
    ``o_t(S_in) = o_t(0) + S_inᵀ q̃_t``. Through the document's own outputs, the gradient
    of a loss with respect to ``S_in`` is therefore ``Σ_t q̃_t ⊗ do_t``
    (``tests/test_entry_state_queries.py`` checks both against the token recurrence).

    Per chunk ``c``: ``q̃_t = scale · Φ_{c-1}ᵀ (e^{G_t} q_t − Σ_{s ≤ t} (q_t·k_s)
    e^{G_t − G_s} w_s)``. Here ``Φ_{c-1}`` is the transition from the document's start to
    the chunk's start: the chunk-state recurrence of the identity with ``v = 0``, the ``M``
    half of a segment summary ``[E | M]``. This is the fp32 reference of an exact split
    in which a segment's outputs are its zero-entry outputs plus ``q̃ S_in`` and its
    entry-state gradient a token reduction (``docs/exact_split.md``: what that would save,
    and why it needs a walk of the doubled state).

    ``q, k: [T,HV,K]`` (k expanded to the value heads), ``W: [T,HV,K]`` and
    ``G: [T,HV]`` as :func:`wy_ref` and :func:`chunk_cumsum_ref` give them.
    """
    HV, K = k.shape[1], k.shape[2]
    C = chunk_size
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(K, dtype=k.dtype, device=k.device).expand(1, HV, K, K)
    parts = []
    for bos, eos in bounds:
        if eos == bos:
            continue
        doc = [(0, eos - bos)]
        kd, Wd, Gd = k[bos:eos], W[bos:eos], G[bos:eos]
        phi, _, _ = chunk_states_ref(kd, Wd, torch.zeros_like(Wd), Gd, doc, eye, C)
        qc, kc, wc = (_doc_chunks(x, bos, eos, C) for x in (q, k, W))
        Gc = _doc_chunks(G, bos, eos, C, edge_pad=True)
        attn = _causal_attention(qc, kc, Gc, causal)
        q_hat = qc * Gc.exp()[..., None] - torch.einsum("nhij,njhk->nihk", attn, wc)
        q_tilde = torch.einsum("nhkj,nihk->nihj", phi, q_hat) * scale
        parts.append(_unchunk(q_tilde, eos - bos))
    if not parts:
        return q.new_zeros(0, HV, K)
    return torch.cat(parts)


def chunk_gdn_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked GDN in vectorised fp32 torch; same contract as :func:`naive_recurrent_gdn`."""
    B, T = q.shape[:2]
    q, k, v, g, beta, scale = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    HV = v.shape[2]
    q, k, v, g, beta = (x.reshape(B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
    bounds = document_bounds(cu_seqlens, B, T)
    G = chunk_cumsum_ref(g, bounds, chunk_size)
    _, W, U = wy_ref(k, v, beta, G, bounds, chunk_size)
    h, v_new, final = chunk_states_ref(k, W, U, G, bounds, initial_state, chunk_size)
    o = chunk_output_ref(q, k, v_new, h, G, scale, bounds, chunk_size)
    o = o.reshape(B, T, HV, v.shape[-1])
    return o, (final if output_final_state else None)

