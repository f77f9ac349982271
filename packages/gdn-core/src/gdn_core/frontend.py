"""The public calls of the single-rank training packages, written once.

A package declares its mode, its namespace and its typed classes; a
:class:`SingleRankAPI` makes its public functions (named, documented and
placed in the package's module), so that ``gdn_train`` and ``gdn_det_train``
are declarations, not copies::

    API = SingleRankAPI("gdn_det_train", deterministic=True, saved_cls=DetSavedSet,
                        workspace_cls=DetWorkspace, grads_cls=DetGrads)
    chunk_gated_delta_rule_det = API.autograd_call("chunk_gated_delta_rule_det", doc)

Each function is the whole host path in front of the composition: the type
checks of the package's own classes, the plan (:func:`gdn_core.plan.make_plan`:
every other check, once), then the composition: through
:class:`gdn_core.autograd.ChunkGDNFunction` (the autograd call, eagerly), the custom op
(the autograd call under ``torch.compile``; the conv) or
:func:`gdn_core.compose.fwd` / :func:`~gdn_core.compose.bwd` (split API).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from gdn_core import compose
from gdn_core.autograd import ChunkGDNFunction, TrainGrads, TrainSaved, TrainWorkspace
from gdn_core.custom_ops import object_handle
from gdn_core.layout import VarlenLayout
from gdn_core.plan import make_plan
from gdn_core.train_ops import TrainOps, define_train_ops, layout_segment_size, op_plan
from gdn_core.typed import mode_name, require_instance
from gdn_core.validation import check_bool, check_input_values

__all__ = ["SingleRankAPI"]

F = TypeVar("F", bound=Callable[..., Any])
Tensor = torch.Tensor


_AUTOGRAD_DOC = """{summary}

    Shapes: ``q, k: [B,T,H,K]``, ``v: [B,T,HV,V]`` (``HV`` a multiple of ``H``),
    ``g, beta: [B,T,HV]``, ``initial_state: [N,HV,K,V]``, ``cu_seqlens: [N+1]``
    (packed documents, ``B == 1``; a list, a tensor — a CPU one under
    ``torch.compile`` — or a :class:`gdn_core.layout.VarlenLayout` with
    fixed-size device tables for CUDA graphs). ``g`` is the log-decay, or with
    ``use_gate_in_kernel=True`` the raw gate input, turned into
    ``−exp(A_log)·softplus(g + dt_bias)`` (``A_log, dt_bias: [HV]``) inside.

    Returns ``(o [B,T,HV,V], final_state [N,HV,K,V] fp32 or None)``. Gradients
    flow to ``q, k, v, g, beta, initial_state`` (and ``A_log, dt_bias``);
    {mode} ``workspace``: a :class:`{workspace}` the backward reuses.

    {segments}

    Values are not read (no device synchronisation): ``g = -inf`` is a full
    reset (the state before the token is forgotten; finite results), ``g > 0``
    (a growing state) is undefined (it overflows to inf/NaN), ``beta`` outside
    ``[0, 1]`` is computed as the formula says. ``check_inputs=True`` (one host
    synchronisation; debugging) raises ``ValueError`` naming the first value
    of ``g > 0`` or NaN (with ``use_gate_in_kernel``: a NaN raw gate input, a
    non-finite ``A_log`` / ``dt_bias``), or of ``beta`` outside ``[0, 1]``.

    Traced by ``torch.compile(fullgraph=True)`` without a graph break: there it runs
    the custom op ``torch.ops.{ns}.chunk_gated_delta_rule`` (see
    :mod:`gdn_core.train_ops`; ``check_inputs=True`` reads values, so not there);
    eagerly the same composition through one ``autograd.Function`` (same bits, less
    host time).
    """

_FWD_DOC = """Forward of the split API: ``(o, final_state, saved)``.

    Same arguments as :func:`{autograd}` (``check_inputs`` included); no
    autograd graph is recorded. Pass ``saved`` to :func:`{bwd}`, and leave the
    inputs unmodified until then (it refuses inputs modified in place).
    """

_BWD_DOC = """Backward of the split API.

    ``saved``: the :class:`{saved}` of :func:`{fwd}`; ``do``:
    gradient of ``o``; ``dht``: gradient of the final state or ``None``;
    ``workspace``: a :class:`{workspace}` (reused across steps) or ``None``.

    Raises ``ValueError`` — before touching any tensor — if ``saved`` is not a
    ``{saved}`` or ``workspace`` not a ``{workspace}`` (e.g. made by
    ``{other}``), or the workspace is too small or on another device, and (as
    autograd does) if an input of the forward was modified in place since
    (its version counter moved; the message names it).
    """

_CONV_DOC = """{summary}

    ``x: [B,T,D]``, ``weight: [D,W]`` (``weight[:, -1]`` multiplies the current
    token), ``bias: [D]`` or ``None``, ``activation`` ``"silu"``/``"swish"`` or
    ``None``, ``cu_seqlens: [N+1]`` (``B == 1``): no token sees a previous
    document (or a :class:`VarlenLayout`: fixed-size device tables, see
    :mod:`gdn_core.layout`). Returns ``y: [B,T,D]`` in ``x``'s dtype. The weight and bias
    gradients (sums over all tokens) {reduction}.
    """


def _check_values(g: Tensor, beta: Tensor, gate: bool, A_log: Tensor | None,
                  dt_bias: Tensor | None) -> None:
    """``check_inputs=True``: ``ValueError`` for a value outside the domain
    (:func:`gdn_core.validation.check_input_values`; one host synchronisation)."""
    msg = check_input_values(g, beta, use_gate_in_kernel=gate, A_log=A_log, dt_bias=dt_bias)
    if msg is not None:
        raise ValueError(msg)


def _named(fn: F, module: str, name: str, doc: str) -> F:
    """``fn`` as the package's public ``module.name`` (tracebacks show that name too)."""
    fn.__module__, fn.__name__, fn.__qualname__, fn.__doc__ = module, name, name, doc
    fn.__code__ = fn.__code__.replace(co_name=name, co_qualname=name)
    return fn


