"""Kernels in Gluon (``triton.experimental.gluon``, Triton 3.6's Hopper API).

The environment variable ``GDN_CORE_GLUON`` names the stages (the keys of :data:`STAGES`:
``output``, ``grads``, ``grads2``, ``wy``, ``wy_apply``, ``state``, ``state_bwd``,
``dv_local``, ``fused_state``, ``fused_fwd``, ``recompute``, ``fused_bwd``; comma-separated,
``all`` — every stage but :data:`BY_NAME_ONLY` — or ``none``) whose Gluon kernel replaces the Triton
one where it serves the call (``grads2``, the persistent chunk-gradient kernel, supersedes
``grads``' kernel where both are asked for; ``fused_state``, the warp-specialised state
backward with ``dv_local`` inside, supersedes the ``dv_local`` + ``state_bwd`` pair in
:func:`gdn_core.ops.backward.backward_from_recompute`; ``recompute`` the backward's
``wy_apply`` + ``state`` pair in :func:`gdn_core.segment.segment_bwd_begin`). Unset or
empty, it means
:data:`DEFAULT_STAGES`: the stages measured faster end to end on the H200 (``grads``,
``wy``, ``fused_fwd``, ``recompute``, and ``fused_state`` where a launch has enough
programs: :func:`gdn_core.ops.backward.pick_fused_state`);
``none`` keeps Triton everywhere. :func:`pick` chooses; elsewhere the Triton kernel runs,
and a profile or ``record_launches`` shows which ran. A caller may also use a launcher
directly (``gdn_core.ops.gluon.<module>.<launcher>``, :data:`STAGES` names them).

The state stage replaces only the passes that walk a segment from its entry state (the
forward, the backward's recompute); the segment summaries (the ``[E | M]`` launch and
:mod:`gdn_core.kcp.summary`) stay Triton, so a summary has the same bits whichever
world size computes it (partition invariance).

Importing this package never compiles anything and never fails on a machine without a
GPU or without Gluon; :func:`available` says whether Gluon imports here and the current
device is an sm_90 GPU.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

from gdn_core.switches import env_value

__all__ = ["BY_NAME_ONLY", "DEFAULT_STAGES", "GLUON_ENV", "STAGES", "available", "named",
           "pick", "requested"]

#: the environment variable naming the stages whose Gluon kernel is wanted
GLUON_ENV = "GDN_CORE_GLUON"

#: stage -> (module of ``gdn_core.ops.gluon``, its launcher, its ``supported(*probe)`` test);
#: each launcher takes the arguments of, and returns what, the Triton launcher it replaces
STAGES: dict[str, tuple[str, str, str]] = {
    "output": ("output", "chunk_output_fwd_gluon", "gluon_output_supported"),
    "grads": ("chunk_grads", "chunk_grads_bwd_gluon", "gluon_chunk_grads_supported"),
    "wy": ("wy", "wy_fwd_gluon", "gluon_wy_supported"),
    "state": ("chunk_state", "chunk_state_fwd_gluon", "gluon_chunk_state_supported"),
    "state_bwd": ("chunk_state_bwd", "chunk_state_bwd_gluon", "gluon_state_bwd_supported"),
    "wy_apply": ("wy", "wy_apply_gluon", "gluon_wy_apply_supported"),
    "dv_local": ("dv_local", "dv_local_bwd_gluon", "gluon_dv_local_supported"),
    # the persistent chunk-gradient kernel; asked for, it replaces "grads"' kernel
    "grads2": ("chunk_grads_pipelined", "chunk_grads_bwd_gluon_pipelined",
               "gluon_chunk_grads_pipelined_supported"),
    # dv_local inside the reverse state recurrence, warp-specialised (one launch); asked
    # for, it replaces the "dv_local" + "state_bwd" pair where the backward runs both. Its
    # launcher takes chunk_state_bwd's arguments less dv_local.
    "fused_state": ("fused_state_bwd", "fused_state_bwd_gluon", "gluon_fused_state_supported"),
    # the forward's recurrence and output warp-specialised; asked for, it replaces the Triton
    # fused forward (chunk_fwd_fused) where that runs, with its arguments
    "fused_fwd": ("fused_fwd", "chunk_fwd_fused_gluon", "gluon_fused_fwd_supported"),
    # the backward's recompute in one launch: W and U formed on chip, h and v_new stored;
    # asked for, it replaces wy_apply + chunk_state_fwd(store_states) where the backward
    # runs both. Its launcher takes wy_apply's arguments and chunk_state_fwd's
    # initial_state and returns (W, h, v_new).
    "recompute": ("recompute", "chunk_recompute_gluon", "gluon_recompute_supported"),
    # the reverse state recurrence and every chunk gradient in one warp-specialised launch
    # (one value head per q/k head); asked for, it replaces fused_state (or the state pair)
    # + grads where a backward runs the whole of backward_from_recompute. Its launcher
    # takes the inputs of both and returns (dq, dk, dv, dbeta, dg, dh0).
    "fused_bwd": ("fused_bwd", "fused_bwd_gluon", "gluon_fused_bwd_supported"),
}


#: the stages a call runs on Gluon when :data:`GLUON_ENV` is unset: ``grads``, the one-tile
#: chunk-gradient kernel, measured 0.85-0.90x the Triton pipeline's forward+backward at B4
#: T8192, B1 T32768 and B1 T32768 8 documents and level at B1 T8192 (session 14,
#: ``benchmarks/results/2026-12-02-h200-s14.md``); ``fused_state``, the same bits as the
#: ``dv_local`` + ``state_bwd`` pair in both reverse passes, det forward+backward 0.88-0.97x
#: at five of issue 19's six shapes, taken unasked only where a launch has at least
#: :data:`gdn_core.ops.backward.FUSED_STATE_MIN_PROGRAMS` programs (session 17,
#: ``benchmarks/results/2026-12-03-h200-s17.md``); ``wy``, the WY forward with its inverse
#: in a swizzled shared tile and the backward's 16-bit inverse written by the kernel, 0.53x
#: the Triton kernel's time and det forward+backward 0.92x at B4 T8192 and at B1 T32768 in
#: 8 documents (session 20, ``benchmarks/results/2026-12-04-h200-s20.md``; other bits than
#: the Triton WY, within its tolerance); ``fused_fwd``, the warp-specialised fused forward:
#: the Triton fused forward's bits in 0.56-0.59x its time, det forward 0.80-0.87x at B4
#: T8192 and at B1 T32768 in 8 documents with 16 and 32 value heads (session 21,
#: ``benchmarks/results/2026-12-04-h200-s21.md``); ``recompute``, the backward's W, h and
#: v_new in one launch, bitwise the ``wy_apply`` + ``chunk_state_fwd`` pair it replaces and
#: 0.19-0.41 ms less kernel time a det step at 16 and 32 value heads (sessions 22 and 24 on
#: an H100, ``benchmarks/results/2026-12-05-h100-s22-recompute-timelines.md``), a default
#: since session 29 with the whole GPU suite passing. The others were slower.
DEFAULT_STAGES: frozenset[str] = frozenset({"grads", "fused_state", "wy", "fused_fwd",
                                            "recompute"})

#: stages ``all`` leaves out, run only where named or by default: ``fused_state`` supersedes
#: the ``dv_local`` and ``state_bwd`` stages, whose Gluon kernels ``all`` runs; ``fused_fwd``
#: supersedes the Triton fused forward, which itself replaces the ``state`` and ``output``
#: stages' kernels (``all`` runs those where the fused forward is switched off);
#: ``recompute`` supersedes the ``wy_apply`` and ``state`` stages in the backward;
#: ``fused_bwd`` supersedes ``fused_state`` and ``grads`` (not yet timed on a GPU)
BY_NAME_ONLY: frozenset[str] = frozenset({"fused_state", "fused_fwd", "recompute", "fused_bwd"})


def requested(stage: str) -> bool:
    """Whether :data:`GLUON_ENV` asks for the Gluon kernel of ``stage`` (a key of
    :data:`STAGES`; the variable holds stage names, comma-separated, ``all`` (every stage
    but :data:`BY_NAME_ONLY`) or ``none``; unset or empty: :data:`DEFAULT_STAGES`).

    Raises:
        ValueError: the variable names an unknown stage (a typo must not silently
            leave the Triton kernel in place).
    """
    names = _stage_names(env_value(GLUON_ENV))
    return stage in names or ("all" in names and stage not in BY_NAME_ONLY)


def named(stage: str) -> bool:
    """Whether :data:`GLUON_ENV` names ``stage`` itself (not through :data:`DEFAULT_STAGES`
    or ``all``): a caller's shape rule for a default stage then gives way.

    Raises:
        ValueError: as :func:`requested`.
    """
    raw = env_value(GLUON_ENV)
    return stage in _stage_names(raw) and stage in {n.strip() for n in raw.split(",")}


@functools.lru_cache(maxsize=16)
def _stage_names(raw: str) -> frozenset[str]:
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    if not names:
        return DEFAULT_STAGES
    if "none" in names:
        if len(names) > 1:
            raise ValueError(f"{GLUON_ENV}={raw!r}: 'none' cannot be combined with stages")
        return frozenset()
    unknown = names - {*STAGES, "all"}
    if unknown:
        raise ValueError(f"{GLUON_ENV}={raw!r}: unknown stage(s) {sorted(unknown)}; known: "
                         f"{', '.join(STAGES)}, all, none")
    return names


def pick(stage: str, triton_launcher: Callable, *probe) -> Callable:
    """The launcher for ``stage`` given these inputs: its Gluon launcher when
    :func:`requested`, :func:`available` (the first probe tensor on CUDA) and the
    kernel's ``supported(*probe)`` says it serves them; else ``triton_launcher``
    (the caller's, imported with its module: a @triton.jit kernel takes the
    interpreter only if ``TRITON_INTERPRET`` is set when its module is imported)."""
    if probe[0].is_cuda and requested(stage) and available():
        gluon_launcher, supported = _stage_functions(stage)
        if supported(*probe):
            return gluon_launcher
    return triton_launcher


@functools.cache
def _stage_functions(stage: str) -> tuple[Callable, Callable]:
    """``(Gluon launcher, supported)`` of ``stage``, its module imported on first use."""
    module, name, supported = STAGES[stage]
    mod = importlib.import_module(f"{__name__}.{module}")  # import-check: allow-dynamic (STAGES)
    return getattr(mod, name), getattr(mod, supported)


@functools.cache
def available() -> bool:
    """Whether Gluon's Hopper API imports and the current CUDA device is compute capability 9.0."""
    try:
        import torch

        if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            return False
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True
