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


def _fields(desc):
    return (desc.base.data_ptr(), desc.base.dtype, tuple(desc.shape), tuple(desc.strides),
            list(desc.block_shape), desc.padding)


@pytest.mark.parametrize("make", [
    lambda: torch.zeros(128, 2, 64, dtype=torch.bfloat16),       # contiguous, 3-D
    lambda: torch.zeros(256, 128, dtype=torch.float16),          # contiguous, 2-D
    lambda: torch.zeros(128, 3 * 128, dtype=torch.bfloat16)[:, 128:256].view(128, 2, 64),
    lambda: torch.zeros(128 * 128 + 1, dtype=torch.bfloat16)[1:].view(128, 128),  # unaligned
], ids=["contiguous-3d", "contiguous-2d", "packed-view", "unaligned-copy"])
def test_descriptor_is_the_one_from_tensor_builds_over_rows_view(make):
    """``descriptor(x)`` (built without the 2-D view where ``x`` is contiguous and aligned)
    describes what ``TensorDescriptor.from_tensor(rows_view(x), block, layout)`` does, at
    the same address, and carries the key the launch cache computes from its fields."""
    hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from gdn_core.ops import launch

    x = make()
    got = descriptor(x, [64, 128])
    want = hopper.TensorDescriptor.from_tensor(rows_view(x), [64, 128], got.layout)
    if x.data_ptr() % 16:  # the aligned copy is fresh each time: all but the address agree
        assert got.base.data_ptr() % 16 == 0 and got.base.data_ptr() != x.data_ptr()
        assert _fields(got)[1:] == _fields(want)[1:]
    else:  # described in place, the packed view at its own row stride
        assert got.base.data_ptr() == x.data_ptr()
        assert _fields(got) == _fields(want)
    key = launch.descriptor_key(got)
    del got._gdn_key
    assert launch.descriptor_key(got) == key


def test_descriptor_of_an_empty_tensor_raises_as_the_constructor_does():
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    with pytest.raises(AssertionError):
        descriptor(torch.zeros(0, 128, dtype=torch.bfloat16), [64, 128])
    with pytest.raises((AssertionError, ValueError)):  # a block Triton refuses
        descriptor(torch.zeros(64, 128, dtype=torch.bfloat16), [64, 100])
