"""Deterministic chunked KDA: forward, explicit backward, autograd wrapper.

Per value head and chunk of ``C = 64`` tokens (``G`` the within-chunk
cumulative log decay, per channel; ``Γ = exp(G)``; ``G_L`` its last row;
``S`` the state entering the chunk)::

    M_ij = Σ_c k_ic k_jc exp(G_ic − G_jc)  (j < i)     decayed_gram(k, k, G, strict)
    T    = (I + diag(β) M)^{-1}
    W    = T diag(β) (Γ ⊙ K),   U = T diag(β) V
    δ    = U − W S                                      ("v_new")
    P_ij = Σ_c q_ic k_jc exp(G_ic − G_jc)  (j ≤ i)     decayed_gram(q, k, G)
    O    = scale ((Γ ⊙ Q) S + P δ)
    S'   = Diag(exp(G_L)) S + (K ⊙ exp(G_L − G))ᵀ δ

The backward pass is written out (no autograd through the forward graph). It
recomputes the forward quantities, runs the reverse state recurrence ::

    dδ  = scale Pᵀ dO + (K ⊙ exp(G_L − G)) dS'
    dS  = scale (Γ ⊙ Q)ᵀ dO + Diag(exp(G_L)) dS' − Wᵀ dδ

and then, in parallel over chunks, the adjoints of every stage (output,
state update, WY representation and triangular inverse, decayed Gram
matrices), accumulating ``dG`` and finishing with ``dg`` = reverse
within-chunk cumulative sum of ``dG``.

Everything runs in fp32 (float64 for float64 inputs); every reduction is a
torch reduction of fixed shape or a fixed-order sum of a few terms; tokens move
to and from the chunk layout by gathers only. Hence bitwise repeatable on CPU
and GPU under ``torch.use_deterministic_algorithms(True)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from gdn_core.chunking import CHUNK_SIZE
from gdn_core.reference import l2_normalize

from kda_det_train.intra import chunk_cumsum, decayed_gram, decayed_gram_bwd
from kda_det_train.layout import ChunkLayout
from kda_det_train.naive import L2_EPS
from kda_det_train.precision import ieee_fp32_matmul
from kda_det_train.validation import KDAProblem, validate_kda_inputs

__all__ = [
    "KDADetGrads",
    "KDADetSavedSet",
    "chunk_kda_det",
    "chunk_kda_det_bwd",
    "chunk_kda_det_fwd",
]


# --------------------------------------------------------------------------- types


@dataclass(frozen=True, eq=False)
class KDADetSavedSet:
    """What :func:`chunk_kda_det_bwd` needs: the inputs (by reference) and the layout.

    The backward pass recomputes every intermediate from these, so the set
    holds no activation besides the inputs themselves. Produced only by
    :func:`chunk_kda_det_fwd`; the input tensors must not be modified in place
    between forward and backward (checked through their version counters).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    initial_state: torch.Tensor | None
    problem: KDAProblem
    layout: ChunkLayout
    use_qk_l2norm_in_kernel: bool
    versions: tuple[int, ...]


class KDADetGrads(NamedTuple):
    """Gradients from :func:`chunk_kda_det_bwd`, each in its input's dtype.

    ``dh0`` is ``None`` when the forward pass had no initial state.
    """

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dh0: torch.Tensor | None


def _versions(*xs) -> tuple[int, ...]:
    return tuple(-1 if x is None else x._version for x in xs)


# ------------------------------------------------------------------- chunk prep


