"""Machinery for registering the training packages' ``torch.library`` custom ops.

Every training package registers its differentiable entry points (GDN kernel,
causal conv1d, KCP forms) as custom ops in *its own* namespace
(``gdn_det_train::…``, ``gdn_train::…``, …) so that ``torch.compile(fullgraph=
True)`` traces them without a graph break and AOTAutograd sees their backward.
The op bodies are built by :mod:`gdn_core.train_ops` and
:mod:`gdn_core.kcp_ops`; this module holds what they share:

**Handles.** A custom op takes tensors and plain scalars only, never a Python
object. An object an op needs (a :class:`~gdn_core.layout.VarlenLayout`, a KCP
context, a workspace) is registered once in a process-local table and given a
*handle*: a 0-dim int64 **CPU** tensor kept on the object
(:func:`object_handle`). The op receives the handle tensor and looks the
object up (:func:`lookup`); reading a CPU scalar is no device synchronisation.
Because the handle is a tensor, Dynamo lifts it as a graph input and guards
only on its metadata — a new context or layout of the same kind reuses the
compiled graph (no recompilation per batch). Objects are held weakly: the
caller keeps them alive while it calls the op. Handles are made eagerly (in
the objects' constructors / the packages' builders); inside a compiled region
an object without a handle is an error (:func:`object_handle`).

**Saved sets (KCP ops).** The single-rank ops are flat — their forward
returns what the backward reads as outputs (:mod:`gdn_core.train_ops`). The
KCP ops (:mod:`gdn_core.kcp_ops`), whose saved sets hold per-rank state of
data-dependent shape, still use a stash: the forward op of each
differentiable pair also returns a
*token* (0-dim int64 CPU tensor) naming a process-local stash entry
(:func:`stash_put`) that holds what the backward needs and cannot travel
through the op's schema (host metadata, layouts, workspaces, the KCP saved
sets and the tensors the forward made). The entry lives exactly as long as the
token tensor (freed by ``weakref.finalize`` when autograd releases it, after the
backward, or at once when no graph was recorded). The backward op receives the
token *and* the forward's tensor inputs again: those travel as op arguments
(saved by AOTAutograd), never through the stash, because a compiler may reuse
the memory of a buffer it thinks is dead. :func:`stash_put` therefore drops
every reference the stashed object holds to an input (or output) of the op and
:func:`stash_get` puts back the equivalent view of the backward's argument
(:class:`_Rebind`); a stashed tensor that merely overlaps an op tensor is
cloned.

:func:`define_op` wraps ``torch.library.custom_op`` + ``register_fake`` +
``register_autograd`` for a namespace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "autograd_enabled",
    "define_op",
    "is_compiling",
    "keep_alive",
    "lookup",
    "object_handle",
    "register_handle",
    "stash_get",
    "stash_put",
    "stash_size",
]

_HANDLE_ATTR = "_gdn_op_handle"
_counter = itertools.count(1)
_lock = threading.Lock()
_objects: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_stash: dict[int, Any] = {}


def is_compiling() -> bool:
    """True while Dynamo traces (``torch.compiler.is_compiling``)."""
    try:
        return bool(torch.compiler.is_compiling())
    except AttributeError:  # pragma: no cover - torch < 2.3
        return False


def _next_key() -> int:
    with _lock:
        return next(_counter)


def register_handle(obj: Any) -> torch.Tensor:
    """Give ``obj`` a handle (once) and return it: a 0-dim int64 CPU tensor."""
    h = getattr(obj, _HANDLE_ATTR, None)
    if h is not None:
        return h
    key = _next_key()
    h = torch.tensor(key, dtype=torch.int64)
    _objects[key] = obj
    object.__setattr__(obj, _HANDLE_ATTR, h)
    return h


def object_handle(obj: Any, argname: str = "object") -> torch.Tensor:
    """The handle of ``obj`` (registered on first use outside a compiled region).

    Inside ``torch.compile`` only reading the existing handle is traceable:
    objects built by this library register at construction; anything else must
    be made (or passed once) outside the compiled region.
    """
    h = getattr(obj, _HANDLE_ATTR, None)
    if h is not None:
        return h
    if is_compiling():
        raise RuntimeError(
            f"{argname} ({type(obj).__qualname__}) has no custom-op handle yet: build it with "
            "this library's constructors (or use it once eagerly) outside torch.compile"
        )
    return register_handle(obj)


def keep_alive(output: torch.Tensor, *objs: Any) -> torch.Tensor:
    """Hold ``objs`` (the objects behind an op call's handles) as long as ``output``'s
    autograd node lives, so that the backward finds them: a ``VarlenLayout`` built in
    the call expression is otherwise collected before ``backward()`` looks it up.
    Returns ``output``; a no-op without a graph."""
    node = output.grad_fn
    if node is not None:
        node.metadata.setdefault("gdn_handles", []).extend(o for o in objs if o is not None)
    return output


def lookup(handle: torch.Tensor, argname: str = "object") -> Any:
    """The object registered under ``handle`` (``ValueError`` when it is gone)."""
    key = int(handle)  # a CPU scalar: no device synchronisation
    obj = _objects.get(key)
    if obj is None:
        raise ValueError(
            f"{argname}: handle {key} names no live object (it was garbage-collected, or the "
            "handle comes from another process)"
        )
    return obj


@contextlib.contextmanager
def autograd_enabled():
    """Record autograd graphs inside an op implementation.

    A custom op's implementation runs below the autograd dispatch keys, so
    ``torch.enable_grad()`` alone records nothing there; the reference
    backend's backward (autograd through the fp32 reference) needs it.
    """
    try:
        DK = torch._C.DispatchKey
        incl = torch._C._dispatch_tls_local_include_set()
        excl = torch._C._dispatch_tls_local_exclude_set()
        for key in (DK.AutogradFunctionality, DK.ADInplaceOrView):
            excl = excl.remove(key)
        guard = torch._C._ForceDispatchKeyGuard(incl, excl)
    except (AttributeError, RuntimeError):  # pragma: no cover - other torch builds
        guard = contextlib.nullcontext()
    with guard, torch.enable_grad():
        yield


# ------------------------------------------------------------------ stash --


@dataclasses.dataclass(frozen=True)
class _Rebind:
    """A stashed placeholder: ``args[index].reshape(shape)`` at backward time."""

    index: int
    shape: tuple[int, ...]


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    try:
        sa, sb = a.untyped_storage(), b.untyped_storage()
    except (RuntimeError, NotImplementedError):  # pragma: no cover - exotic tensors
        return False
    return sa.data_ptr() == sb.data_ptr() and sa.data_ptr() != 0


def _same_memory(t: torch.Tensor, x: torch.Tensor) -> bool:
    """``t`` is ``x`` or a view of it by reshaping: ``x.view(t.shape)`` has ``t``'s memory."""
    if t is x:
        return True
    if (t.device != x.device or t.dtype != x.dtype or t.numel() != x.numel()
            or t.data_ptr() != x.data_ptr()):
        return False
    try:
        return x.view(t.shape).stride() == t.stride()
    except RuntimeError:  # not expressible as a view of x
        return False


def _walk(obj: Any, fn: Callable[[Any], Any], depth: int = 0) -> Any:
    """Apply ``fn`` to the tensors/placeholders in ``obj`` (lists, tuples and dataclass
    fields, a few levels deep), rebuilding only the containers that changed.
    Registered objects (those with a handle: contexts, layouts, workspaces) are
    shared, never descended into."""
    if isinstance(obj, (torch.Tensor, _Rebind)):
        return fn(obj)
    if depth > 3 or obj is None or isinstance(obj, (int, float, str, bool, torch.dtype)):
        return obj
    if getattr(obj, _HANDLE_ATTR, None) is not None:
        return obj
    if isinstance(obj, (list, tuple)):
        items = [_walk(o, fn, depth + 1) for o in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return items if isinstance(obj, list) else tuple(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            if not f.init:
                continue
            val = getattr(obj, f.name)
            new = _walk(val, fn, depth + 1)
            if new is not val:
                changes[f.name] = new
        return dataclasses.replace(obj, **changes) if changes else obj
    return obj


def _detach(obj: Any, args: Sequence[torch.Tensor | None], outs: Sequence[torch.Tensor]) -> Any:
    def fn(t):
        if not isinstance(t, torch.Tensor):
            return t
        for i, x in enumerate(args):
            if x is not None and _same_memory(t, x):
                return _Rebind(i, tuple(t.shape))
        if any(x is not None and _overlaps(t, x) for x in (*args, *outs)):
            return t.clone()
        return t

    return _walk(obj, fn)


def _rebind(obj: Any, args: Sequence[torch.Tensor | None]) -> Any:
    def fn(t):
        if not isinstance(t, _Rebind):
            return t
        a = args[t.index]
        # the same logical values; a view when the argument's strides allow it
        return a if tuple(a.shape) == t.shape else a.reshape(t.shape)

    return _walk(obj, fn)


def stash_put(obj: Any, args: Sequence[torch.Tensor | None] = (),
              outs: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """Stash ``obj`` for a backward; return its token (0-dim int64 CPU tensor).

    Tensors inside ``obj`` (lists, tuples, dataclasses, a few levels deep) that
    are ``args[i]`` or a reshape view of it are replaced by placeholders that
    :func:`stash_get` fills from the backward's arguments; tensors sharing
    memory with ``args`` or ``outs`` otherwise are cloned. The entry is freed
    with the token.
    """
    key = _next_key()
    _stash[key] = _detach(obj, list(args), list(outs))
    token = torch.tensor(key, dtype=torch.int64)
    weakref.finalize(token, _stash.pop, key, None)
    return token


def stash_get(token: torch.Tensor, args: Sequence[torch.Tensor | None] = ()) -> Any:
    """The object stashed under ``token``, with the forward's inputs taken from ``args``
    (the same tensors, in the same order, as given to :func:`stash_put`)."""
    key = int(token)
    if key not in _stash:
        raise RuntimeError(f"saved set {key} is gone (the backward ran after it was freed)")
    return _rebind(_stash[key], list(args))


def stash_size() -> int:
    """Live stash entries (tests)."""
    return len(_stash)


# --------------------------------------------------------------- defining --


def define_op(
    namespace: str,
    name: str,
    impl: Callable[..., Any],
    *,
    fake: Callable[..., Any],
    backward: Callable[..., Any] | None = None,
    setup_context: Callable[..., Any] | None = None,
    schema: str | None = None,
) -> Any:
    """``torch.library.custom_op(f"{namespace}::{name}")`` over ``impl`` (type-annotated:
    the schema is inferred unless given), with ``fake`` as its fake/meta
    implementation and, when given, ``backward``/``setup_context`` as its autograd.

    Returns the op (callable like ``impl``). Registering the same qualified
    name twice in one process raises (``torch.library``'s own check).
    """
    op = torch.library.custom_op(f"{namespace}::{name}", impl, mutates_args=(), schema=schema)
    op.register_fake(fake)
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)
    return op
