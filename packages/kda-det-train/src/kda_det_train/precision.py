"""Keep fp32 matrix products IEEE fp32 whatever the caller's global setting.

``torch.set_float32_matmul_precision("high"/"medium")`` lets fp32 matmuls run
in TF32 (CUDA) or bf16 (oneDNN on CPU), which changes both the accuracy and the
bits of the result. The deterministic contract is "same inputs → same bits",
independent of the caller's settings, so every entry point of this package runs
its products at ``"highest"`` and restores the caller's setting afterwards.
(The setting is process-global: calls from several threads at once that also
change it race, as with any code that touches it.)
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["ieee_fp32_matmul"]


@contextlib.contextmanager
def ieee_fp32_matmul():
    previous = torch.get_float32_matmul_precision()
    if previous == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)
