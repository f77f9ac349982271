"""The public calls of the context-parallel training packages, written once.

A KCP package declares its mode and its typed classes; a :class:`KCPAPI`
makes its public functions (named ``<call>_det_kcp`` in the deterministic
package, ``<call>_kcp`` in the other; documented, placed in the package's
module), so that ``gdn_train_kcp`` and ``gdn_det_train_kcp`` are declarations,
not copies. The functions route to :mod:`gdn_core.kcp.plan`,
:mod:`gdn_core.kcp.context`, :mod:`gdn_core.kcp.compose` (split API) and the
package's custom ops (:mod:`gdn_core.kcp_ops`: differentiable calls, conv).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gdn_core.chunking import CHUNK_SIZE
from gdn_core.custom_ops import register_handle
from gdn_core.kcp.compose import (
    check_forward_call,
    check_forward_world,
    kcp_backward,
    kcp_backward_simulated,
    kcp_forward,
    kcp_forward_simulated,
)
from gdn_core.kcp.context import build_context, build_simulated_contexts
from gdn_core.kcp.plan import DEFAULT_DOC_SLACK, partition
from gdn_core.kcp_ops import KCPOps, attach_static_layout, define_kcp_ops, rebind_static_context
from gdn_core.validation import check_bool

__all__ = ["KCPAPI"]

Tensor = torch.Tensor

_DOCS = {
    "partition": """Cut the packed sequence over ``world_size`` ranks → :class:`{plan}`.

    Pure CPU and deterministic; ``cu_seqlens`` a list or 1-D int tensor of the
    global packed sequence. ``boundary``:

    * ``"even"`` — balanced token counts (loads differ by at most one token);
    * ``"chunk"`` (default) — every cut on a chunk boundary of the document it
      splits (each fragment keeps the single-rank chunk grid), within
      ``chunk_size/2`` of the balanced position;
    * ``"doc"`` — cut at document boundaries; split a document (on a chunk
      boundary) only when no boundary lies within ``doc_slack·T/world_size`` of
      the balanced position;
    * ``"segment"`` — cut only at document starts or on ``segment_size``
      boundaries of a document (default 4096 tokens).

    Any ``world_size >= 1`` and any total length work; ranks may get no token.
    """,
    "build_context": """Rank ``rank``'s :class:`{context}` of ``plan``.

    ``group``: the ``torch.distributed`` process group (``None``: the default
    group when ``world_size > 1``; no communication at all for one rank).
    With a group, one small all-gather (once, here) compares what every rank
    must agree on — the world size and ranks, the plan (mode, boundary, chunk
    and segment sizes, digest), ``conv_kernel_size`` and the declared calls —
    so call it on all ranks: a disagreement raises the same ``ValueError`` on
    every rank within the collective (no timeout), and a rank whose own
    arguments are bad raises its error while its peers raise a ``ValueError``
    naming it. ``device``: where this rank's tensors live (default: the current
    CUDA device with NCCL, else the CPU; ``ValueError`` for a device this
    process cannot use, e.g. ``"cuda"`` without CUDA). ``conv_kernel_size``
    prebuilds the conv halo tables (else built at the first conv call).

    ``heads=(H, HV)``, ``head_dims=(K, V)``, ``dtype`` (of q, k, v, g, beta) and
    ``exchange`` declare what this rank's GDN calls will use (``None``: not
    declared). Declare them to have the ranks checked against each other here;
    a later call that differs from the declaration raises ``ValueError`` before
    any collective.

    ``max_docs`` (world of one only) makes the context *static*, for CUDA
    graphs: the differentiable calls then run over fixed-size device tables of
    up to ``max_docs`` documents and ``max_chunks`` chunks (default: enough for
    any layout of the shard's length), and :func:`{update_context}` points
    the same context — the same device buffers — at the next batch's plan
    (see :mod:`gdn_core.kcp_ops`).
    """,
    "update_context": """Point a static context (``{build_context}(..., max_docs=...)``) at ``plan``
    — a world of one over the same number of tokens, within the capacities — in
    place, so that a training step captured in a CUDA graph with the old plan
    replays for the new one. Returns ``context``. Not during a capture.""",
    "build_simulated_contexts": """The contexts of *all* ranks of ``plan`` for a simulated
    world in one process (no process group): run them with the ``*_simulated``
    functions. ``heads``, ``head_dims``, ``dtype``, ``exchange``: declared for
    every rank, as in the rank context's build.""",
    "fwd": """This rank's {mode_}KCP forward → ``(o, saved)``.

    ``q, k: [1,T,H,K]``, ``v: [1,T,HV,V]``, ``g, beta: [1,T,HV]``: this rank's
    shard ``[start, stop)`` of the global packed sequence
    (``T = stop - start``, possibly 0). ``o: [1,T,HV,V]`` in v's dtype.
    ``exchange``: ``"allgather"`` (summaries all-gathered, each rank folds its
    predecessors) or ``"ring"`` (the fold carried rank to rank by
    point-to-point sends){same_bits}. ``backend``: as
    :func:`gdn_core.resolve_backend` (default: triton on CUDA, reference on
    CPU). All checks run before any communication. The first call of a
    signature (heads, head dimensions, dtype, exchange, L2 norm) on a context
    all-gathers it once (:mod:`gdn_core.kcp.agree`): ranks that differ raise
    the same ``ValueError``, where they would otherwise abort or deadlock in
    the exchange; later calls of an agreed signature cost nothing.
    ``check_inputs=True`` (debugging: one host synchronisation and one small
    all-gather per call) raises ``ValueError`` on every rank when a rank's
    ``g`` holds a value ``> 0`` or NaN, or its ``beta`` one outside
    ``[0, 1]`` (its own message on that rank, naming the index and value);
    ``g = -inf`` is a full reset, never refused. Values are not read without it.
    """,
    "bwd": """This rank's {mode_}KCP backward → :class:`{grads}`.

    Raises ``ValueError`` — before any communication — when ``saved`` is not a
    :class:`{saved}` (e.g. the {other_mode} package's), when
    ``workspace`` is not a fitting :class:`{workspace}`, when ``do``
    does not match the rank's output, or when an input of the forward (q, k, v, g,
    beta) was modified in place since (its version counter moved, as autograd checks).
    That last check is this rank's own: its peers, already in the backward's exchange,
    would wait for it until the process group's timeout. ``check_inputs=True`` makes
    the ranks agree on it first (one small all-gather per call; over NCCL a host
    synchronisation), so that every rank raises ``ValueError`` at once.
    """,
    "autograd": """Differentiable {mode_}KCP GDN on this rank's shard → ``o [1,T,HV,V]``.

    Arguments and checks (``check_inputs`` included) as in the forward of the
    split API. Gradients flow to q, k, v, g and beta. The backward contains collectives:
    every rank's ``o`` must take part in the loss (or be backpropagated
    through) so that all ranks run it.
    """,
    "fwd_simulated": """Every rank's forward of a simulated world, in this process →
    ``([o], [saved])``.

    ``contexts`` from :func:`~{module}.{build_simulated_contexts}`;
    ``qs[r]`` etc. rank ``r``'s shard.{same_bits_sentence}
    """,
    "bwd_simulated": """Every rank's backward of a simulated world → ``[{grads}]``.

    Raises ``ValueError`` before any rank's work when a rank's saved set does not fit
    (as the split backward checks it), its inputs modified in place since included.
    """,
    "autograd_simulated": """Differentiable simulated world: every rank's shard in one
    process → ``[o]``.""",
    "conv": """Causal depthwise conv1d of this rank's shard ``x [1,T,D]`` → ``y [1,T,D]``.

    ``weight: [D, W]``, ``bias: [D]`` or ``None``, ``activation`` ``"silu"`` or
    ``None``. Tokens read the previous ``W-1`` tokens of their own document,
    across ranks (halo exchange; also in backward). Differentiable in ``x``,
    ``weight`` and ``bias``. Every rank must call it (and its backward).
    """,
    "conv_simulated": """Every rank's conv of a simulated world → ``[y]``; ``dweight``/``dbias``
    are summed over ranks in rank order.""",
}


