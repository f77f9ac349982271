"""On/off environment switches of the kernel pipeline (read at each call).

Each switch selects between kernel paths that keep the determinism contract. An on/off
switch holds ``1`` (on), ``0`` (off) or nothing (the switch's default); a choice switch
(:func:`switch_choice`) names one of its paths. Any other value raises, so that a typo
never silently leaves the other path in place.
"""

from __future__ import annotations

import os

__all__ = ["BWD_ALIAS_ENV", "DOC_ORDER_ENV", "FUSED_FWD_ENV", "WY_INV_CHOICES", "WY_INV_ENV",
           "env_value", "switch_choice", "switch_setting"]

#: the forward's last phase (state recurrence and output) as one kernel (default: on where
#: measured, :func:`gdn_core.segment.fused_fwd_wanted`)
FUSED_FWD_ENV = "GDN_CORE_FUSED_FWD"

#: the backward writes ``dv`` over its own ``dV'`` buffer and (one value head per q/k head)
#: ``dq`` over its own ``v_new`` where the one-tile Gluon chunk-gradient kernel runs
#: (:func:`gdn_core.ops.backward.plan_aliases`; unset or ``1``: on where valid, the default
#: since the H200 ran it in session 16; ``0``: off). The same bits, up to 2 units of
#: ``[T, HV, 128]`` 16-bit less at the backward's peak (18-20 % of the fwd+bwd peak)
BWD_ALIAS_ENV = "GDN_CORE_BWD_ALIAS"

#: the kernels that walk one document (segment) a program take their documents longest
#: first (:func:`gdn_core.chunking.ordered_docs`, a document-major grid): the fused state
#: backward (Gluon), the state forward and the fused forward (Triton). The same bits; a
#: shorter wave tail where the programs outnumber the SMs (list scheduling of the
#: benchmark's 8-document segments, one program an SM: 102 → 67 chunk steps). Unset or
#: ``1``: every such kernel (the default since session 19); ``0``: none. H200: the forward
#: 0.87-0.92× at 8 and 16 documents and HV32 (session 18); the fused state backward 243
#: against 301 µs a call at 8 documents of the benchmark's lengths (session 19 profile)
DOC_ORDER_ENV = "GDN_CORE_DOC_ORDER"

#: how the WY forward kernel inverts ``I + A`` (:func:`gdn_core.ops.wy.wy_fwd`): ``subst``
#: (the default; diagonal blocks by substitution, merges through the ``A_inv`` buffer) or
#: ``reg`` (the whole inverse in registers by block merges; other bits)
WY_INV_ENV = "GDN_CORE_WY_INV"
WY_INV_CHOICES = ("subst", "reg")


_ENVIRON = os.environ
_ENV_DATA = getattr(_ENVIRON, "_data", None)  # the encoded mapping os.environ keeps in step
_ENV_KEYS: dict[str, object] = {}  # name -> its encoded key


def env_value(name: str) -> str:
    """The environment variable ``name`` as :data:`os.environ` holds it now (``""`` when
    unset). Read from the encoded mapping ``os.environ`` keeps in step with itself, so a
    switch read on every call costs ~0.05 µs instead of ``os.environ.get``'s ~0.85 µs (key
    encoding and a caught ``KeyError`` for an unset name); the same value either way."""
    if _ENV_DATA is None:  # another os.environ: its own lookup
        return _ENVIRON.get(name, "")
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = _ENVIRON.encodekey(name)
    raw = _ENV_DATA.get(key)
    return "" if raw is None else _ENVIRON.decodevalue(raw)


def switch_setting(name: str) -> bool | None:
    """``True`` / ``False`` where the environment variable ``name`` is ``1`` / ``0``;
    ``None`` where it is unset or empty (the caller's default).

    Raises:
        ValueError: it is set to anything else.
    """
    raw = env_value(name).strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{name}={raw!r}: expected 0 or 1")
    return None if raw == "" else raw == "1"


def switch_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """The path the environment variable ``name`` names (one of ``choices``), or
    ``default`` where it is unset or empty.

    Raises:
        ValueError: it names anything else.
    """
    raw = env_value(name).strip()
    if raw == "":
        return default
    if raw not in choices:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return raw
