"""Kernels in Gluon (``triton.experimental.gluon``, Triton 3.6's Hopper API), opt-in.

Nothing here is wired into the pipeline: a caller asks for a Gluon launcher by
name (:func:`gdn_core.ops.gluon.output.chunk_output_fwd_gluon`,
:func:`gdn_core.ops.gluon.chunk_grads.chunk_grads_bwd_gluon`). Importing this
package never compiles anything and never fails on a machine without a GPU or
without Gluon; :func:`available` says whether Gluon imports here and the current
device is an sm_90 GPU.
"""

from __future__ import annotations

import functools

__all__ = ["available"]


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
