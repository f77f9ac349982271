"""Host side of the Gluon kernels' TMA loads: 2-D tile views and their descriptors.

Every Gluon kernel here reads its tiles through host-built TMA descriptors over a 2-D
view of a token-major tensor (``[T, heads * D]``, or ``[chunks * heads * K, V]`` for the
chunk states). Building them is per-call host work on the launch path, so this module
keeps it small: the shared-memory layouts are computed once per (block, dtype), and a
strided view of a packed projection (``q``, ``k``, ``v`` cut from one ``[T, ·]`` buffer)
is described at its own strides instead of being copied.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

from gdn_core.ops.launch import ByIdentity

try:  # Triton 3.6's Gluon; an older or CPU-only Triton may lack it: import must not fail
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except Exception:  # noqa: BLE001 - the kernels' modules report Gluon's absence themselves
    gl = None
    TensorDescriptor = None
try:  # the block-shape check TensorDescriptor makes (Triton's own, so the errors agree)
    from triton._utils import validate_block_shape
except Exception:  # noqa: BLE001 - another Triton: every descriptor through from_tensor
    validate_block_shape = None

__all__ = ["descriptor", "ensure_context", "rows_view"]

_TMA_ALIGN = 16  # bytes: TMA's base-address and stride granularity


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` (``[R, *inner]``) as a 2-D ``[R, prod(inner)]`` view TMA can address.

    A view whose inner dims are dense (each stride the product of the sizes after it,
    the last 1) keeps its row stride, so a head-split view of a packed projection is not
    copied; a row stride or base address that is not a multiple of 16 bytes, or inner
    dims that are not dense, give a contiguous copy (still 16-byte aligned: a fresh
    allocation is).
    """
    rows = x.shape[0]
    if x.is_contiguous() and rows > 0:  # the common case: one check in C, a view
        width = x.numel() // rows
        if x.data_ptr() % _TMA_ALIGN == 0 and (width * x.element_size()) % _TMA_ALIGN == 0:
            return x.view(rows, width)
    inner = x.shape[1:]
    width, dense = 1, True
    for size, stride in zip(reversed(inner), reversed(x.stride()[1:]), strict=True):
        dense = dense and (size == 1 or stride == width)
        width *= size
    esz = x.element_size()
    row_stride = x.stride(0) if rows > 1 else width
    if (not dense or x.data_ptr() % _TMA_ALIGN or (row_stride * esz) % _TMA_ALIGN
            or row_stride < width):
        x = x.contiguous()
        if x.data_ptr() % _TMA_ALIGN:
            x = x.clone()
        row_stride = width
    return x.as_strided((rows, width), (row_stride, 1))


@functools.cache
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    dt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for(list(block), dt)


_THREAD = threading.local()


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def ensure_context(device: torch.device) -> None:
    """Make the device's primary CUDA context current in this thread, once per thread.

    Triton fills a host TMA descriptor (``cuTensorMapEncodeTiled``) before its launcher
    binds a context, so a Gluon kernel launched first in a thread that never touched the
    GPU (a worker thread running a backward) fails with "invalid device context". A
    thread that already has a current context is left as it is.

    Raises:
        RuntimeError: the CUDA driver refuses (its error code in the message).
    """
    if getattr(_THREAD, "bound", False):
        return
    cuda = _libcuda()
    ctx = ctypes.c_void_p()
    _check(cuda.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        dev = ctypes.c_int()
        index = device.index if device.index is not None else torch.cuda.current_device()
        _check(cuda.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
        _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        _check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    _THREAD.bound = True


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {status}")


def descriptor(x: torch.Tensor, block: list[int]):
    """A TMA descriptor over :func:`rows_view` of the 16-bit tensor ``x`` (``[R, *inner]``
    as ``[R, prod(inner)]``; a 2-D ``x`` as it is) for tiles of ``block``, in the NVMMA
    shared-memory layout a ``warpgroup_mma`` reads. CPU tensors suffice
    (``tools/sm90_report.py`` builds them to compile); for a CUDA tensor the thread gets a
    current context first (:func:`ensure_context`).

    This is on every Gluon launch's path, so the common case — a contiguous ``x`` at a
    16-byte aligned address — is described without making the 2-D view: the descriptor
    is the one ``TensorDescriptor.from_tensor(rows_view(x), block, layout)`` builds (its
    base ``x`` itself: TMA reads the address and the dtype), with the checks that
    constructor repeats per call made here instead, the block's once per (block, dtype).
    It carries its launch-cache key (:func:`gdn_core.ops.launch.descriptor_key`).

    Raises:
        AssertionError: what ``TensorDescriptor`` raises for a geometry TMA cannot
            address (an empty tensor, a bad block shape).
    """
    if x.is_cuda:
        ensure_context(x.device)
    block = tuple(block)
    layout, key = _tile_spec(block, x.dtype)
    rows = x.shape[0]
    if rows > 0 and validate_block_shape is not None and x.is_contiguous():
        width = x.numel() // rows
        if (width > 0 and x.data_ptr() % _TMA_ALIGN == 0
                and (width * x.element_size()) % _TMA_ALIGN == 0):
            return _described(x, (rows, width), (width, 1), block, layout, key)
    view = rows_view(x)
    desc = TensorDescriptor.from_tensor(view, list(block), layout)
    desc._gdn_key = key
    return desc


def _described(base: torch.Tensor, shape: tuple[int, int], strides: tuple[int, int],
               block: tuple[int, ...], layout, key: tuple):
    """``TensorDescriptor(base, shape, strides, block, layout)`` with its field checks
    left out: the caller made them (:func:`descriptor`)."""
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(base=base, shape=shape, strides=strides, block_shape=list(block),
                         layout=layout, padding="zero", _gdn_key=key)
    return desc


@functools.cache
def _tile_spec(block: tuple[int, ...], dtype: torch.dtype) -> tuple:
    """The shared layout of ``block`` tiles of ``dtype`` and the launch-cache key of a
    descriptor of them; ``block`` checked as ``TensorDescriptor`` checks it."""
    if validate_block_shape is not None:
        validate_block_shape(list(block))
    layout = _shared_layout(block, dtype)
    return layout, ("desc", dtype, block, ByIdentity(layout))
