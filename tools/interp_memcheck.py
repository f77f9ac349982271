"""Out-of-bounds check for Triton kernels run under the interpreter (CPU).

Every active lane of every load and store a kernel issues must fall inside the
storage of one of the tensors passed to that kernel; the first violation per
kernel is recorded. This finds indexing bugs (a missing mask, a wrong stride)
on a CPU machine, which the GPU would report as an illegal memory access —
it cannot see GPU-only faults (code generation, pipelining).

    TRITON_INTERPRET=1 python tools/interp_memcheck.py 300,129:1:4:256:64:float32 ...

runs the composed GDN forward and backward (``gdn_core.ops``) on each case
``LENGTHS:H:GROUP:K:V:DTYPE`` (document lengths comma-separated) and exits 1
if any kernel touched memory outside its arguments. As a library::

    with checking() as violations:
        ...  # launch interpreted kernels
    assert not violations
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.runtime.interpreter as interp  # noqa: E402

__all__ = ["checking", "run_gdn_case"]


def _element_bytes(ptrs) -> int:
    try:
        return max(1, ptrs.dtype.element_ty.primitive_bitwidth // 8)
    except AttributeError:
        return 1


@contextlib.contextmanager
def checking() -> Iterator[dict[str, str]]:
    """Patch the interpreter for the duration; yields ``{kernel name: first violation}``."""
    ranges: list[tuple[int, int]] = []
    current = [""]
    violations: dict[str, str] = {}
    B, F = interp.InterpreterBuilder, interp.InterpretedFunction
    saved = {n: getattr(B, n) for n in ("create_masked_load", "create_masked_store",
                                         "create_load", "create_store")}
    run0 = F.run

    def run(self, *args, grid, warmup, **kwargs):
        ranges.clear()
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                st = a.untyped_storage()
                ranges.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
        current[0] = getattr(self.fn, "__name__", repr(self.fn))
        return run0(self, *args, grid=grid, warmup=warmup, **kwargs)

    def check(ptrs, mask, what: str) -> None:
        addr = np.asarray(ptrs.data).astype(np.uint64)
        if mask is not None:
            addr = addr[np.broadcast_to(np.asarray(mask.data), addr.shape)]
        addr = addr.ravel()
        if addr.size == 0 or current[0] in violations:
            return
        size = _element_bytes(ptrs)
        ok = np.zeros(addr.shape, bool)
        for lo, hi in ranges:
            ok |= (addr >= lo) & (addr + size <= hi)
        if not ok.all():
            violations[current[0]] = (f"{what}: {int((~ok).sum())} lanes outside every "
                                      f"argument, e.g. {hex(int(addr[~ok][0]))}")

    def masked_load(self, ptrs, mask, other, *a):
        check(ptrs, mask, "load")
        return saved["create_masked_load"](self, ptrs, mask, other, *a)

    def masked_store(self, ptrs, value, mask, *a):
        check(ptrs, mask, "store")
        return saved["create_masked_store"](self, ptrs, value, mask, *a)

    def load(self, ptr, *a):
        check(ptr, None, "load")
        return saved["create_load"](self, ptr, *a)

    def store(self, ptr, value, *a):
        check(ptr, None, "store")
        return saved["create_store"](self, ptr, value, *a)

    F.run = run
    B.create_masked_load, B.create_masked_store = masked_load, masked_store
    B.create_load, B.create_store = load, store
    try:
        yield violations
    finally:
        F.run = run0
        for n, f in saved.items():
            setattr(B, n, f)


def run_gdn_case(lengths: list[int], H: int, group: int, K: int, V: int,
                 dtype: torch.dtype, seed: int = 0) -> None:
    """Composed forward + deterministic backward (initial state, final-state
    gradient, in-kernel L2 norm) on the flat token axis, CPU tensors."""
    from gdn_core.chunking import ChunkIndex
    from gdn_core.ops.backward import chunk_gdn_backward
    from gdn_core.ops.forward import gdn_forward_triton

    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    T, HV, N = offs[-1], H * group, len(lengths)
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(T, HV, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(T, HV, generator=gen) + 2) * 0.5
    beta = torch.rand(T, HV, generator=gen)
    do = torch.randn(T, HV, V, generator=gen)
    h0, dht = (torch.randn(N, HV, K, V, generator=gen) for _ in range(2))
    q, k, v, beta, do = (x.to(dtype) for x in (q, k, v, beta, do))
    index = ChunkIndex.build(offs, "cpu")
    fwd = gdn_forward_triton(q, k, v, g, beta, scale=K**-0.5, index=index, initial_state=h0,
                             output_final_state=True, use_qk_l2norm_in_kernel=True)
    chunk_gdn_backward(fwd.q_used, fwd.k_used, v, g, beta, fwd.G, scale=K**-0.5, index=index,
                       initial_state=h0, do=do, dht=dht, deterministic=True,
                       q_rstd=fwd.q_rstd, k_rstd=fwd.k_rstd)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    bad = 0
    for spec in argv:
        lengths, H, group, K, V, dt = spec.split(":")
        with checking() as violations:
            run_gdn_case([int(x) for x in lengths.split(",")], int(H), int(group), int(K),
                         int(V), getattr(torch, dt))
        print(f"{spec}: " + ("no out-of-bounds access" if not violations else
                             "; ".join(f"{k}: {v}" for k, v in violations.items())))
        bad += bool(violations)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
