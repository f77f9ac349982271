"""The token-by-token KDA oracle.

Per value head, state ``S ∈ R^{K×V}``, per token ``t`` a per-channel log decay
``g_t ∈ R^K`` (``≤ 0``) and a write strength ``β_t``::

    S_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t-1} + β_t k_t v_tᵀ
    o_t = scale · S_tᵀ q_t

Straight from the equations, in fp32 (float64 for float64 inputs), and
differentiable by autograd: it is what the tests compare against.
"""

from __future__ import annotations

import torch
from gdn_core.reference import l2_normalize

from kda_det_train.precision import ieee_fp32_matmul
from kda_det_train.validation import validate_kda_inputs

__all__ = ["naive_recurrent_kda"]

L2_EPS = 1e-6  # the in-kernel L2 norm's eps (gdn_core.reference.l2_normalize's default)


def naive_recurrent_kda(
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
    """Token-by-token KDA recurrence (the oracle).

    Shapes: ``q, k: [B,T,H,K]``, ``v: [B,T,HV,V]``, ``g: [B,T,HV,K]``,
    ``beta: [B,T,HV]``, ``initial_state: [N,HV,K,V]``; ``cu_seqlens: [N+1]``
    packs ``N`` documents into ``B == 1``. Returns ``o: [B,T,HV,V]`` and the
    final states ``[N,HV,K,V]`` (or ``None``), both in the compute dtype
    (float32, or float64 for float64 inputs).
    """
    p = validate_kda_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    dt = p.compute_dtype
    with ieee_fp32_matmul():
        q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
        if use_qk_l2norm_in_kernel:
            q, k = l2_normalize(q, L2_EPS), l2_normalize(k, L2_EPS)
        if p.group > 1:
            q = q.repeat_interleave(p.group, dim=2)
            k = k.repeat_interleave(p.group, dim=2)
        flat = [x.reshape(p.B * p.T, *x.shape[2:]) for x in (q, k, v, g, beta)]
        q, k, v, g, beta = flat
        outputs, finals = [], []
        for n, (bos, eos) in enumerate(zip(p.offsets[:-1], p.offsets[1:])):
            if initial_state is not None:
                S = initial_state[n].to(dt)
            else:
                S = q.new_zeros(p.HV, p.K, p.V)
            for t in range(bos, eos):
                S = S * g[t].exp()[:, :, None]  # Diag(exp(g_t)) S_{t-1}
                v_err = v[t] - torch.einsum("hkv,hk->hv", S, k[t])
                S = S + torch.einsum("hk,hv->hkv", k[t], v_err * beta[t][:, None])
                outputs.append(torch.einsum("hkv,hk->hv", S, q[t]) * p.scale)
            finals.append(S)
        if outputs:
            o = torch.stack(outputs).reshape(p.B, p.T, p.HV, p.V)
        else:
            o = q.new_zeros(p.B, p.T, p.HV, p.V)
        final = torch.stack(finals) if output_final_state else None
    return o, final
