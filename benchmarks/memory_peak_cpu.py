"""Peak live tensor memory of one forward+backward, measured on CPU (no GPU needed).

Every tensor an aten op creates is tracked through a ``TorchDispatchMode``
(``gdn_core.testkit.LiveBytes``) until it is freed; the peak of the live bytes,
in units of one ``[T, HV, D]`` 16-bit tensor, shows which buffers a change added
or removed before the H200 measures the real ``torch.cuda.max_memory_allocated``
(``bench_gdn_train.py``). The kernels run under Triton's interpreter.

    python benchmarks/memory_peak_cpu.py --package gdn_train --segment-size 0
    python benchmarks/memory_peak_cpu.py --package gdn_det_train --training-loop

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
    p.add_argument("--training-loop", action="store_true",
                   help="two steps of the autograd call, the first step's output kept alive "
                        "through the second (as a loop's previous loss is): each step's peak")
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
    unit = T * HV * D * 2
    if args.training_loop:
        _training_loop(pkg, det, (q, k, v, g, beta), do, kw, unit, LiveBytesAtPeak)
        return
    with LiveBytesAtPeak() as live:
        o, _, saved = fwd(q, k, v, g, beta, **kw)  # o stays alive, as in training
        fwd_peak = live.peak
        grads = bwd(saved, do)
        del o, grads
    shown = {k: v for k, v in kw.items() if k != "cu_seqlens"}
    print(f"{args.package} T{T} H{H} HV{HV} D{D} docs{args.docs} {shown or '(default path)'}: "
          f"peak live memory forward {fwd_peak / unit:.2f}, forward+backward "
          f"{live.peak / unit:.2f} (units of one [T, HV, D] 16-bit tensor)")
    for n, name in sorted(live.at_peak, reverse=True)[:args.at_peak]:
        print(f"  {n / unit:6.2f}  {name}")


def _training_loop(pkg, det: bool, inputs: tuple, do, kw: dict, unit: int, tracker) -> None:
    """Two steps of ``o = call(...); o.backward(do)`` with step 1's ``o`` alive in step 2
    (a loop's ``loss`` is reassigned only after the next forward): the peak of each step
    above what was live at its start, and what was live when step 2 began (step 1's
    ``o`` and whatever its graph still held)."""
    call = pkg.chunk_gated_delta_rule_det if det else pkg.chunk_gated_delta_rule
    leaves = [x.detach().requires_grad_() for x in inputs]
    with tracker() as live:
        peaks, held = [], 0
        for _ in range(2):
            for x in leaves:
                x.grad = None
            start = live.peak = held = live.current
            o, _ = call(*leaves, **kw)
            o.backward(do)
            peaks.append(live.peak - start)
            kept = o  # noqa: F841 - held through the next step, as a loop's loss is
    print(f"training loop ({call.__name__}, {kw.get('segment_size', 'default')} segments): "
          f"step peaks {peaks[0] / unit:.2f} and {peaks[1] / unit:.2f} above their start; live "
          f"at step 2's start {held / unit:.2f}; step 2's peak in all "
          f"{(held + peaks[1]) / unit:.2f} (units of one [T, HV, D] 16-bit tensor)")


if __name__ == "__main__":
    main()
