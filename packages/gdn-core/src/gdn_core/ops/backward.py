"""The composed chunked GDN backward on the Triton kernels.

Stages (docs/math.md), flat token layout, value head ``hv`` uses q/k head
``hv // group``:

0. recompute ``G`` (if not saved), ``W, U`` from the forward's saved inverse
   (:func:`~gdn_core.ops.wy.wy_apply`; or ``A_inv, W, U`` with
   :func:`~gdn_core.ops.wy.wy_fwd` when none was saved) and ``h, v_new``
   (:func:`~gdn_core.ops.chunk_state.chunk_state_fwd`);
1. :func:`~gdn_core.ops.dv_local.dv_local_bwd` — chunk-local ``dV'``;
2. :func:`~gdn_core.ops.chunk_state_bwd.chunk_state_bwd` — reverse recurrence:
   ``dS`` per chunk (``dh``, input dtype), full ``dV'``, ``dh0`` (fp32); on sm_90 at
   16-bit K = V = 128 with enough programs, 1 and 2 are one warp-specialised Gluon
   launch with the same bits (:func:`pick_fused_state`);
3. :func:`~gdn_core.ops.chunk_grads_bwd.chunk_grads_bwd` — every chunk-local
   gradient in two kernels: per-value-head ``dq``/``dk`` (final with one value head
   per q/k head), ``dv``, ``dβ`` and ``dg`` (the WY backward included);
4. :func:`~gdn_core.ops.group_reduce.group_reduce` — fixed-order sum of the
   ``dq``/``dk`` partials over each group of value heads;
5. the L2-norm backward when the forward normalised q/k in the kernel.

Aliasing (on unless ``GDN_CORE_BWD_ALIAS=0``; :func:`plan_aliases`): where the one-tile Gluon
chunk-gradient kernel runs (:mod:`gdn_core.ops.gluon.chunk_grads`), each of its CTAs
TMA-loads every tile of its (chunk, value head) before it stores a result row, and only
that CTA stores those rows; a short chunk's rows past its end (another CTA's) are zeroed
in shared memory before any product. So ``dv`` is written over this call's own ``dV'``
buffer and, with one value head per q/k head and ``dq`` final in v_new's dtype, ``dq`` over
its own ``v_new``: the same bits, up to two ``[T, HV, V]`` buffers fewer at the peak.
Never with a workspace, result buffers (``out``, the slabs), buffers the caller did not
hand over (``donate``), the persistent Gluon kernel or the Triton pair (whose second
kernel re-reads ``V'`` and ``dV'`` after the first stored ``dq``/``dv``).

Determinism: none of these launchers uses atomics, every cross-program sum
runs in a fixed order, and all launch configurations are pinned (no
autotuning), so ``deterministic=True`` results are bitwise repeatable.
``deterministic=False`` currently runs the same kernels (the atomic group
reduction, :func:`~gdn_core.ops.group_reduce.group_reduce_atomic`, is not
faster than the ordered one, which reads each partial once); the flag still
types the workspace.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gdn_core.chunking import ChunkIndex
from gdn_core.ops import gluon
from gdn_core.ops.chunk_grads_bwd import chunk_grads_bwd
from gdn_core.ops.chunk_state_bwd import chunk_state_bwd
from gdn_core.ops.dv_local import dv_local_bwd
from gdn_core.ops.group_reduce import group_reduce
from gdn_core.ops.tiles import unit_last
from gdn_core.switches import BWD_ALIAS_ENV, switch_setting
from gdn_core.typed import TypedWorkspace, mode_name, require_instance

__all__ = [
    "FUSED_STATE_MIN_PROGRAMS",
    "BackwardWorkspace",
    "DetBackwardWorkspace",
    "FreshBuffers",
    "NonDetBackwardWorkspace",
    "Recomputed",
    "gdn_backward_triton",
    "chunk_gdn_backward",
    "backward_from_recompute",
    "fused_state_pays",
    "grads_kernel",
    "pick_fused_bwd",
    "pick_fused_state",
    "plan_aliases",
    "resolve_workspace",
    "uses_dq_partials",
]

_FP32 = torch.float32


def _buffer_specs(
    T: int, HV: int, K: int, V: int, num_chunks: int, dtype: torch.dtype,
    dq_partials: bool = True,
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every scratch buffer of a backward of this size
    (``dq_partials=False``: without ``dq_part`` and ``dk_part``, which a backward with
    one value head per q/k head and outputs in the input dtype does not use)."""
    specs = {
        "dv_local": ((T, HV, V), dtype),
        "dh": ((num_chunks, HV, K, V), dtype),
        "dq_part": ((T, HV, K), _FP32),
        "dk_part": ((T, HV, K), _FP32),
    }
    if not dq_partials:
        del specs["dq_part"], specs["dk_part"]
    return specs


