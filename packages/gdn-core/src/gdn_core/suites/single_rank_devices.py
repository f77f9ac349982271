"""A device this process cannot use is a ``ValueError`` naming it (issue 20): the
package's workspace and a :class:`~gdn_core.layout.VarlenLayout`. Run on a
single-rank package through its ``api`` fixture."""

from __future__ import annotations

import pytest
import torch

from gdn_core.layout import VarlenLayout


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_valueerror(api):
    with pytest.raises(ValueError, match="device='cuda' was given, but CUDA is not available"):
        api.workspace_cls.for_shapes(T=8, H=1, K=16, V=16, device="cuda")
    with pytest.raises(ValueError, match="device='cuda' was given, but CUDA is not available"):
        VarlenLayout([0, 3, 8], device="cuda")
