"""The Gated DeltaNet layer, parameterised by the kernels that run it.

One token mixer of a Qwen3-Next-style hybrid model (see ``docs/layer.md``)::

    q, k, v = silu(conv(x Wq)), silu(conv(x Wk)), silu(conv(x Wv))   short causal conv
    g       = −exp(A_log) · softplus(x Wa + dt_bias)                  log-decay per value head
    beta    = sigmoid(x Wb)                                           write strength
    o       = GDN(l2norm(q), l2norm(k), v, g, beta)                   the chunked kernel
    y       = RMSNorm(o) · silu(x Wg)   per value head                 gated output norm
    out     = y Wo

``q, k`` have ``num_heads`` heads of ``head_dim``; ``v`` has ``num_v_heads``
heads of ``head_dim · expand_v`` (grouped value heads: each q/k head serves
``num_v_heads / num_heads`` of them). Parameter names and shapes are those of
fla's ``GatedDeltaNet`` layer (``q_proj``, ``k_proj``, ``v_proj``, ``a_proj``,
``b_proj``, ``g_proj``, ``o_proj``, ``q_conv1d``/``k_conv1d``/``v_conv1d``
``.weight [D, 1, W]``, ``A_log``, ``dt_bias``, ``o_norm.weight``), so its state
dict loads as it is; :mod:`gdn_core.layers.qwen3_next` converts transformers'
Qwen3-Next layout.

The classes here hold the parameters and the token-local math; a package binds
its kernels by overriding two methods (``_conv1d`` and ``_gdn``):
:class:`GatedDeltaNetBase` (shared), :class:`SingleRankGatedDeltaNet` (one
process, packed ``cu_seqlens``, initial/final state; bound here to
``gdn_core``'s own autograd) and :class:`ContextParallelGatedDeltaNet` (one
rank's shard, taking the rank's context; abstract).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gdn_core.gate import gdn_gate
from gdn_core.layers.norm import GatedRMSNorm

__all__ = ["ContextParallelGatedDeltaNet", "GatedDeltaNetBase", "ShortConv",
           "SingleRankGatedDeltaNet"]

ConvFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
GDNFn = Callable[..., tuple[torch.Tensor, Any]]


class ShortConv(nn.Module):
    """The weights of one depthwise causal conv: ``weight [D, 1, W]`` (``nn.Conv1d``'s
    layout; ``weight[:, 0, -1]`` multiplies the current token) and ``bias [D]`` or none."""

    def __init__(self, channels: int, kernel_size: int, bias: bool = False,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, device=device,
                                               dtype=dtype))
        self.bias = nn.Parameter(torch.empty(channels, device=device, dtype=dtype)) \
            if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.kernel_size)  # nn.Conv1d's default (fan_in = W)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)


class GatedDeltaNetBase(nn.Module):
    """Parameters and token-local math of the GDN layer (module docstring).

    Args: ``hidden_size``; ``num_heads`` q/k heads of ``head_dim``;
    ``num_v_heads`` value heads (default ``num_heads``; a multiple of it) of
    ``head_dim · expand_v``; ``use_gate`` (the output gate ``g_proj``; without
    it a plain RMSNorm); ``use_short_conv`` (without it ``silu`` of the
    projections); ``conv_size``, ``conv_bias``; ``norm_eps`` (output norm);
    ``layer_idx`` (kept for the caller); ``device``, ``dtype`` of the parameters.
    The defaults are fla's.
    """

    #: whether the gate's parameter gradients are reduced in a fixed order
    deterministic: bool = True

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 2.0,
        head_dim: int = 256,
        num_heads: int = 6,
        num_v_heads: int | None = None,
        use_gate: bool = True,
        use_short_conv: bool = True,
        conv_size: int = 4,
        conv_bias: bool = False,
        norm_eps: float = 1e-5,
        layer_idx: int | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        head_v_dim = head_dim * expand_v
        if num_heads < 1 or num_v_heads % num_heads:
            raise ValueError(f"num_v_heads ({num_v_heads}) must be a positive multiple of "
                             f"num_heads ({num_heads})")
        if head_v_dim != int(head_v_dim) or head_v_dim < 1:
            raise ValueError(f"head_dim · expand_v must be a positive integer, got "
                             f"{head_dim} · {expand_v} = {head_v_dim}")
        self.hidden_size, self.layer_idx = hidden_size, layer_idx
        self.num_heads, self.num_v_heads = num_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_dim, int(head_v_dim)
        self.key_dim, self.value_dim = num_heads * head_dim, num_v_heads * int(head_v_dim)
        self.use_gate, self.use_short_conv = use_gate, use_short_conv
        self.conv_size = conv_size
        fk = {"device": device, "dtype": dtype}

        def linear(n_out: int) -> nn.Linear:
            return nn.Linear(hidden_size, n_out, bias=False, **fk)

        self.q_proj, self.k_proj = linear(self.key_dim), linear(self.key_dim)
        self.v_proj = linear(self.value_dim)
        self.a_proj, self.b_proj = linear(num_v_heads), linear(num_v_heads)
        # Mamba2-style gate init: A uniform in (0, 16], dt log-uniform in [1e-3, 0.1]
        # and dt_bias its inverse softplus; both in fp32 whatever ``dtype``
        a = torch.empty(num_v_heads, device=device).uniform_(0, 16).clamp_min(1e-4)
        self.A_log = nn.Parameter(torch.log(a))
        dt = torch.exp(torch.rand(num_v_heads, device=device)
                       * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp_min(1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        if use_short_conv:
            self.q_conv1d = ShortConv(self.key_dim, conv_size, conv_bias, **fk)
            self.k_conv1d = ShortConv(self.key_dim, conv_size, conv_bias, **fk)
            self.v_conv1d = ShortConv(self.value_dim, conv_size, conv_bias, **fk)
        if use_gate:
            self.g_proj = linear(self.value_dim)
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps, **fk)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **fk)

    @classmethod
    def from_qwen3_next(cls, layer: nn.Module, **kwargs: Any) -> GatedDeltaNetBase:
        """This class with the configuration and weights of ``layer`` (transformers'
        ``Qwen3NextGatedDeltaNet``), on its device and dtype; ``kwargs`` override the
        constructor arguments."""
        from gdn_core.layers.qwen3_next import from_qwen3_next_state_dict, qwen3_next_layer_kwargs

        weight = layer.out_proj.weight
        new = cls(**{**qwen3_next_layer_kwargs(layer), **kwargs}, device=weight.device,
                  dtype=weight.dtype)
        new.load_state_dict(from_qwen3_next_state_dict(
            layer.state_dict(), num_k_heads=layer.num_k_heads, num_v_heads=layer.num_v_heads,
            head_k_dim=layer.head_k_dim, head_v_dim=layer.head_v_dim))
        return new


    def _mix(self, x: torch.Tensor, conv: ConvFn, gdn: GDNFn) -> tuple[torch.Tensor, Any]:
        """``x [B, T, hidden]`` → ``(out [B, T, hidden], what gdn returned beside o)``.

        ``conv(x, weight [D, W], bias)`` is the short conv (SiLU included) of the
        concatenated q/k/v projections; ``gdn(q, k, v, g, beta)`` the kernel.
        """
        B, T, _ = x.shape
        # one GEMM per group (weights concatenated: a copy of the weights, not of the
        # activations); the gradient of the concatenation splits back per parameter
        qkv = F.linear(x, torch.cat([self.q_proj.weight, self.k_proj.weight,
                                     self.v_proj.weight]))
        heads = [self.a_proj.weight, self.b_proj.weight]
        if self.use_gate:
            heads.append(self.g_proj.weight)
        a, b, *gate = F.linear(x, torch.cat(heads)).split(
            [self.num_v_heads, self.num_v_heads] + [self.value_dim] * self.use_gate, dim=-1)
        if self.use_short_conv:
            convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
            weight = torch.cat([c.weight[:, 0] for c in convs])
            bias = torch.cat([c.bias for c in convs]) if convs[0].bias is not None else None
            qkv = conv(qkv, weight, bias)
        else:
            qkv = F.silu(qkv)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, self.num_heads, self.head_k_dim)
        k = k.reshape(B, T, self.num_heads, self.head_k_dim)
        v = v.reshape(B, T, self.num_v_heads, self.head_v_dim)
        g = gdn_gate(a.float(), self.A_log, self.dt_bias, deterministic=self.deterministic)
        o, extra = gdn(q, k, v, g, torch.sigmoid(b))
        o = self.o_norm(o, gate[0].reshape_as(o) if gate else None).reshape(B, T, self.value_dim)
        return self.o_proj(o), extra


class SingleRankGatedDeltaNet(GatedDeltaNetBase):
    """The GDN layer in one process: ``forward(x, cu_seqlens=None, initial_state=None,
    output_final_state=False, segment_size=None)`` → ``(out [B, T, hidden],
    final_state or None)``.

    ``cu_seqlens [N+1]`` packs ``N`` documents in one row (``B == 1``): no token
    sees another document, through the conv or the recurrence.
    ``initial_state [N, HV, K, V]`` (``N = B`` without ``cu_seqlens``);
    ``final_state [N, HV, K, V]`` fp32. ``segment_size``: the kernel's (documents
    longer than it run as fixed segments; ``None`` its default). Here bound to
    ``gdn_core``'s autograd (the Triton kernels on CUDA, the fp32 reference on
    CPU), deterministic; the training packages subclass it with their own kernels.
    """

    def _conv1d(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                cu_seqlens: Any) -> torch.Tensor:
        from gdn_core.conv1d import causal_conv1d

        return causal_conv1d(x, weight, bias, "silu", cu_seqlens,
                             deterministic=self.deterministic)

    def _gdn(self, q, k, v, g, beta, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        from gdn_core.autograd import chunk_gdn_autograd

        return chunk_gdn_autograd(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                  deterministic=self.deterministic, **kwargs)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor | list[int] | None = None,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        segment_size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        def conv(x, weight, bias):
            return self._conv1d(x, weight, bias, cu_seqlens)

        def gdn(q, k, v, g, beta):
            return self._gdn(q, k, v, g, beta, initial_state=initial_state,
                             output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                             segment_size=segment_size)

        return self._mix(hidden_states, conv, gdn)


class ContextParallelGatedDeltaNet(GatedDeltaNetBase):
    """The GDN layer on one rank's shard of a packed sequence:
    ``forward(x [1, T, hidden], context, *, exchange="allgather", backend=None)``
    → ``out [1, T, hidden]``.

    Every rank calls it (forward and backward hold collectives); parameters
    are replicas, their gradients this rank's partial sums (add them over ranks,
    in rank order for bitwise repeatability). Abstract: a KCP package binds
    ``_conv1d(x, weight, bias, context)`` and ``_gdn(q, k, v, g, beta, context,
    exchange, backend)``.
    """

    def _conv1d(self, x, weight, bias, context) -> torch.Tensor:
        raise NotImplementedError

    def _gdn(self, q, k, v, g, beta, context, exchange: str, backend: str | None
             ) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, hidden_states: torch.Tensor, context: Any, *,
                exchange: str = "allgather", backend: str | None = None) -> torch.Tensor:
        def conv(x, weight, bias):
            return self._conv1d(x, weight, bias, context)

        def gdn(q, k, v, g, beta):
            return self._gdn(q, k, v, g, beta, context, exchange, backend), None

        return self._mix(hidden_states, conv, gdn)[0]