class _Chunks(NamedTuple):
    """Inputs in head-major chunk space ``[NT, HV, C, D]`` (compute dtype)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor  # [NT, HV, C]


def _to_chunks(p: KDAProblem, layout: ChunkLayout, q, k, v, g, beta, l2norm: bool) -> _Chunks:
    dt = p.compute_dtype
    n_tok = p.B * p.T
    q, k = q.to(dt), k.to(dt)
    if l2norm:
        q, k = l2_normalize(q, L2_EPS), l2_normalize(k, L2_EPS)
    if p.group > 1:
        q = q.repeat_interleave(p.group, dim=2)
        k = k.repeat_interleave(p.group, dim=2)
    q, k = q.reshape(n_tok, p.HV, p.K), k.reshape(n_tok, p.HV, p.K)
    v = v.to(dt).reshape(n_tok, p.HV, p.V)
    g = g.to(dt).reshape(n_tok, p.HV, p.K)
    beta = beta.to(dt).reshape(n_tok, p.HV, 1)
    qc, kc, vc, gc, bc = (layout.to_chunks(x) for x in (q, k, v, g, beta))
    return _Chunks(qc, kc, vc, gc, bc.squeeze(-1))


def _sorted_states(p: KDAProblem, layout: ChunkLayout, x: torch.Tensor | None) -> torch.Tensor:
    """Per-document states ``[N,HV,K,V]`` in the layout's sorted document order."""
    if x is None:
        return torch.zeros(p.num_docs, p.HV, p.K, p.V, dtype=p.compute_dtype, device=p.device)
    return x.to(p.compute_dtype).index_select(0, layout.doc_order)


# -------------------------------------------------------------------- forward


class _Fwd(NamedTuple):
    """Recomputable forward quantities, all ``[NT, HV, ...]``."""

    G: torch.Tensor  # [C, K] within-chunk cumulative log decay
    gam: torch.Tensor  # [C, K] exp(G)
    egl: torch.Tensor  # [K, 1] exp(G_L)
    kb: torch.Tensor  # [C, K] k ⊙ exp(G_L − G)
    M: torch.Tensor  # [C, C] strictly lower decayed k-Gram
    Tm: torch.Tensor  # [C, C] (I + diag(β) M)^{-1}
    X: torch.Tensor  # [C, K] diag(β) (Γ ⊙ k)
    W: torch.Tensor  # [C, K]
    U: torch.Tensor  # [C, V]
    P: torch.Tensor  # [C, C] lower decayed q-k Gram
    h: torch.Tensor  # [K, V] state entering each chunk
    delta: torch.Tensor  # [C, V] v_new


def _forward_chunks(c: _Chunks, layout: ChunkLayout, h0_sorted: torch.Tensor):
    """Chunked forward in chunk space. Returns (``_Fwd``, final states in sorted order)."""
    C = layout.chunk_size
    G = chunk_cumsum(c.g)
    gam = torch.exp(G)
    G_last = G[..., -1:, :]  # pads carry zero decay, so this is the last real row
    egl = torch.exp(G_last).transpose(-1, -2)
    kb = c.k * torch.exp(G_last - G)

    # WY representation of the chunk's delta-rule updates.
    M = decayed_gram(c.k, c.k, G, strict=True)
    eye = torch.eye(C, dtype=G.dtype, device=G.device)
    Tm = torch.linalg.solve_triangular(
        eye + c.beta.unsqueeze(-1) * M, eye.expand(*M.shape), upper=False, unitriangular=True
    )
    X = c.beta.unsqueeze(-1) * gam * c.k
    W = Tm @ X
    U = Tm @ (c.beta.unsqueeze(-1) * c.v)

    # Chunk-state recurrence, step by step, all documents of a step at once.
    W_s, U_s, kb_s, egl_s = (x.index_select(0, layout.step_perm) for x in (W, U, kb, egl))
    S = h0_sorted
    hs, ds = [], []
    for lo, hi in zip(layout.step_offsets[:-1], layout.step_offsets[1:]):
        n = hi - lo
        Sa = S[:n]
        d = U_s[lo:hi] - W_s[lo:hi] @ Sa
        hs.append(Sa)
        ds.append(d)
        S = torch.cat([egl_s[lo:hi] * Sa + kb_s[lo:hi].transpose(-1, -2) @ d, S[n:]])
    h = torch.cat(hs).index_select(0, layout.step_inv)
    delta = torch.cat(ds).index_select(0, layout.step_inv)

    P = decayed_gram(c.q, c.k, G, strict=False)
    return _Fwd(G, gam, egl, kb, M, Tm, X, W, U, P, h, delta), S


def _output(c: _Chunks, f: _Fwd, scale: float) -> torch.Tensor:
    return scale * ((c.q * f.gam) @ f.h + f.P @ f.delta)


# ------------------------------------------------------------------- backward


