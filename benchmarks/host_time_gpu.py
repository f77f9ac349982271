"""Host time of one forward+backward on a CUDA machine, ours against fla (GPU only).

For each arm, in its own process (fla's with ``flash_qla`` blocked from import, so
that fla runs its own Triton kernels), on bf16 inputs at a small shape where the
GPU work is a fraction of the host's:

* ``host ms``: wall time of ``--iters`` back-to-back forward+backward calls
  *without* synchronising, divided by ``--iters`` — what the host spends to
  enqueue one step (the GPU never makes the host wait at these shapes: its time
  is printed beside it, ``gpu ms``, from CUDA events over a synchronised loop);
* ``syncs``: whether anything in the call synchronises the host with the GPU
  (``torch.cuda.set_sync_debug_mode("error")`` over one call: a device-to-host
  copy or a stream synchronisation raises);
* ``launches``: Triton kernel launches per step (our registry; fla: not counted);
* ``graph host ms``: for our arms, the host time of replaying the same step
  captured once in a CUDA graph (``torch.cuda.CUDAGraph``; needs a
  :class:`gdn_core.layout.VarlenLayout` so that nothing is read on the host).

It also times one empty Triton launch (``per-launch us``): the floor that
``launches × per-launch`` puts under any eager Triton implementation.

    python benchmarks/host_time_gpu.py [--shape 1,1024,16] [--iters 200]
"""

from __future__ import annotations

import argparse
import importlib.abc
import json
import subprocess
import sys
import time

import torch

ARMS = ("det", "nondet", "fla")


class _Block(importlib.abc.MetaPathFinder):
    """Refuses ``flash_qla`` (fla dispatches to it whenever it imports)."""

    def find_spec(self, name, path=None, target=None):  # noqa: D102
        if name == "flash_qla" or name.startswith("flash_qla."):
            raise ImportError(f"{name} blocked: this arm times fla's own kernels")
        return None


def _inputs(B: int, T: int, H: int, D: int = 128):
    gen = torch.Generator(device="cuda").manual_seed(0)
    def rnd(*s):
        return torch.randn(*s, device="cuda", generator=gen)
    q = torch.nn.functional.normalize(rnd(B, T, H, D), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(rnd(B, T, H, D), dim=-1).bfloat16()
    v = rnd(B, T, H, D).bfloat16()
    g = torch.nn.functional.logsigmoid(rnd(B, T, H)) / 16
    beta = torch.sigmoid(rnd(B, T, H)).bfloat16()
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
    return leaves, rnd(B, T, H, D).bfloat16()


def _kernel(arm: str):
    if arm == "det":
        from gdn_det_train import chunk_gated_delta_rule_det as fn
        return fn
    if arm == "nondet":
        from gdn_train import chunk_gated_delta_rule as fn
        return fn
    sys.meta_path.insert(0, _Block())
    import fla.ops.common.chunk_o as chunk_o
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn

    chunk_o.TRITON_ABOVE_3_7_1 = True  # Triton 3.6 on Hopper: see the benchmarks README
    return fn


def _empty_launch_us(n: int = 2000) -> float:
    import triton
    import triton.language as tl

    @triton.jit
    def _touch(x):
        tl.store(x, 1.0)

    x = torch.empty(1, device="cuda")
    _touch[(1,)](x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        _touch[(1,)](x)
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def measure(arm: str, B: int, T: int, H: int, iters: int) -> dict:
    """One arm's figures (run in a process of its own)."""
    fn = _kernel(arm)
    leaves, do = _inputs(B, T, H)
    extra = {} if arm == "fla" else {"cu_seqlens": None}

    def step(*xs, **kw):
        o, _ = fn(*xs, **{**extra, **kw})
        torch.autograd.backward(o, do)
        return o

    for _ in range(5):
        step(*leaves)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step(*leaves)
    host_ms = (time.perf_counter() - t0) / iters * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step(*leaves)
    end.record()
    torch.cuda.synchronize()
    out = {"arm": arm, "host_ms": host_ms, "gpu_ms": start.elapsed_time(end) / iters}
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(*leaves)
        out["syncs"] = "none"
    except RuntimeError as exc:
        out["syncs"] = str(exc).splitlines()[0][:160]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    if arm == "fla":
        out["flash_qla_imported"] = "flash_qla" in sys.modules
        return out
    from gdn_core.layout import VarlenLayout
    from gdn_core.ops.registry import record_launches

    with record_launches() as launches:
        step(*leaves)
    out["launches"] = len(launches)
    # the same step (one document of B*T tokens as a packed layout) captured in a CUDA graph
    flat = [x.detach().reshape(1, B * T, *x.shape[2:]).clone().requires_grad_() for x in leaves]
    do_flat = do.reshape(1, B * T, *do.shape[2:])
    layout = VarlenLayout([b * T for b in range(B + 1)], device="cuda", max_docs=max(B, 1))

    def graph_step():
        o, _ = fn(*flat, cu_seqlens=layout)
        torch.autograd.backward(o, do_flat)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            graph_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_step()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    out["graph_host_ms"] = (time.perf_counter() - t0) / iters * 1e3
    torch.cuda.synchronize()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1,1024,16", help="B,T,H (K = V = 128)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    B, T, H = (int(x) for x in args.shape.split(","))
    if args.one:
        print(json.dumps(measure(args.one, B, T, H, args.iters)))
        return
    rows = []
    for arm in args.arms.split(","):
        res = subprocess.run([sys.executable, __file__, "--shape", args.shape, "--iters",
                              str(args.iters), "--one", arm], capture_output=True, text=True)
        line = (res.stdout.strip().splitlines() or [""])[-1]
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            err = (res.stderr.strip().splitlines() or ["?"])[-1]
            rows.append({"arm": arm, "error": err[:200]})
    fla = next((r for r in rows if r["arm"] == "fla" and "host_ms" in r), None)
    print(f"B{B} T{T} H{H} bf16 K=V=128, {args.iters} back-to-back fwd+bwd calls; "
          f"one empty Triton launch: {_empty_launch_us():.1f} us")
    print("| arm | host ms | gpu ms | host / fla | syncs | launches | graph host ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['arm']} | failed: {r['error']} | | | | | |")
            continue
        ratio = f"{r['host_ms'] / fla['host_ms']:.2f}" if fla else "—"
        graph = f"{r['graph_host_ms']:.3f}" if "graph_host_ms" in r else "—"
        print(f"| {r['arm']} | {r['host_ms']:.3f} | {r['gpu_ms']:.3f} | {ratio} | {r['syncs']} | "
              f"{r.get('launches', '—')} | {graph} |")


if __name__ == "__main__":
    main()
