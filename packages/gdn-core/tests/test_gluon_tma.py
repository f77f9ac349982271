"""The Gluon kernels' host-side tile views (``gdn_core.ops.gluon.tma``): CPU only."""

import pytest
import torch
from gdn_core.ops.gluon.tma import descriptor, rows_view


def test_head_split_view_of_a_packed_projection_is_not_copied():
    T, H, D = 10, 4, 32
    packed = torch.randn(T, 3 * H * D, dtype=torch.bfloat16)
    q = packed[:, H * D:2 * H * D].view(T, H, D)  # the middle third, rows 3·H·D apart
    view = rows_view(q)
    assert view.shape == (T, H * D)
    assert view.stride() == (3 * H * D, 1)
    assert view.data_ptr() == q.data_ptr()  # same storage: nothing copied
    assert torch.equal(view, q.reshape(T, H * D))


def test_contiguous_input_keeps_its_storage():
    x = torch.randn(6, 2, 64, dtype=torch.float16)
    view = rows_view(x)
    assert view.data_ptr() == x.data_ptr() and view.stride() == (128, 1)


@pytest.mark.parametrize("case", ["inner_not_dense", "row_stride_unaligned", "base_unaligned"])
def test_views_tma_cannot_address_become_aligned_copies(case):
    T, H, D = 8, 2, 64
    if case == "inner_not_dense":  # heads interleaved: the inner dims are not one run
        x = torch.randn(T, D, H, dtype=torch.bfloat16).transpose(1, 2)
    elif case == "row_stride_unaligned":  # rows 129 elements (258 bytes) apart
        x = torch.randn(T, H * D + 1, dtype=torch.bfloat16)[:, :H * D].view(T, H, D)
    else:  # base one element (2 bytes) past an aligned address
        x = torch.randn(T * H * D + 1, dtype=torch.bfloat16)[1:].view(T, H, D)
    view = rows_view(x)
    assert view.data_ptr() != x.data_ptr()
    assert view.data_ptr() % 16 == 0 and (view.stride(0) * view.element_size()) % 16 == 0
    assert view.stride() == (H * D, 1)
    assert torch.equal(view, x.reshape(T, H * D))


def test_descriptor_describes_the_view_at_its_strides():
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    T, H, D = 128, 2, 64
    packed = torch.zeros(T, 3 * H * D, dtype=torch.bfloat16)
    view = rows_view(packed[:, :H * D].view(T, H, D))
    desc = descriptor(view, [64, D])
    assert list(desc.shape) == [T, H * D]
    assert list(desc.strides) == [3 * H * D, 1]
    assert list(desc.block_shape) == [64, D]
    assert descriptor(view, [64, D]).layout is desc.layout  # one layout per (block, dtype)



@pytest.mark.parametrize("shape", [(6, 2, 64), (1, 4, 32), (64, 128)])
def test_contiguous_fast_path_is_the_general_view(shape):
    """A contiguous aligned input takes ``view`` (one C check) and gets exactly the view the
    general path builds: shape, strides, address and values."""
    x = torch.randn(*shape, dtype=torch.bfloat16)
    got = rows_view(x)
    want = x.as_strided((shape[0], x.numel() // shape[0]), (x.numel() // shape[0], 1))
    assert got.shape == want.shape and got.stride() == want.stride()
    assert got.data_ptr() == want.data_ptr() and torch.equal(got, want)