class SingleRankAPI:
    """The public functions of one single-rank package (one mode, one op namespace).

    Args:
        module: the package's import name; also the namespace of its custom ops
            (``torch.ops.<module>.*``, :func:`gdn_core.train_ops.define_train_ops`).
        deterministic: the package's mode.
        saved_cls, workspace_cls, grads_cls: the package's typed classes
            (subclasses of :class:`~gdn_core.autograd.TrainSaved`,
            :class:`~gdn_core.autograd.TrainWorkspace`,
            :class:`~gdn_core.autograd.TrainGrads` of that mode).

    Attributes: ``ops`` (the :class:`~gdn_core.train_ops.TrainOps`), ``mode``
    (``"deterministic"`` / ``"non-deterministic"``), the arguments, and the
    functions made so far: ``autograd``, ``fwd``, ``bwd``, ``conv`` (what the
    shared test suites of :mod:`gdn_core.suites` call).
    """

    def __init__(self, module: str, *, deterministic: bool, saved_cls: type[TrainSaved],
                 workspace_cls: type[TrainWorkspace], grads_cls: type[TrainGrads]) -> None:
        for cls in (saved_cls, workspace_cls, grads_cls):
            if cls.deterministic is not deterministic:
                raise ValueError(f"{cls.__qualname__} is not of the deterministic="
                                 f"{deterministic} mode")
        self.module = module
        self.deterministic = deterministic
        self.saved_cls, self.workspace_cls, self.grads_cls = saved_cls, workspace_cls, grads_cls
        self.ops: TrainOps = define_train_ops(module, deterministic=deterministic)
        self.mode = mode_name(deterministic)
        self.autograd = self.fwd = self.bwd = self.conv = None

    def autograd_call(self, name: str, *, summary: str, mode: str, segments: str
                      ) -> Callable[..., tuple[Tensor, Tensor | None]]:
        """The differentiable GDN call ``name``: ``(o, final_state or None)``, through
        the op. ``summary``, ``mode``, ``segments``: its docstring's mode-specific
        first line, gradient sentence and ``segment_size`` paragraph."""
        doc = _AUTOGRAD_DOC.format(summary=summary, mode=mode, segments=segments,
                                   workspace=self.workspace_cls.__name__, ns=self.module)
        det, ws_cls, op = self.deterministic, self.workspace_cls, self.ops.gdn

        def call(
            q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
            scale: float | None = None, initial_state: Tensor | None = None,
            output_final_state: bool = False,
            cu_seqlens: Tensor | list[int] | VarlenLayout | None = None,
            use_qk_l2norm_in_kernel: bool = False, *, use_gate_in_kernel: bool = False,
            A_log: Tensor | None = None, dt_bias: Tensor | None = None,
            workspace: TrainWorkspace | None = None, segment_size: int | None = None,
            check_inputs: bool = False,
        ) -> tuple[Tensor, Tensor | None]:
            layout = None
            if workspace is not None:
                require_instance(workspace, ws_cls, "workspace")
            if isinstance(cu_seqlens, VarlenLayout):
                layout, cu_seqlens = cu_seqlens, cu_seqlens.cu_seqlens
            if torch.compiler.is_compiling():  # traced: the custom op
                ws = None if workspace is None else object_handle(workspace, "workspace")
                if isinstance(cu_seqlens, (list, tuple)):
                    cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int64)
                o, final, *_ = op(
                    q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens,
                    None if layout is None else layout.handle, ws,
                    None if scale is None else float(scale), bool(output_final_state),
                    bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel), None,
                    segment_size,
                )
                return o, (final if output_final_state else None)
            # eagerly: every check here, once; then the composition through one
            # autograd.Function (the op's Python dispatch would cost ~1 ms of host
            # time per forward+backward, docs/performance.md; the same bits)
            if layout is not None:
                layout_segment_size(segment_size)
                plan = op_plan(det, q, k, v, g, beta, initial_state, A_log, dt_bias, None,
                               layout, scale, output_final_state, use_qk_l2norm_in_kernel,
                               use_gate_in_kernel, None, segment_size)
            else:
                plan = make_plan(
                    q, k, v, g, beta, deterministic=det, scale=scale,
                    initial_state=initial_state, output_final_state=output_final_state,
                    cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                    segment_size=segment_size)
            if workspace is not None:
                workspace.check_shapes(plan.shapes, v.device, q.dtype, plan.backend)
            if check_bool("check_inputs", check_inputs):
                _check_values(g, beta, use_gate_in_kernel, A_log, dt_bias)
            o, final = ChunkGDNFunction.apply(plan, workspace, q, k, v, g, beta, initial_state,
                                              A_log, dt_bias)
            return o, (final if output_final_state else None)

        self.autograd = _named(call, self.module, name, doc)
        return self.autograd

    def split_fwd(self, name: str, *, autograd: str, bwd: str
                  ) -> Callable[..., tuple[Tensor, Tensor | None, Any]]:
        """The split API's forward ``name``: ``(o, final_state, saved)``, no autograd
        graph (``autograd``, ``bwd``: the names its docstring refers to)."""
        doc = _FWD_DOC.format(autograd=autograd, bwd=bwd)
        saved_cls, det = self.saved_cls, self.deterministic

        def fwd(
            q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
            scale: float | None = None, initial_state: Tensor | None = None,
            output_final_state: bool = False, cu_seqlens: Tensor | list[int] | None = None,
            use_qk_l2norm_in_kernel: bool = False, *, use_gate_in_kernel: bool = False,
            A_log: Tensor | None = None, dt_bias: Tensor | None = None,
            segment_size: int | None = None, check_inputs: bool = False,
        ) -> tuple[Tensor, Tensor | None, TrainSaved]:
            plan = make_plan(q, k, v, g, beta, deterministic=det, scale=scale,
                             initial_state=initial_state, output_final_state=output_final_state,
                             cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                             use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                             segment_size=segment_size)
            if check_bool("check_inputs", check_inputs):
                _check_values(g, beta, use_gate_in_kernel, A_log, dt_bias)
            with torch.no_grad():
                o, final, core, gate = compose.fwd(plan, q, k, v, g, beta, initial_state, A_log,
                                                   dt_bias)
            inputs = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
                          A_log=A_log, dt_bias=dt_bias)
            return o, final, saved_cls(core, gate, inputs)

        self.fwd = _named(fwd, self.module, name, doc)
        return self.fwd

    def split_bwd(self, name: str, *, fwd: str, other: str) -> Callable[..., TrainGrads]:
        """The split API's backward ``name``: the package's gradients class (``fwd``:
        its forward's name; ``other``: the package of the other mode, for the docs)."""
        doc = _BWD_DOC.format(saved=self.saved_cls.__name__, fwd=fwd,
                              workspace=self.workspace_cls.__name__, other=other)
        saved_cls, ws_cls, grads_cls = self.saved_cls, self.workspace_cls, self.grads_cls
        fwd_name = fwd

        def bwd(saved: TrainSaved, do: Tensor, dht: Tensor | None = None,
                workspace: TrainWorkspace | None = None) -> TrainGrads:
            require_instance(saved, saved_cls, "saved")
            saved.check_unmodified(fwd_name)
            core, core_ws = saved.core, None
            if workspace is not None:
                require_instance(workspace, ws_cls, "workspace")
                workspace.check_shapes(core.shapes, core.device, core.k.dtype, core.backend)
                core_ws = workspace.core_for(core)
            compose.check_backward_args(core, do, dht, core.deterministic)
            with torch.no_grad():
                g, dA_log, ddt_bias = compose.bwd(core, saved.gate, do, dht, workspace=core_ws)
            return grads_cls(g.dq, g.dk, g.dv, g.dg, g.dbeta, g.dh0, dA_log, ddt_bias)

        self.bwd = _named(bwd, self.module, name, doc)
        return self.bwd

    def conv_call(self, name: str, *, summary: str, reduction: str) -> Callable[..., Tensor]:
        """The differentiable causal depthwise conv1d ``name``, through the op
        (``summary``, ``reduction``: its docstring's mode-specific parts)."""
        doc = _CONV_DOC.format(summary=summary, reduction=reduction)
        ops = self.ops

        def conv(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                 activation: str | None = "silu",
                 cu_seqlens: Tensor | list[int] | VarlenLayout | None = None) -> Tensor:
            return ops.causal_conv1d(x, weight, bias, activation, cu_seqlens)

        self.conv = _named(conv, self.module, name, doc)
        return self.conv

    def smoke(self) -> None:
        """A tiny CPU conv1d, then GDN with the in-kernel gate through the autograd call
        and the split API (the import-independence checker's smoke run of a package)."""
        gen = torch.Generator().manual_seed(0)
        T, H, K = 8, 1, 16
        x = torch.randn(1, T, 3 * H * K, generator=gen, requires_grad=True)
        w = torch.randn(3 * H * K, 4, generator=gen, requires_grad=True)
        y = self.conv(x, w, None, "silu", cu_seqlens=[0, 3, T])
        q, k, v = y.reshape(1, T, 3, H, K).unbind(2)
        g = torch.randn(1, T, H, generator=gen, requires_grad=True)
        beta = torch.rand(1, T, H, generator=gen)
        A_log = torch.zeros(H, requires_grad=True)
        dt_bias = torch.zeros(H, requires_grad=True)
        o, _ = self.autograd(
            q, k, v, g, beta, cu_seqlens=[0, 3, T], use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
        )
        o.sum().backward()
        o2, _, saved = self.fwd(q.detach(), k.detach(), v.detach(), g.detach(), beta)
        self.bwd(saved, torch.ones_like(o2))
