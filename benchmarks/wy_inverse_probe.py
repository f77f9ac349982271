"""Timing and accuracy probe: the WY forward's two inverses (``GDN_CORE_WY_INV``), GPU only.

Times :func:`gdn_core.ops.wy.wy_fwd` with ``subst`` (the default: substitution through the
``A_inv`` buffer) and ``reg`` (the inverse in registers) on the benchmark's bf16 inputs
(``common.make_gdn_inputs``: L2-normalised keys, ``β = sigmoid(N(0, 1))``, Mamba-style
gates) at B1 T32768 H16 K=V=128, 1 and 8 packed documents, ``G`` from
:func:`chunk_cumsum_fwd`; ``triton.testing.do_bench`` medians (it clears L2 before each
call), as ``wy_fwd`` is called by default (the fp32 ``A_inv`` returned) and as the forward
calls it (``A_inv_for_backward=True``: the 16-bit copy only; also ``reg`` without its L2
prefetch of ``v``). Checks that two ``reg``
calls give the same bits and prints the largest relative error (``max |x − ref| / max
|ref|``) of ``A_inv``, ``W``, ``U`` against a float64 triangular solve of ``I + A`` on the
same (rounded) inputs (``reference.wy_ref``) for both, and of ``reg`` against ``subst``;
also for strong decay (``g`` × 40). One table; < 60 s with compilation::

    python benchmarks/wy_inverse_probe.py [--tokens 32768] [--docs 1,8]

Exit status 2 without CUDA, 1 if ``reg`` is not repeatable. ``--device cpu`` (a dry run of
the script under Triton's interpreter, fp16, no timing; small ``--tokens``) checks the
probe itself on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

H, D = 16, 128
MODES = ("subst", "reg")


def _problem(T: int, docs: int, decay: float, device: str, dtype: torch.dtype) -> dict:
    from gdn_core.chunking import ChunkIndex
    from gdn_core.ops.cumsum import chunk_cumsum_fwd

    inp = common.make_gdn_inputs(common.GDNShape(B=1, T=T, H=H, K=D, V=D, D=docs),
                                 dtype=dtype, device=device, requires_grad=False)
    _, k, v, g, beta = (x[0].contiguous() for x in inp.leaves)
    index = ChunkIndex.build(inp.offsets, device)
    G = chunk_cumsum_fwd(g.float() * decay, index)
    return dict(call=(k, v, beta, G, index, 1),
                bounds=list(zip(inp.offsets[:-1], inp.offsets[1:])))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _run(mode: str, call, **kw):
    from gdn_core.ops.wy import wy_fwd

    os.environ["GDN_CORE_WY_INV"] = mode
    return wy_fwd(*call, **kw)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--docs", default="1,8")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args(argv)
    dry = args.device == "cpu"
    if dry:  # before any kernel is defined
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("wy_inverse_probe: needs CUDA; nothing timed")
        return 2
    dtype = torch.float16 if dry else torch.bfloat16
    common.import_workspace_module("gdn_core")
    import triton
    from gdn_core import reference as R

    name = "interpreter (dry run)" if dry else torch.cuda.get_device_name()
    print(f"triton {triton.__version__}, {name}, B1 T{args.tokens} H{H} K=V={D} "
          f"{str(dtype)[6:]}; do_bench medians (L2 cleared); errors max|x-ref|/max|ref|")
    head = ("docs", "gates", "inverse", "ms", "ms fwd", "x subst", "repeat",
            "A vs f64", "W vs f64", "U vs f64", "A vs subst", "W vs subst", "U vs subst")
    rows = [head]
    ok = True
    for docs in (int(x) for x in args.docs.split(",")):
        for decay in (1.0, 40.0):
            p = _problem(args.tokens, docs, decay, args.device, dtype)
            call = p["call"]
            k, v, beta, G = call[:4]
            ref = R.wy_ref(k.double(), v.double(), beta.double(), G.double(), p["bounds"])
            out, ms = {}, {}
            for mode in MODES:
                out[mode] = _run(mode, call)
                if decay == 1.0 and not dry:
                    ms[mode] = (
                        triton.testing.do_bench(lambda m=mode, c=call: _run(m, c),
                                                return_mode="median"),
                        triton.testing.do_bench(
                            lambda m=mode, c=call: _run(m, c, A_inv_for_backward=True),
                            return_mode="median"))
            if decay == 1.0 and not dry:  # reg without its L2 prefetch of v (not launched)
                from gdn_core.ops import wy

                compiled = wy._compiled
                wy._compiled = lambda x: False
                try:
                    t_np = triton.testing.do_bench(lambda c=call: _run("reg", c,
                                                                       A_inv_for_backward=True),
                                                   return_mode="median")
                finally:
                    wy._compiled = compiled
                rows.append((str(docs), "g", "reg, no prefetch", "", f"{t_np:.4f}",
                             *[""] * (len(head) - 5)))
            for mode in MODES:
                again = _run(mode, call)
                same = all(torch.equal(a, b) for a, b in zip(out[mode], again))
                a16, W16, U16 = _run(mode, call, A_inv_for_backward=True)
                same = same and torch.equal(a16, out[mode][0].to(a16.dtype)) \
                    and torch.equal(W16, out[mode][1]) and torch.equal(U16, out[mode][2])
                ok = ok and same
                t, tf = ms.get(mode, (float("nan"), float("nan")))
                ratio = t / ms["subst"][0] if ms else float("nan")
                rows.append((str(docs), "g" if decay == 1.0 else "40g", mode, f"{t:.4f}",
                             f"{tf:.4f}", f"{ratio:.3f}", str(same),
                             *(f"{_rel(a, r):.2e}" for a, r in zip(out[mode], ref)),
                             *(f"{_rel(a, b):.2e}" for a, b in zip(out[mode], out["subst"]))))
            del ref, out
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print(" | ".join(c.rjust(w) for c, w in zip(r, widths)))
    os.environ.pop("GDN_CORE_WY_INV", None)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
