"""Timing probe: the Triton chunk-gradient pair, the one-tile Gluon kernel and the
persistent (next-tile-prefetching) Gluon kernel side by side (GPU only).

Times :func:`gdn_core.ops.chunk_grads_bwd.chunk_grads_bwd` (``_dq_dv_kernel`` +
``_dk_kernel``), :func:`gdn_core.ops.gluon.chunk_grads.chunk_grads_bwd_gluon` (one CTA per
(chunk, value head)) and
:func:`gdn_core.ops.gluon.chunk_grads_pipelined.chunk_grads_bwd_gluon_pipelined` (one CTA
per SM walking the tiles, loading the next while computing this one) on the inputs
``kernel_variants._problem`` builds (the benchmark's bf16 inputs through the forward and
the state backward), ``dq``/``dk`` rounded into bf16 as the backward runs them at one
value head per q/k head (``common.time_fn``: CUDA-event medians of 20 after 3 warm-ups;
``--flush-l2`` flushes L2 between iterations). Default problems: B1 T32768 H16 K=V=128
with 1 and 8 documents, and B1 T8192 with 1. Prints ms per call, the ratios, whether the
pipelined kernel's outputs are bitwise the one-tile kernel's, whether two pipelined calls
repeat, and the largest relative difference against the Triton pair. Needs Triton 3.6's
Gluon and an sm_90 GPU::

    python benchmarks/gluon_chunk_grads_pipelined_probe.py [--problems 32768x1,32768x8,8192x1] \
        [--flush-l2]

On a machine without one it prints why and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

NAMES = ("dq", "dk", "dv", "dbeta", "dg")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default="32768x1,32768x8,8192x1",
                        help="comma-separated TOKENSxDOCS")
    parser.add_argument("--flush-l2", action="store_true")
    args = parser.parse_args(argv)
    common.import_workspace_module("gdn_core")
    from gdn_core.ops.gluon import available

    if not available():
        print("gluon_chunk_grads_pipelined_probe: needs a CUDA sm_90 GPU and Triton 3.6's "
              f"Gluon (CUDA available: {torch.cuda.is_available()}); nothing timed")
        return 2
    import kernel_variants
    import triton
    from gdn_core.ops.chunk_grads_bwd import chunk_grads_bwd
    from gdn_core.ops.gluon.chunk_grads import chunk_grads_bwd_gluon
    from gdn_core.ops.gluon.chunk_grads_pipelined import chunk_grads_bwd_gluon_pipelined

    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()} "
          f"({torch.cuda.get_device_properties(0).multi_processor_count} SMs), B1 "
          f"H{kernel_variants.H} K=V={kernel_variants.D} bf16, flush_l2={args.flush_l2}")
    for spec in args.problems.split(","):
        tokens, docs = (int(x) for x in spec.split("x"))
        p = kernel_variants._problem(tokens, docs, "cuda")
        call = (p["q"], p["k"], p["v"], p["v_new"], p["h"], p["dh"], p["do"], p["dvp"], p["G"],
                p["beta"], p["A_inv"], p["scale"], p["index"], 1, p["g_dtype"])

        def run(fn, c=call):
            return fn(*c, dq=torch.empty_like(c[0]), dk=torch.empty_like(c[1]))

        def ms(fn):
            return common.time_fn(lambda: run(fn), device="cuda", warmup=3, iters=20,
                                  flush_l2=args.flush_l2).median

        tri, one, pip = (run(f) for f in (chunk_grads_bwd, chunk_grads_bwd_gluon,
                                          chunk_grads_bwd_gluon_pipelined))
        bitwise = all(torch.equal(a, b) for a, b in zip(pip, one))
        again = all(torch.equal(a, b) for a, b in zip(pip, run(chunk_grads_bwd_gluon_pipelined)))
        rel = " ".join(f"{n} {_rel(a, b):.2e}" for n, a, b in zip(NAMES, pip, tri))
        t_tr, t_one, t_pip = (ms(f) for f in (chunk_grads_bwd, chunk_grads_bwd_gluon,
                                              chunk_grads_bwd_gluon_pipelined))
        print(f"T{tokens} D{docs}: triton pair {t_tr:.4f} ms | gluon {t_one:.4f} ms | "
              f"pipelined {t_pip:.4f} ms | pipelined/gluon {t_pip / t_one:.3f} "
              f"pipelined/triton {t_pip / t_tr:.3f} | bitwise = gluon {bitwise} | "
              f"repeatable {again} | max rel diff vs triton {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
