"""What the single-rank training packages have in common above the composition:
its ``torch.autograd.Function`` and the mode-typed
bases of their saved sets, workspaces and gradients.

* :class:`ChunkGDNFunction` / :func:`chunk_gdn_autograd` — the differentiable
  call (gradients for ``q, k, v, g, beta, initial_state, A_log, dt_bias``).
* :class:`TrainSaved`, :class:`TrainWorkspace`, :class:`TrainGrads` — bases a
  package subclasses once per mode (``deterministic = True``/``False``); the
  package's public calls (:mod:`gdn_core.frontend`) drive them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch

from gdn_core.chunking import CHUNK_SIZE
from gdn_core.compose import bwd, fwd
from gdn_core.custom_ops import register_handle
from gdn_core.plan import make_plan, resolve_backend
from gdn_core.saved import GateSaved, GDNSaved, graph_is_released
from gdn_core.typed import TypedSaved, TypedWorkspace, input_versions, modified_input_error
from gdn_core.validation import GDNShapes, check_bool, check_input_values

__all__ = [
    "GateSaved",
    "TrainSaved",
    "TrainWorkspace",
    "TrainGrads",
    "ChunkGDNFunction",
    "chunk_gdn_autograd",
]


# --------------------------------------------------------------------------
# Saved sets, gradients, workspaces
# --------------------------------------------------------------------------


class TrainSaved(TypedSaved):
    """Base of a training package's saved set: the core :class:`GDNSaved` (made
    in this class's mode) and, with the in-kernel gate, its :class:`GateSaved`."""

    __slots__ = ("core", "gate", "_versions")

    def __init__(self, core: GDNSaved, gate: GateSaved | None = None,
                 inputs: dict[str, torch.Tensor | None] | None = None) -> None:
        if type(self).deterministic is None:
            raise TypeError(f"{type(self).__qualname__} has no mode; subclass it")
        if core.deterministic != self.deterministic:
            raise ValueError(
                f"{type(self).__qualname__} ({self.mode}) cannot hold a saved state made with "
                f"deterministic={core.deterministic}"
            )
        self.core = core
        self.gate = gate
        # the forward's inputs (weakly: the saved set holds what the backward reads) and
        # their version counters, for check_unmodified
        self._versions = input_versions(inputs or {})

    def check_unmodified(self, forward: str = "the forward") -> None:
        """Raise ``ValueError`` if an input of the forward that made this saved set was
        modified in place since (its version counter moved, as autograd checks): the
        backward would compute the gradients of other values. An input freed since
        cannot be checked (and cannot be modified any more)."""
        message = modified_input_error(self._versions, forward)
        if message is not None:
            raise ValueError(message)

    @property
    def shapes(self) -> GDNShapes:
        return self.core.shapes

    @property
    def device(self) -> torch.device:
        return self.core.device

    @property
    def backend(self) -> str:
        return self.core.backend

    @property
    def use_gate_in_kernel(self) -> bool:
        return self.gate is not None

    def __repr__(self) -> str:
        s = self.shapes
        return (
            f"{type(self).__qualname__}({self.mode}, backend={self.backend}, B={s.B}, T={s.T}, "
            f"H={s.H}, HV={s.HV}, K={s.K}, V={s.V}, docs={s.num_docs}, "
            f"gate={self.use_gate_in_kernel})"
        )


