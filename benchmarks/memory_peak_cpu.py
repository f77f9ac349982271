"""Peak live tensor memory of one forward+backward, measured on CPU (no GPU needed).

Every tensor an aten op creates is tracked through a ``TorchDispatchMode``
(``gdn_core.testkit.LiveBytes``) until it is freed; the peak of the live bytes,
in units of one ``[T, HV, D]`` 16-bit tensor, shows which buffers a change added
or removed before the H200 measures the real ``torch.cuda.max_memory_allocated``
(``bench_gdn_train.py``). The kernels run under Triton's interpreter.

    python benchmarks/memory_peak_cpu.py --package gdn_train --segment-size 0

The chunk-gradient stage runs the Triton pair here, which writes no result over its
inputs; ``--as-gluon-grads`` counts as where the one-tile Gluon kernel runs (CUDA):
with its aliases (``GDN_CORE_BWD_ALIAS``), the count only, the gradients then being wrong.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402


def _caller() -> str:
    """``file:line`` of the innermost package frame (not the tracker) that allocated."""
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename.replace("\\", "/")
        if "/src/gd" in name and "testkit" not in name:
            return f"{name.rsplit('/src/', 1)[1]}:{frame.lineno}"
    return "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--package", default="gdn_train", choices=["gdn_train", "gdn_det_train"])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--value-heads", type=int, default=None, help="HV (default: --heads)")
    p.add_argument("--docs", type=int, default=1, help="documents packed into the tokens")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--segment-size", type=int, default=None)
    p.add_argument("--at-peak", type=int, default=0, metavar="N",
                   help="also list the N largest tensors live at the forward+backward peak")
    p.add_argument("--as-gluon-grads", action="store_true",
                   help="count the aliases of the Gluon chunk-gradient kernel (wrong grads)")
    args = p.parse_args()
    if args.as_gluon_grads:
        import gdn_core.ops.backward as backward

        backward.grads_kernel = lambda grads: "gluon"
    from gdn_core.testkit import LiveBytes

    class LiveBytesAtPeak(LiveBytes):
        """LiveBytes that also names the tensors live at the peak (op and shape)."""

        def __init__(self) -> None:
            super().__init__()
            self.names: dict[int, str] = {}
            self.at_peak: list[tuple[int, str]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before, was_live = self.peak, set(self.live)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor):
                    key = o.untyped_storage().data_ptr()
                    if key in self.live and key not in was_live:  # newly tracked
                        self.names[key] = f"{list(o.shape)} {o.dtype} at {_caller()}"
            if self.peak > before:
                self.at_peak = [(n, self.names.get(k, "?")) for k, n in self.live.items()]
            return out

    pkg = __import__(args.package)
    det = args.package == "gdn_det_train"
    fwd = pkg.chunk_gdn_det_fwd if det else pkg.chunk_gdn_fwd
    bwd = pkg.chunk_gdn_det_bwd if det else pkg.chunk_gdn_bwd
    T, H, D = args.tokens, args.heads, args.dim
    HV = args.value_heads or H
    inp = common.make_gdn_inputs(common.GDNShape(B=1, T=T, H=H, HV=HV, K=D, V=D, D=args.docs),
                                 dtype=torch.float16,  # the interpreter's dots: fp16, not bf16
                                 requires_grad=False)
    q, k, v, g, beta = inp.leaves
    do = inp.do
    kw = {} if args.segment_size is None else {"segment_size": args.segment_size}
    if inp.cu_seqlens is not None:
        kw["cu_seqlens"] = inp.cu_seqlens
    with LiveBytesAtPeak() as live:
        o, _, saved = fwd(q, k, v, g, beta, **kw)  # o stays alive, as in training
        fwd_peak = live.peak
        grads = bwd(saved, do)
        del o, grads
    unit = T * HV * D * 2
    shown = {k: v for k, v in kw.items() if k != "cu_seqlens"}
    print(f"{args.package} T{T} H{H} HV{HV} D{D} docs{args.docs} {shown or '(default path)'}: "
          f"peak live memory forward {fwd_peak / unit:.2f}, forward+backward "
          f"{live.peak / unit:.2f} (units of one [T, HV, D] 16-bit tensor)")
    for n, name in sorted(live.at_peak, reverse=True)[:args.at_peak]:
        print(f"  {n / unit:6.2f}  {name}")


if __name__ == "__main__":
    main()
