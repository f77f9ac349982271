"""The marks of the shared GPU suites: ``pytest -m gpu`` selects them; without a CUDA
GPU they are skipped."""

from __future__ import annotations

import pytest
import torch

ONE_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
