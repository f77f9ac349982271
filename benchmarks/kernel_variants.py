"""Launch-configuration variants of the state, chunk-gradient, output, WY and dv_local
kernels, timed (GPU only).

The per-kernel profile against fla (``results/2026-11-30-h200-s4-profile-vs-fla-D8.md``)
puts our state forward (0.32 vs 0.21 ms a call) and WY backward (0.71 vs 0.53 ms)
behind fla's. This script times each kernel's launcher under patched pinned
configurations — the module's ``*_config`` function replaced for the call, so the
launcher, masks and arguments are the production ones — against the pinned
configuration, on the benchmark's bf16 inputs (``common.make_gdn_inputs``) at B1
T32768 H16 K=V=128 with 1 and 8 documents (``common.time_fn``: CUDA-event medians of
20 after 3 warm-ups, no L2 flush), and reports each variant's largest difference
from the pinned result (Triton 3.6 gets some narrow blocks wrong on Hopper:
``gdn_core.ops.tiles``; a variant is only a candidate if it agrees).

    python benchmarks/kernel_variants.py [--kernels state_fwd,summary,output,wy,dv_local,...]

``summary`` is the forward's segment-summary launch (``[E | M]``, segments of 4096, only the
segments whose summary is read), which the det forward runs wherever a document spans
segments (0.34 ms of a step at B1 T32768 H16, one document: session 18's profile).

``--check`` runs every variant once, untimed, on a small problem: with
``TRITON_INTERPRET=1 ... --check --device cpu`` it checks the plumbing without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

H, D = 16, 128
SUMMARY_SEGMENT = 4096  # the det path's segment size (the summaries' layout)


@contextlib.contextmanager
def _patched(module, name: str, overrides: dict) -> Iterator[None]:
    """``module.<name>`` returns the pinned configuration updated with ``overrides``."""
    pinned = getattr(module, name)
    setattr(module, name, lambda *a, **kw: {**pinned(*a, **kw), **overrides})
    try:
        yield
    finally:
        setattr(module, name, pinned)


def _problem(T: int, docs: int, device: str) -> dict:
    """Inputs and the forward/backward intermediates each timed kernel reads."""
    from gdn_core.chunking import ChunkIndex
    from gdn_core.ops.chunk_state import chunk_state_fwd
    from gdn_core.ops.chunk_state_bwd import chunk_state_bwd
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.dv_local import dv_local_bwd
    from gdn_core.ops.wy import inverse_for_backward, wy_fwd

    half = torch.bfloat16 if device == "cuda" else torch.float16  # interpreter: no bf16 dots
    inp = common.make_gdn_inputs(common.GDNShape(B=1, T=T, H=H, K=D, V=D, D=docs),
                                 dtype=half, device=device, requires_grad=False)
    q, k, v, g, beta, do = (x[0].contiguous() for x in (*inp.leaves, inp.do))
    index = ChunkIndex.build(inp.offsets, device)
    G = chunk_cumsum_fwd(g, index)
    A_inv, W, U = wy_fwd(k, v, beta, G, index, 1)
    A_inv = inverse_for_backward(A_inv, k, v)
    h, v_new, _ = chunk_state_fwd(k, W, U, G, index, 1)
    scale = D**-0.5
    dvl = dv_local_bwd(q, k, G, do, scale, index, 1)
    dh, dvp, _ = chunk_state_bwd(q, k, W, G, do, dvl, None, scale, index, 1)
    return dict(q=q, k=k, v=v, beta=beta, G=G, W=W, U=U, A_inv=A_inv, do=do, dvl=dvl,
                dvp=dvp, index=index, scale=scale, g_dtype=g.dtype, docs=docs,
                h=h, v_new=v_new, dh=dh, offsets=inp.offsets, device=device)


def _kernels(p: dict) -> dict:
    """name -> (config module, config function name, call, variants)."""
    from gdn_core.ops import chunk_grads_bwd, chunk_state, chunk_state_bwd, dv_local, output, wy

    def state_fwd():
        return chunk_state.chunk_state_fwd(p["k"], p["W"], p["U"], p["G"], p["index"], 1)[0]

    def summary():  # the forward's segment summaries [E | M], as segment_fwd_begin runs them
        from gdn_core.segment import SegmentLayout

        layout = SegmentLayout.build(p["offsets"], SUMMARY_SEGMENT)
        tables = layout.tables(p["device"])
        return chunk_state.chunk_state_fwd(
            p["k"], p["W"], p["U"], p["G"], tables.index, 1, output_final_state=True,
            store_states=False, state_width=2 * D, identity_state=True, store_v_new=False,
            need=tables.fwd_need)[2]

    def state_bwd():
        return chunk_state_bwd.chunk_state_bwd(p["q"], p["k"], p["W"], p["G"], p["do"], p["dvl"],
                                               None, p["scale"], p["index"], 1)[0]

    def chunk_grads():  # direct bf16 dq/dk, as the backward runs it at one head per group
        dq = torch.empty_like(p["q"])
        return chunk_grads_bwd.chunk_grads_bwd(
            p["q"], p["k"], p["v"], p["v_new"], p["h"], p["dh"], p["do"], p["dvp"], p["G"],
            p["beta"], p["A_inv"], p["scale"], p["index"], 1, p["g_dtype"], dq=dq,
            dk=torch.empty_like(p["k"]))[1]

    def chunk_output():
        return output.chunk_output_fwd(p["q"], p["k"], p["v_new"], p["h"], p["G"], p["scale"],
                                       p["index"], 1)

    def wy_forward():
        return wy.wy_fwd(p["k"], p["v"], p["beta"], p["G"], p["index"], 1)[1]

    def dv_local_bwd():
        return dv_local.dv_local_bwd(p["q"], p["k"], p["G"], p["do"], p["scale"], p["index"], 1)

    grid = itertools.product
    return {
        "output": (output, "chunk_output_config", chunk_output,
                   [dict(BV=bv, num_warps=w, num_stages=s)
                    for bv, w, s in grid((64, 128), (4, 8), (1, 2, 3))
                    if (bv, w, s) != (64, 4, 2)]),
        "wy": (wy, "wy_config", wy_forward,
               [dict(num_warps=w, num_stages=s) for w, s in grid((4, 8), (1, 2))
                if (w, s) != (8, 1)]),
        "dv_local": (dv_local, "dv_local_config", dv_local_bwd,
                     [dict(num_warps=w, num_stages=s) for w, s in grid((4, 8), (1, 2, 3))
                      if (w, s) != (4, 1)]),
        "chunk_grads": (chunk_grads_bwd, "chunk_grads_config", chunk_grads,
                        [dict(num_warps=8, num_stages=2), dict(num_warps=4, num_stages=1),
                         dict(num_warps=4, maxnreg=168)]),
        "state_fwd": (chunk_state, "chunk_state_config", state_fwd,
                      [dict(BV=bv, num_warps=w, num_stages=s)  # 4/8 warps x 2/3 stages:
                       for bv, w, s in grid((32, 64), (2, 4), (3, 4))]),  # results/…-s5-…
        # the summaries' state is V + K = 256 wide: pinned BV 32, 4 warps, 3 stages (two CTAs
        # an SM); fewer stages fit three or four
        "summary": (chunk_state, "chunk_state_config", summary,
                    [dict(BV=bv, num_warps=w, num_stages=s)
                     for bv, w, s in grid((32, 64), (2, 4), (2, 3)) if (bv, w, s) != (32, 4, 3)]),
        "state_bwd": (chunk_state_bwd, "chunk_state_bwd_config", state_bwd,
                      # BV=64, 8 warps and 1 stage fault or are wrong (results/…-s5-…)
                      [dict(BV=32, num_warps=w, num_stages=s)
                       for w, s in grid((2, 4), (2, 3, 4)) if (w, s) != (4, 3)]),
    }


def _run_one(args, p: dict, name: str, index: int | None) -> None:
    """Time kernel ``name`` pinned (``index`` None) or under variant ``index``; print one line."""
    module, cfg_name, call, variants = _kernels(p)[name]

    def timed(fn) -> float:
        if args.check:
            return float("nan")
        return common.time_fn(fn, device="cuda", warmup=3, iters=20, flush_l2=False).median

    pinned_out = call().float()
    pinned_ms = timed(call)
    if index is None:
        print(f"\n{name}  B1 T{args.tokens} H{H} D{D} docs={p['docs']}  pinned "
              f"{getattr(module, cfg_name)(D, D)}: {pinned_ms:.3f} ms", flush=True)
        return
    over = variants[index]
    try:
        with _patched(module, cfg_name, over):
            out = call().float()
            ms = timed(call)
        if args.device == "cuda":
            torch.cuda.synchronize()
        diff = (out - pinned_out).abs().max().item()
        speed = "ran" if args.check else f"{ms:.3f} ms ({pinned_ms / ms:.2f}x)"
        print(f"  {over}: {speed}, max |diff| vs pinned {diff:.2e}", flush=True)
    except Exception as exc:  # noqa: BLE001 - a variant that fails is reported
        print(f"  {over}: FAILED {type(exc).__name__}: {str(exc)[:120]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", default="state_fwd,state_bwd,chunk_grads")
    parser.add_argument("--docs", default="1,8", help="document counts, comma separated")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--check", action="store_true", help="run each variant once, untimed")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "kernel:docs:index"
    args = parser.parse_args()
    if args.one is not None:  # a child: one measurement in its own CUDA context
        name, docs, index = args.one.split(":")
        p = _problem(args.tokens, int(docs), args.device)
        _run_one(args, p, name, None if index == "pinned" else int(index))
        return
    # Each measurement runs in its own process: a variant that faults (Triton 3.6
    # gets some configurations wrong on Hopper) poisons its CUDA context, and would
    # fail every later variant of the same process.
    counts = {name: len(v[3]) for name, v in _kernels(None).items()}
    base = [sys.executable, __file__, "--tokens", str(args.tokens), "--device", args.device]
    if args.check:
        base.append("--check")
    for docs in args.docs.split(","):
        for name in args.kernels.split(","):
            for index in ["pinned", *range(counts[name])]:
                res = subprocess.run([*base, "--one", f"{name}:{docs}:{index}"],
                                     capture_output=True, text=True)
                print(res.stdout, end="", flush=True)
                if res.returncode != 0:
                    last = (res.stderr.strip().splitlines() or ["?"])[-1]
                    print(f"  variant {index}: process exit {res.returncode}: {last[:160]}",
                          flush=True)


if __name__ == "__main__":
    main()
