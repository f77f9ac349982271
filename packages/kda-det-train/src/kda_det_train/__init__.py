"""Legacy: deterministic Kimi Delta Attention (per-channel decay) training.

KDA is the gated delta rule with one decay per key channel::

    S_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t-1} + β_t k_t v_tᵀ,   o_t = scale · S_tᵀ q_t

* :func:`chunk_kda_det` — chunked, differentiable, bitwise deterministic.
* :func:`chunk_kda_det_fwd` / :func:`chunk_kda_det_bwd` — the same with the
  saved set exposed (:class:`KDADetSavedSet` → :class:`KDADetGrads`).
* :func:`naive_recurrent_kda` — the fp32 token-by-token oracle.
"""

from kda_det_train.chunk import (
    KDADetGrads,
    KDADetSavedSet,
    chunk_kda_det,
    chunk_kda_det_bwd,
    chunk_kda_det_fwd,
)
from kda_det_train.naive import naive_recurrent_kda
from kda_det_train.validation import KDAProblem, validate_kda_inputs

__version__ = "0.9.0"

__all__ = [
    "KDADetGrads",
    "KDADetSavedSet",
    "KDAProblem",
    "chunk_kda_det",
    "chunk_kda_det_bwd",
    "chunk_kda_det_fwd",
    "naive_recurrent_kda",
    "validate_kda_inputs",
]

# Zero-argument entry points the import-independence checker runs in a fresh interpreter.
__smoke__ = ["kda_det_train.smoke:run"]
