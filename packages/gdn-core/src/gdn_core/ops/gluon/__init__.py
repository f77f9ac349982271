"""Kernels in Gluon (``triton.experimental.gluon``, Triton 3.6's Hopper API), opt-in.

The pipeline runs them only when asked: the environment variable
``GDN_CORE_GLUON`` names the stages (``output``, ``grads``, comma-separated, or
``all``) whose Gluon kernel replaces the Triton one where it serves the shapes
(:func:`output_launcher`, :func:`chunk_grads_launcher` pick the launcher; elsewhere
the Triton kernel runs, and a profile shows which ran). An experiment switch while
the Gluon kernels are new; a caller may also use a launcher directly
(:func:`gdn_core.ops.gluon.output.chunk_output_fwd_gluon`,
:func:`gdn_core.ops.gluon.chunk_grads.chunk_grads_bwd_gluon`). Importing this
package never compiles anything and never fails on a machine without a GPU or
without Gluon; :func:`available` says whether Gluon imports here and the current
device is an sm_90 GPU.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

# The Triton launchers are imported here, with the package, not at their first use: a
# @triton.jit kernel takes the interpreter only if TRITON_INTERPRET is set when its module
# is imported, so a lazy import inside a call could make real-GPU kernels on a CPU run.
from gdn_core.ops.chunk_grads_bwd import chunk_grads_bwd
from gdn_core.ops.output import chunk_output_fwd

__all__ = ["GLUON_ENV", "available", "chunk_grads_launcher", "output_launcher", "requested"]

#: the environment variable naming the stages whose Gluon kernel is wanted
GLUON_ENV = "GDN_CORE_GLUON"
_STAGES = ("output", "grads")


def requested(stage: str) -> bool:
    """Whether :data:`GLUON_ENV` asks for the Gluon kernel of ``stage`` (``"output"`` or
    ``"grads"``; the variable holds stage names, comma-separated, or ``all``).

    Raises:
        ValueError: the variable names an unknown stage (a typo must not silently
            leave the Triton kernel in place).
    """
    names = {n.strip() for n in os.environ.get(GLUON_ENV, "").split(",") if n.strip()}
    unknown = names - {*_STAGES, "all"}
    if unknown:
        raise ValueError(f"{GLUON_ENV}={os.environ[GLUON_ENV]!r}: unknown stage(s) "
                         f"{sorted(unknown)}; known: {', '.join(_STAGES)}, all")
    return stage in names or "all" in names


def output_launcher(q, v_new, h, index) -> Callable:
    """The chunk-output launcher for these inputs: the Gluon one when :func:`requested`,
    :func:`available` and it serves the shapes, else the Triton
    :func:`gdn_core.ops.output.chunk_output_fwd` (same arguments and result)."""
    if requested("output") and q.is_cuda and available():
        from gdn_core.ops.gluon.output import chunk_output_fwd_gluon, gluon_output_supported

        if gluon_output_supported(q, v_new, h, index):
            return chunk_output_fwd_gluon
    return chunk_output_fwd


def chunk_grads_launcher(q, v, A_inv, index) -> Callable:
    """The chunk-gradient launcher for these inputs: the Gluon one when :func:`requested`,
    :func:`available` and it serves the shapes, else the Triton
    :func:`gdn_core.ops.chunk_grads_bwd.chunk_grads_bwd` (same arguments and results)."""
    if requested("grads") and q.is_cuda and available():
        from gdn_core.ops.gluon.chunk_grads import (
            chunk_grads_bwd_gluon,
            gluon_chunk_grads_supported,
        )

        if gluon_chunk_grads_supported(q, v, A_inv, index):
            return chunk_grads_bwd_gluon
    return chunk_grads_bwd


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
