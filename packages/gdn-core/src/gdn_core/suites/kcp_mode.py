"""What a KCP package's mode promises, for the shared KCP suites: its public class
names (:func:`kcp_names`) and how its results compare (:func:`agree`: bitwise in
the deterministic package, :func:`close` otherwise)."""

from __future__ import annotations

from typing import NamedTuple

import torch

GRADS = ("dq", "dk", "dv", "dg", "dbeta")


class KCPNames(NamedTuple):
    """The public names of one KCP package's mode."""

    module: str
    plan: str
    context: str
    saved: str
    workspace: str
    mode: str


_NAMES = {
    True: KCPNames("gdn_det_train_kcp", "DetKCPPlan", "DetKCPContext", "DetKCPSavedSet",
                   "DetKCPWorkspace", "deterministic"),
    False: KCPNames("gdn_train_kcp", "KCPPlan", "KCPContext", "KCPSavedSet", "KCPWorkspace",
                    "non-deterministic"),
}


def kcp_names(deterministic: bool) -> KCPNames:
    """The names of the KCP package of mode ``deterministic``."""
    return _NAMES[bool(deterministic)]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖ / ‖b‖`` in fp32 (the KCP GPU tests' measure)."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def close(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Within fp32 tolerance, the absolute part scaled by ``want``'s largest magnitude."""
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=what)


def agree(deterministic: bool, got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """The same bits where the package is ``deterministic``, else :func:`close`."""
    if deterministic:
        assert torch.equal(got, want), what
    else:
        close(got, want, what)
