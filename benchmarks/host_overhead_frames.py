"""Host path depth and Python-call count of the public GDN calls (CPU, Triton interpreter).

Two numbers per public entry point, both restricted to project code (files
under ``packages/``):

* **frames to the first kernel launch** — the project frames on the stack,
  from the public function (inclusive) down to the frame that launches the
  first Triton kernel (``kernel[grid](...)``), forward and backward. For the
  autograd call's backward the outermost project frame is the one autograd
  enters (the registered backward).
* **Python calls per forward+backward** — ``sys.setprofile`` ``call`` events
  whose code lives under ``packages/``, kernel bodies excluded (the
  interpreter executes ``@triton.jit`` functions as Python; those calls are
  the kernels, not host work). Also the number of kernel launches.

One document, ``B=1 T=128 H=HV=1 K=V=16`` fp32 by default (the figures of
issue 18). The kernels really run (interpreted), so the path taken is the real
one.

    python benchmarks/host_overhead_frames.py [--T 128] [--docs 1] [--segment-size S]
        [--by-function N] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
os.environ.pop("GDN_CORE_BACKEND", None)

import torch  # noqa: E402
import triton.runtime.interpreter as interp  # noqa: E402

PACKAGES = str(Path(__file__).resolve().parents[1] / "packages") + os.sep


def _project(code) -> bool:
    return code.co_filename.startswith(PACKAGES)


class Probe:
    """Counts project calls and launches; records the stack depth at the first launch."""

    def __init__(self) -> None:
        self.calls = 0
        self.launches = 0
        self.first_stack: list[str] | None = None
        self._in_kernel = 0
        self._real_run = interp.InterpretedFunction.run
        probe = self

        def run(self_, *args, **kwargs):
            probe.launches += 1
            if probe.first_stack is None:
                probe.first_stack = probe._stack()
            probe._in_kernel += 1
            try:
                return probe._real_run(self_, *args, **kwargs)
            finally:
                probe._in_kernel -= 1

        interp.InterpretedFunction.run = run

    @staticmethod
    def _stack() -> list[str]:
        f = sys._getframe(2)  # the frame that wrote kernel[grid](...)
        out = []
        while f is not None:
            if _project(f.f_code):
                rel = f.f_code.co_filename[len(PACKAGES):]
                out.append(f"{rel.split('/src/')[-1]}:{f.f_code.co_name}")
            f = f.f_back
        return out[::-1]

    def _profile(self, frame, event, arg):
        if event == "call" and not self._in_kernel and _project(frame.f_code):
            self.calls += 1
            code = frame.f_code
            self.by_function[f"{code.co_filename.split('/src/')[-1]}:{code.co_name}"] += 1

    def __enter__(self):
        self.calls = self.launches = 0
        self.first_stack = None
        self.by_function = collections.Counter()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


def _inputs(T: int, docs: int, H: int = 1, D: int = 16, grad: bool = False):
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, T, H, D, generator=gen) for _ in range(4))
    g = -torch.rand(1, T, H, generator=gen)
    beta = torch.rand(1, T, H, generator=gen)
    ins = [q, k, v, g, beta]
    if grad:
        ins = [x.requires_grad_(True) for x in ins]
    cu = torch.linspace(0, T, docs + 1).long().tolist() if docs > 1 else None
    return ins, do, cu


def _trim(stack: list[str], public: str) -> list[str]:
    """The stack from the public function's frame on (all of it for a backward)."""
    for i, s in enumerate(stack):
        if s.endswith(":" + public):
            return stack[i:]
    return stack


def measure(pkg_name: str, T: int, docs: int, segment_size: int | None = None) -> dict:
    import importlib

    pkg = importlib.import_module(pkg_name)
    det = pkg_name.endswith("det_train")
    sfx = "_det" if det else ""
    auto = getattr(pkg, f"chunk_gated_delta_rule{sfx}")
    fwd = getattr(pkg, f"chunk_gdn{sfx}_fwd")
    bwd = getattr(pkg, f"chunk_gdn{sfx}_bwd")
    probe = Probe()
    out: dict = {"package": pkg_name, "T": T, "docs": docs}
    kw = {} if segment_size is None else {"segment_size": segment_size}

    def autograd_call():
        ins, do, cu = _inputs(T, docs, grad=True)
        o, _ = auto(*ins, cu_seqlens=cu, **kw)
        return o, do

    for _ in range(2):  # warm: caches, lazy imports, the interpreter's first-call setup
        o, do = autograd_call()
        o.backward(do)
    ins, do, cu = _inputs(T, docs, grad=True)
    with probe:
        o, _ = auto(*ins, cu_seqlens=cu, **kw)
    out["autograd_fwd"] = {"calls": probe.calls, "launches": probe.launches,
                           "stack": _trim(probe.first_stack, auto.__name__)}
    fwd_counts = probe.by_function
    with probe:
        o.backward(do)
    out["autograd_bwd"] = {"calls": probe.calls, "launches": probe.launches,
                           "stack": probe.first_stack}
    out["autograd_by_function"] = dict((fwd_counts + probe.by_function).most_common())

    ins, do, cu = _inputs(T, docs)
    for _ in range(2):
        _, _, saved = fwd(*ins, cu_seqlens=cu, **kw)
        bwd(saved, do)
    with probe:
        _, _, saved = fwd(*ins, cu_seqlens=cu, **kw)
    out["split_fwd"] = {"calls": probe.calls, "launches": probe.launches,
                        "stack": _trim(probe.first_stack, fwd.__name__)}
    with probe:
        bwd(saved, do)
    out["split_bwd"] = {"calls": probe.calls, "launches": probe.launches,
                        "stack": _trim(probe.first_stack, bwd.__name__)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, default=128)
    p.add_argument("--docs", type=int, default=1)
    p.add_argument("--packages", default="gdn_det_train,gdn_train")
    p.add_argument("--segment-size", type=int, default=None,
                   help="passed to every call (default: the packages' own, 4096)")
    p.add_argument("--by-function", type=int, default=0, metavar="N",
                   help="also list the N project functions called most in the autograd "
                        "forward+backward")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    torch.set_num_threads(1)
    results = []
    for name in args.packages.split(","):
        r = measure(name, args.T, args.docs, args.segment_size)
        results.append(r)
        print(f"{name}  T={args.T} docs={args.docs}")
        for key in ("autograd", "split"):
            f, b = r[f"{key}_fwd"], r[f"{key}_bwd"]
            print(f"  {key:8s} fwd+bwd: {f['calls'] + b['calls']:4d} project calls "
                  f"({f['calls']} + {b['calls']}), {f['launches'] + b['launches']} launches; "
                  f"frames to first launch: fwd {len(f['stack'])}, bwd {len(b['stack'])}")
            print(f"      fwd: {' > '.join(f['stack'])}")
            print(f"      bwd: {' > '.join(b['stack'])}")
        for fn, n in list(r["autograd_by_function"].items())[:args.by_function]:
            print(f"    {n:4d}  {fn}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
