"""tools/interp_memcheck.py: it flags an out-of-bounds lane, and the composed GDN
kernels touch only their arguments' memory (under Triton's interpreter)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined

import pytest  # noqa: E402
import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="checks interpreted kernels (CPU only)")


@pytest.fixture(scope="module")
def memcheck():
    spec = importlib.util.spec_from_file_location("interp_memcheck",
                                                  REPO_ROOT / "tools" / "interp_memcheck.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_an_out_of_bounds_load_is_reported(memcheck):
    import triton
    import triton.language as tl

    @triton.jit
    def shifted_copy(x, y, n):
        r = tl.arange(0, 16)
        tl.store(y + r, tl.load(x + r + 8, mask=r < n))

    src, dst = torch.zeros(16), torch.zeros(16)
    with memcheck.checking() as violations:
        shifted_copy[(1,)](src, dst, 8)  # lanes 0..7 read x[8..15]: inside
    assert not violations
    with memcheck.checking() as violations:
        shifted_copy[(1,)](src, dst, 16)  # lanes 8..15 read x[16..23]: outside
    assert list(violations) == ["shifted_copy"] and "8 lanes" in violations["shifted_copy"]


@pytest.mark.parametrize("lengths,H,group,K,V,dtype", [
    ([100, 28], 1, 2, 48, 16, torch.float16),  # grouped, K and V below a block
    ([130, 0, 65], 1, 4, 80, 64, torch.float32),  # group 4, empty document, K=80
])
def test_gdn_kernels_stay_inside_their_arguments(memcheck, lengths, H, group, K, V, dtype):
    with memcheck.checking() as violations:
        memcheck.run_gdn_case(lengths, H, group, K, V, dtype)
    assert violations == {}
