"""The short causal conv1d of a GDN layer alone, forward and forward+backward.

    python benchmarks/bench_conv.py --compare fla

Arms: ``ours`` (``gdn_core.conv1d.causal_conv1d``: the Triton kernels of
``gdn_core.ops.conv1d`` / ``conv1d_bwd`` on CUDA, deterministic), ``torch``
(the same call with ``GDN_CORE_BACKEND=reference``: the plain-torch fp32 path
it replaced) and, with ``--compare fla``, fla's
``fla.modules.convolution.causal_conv1d`` (Triton backend; it autotunes at its
first call, which this script does before timing). Default problem: the q/k/v
conv of a Qwen3-Next-sized layer at B1 T32768, ``D = 4096`` channels, width 4,
SiLU, no bias, bf16; ``--docs N`` packs N equal documents (``cu_seqlens``).

Before timing, every arm's ``y``, ``dx`` and ``dweight`` are compared with the
torch path run in fp32 on the same (low-precision) inputs: relative max error.
Timing: ``triton.testing.do_bench`` median (``x``/``weight`` gradients reset
each call); GB/s counts the unavoidable traffic (forward: read ``x``, write
``y``; backward adds read ``dy``, write ``dx``). ``--device cpu`` is a smoke
run (our arm under the interpreter when ``TRITON_INTERPRET=1``, wall clock).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("gdn_core") is None:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "packages" / "gdn-core" / "src"))


@contextlib.contextmanager
def backend(name: str | None):
    before = os.environ.get("GDN_CORE_BACKEND")
    if name is None:
        os.environ.pop("GDN_CORE_BACKEND", None)
    else:
        os.environ["GDN_CORE_BACKEND"] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("GDN_CORE_BACKEND", None)
        else:
            os.environ["GDN_CORE_BACKEND"] = before


def make_arm(name: str, cu, device):
    """``(fn(x, w) -> y`` differentiable, the ``GDN_CORE_BACKEND`` its forward and
    backward run under)."""
    from gdn_core.conv1d import causal_conv1d

    offsets = None if cu is None else cu.tolist()

    def ours(x, w):
        return causal_conv1d(x, w, None, "silu", offsets, deterministic=True)

    if name == "ours":
        return ours, (None if device.type == "cuda" else "triton")
    if name == "torch":
        return ours, "reference"
    if name == "fla":
        fla_conv = importlib.import_module("fla.modules.convolution").causal_conv1d

        def fla(x, w):
            out = fla_conv(x=x, weight=w, bias=None, activation="silu", cu_seqlens=cu)
            return out[0] if isinstance(out, tuple) else out
        return fla, None
    raise SystemExit(f"unknown arm {name!r}")


def grads(arm, x, w, dy):
    fn, mode = arm
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    with backend(mode):
        y = fn(x, w)
        y.backward(dy)
    return y.detach().float(), x.grad.float(), w.grad.float()


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compare", choices=("fla",), help="also time fla's causal_conv1d")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--D", type=int, default=4096)
    p.add_argument("--W", type=int, default=4)
    p.add_argument("--docs", type=int, default=1)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument("--no-check", action="store_true")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU (use --device cpu for a smoke run)")
    dtype = getattr(torch, args.dtype)
    B, T, D, W = args.B, args.T, args.D, args.W
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(B, T, D, device=device, dtype=dtype, generator=gen)
    dy = torch.randn(B, T, D, device=device, dtype=dtype, generator=gen)
    w = (torch.randn(D, W, device=device, generator=gen) / W ** 0.5).to(dtype)
    cu = None
    if args.docs > 1:
        if B != 1:
            raise SystemExit("packed documents need --B 1")
        cu = torch.linspace(0, T, args.docs + 1, device=device).round().to(torch.int32)
    arms = ["ours", "torch"] + (["fla"] if args.compare else [])
    import triton

    print(f"# causal conv1d B{B} T{T} D{D} W{W} docs {args.docs} {args.dtype} SiLU, no bias")
    print(f"- torch {torch.__version__}, triton {triton.__version__}"
          + (f", {torch.cuda.get_device_name()}" if device.type == "cuda" else ""))
    fns = {a: make_arm(a, cu, device) for a in arms}
    if not args.no_check:
        want = grads(fns["torch"], x.float(), w.float(), dy.float())
        print("\nrelative max error against the torch path in fp32:\n\n"
              "| arm | y | dx | dweight |\n|---|---|---|---|")
        ours = None
        for a in arms:
            got = grads(fns[a], x, w, dy)
            ours = got if a == "ours" else ours
            print(f"| {a} | " + " | ".join(f"{rel(g, r):.2e}" for g, r in zip(got, want)) + " |")
        again = grads(fns["ours"], x, w, dy)
        same = all(torch.equal(a, b) for a, b in zip(ours, again))
        print(f"\nours bitwise repeatable (y, dx, dweight): {same}")
        del ours, again, want, got
    gb_f = 2 * B * T * D * x.element_size() / 1e9
    gb_b = 4 * B * T * D * x.element_size() / 1e9
    print("\n| arm | fwd ms | fwd GB/s | fwd+bwd ms | fwd+bwd GB/s |\n|---|---|---|---|---|")
    xg = x.detach().clone().requires_grad_(True)
    wg = w.detach().clone().requires_grad_(True)
    for a in arms:
        fn, mode = fns[a]

        def fwd(fn=fn, mode=mode):
            with torch.no_grad(), backend(mode):
                fn(xg, wg)

        def fwd_bwd(fn=fn, mode=mode):
            with backend(mode):
                fn(xg, wg).backward(dy)

        if device.type == "cuda":
            from triton.testing import do_bench

            fwd_bwd()  # compile / autotune first
            t_f = do_bench(fwd, warmup=args.warmup, rep=args.rep, return_mode="median")
            t_fb = do_bench(fwd_bwd, warmup=args.warmup, rep=args.rep, grad_to_none=[xg, wg],
                            return_mode="median")
        else:
            fwd_bwd()
            t0 = time.perf_counter()
            fwd()
            t_f = (time.perf_counter() - t0) * 1e3
            t0 = time.perf_counter()
            fwd_bwd()
            t_fb = (time.perf_counter() - t0) * 1e3
        print(f"| {a} | {t_f:.3f} | {gb_f / t_f * 1e3:.0f} | {t_fb:.3f} | "
              f"{(gb_f + gb_b) / t_fb * 1e3:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