def uses_dq_partials(group: int, dqk_dtype: torch.dtype | None) -> bool:
    """Whether a backward with ``group`` value heads per q/k head, returning ``dq``/``dk``
    in ``dqk_dtype`` (``None``: the inputs' dtype), uses the workspace's fp32 ``dq``
    partials: it does unless ``group == 1`` and the outputs are not the fp32 partials
    themselves (then the kernels round ``dq``/``dk`` straight into their outputs)."""
    return group != 1 or dqk_dtype == torch.float32


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class BackwardWorkspace(TypedWorkspace):
    """Preallocated scratch of the backward, reusable across steps.

    Sized once for a largest problem (:meth:`for_shapes`): up to ``T`` tokens,
    ``num_chunks`` chunks and ``num_docs`` documents (capacities), with exactly
    ``H, HV, K, V`` and ``dtype`` (layout). A smaller problem uses the leading
    part of each buffer. Typed per mode: :meth:`for_shapes` returns a
    :class:`DetBackwardWorkspace` or a :class:`NonDetBackwardWorkspace`, and a
    backward of the other mode, of a larger size, of another layout, dtype or
    device rejects it with ``ValueError`` (:meth:`check`).

    Buffers (flat fp32 / input-dtype storage, viewed per call; ``NT`` chunks):

    * ``dv_local [T,HV,V]`` — input dtype; the state backward turns it into the full
      ``dV'`` in place;
    * ``dh [NT,HV,K,V]`` — ``dS`` of the state leaving each chunk, input dtype;
    * ``dq_part, dk_part [T,HV,K]`` — fp32 per-value-head partials (only with
      ``dq_partials=True``, the default: a backward with one value head per q/k head
      writes ``dq``/``dk`` straight into its outputs unless it returns fp32 partials
      for the L2-norm backward; a grouped backward on the one-tile Gluon kernel does
      not use them: its running sums go through the spent ``h``/``dh`` tiles).
    """

    def __init__(
        self,
        device: torch.device | str,
        capacity: dict[str, int],
        layout: dict[str, Any],
        storage: dict[str, torch.Tensor],
    ) -> None:
        if type(self).deterministic is None:
            raise TypeError(
                "BackwardWorkspace has no mode: make one with BackwardWorkspace.for_shapes(...)"
            )
        super().__init__(device, capacity, layout)
        self.dtype = layout["dtype"]
        self.storage = storage

    @classmethod
    def for_shapes(
        cls,
        T: int,
        H: int,
        HV: int,
        K: int,
        V: int,
        num_chunks: int,
        num_docs: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        deterministic: bool | None = None,
        dq_partials: bool = True,
    ) -> BackwardWorkspace:
        """A workspace for problems of up to ``T`` tokens, ``num_chunks`` chunks and
        ``num_docs`` documents. The mode is the class's (``DetBackwardWorkspace``,
        ``NonDetBackwardWorkspace``) or, on the base class, ``deterministic``
        (default ``True``). ``dq_partials=False`` leaves out the fp32 ``dq``/``dk``
        partials (a backward that needs them then rejects the workspace)."""
        if cls.deterministic is not None:
            if deterministic is not None and bool(deterministic) != cls.deterministic:
                raise ValueError(
                    f"{cls.__qualname__} is {mode_name(cls.deterministic)}, "
                    f"got deterministic={deterministic}"
                )
            target = cls
        else:
            det = True if deterministic is None else bool(deterministic)
            target = DetBackwardWorkspace if det else NonDetBackwardWorkspace
        for name, val in (("T", T), ("num_chunks", num_chunks), ("num_docs", num_docs)):
            if val < 0:
                raise ValueError(f"{name} must be >= 0, got {val}")
        if HV % H:
            raise ValueError(f"HV={HV} must be a multiple of H={H}")
        device = torch.device(device)
        specs = _buffer_specs(T, HV, K, V, num_chunks, dtype, dq_partials)
        storage = {
            name: torch.empty(_numel(shape), dtype=dt, device=device)
            for name, (shape, dt) in specs.items()
        }
        return target(
            device,
            {"tokens": T, "chunks": num_chunks, "docs": num_docs},
            {"H": H, "HV": HV, "K": K, "V": V, "dtype": dtype},
            storage,
        )

    def check(
        self,
        *,
        deterministic: bool,
        T: int,
        H: int,
        HV: int,
        K: int,
        V: int,
        num_chunks: int,
        num_docs: int,
        dtype: torch.dtype,
        device: torch.device | str,
        dq_partials: bool = True,
    ) -> None:
        """Raise ``ValueError`` unless this workspace serves the described backward
        (``dq_partials``: whether it needs the fp32 ``dq`` partials)."""
        if type(self).deterministic != bool(deterministic):
            raise ValueError(
                f"workspace is a {type(self).__qualname__} ({self.mode}), but the backward "
                f"is {mode_name(bool(deterministic))}"
            )
        self.check_fits(
            device,
            {"tokens": T, "chunks": num_chunks, "docs": num_docs},
            {"H": H, "HV": HV, "K": K, "V": V, "dtype": dtype},
        )
        specs = _buffer_specs(T, HV, K, V, num_chunks, dtype, dq_partials)
        for name, (shape, dt) in specs.items():
            buf = self.storage.get(name)
            if buf is None or buf.dtype != dt or buf.numel() < _numel(shape) or (
                not buf.is_contiguous()
            ):
                got = "missing" if buf is None else f"{buf.numel()} x {buf.dtype}"
                raise ValueError(
                    f"workspace buffer {name!r} is {got}, expected at least "
                    f"{_numel(shape)} x {dt} (contiguous)"
                )

    def views(
        self, T: int, HV: int, K: int, V: int, num_chunks: int, dtype: torch.dtype,
        dq_partials: bool = True,
    ) -> dict[str, torch.Tensor]:
        """The buffers viewed at the shapes of a backward of this size (after :meth:`check`)."""
        specs = _buffer_specs(T, HV, K, V, num_chunks, dtype, dq_partials)
        return {name: self.storage[name][: _numel(shape)].view(shape)
                for name, (shape, _) in specs.items()}


