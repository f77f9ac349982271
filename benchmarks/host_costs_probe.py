"""Host µs of the pieces one launch of ours is made of, on a CUDA machine (issue 18).

Each row times ``--n`` back-to-back repetitions of one piece and prints µs a piece:

* ``torch.empty``: one ``[1024, 16, 128]`` bf16 allocation (the caching allocator's hit);
* ``gluon descriptor``: one :func:`gdn_core.ops.gluon.tma.descriptor` of a ``[T·H, 128]``
  bf16 tensor with a ``[64, 64]`` block (built per launch for each TMA operand), one of a
  ``[T, H, 128]`` one (described as ``[T, H·128]`` rows without making the view: the
  launchers' path since session 28), and ``rows_view`` + a descriptor of it (the path of a
  view that is not contiguous) (``--device cpu``: only these rows, whose Python is the same
  off the GPU);
* ``cached launch``: an empty kernel with 24 arguments (12 tensors, 12 ints) through
  :class:`gdn_core.ops.launch.CachedLauncher`;
* ``compiled.run``: the same kernel through the compiled launcher alone (addresses as
  ints): what is left when none of our Python runs;
* ``cuLaunchKernel floor``: the same launch with a 1-argument empty kernel.

The launches are throttled every 256 (a synchronize outside the timed region), so the
queue never fills and the host time is not the GPU's.

    python benchmarks/host_costs_probe.py [--n 2000] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _wide(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11,
          n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, B: tl.constexpr):
    tl.program_id(0)


@triton.jit
def _one(x):
    tl.program_id(0)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _us(piece, n: int) -> float:
    """Host µs a call of ``piece``, synchronising every 256 calls outside the clock."""
    for _ in range(20):
        piece()
    _sync()
    total, done = 0.0, 0
    while done < n:
        m = min(256, n - done)
        t0 = time.perf_counter()
        for _ in range(m):
            piece()
        total += time.perf_counter() - t0
        _sync()
        done += m
    return total * 1e6 / n


def _descriptor_rows(device: str) -> dict:
    """The Gluon descriptor rows: one descriptor of a 2-D tensor, one of a ``[1024, 16,
    128]`` one, and ``rows_view`` + a descriptor of it (what each TMA operand costs)."""
    try:
        from gdn_core.ops.gluon.tma import descriptor, rows_view
        t = torch.empty(1024 * 16, 128, device=device, dtype=torch.bfloat16)
        x = torch.empty(1024, 16, 128, device=device, dtype=torch.bfloat16)
        return {"gluon descriptor [64,64] block": lambda: descriptor(t, [64, 64]),
                "descriptor [1024,16,128]": lambda: descriptor(x, [64, 128]),
                "rows_view + descriptor [1024,16,128]": lambda: descriptor(rows_view(x),
                                                                           [64, 128])}
    except Exception as e:  # noqa: BLE001 - no Gluon here: the rows are left out
        print(f"(no Gluon descriptor rows: {e})")
        return {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--device", default="cuda",
                   help="cuda, or cpu: only the descriptor rows (their Python is the same)")
    args = p.parse_args()
    if args.device == "cpu":
        for name, piece in _descriptor_rows("cpu").items():
            print(f"{name:34s} {_us(piece, args.n):7.2f} us", flush=True)
        return
    from gdn_core.ops.launch import CachedLauncher

    x = torch.empty(64, device="cuda")
    wide_args = [x] * 12 + [7, 16, 3, 128, 5, 6, 7, 8, 9, 10, 11, 12]
    cached = CachedLauncher(_wide)
    compiled = cached[(1,)](*wide_args, B=64)
    one = _one[(1,)](x)
    stream = torch.cuda.current_stream().cuda_stream
    ints = [x.data_ptr()] * 12 + wide_args[12:] + [64]  # the constexpr too: 3.6 passes all
    rows = {
        "torch.empty [1024,16,128] bf16": lambda: torch.empty(
            1024, 16, 128, device="cuda", dtype=torch.bfloat16),
        "cached launch (24 args)": lambda: cached[(1,)](*wide_args, B=64),
        "compiled.run (24 args)": lambda: compiled.run(
            1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
            *ints),
        "cuLaunchKernel floor (1 arg)": lambda: one.run(
            1, 1, 1, stream, one.function, one.packed_metadata, None, None, None,
            x.data_ptr()),
    }
    rows.update(_descriptor_rows("cuda"))
    for name, piece in rows.items():
        print(f"{name:34s} {_us(piece, args.n):7.2f} us", flush=True)


if __name__ == "__main__":
    main()