def _backward_chunks(c: _Chunks, f: _Fwd, layout: ChunkLayout, scale: float,
                     do: torch.Tensor, dht_sorted: torch.Tensor):
    """Explicit backward in chunk space.

    ``do: [NT,HV,C,V]``. Returns chunk-space ``dq, dk, dv, dg, dbeta`` and the
    initial-state gradient in sorted document order.
    """
    # Local (state-independent) parts of the recurrence's inputs.
    dd_local = scale * (f.P.transpose(-1, -2) @ do)  # [C, V]
    dS_local = scale * ((c.q * f.gam).transpose(-1, -2) @ do)  # [K, V]

    # Reverse chunk-state recurrence.
    dd_l, dS_l, kb_s, egl_s, W_s = (
        x.index_select(0, layout.step_perm) for x in (dd_local, dS_local, f.kb, f.egl, f.W)
    )
    dS = dht_sorted
    n_steps = layout.num_steps
    dhn_parts: list[torch.Tensor] = [dS] * n_steps
    dd_parts: list[torch.Tensor] = [dS] * n_steps
    for s in reversed(range(n_steps)):
        lo, hi = layout.step_offsets[s], layout.step_offsets[s + 1]
        n = hi - lo
        dSa = dS[:n]  # gradient of the state leaving the chunk
        dd = dd_l[lo:hi] + kb_s[lo:hi] @ dSa
        dhn_parts[s], dd_parts[s] = dSa, dd
        dS_prev = dS_l[lo:hi] + egl_s[lo:hi] * dSa - W_s[lo:hi].transpose(-1, -2) @ dd
        dS = torch.cat([dS_prev, dS[n:]])
    dhn = torch.cat(dhn_parts).index_select(0, layout.step_inv)  # [K, V]
    dd = torch.cat(dd_parts).index_select(0, layout.step_inv)  # [C, V]

    # State update S' = Diag(exp(G_L)) S + kbᵀ δ.
    d_kb = f.delta @ dhn.transpose(-1, -2)  # [C, K]
    dk = d_kb * torch.exp(f.G[..., -1:, :] - f.G)
    dG = -f.kb * d_kb
    dG_last = (f.kb * d_kb).sum(-2) + f.egl.squeeze(-1) * (f.h * dhn).sum(-1)  # [K]

    # Output O = scale ((Γ ⊙ Q) S + P δ).
    dqg = scale * (do @ f.h.transpose(-1, -2))  # gradient of Γ ⊙ Q
    dq = dqg * f.gam
    dG = dG + dq * c.q
    dq_p, dk_p = decayed_gram_bwd(scale * (do @ f.delta.transpose(-1, -2)), c.q, c.k, f.G,
                                  strict=False)
    dq = dq + dq_p
    dk = dk + dk_p
    dG = dG + c.q * dq_p - c.k * dk_p

    # δ = U − W S.
    dW = -(dd @ f.h.transpose(-1, -2))  # [C, K]
    dU = dd

    # WY: W = T X, U = T Y, T = (I + diag(β) M)^{-1}.
    Tt = f.Tm.transpose(-1, -2)
    Y = c.beta.unsqueeze(-1) * c.v
    dX = Tt @ dW
    dY = Tt @ dU
    dT = dW @ f.X.transpose(-1, -2) + dU @ Y.transpose(-1, -2)
    dA = -(Tt @ dT @ Tt).tril(-1)
    dbeta = (dX * f.gam * c.k).sum(-1) + (dY * c.v).sum(-1) + (dA * f.M).sum(-1)
    dk = dk + dX * c.beta.unsqueeze(-1) * f.gam
    dG = dG + dX * f.X
    dv = dY * c.beta.unsqueeze(-1)
    dk_i, dk_j = decayed_gram_bwd(c.beta.unsqueeze(-1) * dA, c.k, c.k, f.G, strict=True)
    dk = dk + dk_i + dk_j
    dG = dG + c.k * (dk_i - dk_j)

    dG = torch.cat([dG[..., :-1, :], dG[..., -1:, :] + dG_last.unsqueeze(-2)], dim=-2)
    dg = chunk_cumsum(dG, reverse=True)
    return dq, dk, dv, dg, dbeta, dS