class DetBackwardWorkspace(BackwardWorkspace):
    """:class:`BackwardWorkspace` of deterministic backwards."""

    deterministic = True


class NonDetBackwardWorkspace(BackwardWorkspace):
    """:class:`BackwardWorkspace` of non-deterministic backwards."""

    deterministic = False


class FreshBuffers(Mapping[str, torch.Tensor]):
    """The scratch of a backward that was given no workspace: each buffer is
    allocated at its first use, so that its memory is taken only from the stage
    that writes it on (the fp32 ``dq``/``dk`` partials, for one, are not live
    during the state recurrence's reverse passes)."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 device: torch.device | str) -> None:
        self._specs, self._device = specs, torch.device(device)
        self._made: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._made:
            shape, dt = self._specs[name]
            self._made[name] = torch.empty(shape, dtype=dt, device=self._device)
        return self._made[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


def resolve_workspace(
    workspace: BackwardWorkspace | None,
    *,
    deterministic: bool,
    dq_partials: bool,
    T: int,
    H: int,
    HV: int,
    K: int,
    V: int,
    num_chunks: int,
    num_docs: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> tuple[BackwardWorkspace | None, Mapping[str, torch.Tensor]]:
    """The buffers of a backward of this size: ``(workspace, its views)`` after
    the workspace's checks, or ``(None, FreshBuffers)`` without one (allocated
    each at its first use; no fp32 ``dq`` partials unless ``dq_partials``).

    Raises:
        ValueError: ``workspace`` is of the other mode or not a backward workspace,
            or does not fit (see :meth:`BackwardWorkspace.check`).
    """
    if workspace is None:
        return None, FreshBuffers(_buffer_specs(T, HV, K, V, num_chunks, dtype, dq_partials),
                                  device)
    shape_kw = dict(T=T, H=H, HV=HV, K=K, V=V, num_chunks=num_chunks, num_docs=num_docs,
                    dtype=dtype, device=device)
    expected = DetBackwardWorkspace if deterministic else NonDetBackwardWorkspace
    require_instance(workspace, expected, "workspace")
    workspace.check(deterministic=deterministic, dq_partials=dq_partials, **shape_kw)
    return workspace, workspace.views(T, HV, K, V, num_chunks, dtype, dq_partials)


def grads_kernel(grads: Callable) -> str:
    """Which chunk-gradient launcher ``grads`` is (what :func:`gluon.pick` chose):
    ``"gluon"`` (the one-tile kernel, :mod:`gdn_core.ops.gluon.chunk_grads`),
    ``"gluon_persistent"`` (``grads2``) or ``"triton"`` (anything else). Imports nothing:
    a Gluon launcher can only have been picked once its module was imported."""
    for stage, kind in (("grads", "gluon"), ("grads2", "gluon_persistent")):
        module, name, _ = gluon.STAGES[stage]
        mod = sys.modules.get(f"{gluon.__name__}.{module}")
        if mod is not None and grads is getattr(mod, name, None):
            return kind
    return "triton"


def _sole_view(x: torch.Tensor | None) -> bool:
    """Whether ``x`` is the whole of its storage, contiguous (so that handing its memory out
    as a result neither keeps a larger buffer alive nor exposes other data)."""
    return (x is not None and x.is_contiguous() and x.storage_offset() == 0
            and x.untyped_storage().nbytes() == x.numel() * x.element_size())


#: ``fused_state`` (a default stage of :mod:`gdn_core.ops.gluon`) runs unasked only where its
#: launch has at least this many programs, (segments or documents) × value heads: one
#: program walks a whole segment with the whole 128×128 state, so with few of them the
#: launch is one chain of ~3.7 µs a chunk on a few SMs, where the pair splits the value
#: columns over 4× more programs. H200, det fwd+bwd (session 17): 128-384 programs 0.88-0.97x
#: the pair; 32 (B1 T8192, one document) not faster. Either way the bits are the pair's.
FUSED_STATE_MIN_PROGRAMS = 96


def pick_fused_state(q: torch.Tensor, W: torch.Tensor, do: torch.Tensor,
                     index: ChunkIndex) -> Callable | None:
    """The fused state backward (``dv_local`` inside the reverse recurrence, one launch) where
    it serves this call and is wanted, else ``None`` (the caller runs the pair).

    ``q, W: [T,·,K]``, ``do: [T,HV,V]`` flat; ``index``: the launch's chunk table (its
    documents are the segments). Wanted: ``GDN_CORE_GLUON`` names ``fused_state``, or it is
    unset (the default stages) and the launch has at least :data:`FUSED_STATE_MIN_PROGRAMS`
    programs (``index.num_docs × HV``; :func:`fused_state_pays`)."""
    fused = gluon.pick("fused_state", None, q, W, do, index)
    if fused is None or gluon.named("fused_state"):
        return fused
    return fused if fused_state_pays(index.num_docs, do.shape[1]) else None


def pick_fused_bwd(q: torch.Tensor, v: torch.Tensor, A_inv: torch.Tensor, index: ChunkIndex,
                   rec: Recomputed, do: torch.Tensor, *, workspace: object, out: object,
                   dv_local: torch.Tensor | None) -> Callable | None:
    """The fused backward (:mod:`gdn_core.ops.gluon.fused_bwd`: the reverse state recurrence
    and every chunk gradient in one launch) where it serves this backward and is asked for
    (stage ``fused_bwd`` of ``GDN_CORE_GLUON``, by name only), else ``None``.

    It serves the whole of :func:`backward_from_recompute` (no ``dv_local`` from the caller,
    no workspace, no given result buffers) on CUDA sm_90 at K = V = 128, chunks of 64, with
    ``W``, ``h``, ``v_new`` and ``do`` in q's 16-bit dtype; grouped value heads through
    fp32 per-value-head ``dq``/``dk`` and :func:`group_reduce`."""
    if dv_local is not None or workspace is not None or out is not None:
        return None
    fused = gluon.pick("fused_bwd", None, q, v, A_inv, index)
    if fused is None or any(x is None or x.dtype != q.dtype
                            for x in (rec.W, rec.h, rec.v_new, do)):
        return None
    return fused


def fused_state_pays(num_docs: int, HV: int) -> bool:
    """Whether a fused state launch over ``num_docs`` documents (segments) × ``HV`` value
    heads has enough programs to beat the pair (:data:`FUSED_STATE_MIN_PROGRAMS`)."""
    return num_docs * HV >= FUSED_STATE_MIN_PROGRAMS


def plan_aliases(
    *,
    kernel: str,
    group: int,
    dq: tuple[tuple[int, ...], torch.dtype] | None,
    dv: tuple[tuple[int, ...], torch.dtype],
    v_new: torch.Tensor | None,
    du: torch.Tensor,
    v_new_owned: bool,
    du_owned: bool,
    workspace: bool,
    out: bool,
    setting: bool | None,
) -> tuple[bool, bool]:
    """Which results the chunk-gradient launch writes over its inputs: ``(dv over du,
    dq over v_new)`` (pure; :func:`backward_from_recompute` asks it).

    ``kernel``: :func:`grads_kernel` of the launcher; ``group``: value heads per q/k head;
    ``dq``: ``(shape, dtype)`` of the final ``dq`` the kernel rounds into (``None``: it
    writes fp32 partials, e.g. for the L2-norm backward or a group reduction); ``dv``:
    ``(shape, dtype)`` of ``dv``; ``v_new``, ``du`` (``dV'``): the kernel's inputs;
    ``v_new_owned``, ``du_owned``: held by nothing but this backward (fresh, handed over);
    ``workspace``: the backward has a workspace; ``out``: its results go into given
    buffers (the slabs); ``setting``: :data:`~gdn_core.switches.BWD_ALIAS_ENV`'s
    (``None``, unset, and ``True``: on where valid; ``False``: off).

    Both need the switch not off, the one-tile Gluon kernel (each CTA loads all its tiles
    before storing and owns its rows), no workspace, no given result buffers, and the
    input owned, the whole of its storage and contiguous, of the result's shape and dtype;
    ``dq`` also one value head per q/k head.
    """
    if setting is False or kernel != "gluon" or workspace or out:
        return False, False

    def fits(x: torch.Tensor | None, owned: bool, spec) -> bool:
        return (owned and spec is not None and _sole_view(x)
                and tuple(x.shape) == tuple(spec[0]) and x.dtype == spec[1])

    return fits(du, du_owned, dv), group == 1 and fits(v_new, v_new_owned, dq)


@dataclass
class Recomputed:
    """What a backward rebuilt of the forward: ``W [T,HV,K]``, ``h [NT,HV,K,V]``,
    ``v_new [T,HV,V]``. :func:`backward_from_recompute` drops each field (sets it to
    ``None``) once its last reader has run — ``W`` after the state backward, ``h``
    and ``v_new`` after the chunk-gradient kernel — so that, held nowhere else, their
    memory is free again as soon as possible."""

    W: torch.Tensor | None
    h: torch.Tensor | None
    v_new: torch.Tensor | None


def backward_from_recompute(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    G: torch.Tensor,
    A_inv: torch.Tensor,
    rec: Recomputed,
    *,
    scale: float,
    index: ChunkIndex,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    g_dtype: torch.dtype,
    deterministic: bool,
    workspace: BackwardWorkspace | None = None,
    dqk_dtype: torch.dtype | None = None,
    dv_local: torch.Tensor | None = None,
    num_docs: int | None = None,
    dh0: torch.Tensor | None = None,
    out: tuple[torch.Tensor, ...] | None = None,
    donate: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Stages 1–5 given the forward's intermediates.

    ``q, k: [T,H,K]`` (the tensors the recurrence used); ``v: [T,HV,V]`` (unit last
    stride);
    ``beta: [T,HV]``; ``G: [T,HV]`` fp32; ``A_inv: [T,HV,C]``; ``rec``: ``W``,
    ``h``, ``v_new`` (:class:`Recomputed`, emptied as they are spent);
    ``do: [T,HV,V]``; ``dht: [N,HV,K,V]`` or ``None``. Returns ``(dq [T,H,K],
    dk [T,H,K], dv, dg, dbeta, dh0 [N,HV,K,V] fp32)`` w.r.t. the tensors the
    recurrence used (before any L2-norm backward); ``dq``/``dk`` in ``dqk_dtype``
    (default: q's dtype), the rest in their inputs' dtypes.
    ``dqk_dtype=torch.float32`` is for a caller that consumes ``dq``/``dk`` at once
    (the L2-norm backward): with one value head per q/k head they are then the
    workspace's fp32 partial buffers themselves (no copy), valid until the
    workspace is used again. Otherwise, with one value head per q/k head, the chunk-gradient
    kernel rounds ``dq``/``dk`` straight into fresh outputs (the same bits as rounding
    the fp32 partials, without the fp32 buffers or the reduction launches). With grouped
    value heads, where the one-tile Gluon chunk-gradient kernel runs (and no ``out``),
    it sums each group in its CTA (``chunk_grads_bwd_gluon_summed`` of
    :mod:`gdn_core.ops.gluon.chunk_grads`, ``group_reduce``'s bits): fresh ``[T, H, K]`` outputs,
    the running fp32 sums in the spent ``h``/``dh`` tiles where ``donate`` (``h`` is then
    this call's own; ``dh`` always is), else in fresh buffers; no reduction launches.

    ``dv_local``: stage 1's result when the caller already has it (the segment
    path computes it before its first reverse pass). ``out``: ``(dq, dk, dv, dg, dbeta)``
    buffers the results are written into (row slices of a whole call's outputs,
    :mod:`gdn_core.bwd_slabs`); ``dq``/``dk`` only where the kernels round them straight
    into their outputs (one value head per q/k head, not fp32), else the caller writes
    them from what is returned. ``num_docs``: the document
    count the workspace is checked against (default: the index's; the segment
    path's index holds segments). ``dh0``: the buffer of that result, may be ``dht``
    (:func:`~gdn_core.ops.chunk_state_bwd.chunk_state_bwd`). ``donate``: ``rec.v_new`` and
    ``dv_local`` are held by nothing else (fresh, handed over), so that results may be
    written over them (:func:`plan_aliases`; a ``dv_local`` this call allocates is its own).
    """
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    group = HV // H
    dtype = k.dtype
    fused_all = pick_fused_bwd(q, v, A_inv, index, rec, do, workspace=workspace, out=out,
                               dv_local=dv_local)
    if fused_all is not None:  # the reverse chain and every chunk gradient in one launch
        # results over the recomputed inputs where they are this call's own (the kernel's
        # docstring says why that is safe): dv over W, dq over v_new
        alias = switch_setting(BWD_ALIAS_ENV) is not False
        dq_spec = (T, H, K), dqk_dtype or q.dtype
        over_vn = (alias and donate and group == 1 and _sole_view(rec.v_new)
                   and tuple(rec.v_new.shape) == dq_spec[0] and rec.v_new.dtype == dq_spec[1])
        over_w = (alias and _sole_view(rec.W) and tuple(rec.W.shape) == (T, HV, V)
                  and rec.W.dtype == v.dtype)
        if group == 1:
            dq = rec.v_new if over_vn else torch.empty(dq_spec[0], dtype=dq_spec[1],
                                                       device=q.device)
            dk = torch.empty(T, H, K, dtype=dqk_dtype or k.dtype, device=k.device)
        else:  # fp32 per-value-head partials, summed below in the summed kernel's order
            dq = dk = None
        dq, dk, dv, dbeta, dg, dh0 = fused_all(
            q, k, v, rec.v_new, rec.h, rec.W, do, G, beta, A_inv, dht, scale, index, g_dtype,
            dq=dq, dk=dk, dv=rec.W if over_w else None, dh0=dh0)
        rec.W = rec.h = rec.v_new = None
        if group > 1:
            dq = group_reduce(dq, group, dqk_dtype or q.dtype)
            dk = group_reduce(dk, group, dqk_dtype or k.dtype)
        return dq, dk, dv, dg, dbeta, dh0
    direct = not uses_dq_partials(group, dqk_dtype)  # dq/dk complete in their kernels
    _, ws = resolve_workspace(
        workspace, deterministic=deterministic, dq_partials=not direct, T=T, H=H, HV=HV, K=K,
        V=V, num_chunks=index.num_chunks,
        num_docs=index.num_docs if num_docs is None else num_docs, dtype=dtype, device=k.device,
    )

    du_owned = workspace is None and (dv_local is None or donate)
    # dv_local inside the state backward, one launch (pick_fused_state: where it pays)
    fused = None if dv_local is not None else pick_fused_state(q, rec.W, do, index)
    if fused is not None:
        dh, dvp, dh0 = fused(q, k, rec.W, G, do, dht, scale, index, group, dh=ws["dh"],
                             dv=ws["dv_local"], dh0=dh0)
        dv_local = dvp  # dV' in dv_local's buffer, as the pair leaves it
    else:
        if dv_local is None:
            dv_local = gluon.pick("dv_local", dv_local_bwd, q, do, index)(
                q, k, G, do, scale, index, group, out=ws["dv_local"])
        state_bwd = gluon.pick("state_bwd", chunk_state_bwd, q, rec.W, do, dv_local, index)
        dh, dvp, dh0 = state_bwd(
            q, k, rec.W, G, do, dv_local, dht, scale, index, group, dh=ws["dh"], dv=dv_local,
            dh0=dh0,
        )  # dV' over dv_local: each element is rewritten by the program that read it
    rec.W = None
    probe = (q, v, A_inv, index)
    grads = gluon.pick("grads2", gluon.pick("grads", chunk_grads_bwd, *probe), *probe)
    dv_over_du, dq_over_vn = plan_aliases(
        kernel=grads_kernel(grads), group=group,
        dq=((T, H, K), dqk_dtype or q.dtype) if direct else None, dv=((T, HV, V), v.dtype),
        v_new=rec.v_new, du=dvp, v_new_owned=donate, du_owned=du_owned and dvp is dv_local,
        workspace=workspace is not None, out=out is not None,
        setting=switch_setting(BWD_ALIAS_ENV),
    )
    # grouped value heads: the one-tile Gluon kernel sums dq/dk over each group in its CTA
    # (group_reduce's bits, no [T, HV, K] fp32 partials, no reduction launches)
    sum_group = group > 1 and out is None and grads_kernel(grads) == "gluon"
    res = {} if out is None else dict(dv=out[2], dg=out[3], dbeta=out[4])
    # Outputs are allocated as late as possible, each once the tensors spent
    # before it are free (so the backward's peak holds only one of W | h, v_new).
    if sum_group:
        from gdn_core.ops.gluon.chunk_grads import chunk_grads_bwd_gluon_summed as grads

        dq_out, dk_out = (torch.empty(T, H, K, dtype=dqk_dtype or x.dtype, device=x.device)
                          for x in (q, k))
        # the running fp32 sums in the spent h / dh tiles: h is this call's own if donated,
        # dh always (the workspace's scratch or fresh)
        res["spend_states"] = donate
    elif direct and out is not None:
        dq_out, dk_out = out[0], out[1]
    elif direct:
        dq_out = rec.v_new if dq_over_vn else torch.empty(
            T, H, K, dtype=dqk_dtype or q.dtype, device=q.device)
        dk_out = torch.empty(T, H, K, dtype=dqk_dtype or k.dtype, device=k.device)
    else:
        dq_out, dk_out = ws["dq_part"], ws["dk_part"]
    if dv_over_du:
        res["dv"] = dvp  # each CTA stores its dv rows after its dV' tile has landed
    dq_part, dk_part, dv, dbeta, dg = grads(
        q, k, v, rec.v_new, rec.h, dh, do, dvp, G, beta, A_inv, scale, index, group, g_dtype,
        dq=dq_out, dk=dk_out, **res,
    )
    del dvp, dv_local
    rec.h = rec.v_new = None
    if group == 1 or sum_group:  # the sums already (rounded into outputs if not fp32)
        return dq_part, dk_part, dv, dg, dbeta, dh0
    dq = group_reduce(dq_part, group, dqk_dtype or q.dtype)
    dk = group_reduce(dk_part, group, dqk_dtype or k.dtype)
    return dq, dk, dv, dg, dbeta, dh0


def chunk_gdn_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    G: torch.Tensor | None,
    *,
    scale: float,
    index: ChunkIndex,
    initial_state: torch.Tensor | None,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    deterministic: bool,
    workspace: BackwardWorkspace | None = None,
    q_rstd: torch.Tensor | None = None,
    k_rstd: torch.Tensor | None = None,
    A_inv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Full backward on flat tensors.

    ``q, k: [T,H,K]`` are the tensors the recurrence used (L2-normalised when
    ``q_rstd``/``k_rstd`` are given: then ``dq``/``dk`` are taken through the
    normalisation's backward); ``v: [T,HV,V]``; ``g, beta: [T,HV]``; ``G``: the
    forward's within-chunk cumsum of ``g`` (fp32) or ``None`` to recompute;
    ``do: [T,HV,V]``; ``dht: [N,HV,K,V]`` or ``None``; ``A_inv``: the forward's
    inverse (:func:`~gdn_core.ops.wy.inverse_for_backward`) or ``None`` to recompute.

    Returns ``(dq, dk [T,H,K], dv [T,HV,V], dg, dbeta [T,HV], dh0 [N,HV,K,V] fp32)``
    in the inputs' dtypes.
    """
    from gdn_core.ops.chunk_state import chunk_state_fwd
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.wy import wy_apply, wy_fwd

    T, H, K = k.shape
    HV = v.shape[1]
    if HV % H:
        raise ValueError(f"value heads HV={HV} must be a multiple of the q/k heads H={H}")
    group = HV // H
    if index.total_tokens != T:
        raise ValueError(f"index covers {index.total_tokens} tokens, the inputs have T={T}")
    q, k, beta = (x.contiguous() for x in (q, k, beta))
    v = unit_last(v)  # the WY and chunk-gradient kernels read v at its strides
    do = do.to(k.dtype).contiguous()
    if dht is not None:
        dht = dht.contiguous()
    if G is None:
        G = chunk_cumsum_fwd(g.contiguous(), index)
    G = G.contiguous()
    if A_inv is None:
        A_inv, W, U = gluon.pick("wy", wy_fwd, k, v, index)(k, v, beta, G, index, group)
    else:
        W, U = gluon.pick("wy_apply", wy_apply, k, v, A_inv, index)(
            k, v, beta, G, A_inv, index, group)
    rec = Recomputed(W, None, None)
    del W  # the backward frees W, h and v_new as it spends them: no other reference
    rec.h, rec.v_new, _ = gluon.pick("state", chunk_state_fwd, k, rec.W, U, index)(
        k, rec.W, U, G, index, group, initial_state=initial_state, output_final_state=False,
        store_states=True,
    )
    del U  # spent: v_new holds what the backward needs of it
    l2 = q_rstd is not None or k_rstd is not None
    dq, dk, dv, dg, dbeta, dh0 = backward_from_recompute(
        q, k, v, beta, G, A_inv, rec, scale=scale, index=index, do=do, dht=dht,
        g_dtype=g.dtype, deterministic=deterministic, workspace=workspace,
        dqk_dtype=torch.float32 if l2 else None, donate=True,  # rec is this call's own
    )
    if l2:
        # The normalisation's backward reads dq/dk in fp32 and rounds its result once,
        # into the inputs' dtype.
        from gdn_core.ops.l2norm import l2norm_bwd, l2norm_bwd_pair

        if q_rstd is not None and k_rstd is not None:  # one launch for both
            dq, dk = l2norm_bwd_pair((q, q_rstd, dq, q.new_empty(q.shape)),
                                     (k, k_rstd, dk, k.new_empty(k.shape)))
        else:
            dq = l2norm_bwd(q, q_rstd, dq, out=q.new_empty(q.shape)) if q_rstd is not None \
                else dq.to(q.dtype)
            dk = l2norm_bwd(k, k_rstd, dk, out=k.new_empty(k.shape)) if k_rstd is not None \
                else dk.to(k.dtype)
    return dq, dk, dv, dg, dbeta, dh0


def gdn_backward_triton(
    saved,
    do: torch.Tensor,
    dht: torch.Tensor | None = None,
    *,
    deterministic: bool,
    workspace: BackwardWorkspace | None = None,
) -> tuple[torch.Tensor, ...]:
    """Backward from a :class:`gdn_core.compose.GDNSaved` of the triton backend.

    ``do: [T,HV,V]`` (flat), ``dht: [N,HV,K,V]`` or ``None``. Returns
    ``(dq, dk, dv, dg, dbeta, dh0)`` flat (see :func:`chunk_gdn_backward`).
    """
    if getattr(saved, "deterministic", deterministic) != deterministic:
        raise ValueError(
            f"saved set was produced with deterministic={saved.deterministic}, "
            f"but the backward was asked for deterministic={deterministic}"
        )
    if saved.index is None:
        raise ValueError("saved set has no ChunkIndex (not produced by the triton backend)")
    l2 = bool(getattr(saved, "use_qk_l2norm_in_kernel", False))
    return chunk_gdn_backward(
        saved.q, saved.k, saved.v, saved.g, saved.beta, saved.G,
        scale=saved.scale, index=saved.index, initial_state=saved.initial_state,
        do=do, dht=dht, deterministic=deterministic, workspace=workspace,
        q_rstd=saved.q_rstd if l2 else None, k_rstd=saved.k_rstd if l2 else None,
        A_inv=getattr(saved, "A_inv", None),
    )
