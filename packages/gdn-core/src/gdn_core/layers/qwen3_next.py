"""State-dict conversion between transformers' Qwen3-Next GDN layer and ours.

transformers' ``Qwen3NextGatedDeltaNet`` fuses its projections and orders their
rows by key-head group (facts of its layout, see ``docs/layer.md``):

* ``in_proj_qkvz.weight [2·H·K + 2·HV·V, hidden]``: per key head ``h`` the rows
  ``q_h (K) | k_h (K) | v of its HV/H value heads (HV/H·V) | z of them (HV/H·V)``;
* ``in_proj_ba.weight [2·HV, hidden]``: per key head ``b`` of its value heads,
  then ``a`` of them;
* ``conv1d.weight [2·H·K + HV·V, 1, W]``: the q, k, v channels in that order
  (already head-major), no bias;
* ``A_log``, ``dt_bias [HV]``, ``norm.weight [V]``, ``out_proj.weight``.

Ours (fla's names): ``q_proj``, ``k_proj``, ``v_proj``, ``g_proj`` (= z),
``a_proj``, ``b_proj``, ``q_conv1d``/``k_conv1d``/``v_conv1d``, ``A_log``,
``dt_bias``, ``o_norm``, ``o_proj``. The conversion is a pure re-indexing:
converted layers compute the same function.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["from_qwen3_next_state_dict", "qwen3_next_layer_kwargs", "to_qwen3_next_state_dict"]


def qwen3_next_layer_kwargs(layer: Any) -> dict[str, Any]:
    """Constructor arguments of our layer matching a ``Qwen3NextGatedDeltaNet`` instance
    (or anything with its attributes ``hidden_size``, ``num_k_heads``, ``num_v_heads``,
    ``head_k_dim``, ``head_v_dim``, ``conv_kernel_size``, ``layer_norm_epsilon``)."""
    return dict(hidden_size=layer.hidden_size, num_heads=layer.num_k_heads,
                num_v_heads=layer.num_v_heads, head_dim=layer.head_k_dim,
                expand_v=layer.head_v_dim / layer.head_k_dim, use_gate=True,
                use_short_conv=True, conv_size=layer.conv_kernel_size, conv_bias=False,
                norm_eps=layer.layer_norm_epsilon, layer_idx=getattr(layer, "layer_idx", None))


def _dims(num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int):
    if num_v_heads % num_k_heads:
        raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads "
                         f"({num_k_heads})")
    return num_k_heads, num_v_heads // num_k_heads, head_k_dim, head_v_dim


def from_qwen3_next_state_dict(sd: dict[str, torch.Tensor], *, num_k_heads: int,
                               num_v_heads: int, head_k_dim: int, head_v_dim: int
                               ) -> dict[str, torch.Tensor]:
    """A ``Qwen3NextGatedDeltaNet`` state dict (keys without prefix) → ours."""
    H, r, K, V = _dims(num_k_heads, num_v_heads, head_k_dim, head_v_dim)
    qkvz = sd["in_proj_qkvz.weight"]
    hidden = qkvz.shape[-1]
    q, k, v, z = qkvz.reshape(H, 2 * K + 2 * r * V, hidden).split([K, K, r * V, r * V], dim=1)
    b, a = sd["in_proj_ba.weight"].reshape(H, 2 * r, hidden).split([r, r], dim=1)
    cq, ck, cv = sd["conv1d.weight"].split([H * K, H * K, H * r * V], dim=0)
    out = {name: t.reshape(-1, hidden).contiguous() for name, t in
           (("q_proj.weight", q), ("k_proj.weight", k), ("v_proj.weight", v),
            ("g_proj.weight", z), ("a_proj.weight", a), ("b_proj.weight", b))}
    out.update({"q_conv1d.weight": cq.contiguous(), "k_conv1d.weight": ck.contiguous(),
                "v_conv1d.weight": cv.contiguous(), "A_log": sd["A_log"],
                "dt_bias": sd["dt_bias"], "o_norm.weight": sd["norm.weight"],
                "o_proj.weight": sd["out_proj.weight"]})
    return out


def to_qwen3_next_state_dict(sd: dict[str, torch.Tensor], *, num_k_heads: int,
                             num_v_heads: int, head_k_dim: int, head_v_dim: int
                             ) -> dict[str, torch.Tensor]:
    """Ours → a ``Qwen3NextGatedDeltaNet`` state dict (the inverse of
    :func:`from_qwen3_next_state_dict`; a conv bias has no place there: ``ValueError``)."""
    if any(key.endswith("conv1d.bias") for key in sd):
        raise ValueError("Qwen3-Next's conv1d has no bias; this layer has conv_bias=True")
    H, r, K, V = _dims(num_k_heads, num_v_heads, head_k_dim, head_v_dim)
    hidden = sd["q_proj.weight"].shape[-1]

    def grouped(name: str, rows: int) -> torch.Tensor:
        return sd[name].reshape(H, rows, hidden)

    qkvz = torch.cat([grouped("q_proj.weight", K), grouped("k_proj.weight", K),
                      grouped("v_proj.weight", r * V), grouped("g_proj.weight", r * V)], dim=1)
    ba = torch.cat([grouped("b_proj.weight", r), grouped("a_proj.weight", r)], dim=1)
    conv = torch.cat([sd["q_conv1d.weight"], sd["k_conv1d.weight"], sd["v_conv1d.weight"]])
    return {"in_proj_qkvz.weight": qkvz.reshape(-1, hidden), "in_proj_ba.weight":
            ba.reshape(-1, hidden), "conv1d.weight": conv, "A_log": sd["A_log"],
            "dt_bias": sd["dt_bias"], "norm.weight": sd["o_norm.weight"],
            "out_proj.weight": sd["o_proj.weight"]}