# ------------------------------------------------------------- public entries


def chunk_kda_det_fwd(
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
) -> tuple[torch.Tensor, torch.Tensor | None, KDADetSavedSet]:
    """Deterministic chunked KDA forward.

    Same arguments as :func:`chunk_kda_det`. Returns ``o: [B,T,HV,V]`` (in
    ``v``'s dtype), the final states ``[N,HV,K,V]`` fp32 (or ``None``) and the
    :class:`KDADetSavedSet` for :func:`chunk_kda_det_bwd`. Not differentiable by
    autograd; use :func:`chunk_kda_det` for that.
    """
    p = validate_kda_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    layout = ChunkLayout.build(p.offsets, CHUNK_SIZE, p.device)
    with torch.no_grad(), ieee_fp32_matmul():
        h0 = _sorted_states(p, layout, initial_state)
        if layout.num_chunks:
            c = _to_chunks(p, layout, q, k, v, g, beta, use_qk_l2norm_in_kernel)
            f, final = _forward_chunks(c, layout, h0)
            o = layout.to_tokens(_output(c, f, p.scale))
        else:
            o, final = v.new_zeros(p.B * p.T, p.HV, p.V, dtype=p.compute_dtype), h0
        o = o.reshape(p.B, p.T, p.HV, p.V).to(v.dtype)
        final = final.index_select(0, layout.doc_rank) if output_final_state else None
    saved = KDADetSavedSet(
        q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, problem=p, layout=layout,
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
        versions=_versions(q, k, v, g, beta, initial_state),
    )
    return o, final, saved


