"""gdn_core.devices.require_device, and the constructors that call it (issue 20):
a device this process cannot use is a ``ValueError`` naming it, not torch's bare
``AssertionError`` at the first allocation."""

from __future__ import annotations

import pytest
import torch
from gdn_core.devices import require_device
from gdn_core.layout import VarlenLayout
from gdn_core.typed import TypedWorkspace

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def test_usable_devices_pass_unchanged():
    assert require_device("cpu") == torch.device("cpu")
    assert require_device(torch.device("meta")) == torch.device("meta")


@pytest.mark.parametrize("bad, err", [(None, TypeError), (True, TypeError), (1.5, TypeError),
                                      ("gpu", ValueError), ("cuda:x", ValueError)])
def test_what_is_not_a_device_is_refused(bad, err):
    with pytest.raises(err, match="device"):
        require_device(bad)


@no_cuda
@pytest.mark.parametrize("dev", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_cuda_without_cuda_is_a_valueerror_naming_it(dev):
    with pytest.raises(ValueError, match="CUDA is not available"):
        require_device(dev)
    with pytest.raises(ValueError, match="device=0"):  # an int is an accelerator index
        require_device(0)


@no_cuda
def test_layout_and_workspace_refuse_cuda_without_cuda():
    with pytest.raises(ValueError, match="device='cuda' was given"):
        VarlenLayout([0, 3, 8], device="cuda")
    with pytest.raises(ValueError, match="device='cuda' was given"):
        TypedWorkspace("cuda", {"T": 8})
