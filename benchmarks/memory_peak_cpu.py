"""Peak live tensor memory of one forward+backward, measured on CPU (no GPU needed).

Every tensor an aten op creates is tracked through a ``TorchDispatchMode``
(``gdn_core.testkit.LiveBytes``) until it is freed; the peak of the live bytes,
in units of one ``[T, HV, D]`` 16-bit tensor, shows which buffers a change added
or removed before the H200 measures the real ``torch.cuda.max_memory_allocated``
(``bench_gdn_train.py``). The kernels run under Triton's interpreter.

    python benchmarks/memory_peak_cpu.py --package gdn_train --segment-size 0
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--package", default="gdn_train", choices=["gdn_train", "gdn_det_train"])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--segment-size", type=int, default=None)
    args = p.parse_args()
    from gdn_core.testkit import LiveBytes

    pkg = __import__(args.package)
    det = args.package == "gdn_det_train"
    fwd = pkg.chunk_gdn_det_fwd if det else pkg.chunk_gdn_fwd
    bwd = pkg.chunk_gdn_det_bwd if det else pkg.chunk_gdn_bwd
    T, H, D = args.tokens, args.heads, args.dim
    inp = common.make_gdn_inputs(common.GDNShape(B=1, T=T, H=H, K=D, V=D),
                                 dtype=torch.float16,  # the interpreter's dots: fp16, not bf16
                                 requires_grad=False)
    q, k, v, g, beta = inp.leaves
    do = inp.do
    kw = {} if args.segment_size is None else {"segment_size": args.segment_size}
    with LiveBytes() as live:
        o, _, saved = fwd(q, k, v, g, beta, **kw)  # o stays alive, as in training
        fwd_peak = live.peak
        grads = bwd(saved, do)
        del o, grads
    unit = T * H * D * 2
    print(f"{args.package} T{T} H{H} D{D} {kw or '(default path)'}: peak live memory "
          f"forward {fwd_peak / unit:.2f}, forward+backward {live.peak / unit:.2f} "
          f"(units of one [T, HV, D] 16-bit tensor)")


if __name__ == "__main__":
    main()