def _check_grad_tensor(name: str, x, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(
            f"{name} must have shape {shape} (from the saved set), got {tuple(x.shape)}"
        )
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but the saved set is on {device}")


def chunk_kda_det_bwd(
    saved: KDADetSavedSet, do: torch.Tensor, dht: torch.Tensor | None = None
) -> KDADetGrads:
    """Explicit deterministic backward of :func:`chunk_kda_det_fwd`.

    ``do: [B,T,HV,V]`` is the gradient of ``o``; ``dht: [N,HV,K,V]`` that of
    the final states (``None`` = zero). A ``saved`` that is not a
    :class:`KDADetSavedSet` (e.g. a saved set of another mode or package)
    raises ``ValueError`` before anything is computed.
    """
    if not isinstance(saved, KDADetSavedSet):
        got = type(saved)
        raise ValueError(
            f"chunk_kda_det_bwd expected a kda_det_train.KDADetSavedSet (from chunk_kda_det_fwd), "
            f"got {got.__module__}.{got.__qualname__}; saved sets of other modes or packages "
            f"cannot be used here"
        )
    p, layout = saved.problem, saved.layout
    current = _versions(saved.q, saved.k, saved.v, saved.g, saved.beta, saved.initial_state)
    if current != saved.versions:
        raise ValueError(
            "an input of chunk_kda_det_fwd was modified in place after the forward pass; "
            "the saved set no longer matches it"
        )
    _check_grad_tensor("do", do, (p.B, p.T, p.HV, p.V), p.device)
    if dht is not None:
        _check_grad_tensor("dht", dht, (p.num_docs, p.HV, p.K, p.V), p.device)

    q, k, v, g, beta = saved.q, saved.k, saved.v, saved.g, saved.beta
    n_tok = p.B * p.T
    dt = p.compute_dtype
    with torch.no_grad(), ieee_fp32_matmul():
        dht_sorted = _sorted_states(p, layout, dht)
        if layout.num_chunks:
            c = _to_chunks(p, layout, q, k, v, g, beta, saved.use_qk_l2norm_in_kernel)
            f, _ = _forward_chunks(c, layout, _sorted_states(p, layout, saved.initial_state))
            do_c = layout.to_chunks(do.to(dt).reshape(n_tok, p.HV, p.V))
            dq, dk, dv, dg, dbeta, dh0 = _backward_chunks(c, f, layout, p.scale, do_c, dht_sorted)
            dq, dk, dv, dg = (layout.to_tokens(x) for x in (dq, dk, dv, dg))
            dbeta = layout.to_tokens(dbeta.unsqueeze(-1)).squeeze(-1)
        else:
            dq = dk = torch.zeros(n_tok, p.HV, p.K, dtype=dt, device=p.device)
            dg = torch.zeros(n_tok, p.HV, p.K, dtype=dt, device=p.device)
            dv = torch.zeros(n_tok, p.HV, p.V, dtype=dt, device=p.device)
            dbeta = torch.zeros(n_tok, p.HV, dtype=dt, device=p.device)
            dh0 = dht_sorted
        if p.group > 1:  # each q/k head served `group` value heads: fixed-order sum
            dq = dq.view(n_tok, p.H, p.group, p.K).sum(2)
            dk = dk.view(n_tok, p.H, p.group, p.K).sum(2)
        dq = dq.reshape(p.B, p.T, p.H, p.K)
        dk = dk.reshape(p.B, p.T, p.H, p.K)
        if saved.use_qk_l2norm_in_kernel:
            dq = _l2_normalize_bwd(q.to(dt), dq)
            dk = _l2_normalize_bwd(k.to(dt), dk)
        dh0 = None if saved.initial_state is None else dh0.index_select(0, layout.doc_rank)
        return KDADetGrads(
            dq=dq.to(q.dtype),
            dk=dk.to(k.dtype),
            dv=dv.reshape(p.B, p.T, p.HV, p.V).to(v.dtype),
            dg=dg.reshape(p.B, p.T, p.HV, p.K).to(g.dtype),
            dbeta=dbeta.reshape(p.B, p.T, p.HV).to(beta.dtype),
            dh0=None if dh0 is None else dh0.to(saved.initial_state.dtype),
        )


def _l2_normalize_bwd(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Adjoint of ``y = x / sqrt(Σx² + eps)``: ``dx = r (dy − y Σ(y ⊙ dy))``."""
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)
    y = x * r
    return r * (dy - y * (y * dy).sum(-1, keepdim=True))


# ------------------------------------------------------------------- autograd


class _ChunkKDADet(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens,
                use_qk_l2norm_in_kernel):
        o, final, saved = chunk_kda_det_fwd(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.problem, ctx.layout = saved.problem, saved.layout
        ctx.use_l2 = saved.use_qk_l2norm_in_kernel
        if final is None:
            return o
        return o, final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht=None):
        q, k, v, g, beta, initial_state = ctx.saved_tensors
        saved = KDADetSavedSet(
            q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, problem=ctx.problem,
            layout=ctx.layout, use_qk_l2norm_in_kernel=ctx.use_l2,
            versions=_versions(q, k, v, g, beta, initial_state),
        )
        grads = chunk_kda_det_bwd(saved, do, dht)
        dh0 = grads.dh0 if ctx.needs_input_grad[5] else None
        return grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta, dh0, None, None, None, None


def chunk_kda_det(
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
    """Deterministic chunked Kimi Delta Attention, differentiable.

    Args:
        q, k: ``[B, T, H, K]``.
        v: ``[B, T, HV, V]``; ``HV`` a multiple of ``H`` (grouped value heads).
        g: ``[B, T, HV, K]``, per-channel log decay (``≤ 0``).
        beta: ``[B, T, HV]``, write strength.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]``, one per sequence (fp32 recommended).
        output_final_state: also return the final states ``[N, HV, K, V]`` fp32.
        cu_seqlens: ``[N+1]`` int32/int64 document offsets of a packed batch
            (``B == 1``; starts at 0, non-decreasing, ends at ``T``).
        use_qk_l2norm_in_kernel: L2-normalise ``q`` and ``k`` inside (with backward).

    Returns ``(o, final_state)``: ``o: [B, T, HV, V]`` in ``v``'s dtype,
    ``final_state`` or ``None``. Gradients flow to ``q, k, v, g, beta`` and
    ``initial_state``; bitwise identical across calls and processes for the
    same inputs on the same device type.
    """
    out = _ChunkKDADet.apply(q, k, v, g, beta, initial_state, scale, bool(output_final_state),
                             cu_seqlens, bool(use_qk_l2norm_in_kernel))
    if output_final_state:
        return out[0], out[1]
    return out, None
