"""Mode typing for saved sets, workspaces and gradients of the training packages.

Every training package defines its own classes for what a forward hands to a
backward (a *saved set*) and for the backward's reusable scratch memory (a
*workspace*), each fixed to one mode: deterministic or not. A backward checks
with :func:`require_instance` that it got an instance of *its* class before it
touches any tensor, so a saved set or workspace of another package (another
mode) is refused with a :class:`ValueError` naming what was got and what was
expected::

    class DetSavedSet(TypedSaved):
        deterministic = True

    require_instance(saved, DetSavedSet, "saved")
    # ValueError: saved must be a DetSavedSet (deterministic), got gdn_train.SavedSet
    #             (non-deterministic)

:class:`TypedWorkspace` adds the size and device checks of a workspace
(:meth:`TypedWorkspace.check_fits`). This module is small and stable on
purpose: all four GDN training packages build on it.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import torch

from gdn_core.devices import require_device

__all__ = [
    "DETERMINISTIC",
    "NON_DETERMINISTIC",
    "ModeTyped",
    "TypedSaved",
    "TypedWorkspace",
    "input_versions",
    "mode_name",
    "mode_of",
    "modified_input_error",
    "qualified_name",
    "require_instance",
]

DETERMINISTIC = "deterministic"
NON_DETERMINISTIC = "non-deterministic"

T = TypeVar("T")


def mode_name(deterministic: bool) -> str:
    """``"deterministic"`` or ``"non-deterministic"``."""
    return DETERMINISTIC if deterministic else NON_DETERMINISTIC


class ModeTyped:
    """Base of every mode-typed class.

    A subclass fixes its mode with the class attribute ``deterministic``
    (``True``/``False``); ``mode`` (``"deterministic"``/``"non-deterministic"``)
    follows from it. Classes that leave ``deterministic`` as ``None`` are
    abstract bases without a mode.
    """

    deterministic: ClassVar[bool | None] = None
    mode: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "deterministic" in cls.__dict__:
            det = cls.__dict__["deterministic"]
            if det is not None and not isinstance(det, bool):
                raise TypeError(f"{cls.__qualname__}.deterministic must be a bool or None")
            cls.mode = None if det is None else mode_name(det)


def qualified_name(cls: type) -> str:
    """``module.Qualname`` of a class (the public module if the class sets one)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def mode_of(obj: object) -> str | None:
    """The mode of an object or class: its ``mode`` attribute, else derived from a
    bool ``deterministic`` attribute, else ``None``."""
    mode = getattr(obj, "mode", None)
    if isinstance(mode, str):
        return mode
    det = getattr(obj, "deterministic", None)
    if isinstance(det, bool):
        return mode_name(det)
    return None


def require_instance(obj: T | object, expected_cls: type[T], argname: str) -> T:
    """Return ``obj`` if it is an ``expected_cls``; else raise ``ValueError``.

    The message names the argument, the expected class and its mode, and what
    was got (``module.Qualname``, plus its mode when it has one)::

        saved must be a DetSavedSet (deterministic), got gdn_train.SavedSet (non-deterministic)

    Only ``isinstance`` is consulted: no attribute of ``obj`` is trusted, no
    tensor is touched.
    """
    if isinstance(obj, expected_cls):
        return obj
    expected_mode = mode_of(expected_cls)
    expected = expected_cls.__qualname__
    if expected_mode is not None:
        expected += f" ({expected_mode})"
    got = qualified_name(type(obj))
    try:
        got_mode = mode_of(obj)
    except Exception:  # a hostile __getattr__ must not mask the real error
        got_mode = None
    if got_mode is not None:
        got += f" ({got_mode})"
    raise ValueError(f"{argname} must be a {expected}, got {got}")


def input_versions(inputs: dict[str, torch.Tensor | None]) -> tuple:
    """``(name, weak reference, version counter)`` of each tensor of ``inputs``: what a
    saved set keeps so that its backward can refuse inputs modified in place since
    (:func:`modified_input_error`); weakly, so that it keeps no input alive."""
    return tuple((name, weakref.ref(t), t._version)
                 for name, t in inputs.items() if t is not None)


def modified_input_error(versions: tuple, forward: str = "the forward") -> str | None:
    """The message for the first input of ``versions`` (:func:`input_versions`) whose
    version counter moved since — it was modified in place after ``forward`` — or
    ``None``. An input freed since cannot be checked (and cannot be modified any more)."""
    for name, ref, version in versions:
        t = ref()
        if t is not None and t._version != version:
            return (f"{name} was modified in place after {forward} (its version counter "
                    f"went from {version} to {t._version}): the saved set no longer matches "
                    f"it, so the backward refuses it, as autograd does; run the forward again "
                    f"or modify a copy")
    return None


class TypedSaved(ModeTyped):
    """Base of a package's saved set (what its forward hands to its backward).

    Subclasses set ``deterministic`` and add their fields; they are plain
    containers, the checks live in the package's backward.
    """


class TypedWorkspace(ModeTyped):
    """Base of a package's backward workspace: scratch buffers sized once.

    ``device`` is where the buffers live. ``capacity`` maps size names (e.g.
    ``"tokens"``, ``"chunks"``, ``"docs"``) to the largest value the buffers
    hold; ``layout`` maps names (e.g. ``"HV"``, ``"K"``, ``"V"``) to values that
    must match exactly. :meth:`check_fits` compares them with a problem's needs.
    """

    def __init__(
        self,
        device: torch.device | str,
        capacity: Mapping[str, int],
        layout: Mapping[str, Any] | None = None,
    ) -> None:
        self.device = require_device(device)  # ValueError for a device not usable here
        self.capacity = dict(capacity)
        self.layout = dict(layout or {})

    def check_fits(
        self,
        device: torch.device | str,
        required: Mapping[str, int],
        layout: Mapping[str, Any] | None = None,
        argname: str = "workspace",
    ) -> None:
        """Raise ``ValueError`` unless this workspace serves a problem on ``device``
        needing ``required`` (each at most the capacity) with ``layout`` (equal)."""
        device = torch.device(device)
        if not _same_device(self.device, device):
            raise ValueError(
                f"{argname} was allocated on {self.device}, but the tensors are on {device}"
            )
        name = type(self).__qualname__
        for key, need in required.items():
            have = self.capacity.get(key)
            if have is None or have < need:
                raise ValueError(
                    f"{argname} is too small: {name} holds {key}={have}, the problem needs "
                    f"{key}={need}; size it with {name}.for_shapes(...) for this problem"
                )
        for key, want in (layout or {}).items():
            have = self.layout.get(key)
            if have != want:
                raise ValueError(
                    f"{argname} does not fit: {name} was sized for {key}={have}, the problem "
                    f"has {key}={want}"
                )

    def __repr__(self) -> str:
        sizes = ", ".join(f"{k}={v}" for k, v in {**self.capacity, **self.layout}.items())
        return f"{type(self).__qualname__}({self.mode}, device={self.device}, {sizes})"


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda":
        ia = a.index if a.index is not None else torch.cuda.current_device()
        ib = b.index if b.index is not None else torch.cuda.current_device()
        return ia == ib
    return True