class KCPAPI:
    """The public functions of one KCP package (one mode, one op namespace).

    Args:
        module: the package's import name; also its custom ops' namespace.
        deterministic: the package's mode.
        plan_cls, context_cls, saved_cls, workspace_cls, grads_cls: the
            package's typed classes (subclasses of the :mod:`gdn_core.kcp` bases
            of that mode).

    Attributes: ``ops`` (the :class:`~gdn_core.kcp_ops.KCPOps`), and one public
    function per call: ``partition``, ``build_context``, ``update_context``,
    ``build_simulated_contexts``, ``fwd``, ``bwd``, ``autograd``,
    ``fwd_simulated``, ``bwd_simulated``, ``autograd_simulated``, ``conv``,
    ``conv_simulated`` (each also named as the package exports it:
    :meth:`name`).
    """

    def __init__(self, module: str, *, deterministic: bool, plan_cls: type, context_cls: type,
                 saved_cls: type, workspace_cls: type, grads_cls: type) -> None:
        self.module, self.deterministic = module, bool(deterministic)
        self.plan_cls, self.context_cls = plan_cls, context_cls
        self.saved_cls, self.workspace_cls, self.grads_cls = saved_cls, workspace_cls, grads_cls
        self.ops: KCPOps = define_kcp_ops(module, deterministic=self.deterministic,
                                          context_cls=context_cls, saved_cls=saved_cls,
                                          workspace_cls=workspace_cls, grads_cls=grads_cls)
        det = self.deterministic
        fmt = dict(
            plan=plan_cls.__name__, context=context_cls.__name__, saved=saved_cls.__name__,
            workspace=workspace_cls.__name__, grads=grads_cls.__name__, module=module,
            mode_="deterministic " if det else "",
            other_mode="non-deterministic" if det else "deterministic",
            same_bits="; same bits" if det else "",
            same_bits_sentence=" Same bits as the distributed run." if det else "",
            update_context=self.name("update_context"), build_context=self.name("build_context"),
            build_simulated_contexts=self.name("build_simulated_contexts"),
        )
        # the package's own classes in the signatures (the closures are typed generically)
        typed = {"plan": plan_cls, "context": context_cls, "saved": saved_cls,
                 "workspace": workspace_cls | None}
        returns = {"partition": plan_cls, "build_context": context_cls,
                   "update_context": context_cls, "build_simulated_contexts": list[context_cls],
                   "fwd": tuple[Tensor, saved_cls], "bwd": grads_cls,
                   "bwd_simulated": list[grads_cls]}
        for call in _DOCS:
            fn = getattr(self, f"_make_{call}")()
            name = self.name(call)
            fn.__module__, fn.__name__, fn.__qualname__ = module, name, name
            fn.__doc__ = _DOCS[call].format(**fmt)
            fn.__code__ = fn.__code__.replace(co_name=name, co_qualname=name)
            fn.__annotations__.update({k: v for k, v in typed.items() if k in fn.__annotations__})
            if call in returns:
                fn.__annotations__["return"] = returns[call]
            setattr(self, call, fn)

    def name(self, call: str) -> str:
        """The package's name of ``call`` (``"fwd"`` → ``chunk_gdn_det_fwd_kcp``, …)."""
        d = "_det" if self.deterministic else ""
        return {
            "partition": f"partition{d}_kcp", "build_context": f"build_context{d}_kcp",
            "update_context": f"update_context{d}_kcp",
            "build_simulated_contexts": f"build_simulated_contexts{d}_kcp",
            "fwd": f"chunk_gdn{d}_fwd_kcp", "bwd": f"chunk_gdn{d}_bwd_kcp",
            "autograd": f"chunk_gated_delta_rule{d}_kcp",
            "fwd_simulated": f"chunk_gdn{d}_fwd_kcp_simulated",
            "bwd_simulated": f"chunk_gdn{d}_bwd_kcp_simulated",
            "autograd_simulated": f"chunk_gated_delta_rule{d}_kcp_simulated",
            "conv": f"causal_conv1d{d}_kcp", "conv_simulated": f"causal_conv1d{d}_kcp_simulated",
        }[call]

    # ------------------------------------------------------------ plans --

    def _make_partition(self) -> Callable[..., Any]:
        plan_cls = self.plan_cls

        def fn(cu_seqlens: Tensor | list[int], world_size: int, *, chunk_size: int = CHUNK_SIZE,
               boundary: str = "chunk", segment_size: int | None = None,
               doc_slack: float = DEFAULT_DOC_SLACK) -> Any:
            return partition(cu_seqlens, world_size, chunk_size=chunk_size, boundary=boundary,
                             segment_size=segment_size, doc_slack=doc_slack, plan_cls=plan_cls)

        return fn

    def _make_build_context(self) -> Callable[..., Any]:
        plan_cls, context_cls = self.plan_cls, self.context_cls

        def fn(plan: Any, rank: int, *, group: Any = None,
               device: torch.device | str | None = None, conv_kernel_size: int | None = None,
               max_docs: int | None = None, max_chunks: int | None = None,
               heads: tuple[int, int] | None = None, head_dims: tuple[int, int] | None = None,
               dtype: torch.dtype | None = None, exchange: str | None = None) -> Any:
            ctx = build_context(plan, rank, group=group, device=device,
                                conv_kernel_size=conv_kernel_size, heads=heads,
                                head_dims=head_dims, dtype=dtype, exchange=exchange,
                                plan_cls=plan_cls, context_cls=context_cls)
            if max_docs is not None or max_chunks is not None:
                if max_docs is None:
                    raise ValueError("max_chunks needs max_docs (a static context's document "
                                     "capacity)")
                attach_static_layout(ctx, max_docs=max_docs, max_chunks=max_chunks)
            register_handle(ctx)  # the custom ops reach the context through a handle
            return ctx

        return fn

    def _make_update_context(self) -> Callable[..., Any]:
        plan_cls, context_cls = self.plan_cls, self.context_cls

        def fn(context: Any, plan: Any) -> Any:
            return rebind_static_context(context, plan, plan_cls=plan_cls,
                                         context_cls=context_cls)

        return fn

    def _make_build_simulated_contexts(self) -> Callable[..., Any]:
        plan_cls, context_cls = self.plan_cls, self.context_cls

        def fn(plan: Any, *, device: torch.device | str | None = None,
               conv_kernel_size: int | None = None, heads: tuple[int, int] | None = None,
               head_dims: tuple[int, int] | None = None, dtype: torch.dtype | None = None,
               exchange: str | None = None) -> list[Any]:
            ctxs = build_simulated_contexts(plan, device=device,
                                            conv_kernel_size=conv_kernel_size, heads=heads,
                                            head_dims=head_dims, dtype=dtype, exchange=exchange,
                                            plan_cls=plan_cls, context_cls=context_cls)
            for ctx in ctxs:
                register_handle(ctx)
            return ctxs

        return fn

    # -------------------------------------------------------------- GDN --

    def _types(self) -> dict[str, type]:
        return dict(saved_cls=self.saved_cls, workspace_cls=self.workspace_cls,
                    grads_cls=self.grads_cls)

    def _make_fwd(self) -> Callable[..., Any]:
        det, context_cls, saved_cls = self.deterministic, self.context_cls, self.saved_cls

        def fn(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, context: Any, *,
               scale: float | None = None, use_qk_l2norm_in_kernel: bool = False,
               exchange: str = "allgather", backend: str | None = None,
               check_inputs: bool = False) -> tuple[Tensor, Any]:
            return kcp_forward(q, k, v, g, beta, context, deterministic=det,
                               context_cls=context_cls, saved_cls=saved_cls, scale=scale,
                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                               exchange=exchange, backend=backend, check_inputs=check_inputs)

        return fn

    def _make_bwd(self) -> Callable[..., Any]:
        det, types, fwd = self.deterministic, self._types(), self.name("fwd")

        def fn(saved: Any, do: Tensor, workspace: Any = None, *,
               check_inputs: bool = False) -> Any:
            return kcp_backward(saved, do, workspace, deterministic=det,
                                unmodified=(fwd, check_bool("check_inputs", check_inputs)),
                                **types)

        return fn

    def _make_autograd(self) -> Callable[..., Tensor]:
        ops, det, context_cls, saved_cls = (self.ops, self.deterministic, self.context_cls,
                                            self.saved_cls)

        def fn(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, context: Any,
               scale: float | None = None, use_qk_l2norm_in_kernel: bool = False,
               exchange: str = "allgather", backend: str | None = None,
               workspace: Any = None, check_inputs: bool = False) -> Tensor:
            if check_inputs is not False:  # the op's forward checks everything else
                check_forward_call(q, k, v, g, beta, context, deterministic=det,
                                   context_cls=context_cls, saved_cls=saved_cls, scale=scale,
                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                   exchange=exchange, backend=backend,
                                   check_inputs=check_inputs)
            return ops.chunk_gated_delta_rule(q, k, v, g, beta, context, scale=scale,
                                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                              exchange=exchange, backend=backend,
                                              workspace=workspace)

        return fn

    def _make_fwd_simulated(self) -> Callable[..., Any]:
        det, context_cls, saved_cls = self.deterministic, self.context_cls, self.saved_cls

        def fn(qs, ks, vs, gs, betas, contexts, *, scale=None, use_qk_l2norm_in_kernel=False,
               exchange="allgather", backend=None, check_inputs=False):
            return kcp_forward_simulated(qs, ks, vs, gs, betas, contexts, deterministic=det,
                                         context_cls=context_cls, saved_cls=saved_cls,
                                         scale=scale,
                                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                         exchange=exchange, backend=backend,
                                         check_inputs=check_inputs)

        return fn

    def _make_bwd_simulated(self) -> Callable[..., Any]:
        det, types, fwd = self.deterministic, self._types(), self.name("fwd_simulated")

        def fn(saveds, dos, workspaces=None) -> list[Any]:
            return kcp_backward_simulated(saveds, dos, workspaces, deterministic=det,
                                          unmodified=fwd, **types)

        return fn

    def _make_autograd_simulated(self) -> Callable[..., list[Tensor]]:
        ops, det, context_cls, saved_cls = (self.ops, self.deterministic, self.context_cls,
                                            self.saved_cls)

        def fn(qs, ks, vs, gs, betas, *, contexts, scale=None, use_qk_l2norm_in_kernel=False,
               exchange="allgather", backend=None, check_inputs=False) -> list[Tensor]:
            if check_inputs is not False:
                check_forward_world(qs, ks, vs, gs, betas, contexts, deterministic=det,
                                    context_cls=context_cls, saved_cls=saved_cls, scale=scale,
                                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                    exchange=exchange, backend=backend,
                                    check_inputs=check_inputs)
            return ops.chunk_gated_delta_rule_simulated(
                qs, ks, vs, gs, betas, contexts, scale=scale,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, exchange=exchange,
                backend=backend)

        return fn

    # ------------------------------------------------------------- conv --

    def _make_conv(self) -> Callable[..., Tensor]:
        ops = self.ops

        def fn(x: Tensor, weight: Tensor, bias: Tensor | None, context: Any,
               activation: str | None = "silu") -> Tensor:
            return ops.causal_conv1d(x, weight, bias, context, activation)

        return fn

    def _make_conv_simulated(self) -> Callable[..., list[Tensor]]:
        ops = self.ops

        def fn(xs, weight, bias, contexts, activation="silu") -> list[Tensor]:
            return ops.causal_conv1d_simulated(xs, weight, bias, contexts, activation)

        return fn

    # ------------------------------------------------------------ smoke --

    def smoke(self) -> None:
        """A tiny conv + KCP GDN forward/backward at world_size 1 on the CPU, checked
        against the single-rank path of the same mode (bitwise when deterministic):
        the import-independence checker's smoke run of a KCP package."""
        from gdn_core.compose import chunk_gdn_bwd, chunk_gdn_fwd

        det = self.deterministic
        gen = torch.Generator().manual_seed(0)
        offsets = [0, 5, 12]
        T, H, K, V, D = 12, 1, 16, 16, 8
        plan = self.partition(offsets, 1)
        ctx = self.build_context(plan, 0, device="cpu", conv_kernel_size=4)
        x = torch.randn(1, T, D, generator=gen, requires_grad=True)
        w = torch.randn(D, 4, generator=gen, requires_grad=True)
        self.conv(x, w, None, ctx).sum().backward()
        q = torch.randn(1, T, H, K, generator=gen)
        k = torch.randn(1, T, H, K, generator=gen)
        v = torch.randn(1, T, H, V, generator=gen)
        g = -torch.rand(1, T, H, generator=gen)
        beta = torch.rand(1, T, H, generator=gen)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
        o = self.autograd(*leaves, context=ctx, use_qk_l2norm_in_kernel=True,
                          backend="reference")
        do = torch.randn(o.shape, generator=gen)
        o.backward(do)
        o_ref, _, saved = chunk_gdn_fwd(q, k, v, g, beta, cu_seqlens=offsets,
                                        use_qk_l2norm_in_kernel=True, deterministic=det,
                                        backend="reference")
        ref = chunk_gdn_bwd(saved, do, deterministic=det)

        def same(a: Tensor, b: Tensor) -> bool:
            return torch.equal(a, b) if det else torch.allclose(a, b, rtol=1e-5, atol=1e-5)

        if not same(o, o_ref):
            raise AssertionError("world_size=1 output differs from the single-rank result")
        for leaf, want in zip(leaves, (ref.dq, ref.dk, ref.dv, ref.dg, ref.dbeta)):
            if not same(leaf.grad, want):
                raise AssertionError("world_size=1 gradient differs from the single-rank result")
