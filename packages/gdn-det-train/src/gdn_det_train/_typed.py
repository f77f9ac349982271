"""The deterministic mode's saved set, workspace and gradients."""

from __future__ import annotations

from dataclasses import dataclass

from gdn_core.autograd import TrainGrads, TrainSaved, TrainWorkspace

__all__ = ["DetSavedSet", "DetWorkspace", "DetGrads"]


class DetSavedSet(TrainSaved):
    """What :func:`gdn_det_train.chunk_gdn_det_fwd` hands to
    :func:`gdn_det_train.chunk_gdn_det_bwd` (deterministic mode only).

    Attributes: ``core`` (the :class:`gdn_core.GDNSaved` of the kernels),
    ``gate`` (the in-kernel gate's inputs, or ``None``); ``shapes``, ``device``,
    ``backend``. Treat it as opaque and use it for one backward (or several:
    it is not consumed).
    """

    deterministic = True


class DetWorkspace(TrainWorkspace):
    """Scratch buffers of :func:`gdn_det_train.chunk_gdn_det_bwd`, allocated once.

    Size it with :meth:`for_shapes` (``T``, ``H``, ``K``, ``V``, ``HV``, ``B``,
    ``num_docs``, ``device``, ``dtype``) or :meth:`for_inputs` and pass it to
    every backward of a training loop. A problem larger than the workspace, of
    other head sizes, or on another device raises ``ValueError``.
    """

    deterministic = True


@dataclass
class DetGrads(TrainGrads):
    """Gradients of a deterministic backward: ``dq, dk, dv, dg, dbeta, dh0`` and,
    with ``use_gate_in_kernel``, ``dA_log, ddt_bias`` (else ``None``)."""

    deterministic = True


for _cls in (DetSavedSet, DetWorkspace, DetGrads):
    _cls.__module__ = "gdn_det_train"