@dataclass
class TrainGrads:
    """Gradients of one call: ``dq, dk [B,T,H,K]``, ``dv [B,T,HV,V]``, ``dg, dbeta
    [B,T,HV]`` (``dg`` is for the ``g`` the caller passed: the raw gate input
    with ``use_gate_in_kernel``), ``dh0 [N,HV,K,V]`` or ``None``, ``dA_log`` and
    ``ddt_bias [HV]`` with the in-kernel gate, else ``None``."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dh0: torch.Tensor | None
    dA_log: torch.Tensor | None = None
    ddt_bias: torch.Tensor | None = None

    def as_dict(self) -> dict[str, torch.Tensor | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _max_chunks(tokens: int, docs: int, chunk_size: int) -> int:
    """Upper bound of the chunk count of ``tokens`` split into ``docs`` documents."""
    if tokens == 0:
        return 0
    return math.ceil(tokens / chunk_size) + max(docs, 1) - 1


def _num_chunks(offsets: tuple[int, ...], chunk_size: int) -> int:
    return sum(-(-(b - a) // chunk_size) for a, b in zip(offsets[:-1], offsets[1:]))


class TrainWorkspace(TypedWorkspace):
    """Base of a training package's backward workspace.

    Sized once (:meth:`for_shapes`, :meth:`for_inputs`) for a largest problem
    — ``tokens`` (``B*T``), ``chunks`` and ``docs`` up to the capacity, heads and
    head dimensions exactly — and reused step after step. On the triton backend
    it holds the kernels' scratch buffers (``gdn_core.ops.backward.
    BackwardWorkspace``), made at sizing time (CUDA) or at first use.
    """

    def __init__(
        self,
        *,
        T: int,
        H: int,
        K: int,
        V: int,
        HV: int | None = None,
        B: int = 1,
        num_docs: int | None = None,
        device: torch.device | str = "cuda",
        dtype: torch.dtype = torch.bfloat16,
        chunk_size: int = CHUNK_SIZE,
    ) -> None:
        if type(self).deterministic is None:
            raise TypeError(f"{type(self).__qualname__} has no mode; subclass it")
        HV = H if HV is None else HV
        for name, val in (("T", T), ("H", H), ("HV", HV), ("K", K), ("V", V), ("B", B)):
            if not isinstance(val, int) or val < (0 if name == "T" else 1):
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if HV % H:
            raise ValueError(f"HV={HV} must be a multiple of H={H}")
        docs = B if num_docs is None else int(num_docs)
        if docs < 1:
            raise ValueError(f"num_docs must be >= 1, got {num_docs!r}")
        tokens = B * T
        super().__init__(
            device,
            capacity={"tokens": tokens, "chunks": _max_chunks(tokens, docs, chunk_size),
                      "docs": docs},
            layout={"H": H, "HV": HV, "K": K, "V": V, "chunk_size": chunk_size},
        )
        self.dtype = dtype
        register_handle(self)  # custom ops reach the workspace through a handle
        self.core: Any = None
        self._core_backend_checked = False
        try:
            backend = resolve_backend(self.device, dtype)
        except (TypeError, ValueError):
            backend = "reference"
        if backend == "triton":
            self.core = self._make_core()
            self._core_backend_checked = True

    @classmethod
    def for_shapes(cls, *, T: int, H: int, K: int, V: int, HV: int | None = None, B: int = 1,
                   num_docs: int | None = None, device: torch.device | str = "cuda",
                   dtype: torch.dtype = torch.bfloat16):
        """A workspace for problems up to ``B*T`` tokens in up to ``num_docs``
        documents (default ``B``: a fixed-length batch) with ``H`` q/k heads,
        ``HV`` value heads (default ``H``) and head dimensions ``K``, ``V``."""
        return cls(T=T, H=H, K=K, V=V, HV=HV, B=B, num_docs=num_docs, device=device,
                   dtype=dtype)

    @classmethod
    def for_inputs(cls, q: torch.Tensor, v: torch.Tensor, cu_seqlens=None):
        """A workspace sized for exactly the problem of ``q [B,T,H,K]``, ``v [B,T,HV,V]``
        (and ``cu_seqlens``)."""
        B, T, H, K = q.shape
        docs = None if cu_seqlens is None else len(cu_seqlens) - 1
        return cls.for_shapes(T=T, H=H, K=K, V=v.shape[3], HV=v.shape[2], B=B, num_docs=docs,
                              device=q.device, dtype=q.dtype)

    def check_shapes(self, shapes: GDNShapes, device: torch.device,
                     dtype: torch.dtype | None = None, backend: str | None = None,
                     argname: str = "workspace") -> None:
        """Raise ``ValueError`` unless this workspace serves ``shapes`` on ``device``
        (and, on the triton backend, inputs of ``dtype``: the kernels' buffers are typed)."""
        if backend == "triton" and dtype is not None and dtype != self.dtype:
            raise ValueError(
                f"{argname} does not fit: {type(self).__qualname__} was sized for "
                f"dtype={self.dtype}, the inputs are {dtype}"
            )
        self.check_fits(
            device,
            {"tokens": shapes.B * shapes.T,
             "chunks": _num_chunks(shapes.offsets, self.layout["chunk_size"]),
             "docs": shapes.num_docs},
            {"H": shapes.H, "HV": shapes.HV, "K": shapes.K, "V": shapes.V},
            argname=argname,
        )

    def _make_core(self) -> Any:
        """The kernels' :class:`~gdn_core.ops.backward.BackwardWorkspace` at this capacity."""
        from gdn_core.ops.backward import BackwardWorkspace

        cap, lay = self.capacity, self.layout
        return BackwardWorkspace.for_shapes(
            cap["tokens"], lay["H"], lay["HV"], lay["K"], lay["V"], cap["chunks"], cap["docs"],
            self.dtype, self.device, deterministic=bool(self.deterministic),
        )

    def core_for(self, saved: GDNSaved) -> Any:
        """The kernels' workspace for a triton-backend backward (made on first use)."""
        if saved.backend != "triton":
            return None
        if self.core is None and not self._core_backend_checked:
            self._core_backend_checked = True
            self.core = self._make_core()
        return self.core


# --------------------------------------------------------------------------
# The autograd call
# --------------------------------------------------------------------------


class ChunkGDNFunction(torch.autograd.Function):
    """``apply(plan, workspace, q, k, v, g, beta, initial_state, A_log, dt_bias) -> (o, final)``.

    ``final`` is an empty tensor when not requested. The packages' public autograd
    calls run it eagerly (:mod:`gdn_core.frontend`; their custom op under
    ``torch.compile``); else use :func:`chunk_gdn_autograd`. The inputs are saved for
    backward, so that autograd refuses a backward after one of them was modified in
    place (the composition's saved set holds views of them).
    """

    @staticmethod
    def forward(ctx, plan, workspace, q, k, v, g, beta, initial_state, A_log, dt_bias):
        o, final, core, gate = fwd(plan, q, k, v, g, beta, initial_state, A_log, dt_bias)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, A_log, dt_bias)
        ctx.core, ctx.gate, ctx.plan, ctx.workspace = core, gate, plan, workspace
        ctx.h0_dtype = None if initial_state is None else initial_state.dtype
        ctx.set_materialize_grads(False)
        if final is None:
            final = o.new_empty(0)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        ctx.saved_tensors  # noqa: B018 -- autograd's in-place (version) check
        core, gate, plan = ctx.core, ctx.gate, ctx.plan
        s = core.shapes
        if do is None:
            do = torch.zeros(s.B, s.T, s.HV, s.V, dtype=core.v.dtype, device=core.device)
        dht = dfinal if (plan.output_final_state and dfinal is not None) else None
        ws = ctx.workspace.core_for(core) if ctx.workspace is not None else None
        grads, dA_log, ddt_bias = bwd(core, gate, do.contiguous(), dht, workspace=ws)
        if graph_is_released():  # the saved set goes with the saved tensors, not the node
            ctx.core = ctx.gate = None
        dh0 = grads.dh0
        if dh0 is not None and ctx.h0_dtype is not None:
            dh0 = dh0.to(ctx.h0_dtype)
        return (None, None, grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta, dh0, dA_log,
                ddt_bias)


def chunk_gdn_autograd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    deterministic: bool,
    workspace: TrainWorkspace | None = None,
    backend: str | None = None,
    segment_size: int | None = None,
    check_inputs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Differentiable gated GDN: ``(o [B,T,HV,V], final_state [N,HV,K,V] fp32 or None)``.

    Validates everything (including ``workspace``'s fit) before computing; the
    backward reuses ``workspace`` if given. ``segment_size``: see
    :mod:`gdn_core.segment` (``None``: the default). ``check_inputs=True``: the
    values too (:func:`gdn_core.validation.check_input_values`, one host sync).
    """
    plan = make_plan(q, k, v, g, beta, deterministic=deterministic, scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state,
                     cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                     backend=backend, segment_size=segment_size)
    if check_bool("check_inputs", check_inputs):
        msg = check_input_values(g, beta, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                                 dt_bias=dt_bias)
        if msg is not None:
            raise ValueError(msg)
    if workspace is not None:
        workspace.check_shapes(plan.shapes, v.device, q.dtype, plan.backend)
    o, final = ChunkGDNFunction.apply(plan, workspace, q, k, v, g, beta, initial_state, A_log,
                                      dt_bias)
    return o, (final if output_final_state else None)
