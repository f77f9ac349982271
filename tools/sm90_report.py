"""Registers, spills, shared memory and SASS size of a Triton kernel for sm_90,
compiled on a machine without a GPU.

Triton compiles for a target GPU without one present; ptxas and cuobjdump ship
with its wheel. Use the GPU machine's Triton for figures that match it::

    python -m pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36:packages/gdn-core/src python tools/sm90_report.py

prints the WY kernel (inverting and applying) at bf16, K=V=128 (the example);
``... tools/sm90_report.py conv`` the causal conv1d kernels (bf16, width 4, SiLU, the
three document sources, the pinned tiles; unit channel strides as the JIT sees
them); ``... tools/sm90_report.py bwd`` the two chunk-gradient kernels (bf16,
K=V=128, the pinned configuration, one value head per q/k head);
``... tools/sm90_report.py gluon`` the Gluon chunk-output kernel (needs Triton 3.6's
Gluon; bf16, K=V=128, group 1 and 2); ``... tools/sm90_report.py gluon_grads`` the Gluon
chunk-gradient kernel (bf16, K=V=128, group 1 with bf16 ``dq``/``dk`` and group 2 with
fp32 partials, 8 warps and 4); ``... tools/sm90_report.py gluon_grads2`` the persistent
(next-tile-prefetching) Gluon chunk-gradient kernel beside that one (the same shapes, 8
warps); ``... tools/sm90_report.py gluon_state_bwd`` the Gluon
reverse state recurrence (bf16, K=V=128, group 1 and 2, BV 128 / 8 warps and 64 / 4 warps)
next to the Triton ``_chunk_state_bwd_kernel`` (its pinned configuration);
``... tools/sm90_report.py gluon_wy`` the Gluon WY kernel (bf16, K=V=128, group 1 and 2,
4 warps and 8) next to the Triton ``_wy_kernel`` (inverting); ``... tools/sm90_report.py
gluon_fused_fwd`` the warp-specialised Gluon fused forward (bf16, group 1 and 2: registers
per partition, spills, shared bytes, barriers); ``... tools/sm90_report.py
gluon_state`` the Gluon chunk-state kernel beside the Triton one (bf16, K=V=128, BV
64/32/128); ``... tools/sm90_report.py gluon_dv_local`` the Gluon dv_local kernel beside
the Triton ``_dv_local_kernel`` (bf16, K=V=128, group 1 and 2); ``... tools/sm90_report.py
gluon_wy_apply`` the Gluon WY apply kernel (the backward's W, U from the bf16 inverse; group
1 and 2, 4 warps, 4 capped at 96 registers, and 8) next to the Triton ``_wy_kernel``
(non-inverting, bf16 ``A_inv``); ``... tools/sm90_report.py fused_fwd`` the fused forward
last phase (``_chunk_fwd_fused_kernel``, bf16, K=V=128, group 1 and 2, the pinned
configuration and variants) next to ``_chunk_state_fwd_kernel`` + ``_chunk_output_fwd_kernel``;
``... tools/sm90_report.py fused_state`` the warp-specialised fused state backward (dv_local
inside the reverse recurrence; bf16, K=V=128, group 1 and 2, ``store`` on and off) with the
``setmaxnreg`` of each partition, ``bar.sync`` and ``mbarrier`` counts of its PTX;
from Python,
``report(kernel, types, constexprs, num_warps=, num_stages=)`` does any Triton kernel and
``report_gluon(kernel, example_args, constexprs, num_warps=)`` any Gluon one.
``SM90_PTX_DIR=DIR`` also writes each reported kernel's PTX instructions there
(:func:`ptx_code`): a refactor that should keep the bits is checked without a GPU by running
the same mode on the old tree (``git worktree add``, its ``packages/*/src`` on
``PYTHONPATH``) and on the new one into two folders and ``diff -r``-ing them (session 18:
the chunk-gradient phases cut into helpers, both Gluon kernels identical).
Like the JIT on the GPU, pointer arguments are taken as 16-byte aligned and an
int argument written ``"i32:16"`` as a multiple of 16 (the JIT specialises
both; without it loads are not vectorised and the figures are far too high).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

__all__ = ["gluon_grads_args", "ptx_code", "report", "report_gluon", "setmaxnreg"]

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def report(fn, types: list[str], constexprs: dict, num_warps: int = 4, num_stages: int = 1,
           **options) -> dict:
    """Compile ``fn`` for sm_90a; print and return ``{"ptxas": str, "sass_instructions": int,
    "shared_bytes": int}``. ``types``: Triton types of the non-constexpr arguments in
    order (``"*bf16"``, ``"i32"``, ``"i32:16"``, ``"fp32"``)."""
    names = [n for n in fn.arg_names if n not in constexprs]
    if len(names) != len(types):
        raise ValueError(f"{fn.__name__} takes {len(names)} runtime arguments {names}, "
                         f"got {len(types)} types")
    attrs, signature = {}, {}
    for name, t in zip(names, types):
        if t.startswith("*") or t.endswith(":16"):
            attrs[(fn.arg_names.index(name),)] = [["tt.divisibility", 16]]
        signature[name] = t.split(":")[0]
    signature.update({n: "constexpr" for n in constexprs})
    kernel = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 128),
        options=dict(num_warps=num_warps, num_stages=num_stages, **options),
    )
    return _figures(kernel, f"{fn.__name__} warps={num_warps} stages={num_stages}")


def ptx_code(ptx: str) -> str:
    """The instructions of a PTX listing: no debug sections, ``.loc``/``.file`` lines,
    labels or comments. Two builds whose ``ptx_code`` is equal run the same instructions
    (a refactor of a kernel's source that keeps it equal keeps every output bit)."""
    lines = []
    for line in ptx.splitlines():
        if ".debug" in line or "DW_TAG" in line:
            break
        t = line.strip()
        if t.startswith((".loc", ".file", "//", ".section", "$L__")):
            continue
        lines.append(line)
    return "\n".join(lines) + "\n"


def _figures(kernel, label: str) -> dict:
    """ptxas registers/spills (of the PTX, re-assembled with the wheel's ptxas), SASS
    instruction count (of Triton's cubin) and shared memory of a compiled kernel. With
    ``SM90_PTX_DIR`` set, also writes the kernel's :func:`ptx_code` there, one file per
    report in call order (``NN-<kernel name>.ptx``): run a mode on two trees and ``diff -r``
    the folders to check that a refactor changed no instruction."""
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        run = subprocess.run([os.path.join(_BIN, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o",
                              os.path.join(d, "ptxas.cubin")], capture_output=True, text=True)
        info = " ".join(x.strip() for x in run.stderr.splitlines() if "Used" in x or "spill" in x)
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-sass", cubin],
                              capture_output=True, text=True).stdout
    out = {"ptxas": info or run.stderr.strip(),
           "sass_instructions": len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M)),
           "shared_bytes": kernel.metadata.shared, "ptx": kernel.asm["ptx"]}
    print(f"{label}: {out['ptxas']} | "
          f"SASS {out['sass_instructions']} | shared {out['shared_bytes']}")
    folder = os.environ.get("SM90_PTX_DIR")
    if folder:
        os.makedirs(folder, exist_ok=True)
        count = len([f for f in os.listdir(folder) if f.endswith(".ptx")])
        name = re.sub(r"[^A-Za-z0-9_]+", "_", label.split(" ")[0])
        with open(os.path.join(folder, f"{count:02d}-{name}.ptx"), "w") as f:
            f.write(ptx_code(out["ptx"]))
    return out



def report_gluon(fn, args: dict, constexprs: dict, num_warps: int = 4, **options) -> dict:
    """Compile the ``@gluon.jit`` kernel ``fn`` for sm_90a; print and return what
    :func:`report` does. ``args``: an example value of every runtime argument by name (CPU
    tensors, Gluon ``TensorDescriptor`` s over CPU tensors, ints, floats); each is
    specialised as the JIT does on the GPU (type, 16-divisibility of pointers and ints)."""
    from triton.backends.compiler import BaseBackend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import native_specialize_impl

    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default},
                  **constexprs}  # a constexpr left out takes its default, as at a launch
    attrs, signature = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        ty, spec = native_specialize_impl(BaseBackend, args[name], False, True, True)
        signature[name] = ty
        if spec == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(
        GluonASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 128),
        options=dict(num_warps=num_warps, **options),
    )
    return _figures(kernel, f"{fn.__name__} (gluon) warps={num_warps}")


def gluon_reports() -> None:
    """The Gluon chunk-output kernel (:mod:`gdn_core.ops.gluon.output`) as its launcher
    builds it: bf16, K = V = 128, chunks of 64, H = HV = 16 (group 1) and H = 8, HV = 16
    (group 2), 4 warps (the launcher's) and 8 (two warpgroups splitting the columns), TMA
    descriptors over ``[T, H·K]`` / ``[T, HV·V]`` / ``[NT·HV·K, V]``."""
    import torch
    from gdn_core.ops.gluon import output as go
    from gdn_core.ops.gluon.tma import descriptor

    T, NT, K = 1024, 16, 128
    for H, HV in ((16, 16), (8, 16)):
        q = torch.zeros(T, H * K, dtype=torch.bfloat16)
        v = torch.zeros(T, HV * K, dtype=torch.bfloat16)
        h = torch.zeros(NT * HV * K, K, dtype=torch.bfloat16)
        i32 = torch.zeros(NT, dtype=torch.int32)
        args = dict(q_desc=descriptor(q, [64, K]), k_desc=descriptor(q, [64, K]),
                    v_desc=descriptor(v, [64, K]), h_desc=descriptor(h, [K, K]),
                    G=torch.zeros(T, HV), o=v, chunk_start=i32, chunk_len=i32, scale=0.5, HV=HV)
        for warps in (go.GLUON_OUTPUT_WARPS, 8):  # the pinned one warpgroup; two (not launched)
            print(f"H={H} HV={HV}")
            report_gluon(go._chunk_output_fwd_gluon_kernel, args,
                         dict(K=K, V=K, BT=64), num_warps=warps)


def gluon_grads_args(H: int, HV: int) -> dict:
    """Example arguments of the Gluon chunk-gradient kernels as their launchers build them
    (CPU tensors, bf16, K = V = 128, chunks of 64, T = 1024: ``dq``/``dk`` bf16 with one
    value head per q/k head, fp32 partials otherwise)."""
    import torch
    from gdn_core.ops.gluon import chunk_grads as gc

    T, NT, K = 1024, 16, 128
    bf = torch.bfloat16
    q = torch.zeros(T, H, K, dtype=bf)
    v = torch.zeros(T, HV, K, dtype=bf)
    h = torch.zeros(NT, HV, K, K, dtype=bf)
    a = torch.zeros(T, HV, 64, dtype=bf)
    out = torch.zeros(T, HV, K, dtype=bf if H == HV else torch.float32)
    i32 = torch.zeros(NT, dtype=torch.int32)
    return dict(gc._descriptors(q, q, v, v, h, h, v, v, a), G=torch.zeros(T, HV),
                beta=torch.zeros(T, HV, dtype=bf), dq=out, dk=out, dv=v,
                dbeta=torch.zeros(T, HV, dtype=bf), dg=torch.zeros(T, HV),
                chunk_start=i32, chunk_len=i32, scale=0.5, HV=HV, dq_acc=out, dk_acc=out,
                acc_chunk_stride=0, acc_head_stride=0)


def setmaxnreg(ptx: str) -> list[tuple[str, str]]:
    """The ``setmaxnreg`` instructions of a warp-specialised kernel's PTX, in order:
    ``("inc" | "dec", registers)``."""
    return re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)


def print_specialised(ptx: str) -> None:
    """One line of a warp-specialised kernel's PTX figures: its ``setmaxnreg`` list and its
    counts of ``bar.sync``, mbarrier operations and ``wgmma``."""
    print("  setmaxnreg:", setmaxnreg(ptx),
          "| bar.sync:", len(re.findall(r"\bbar\.sync\b|\bbarrier\.sync\b", ptx)),
          "| mbarrier ops:", len(re.findall(r"\bmbarrier\.", ptx)),
          "| wgmma:", len(re.findall(r"wgmma\.mma_async", ptx)))


def gluon_grads_reports() -> None:
    """The Gluon chunk-gradient kernel (:mod:`gdn_core.ops.gluon.chunk_grads`) as its launcher
    builds it: bf16, K = V = 128, chunks of 64, H = HV = 16 (group 1, ``dq``/``dk`` rounded
    into bf16) and H = 8, HV = 16 (group 2, fp32 partials); 8 warps (the launcher's: two
    warpgroups splitting the columns) and 4 (one warpgroup, for comparison)."""
    import torch
    from gdn_core.ops.gluon import chunk_grads as gc

    for H, HV in ((16, 16), (8, 16)):
        args = gluon_grads_args(H, HV)
        for warps in (gc.GLUON_CHUNK_GRADS_WARPS, 4):
            print(f"H={H} HV={HV} dq/dk {args['dq'].dtype}")
            report_gluon(gc._chunk_grads_bwd_gluon_kernel, args,
                         dict(GROUP=HV // H, K=128, V=128, BT=64), num_warps=warps)
    for H, HV in ((8, 16), (4, 16)):  # the group summed in the CTA: dq/dk [T, H, K] bf16
        args = gluon_grads_args(H, HV)
        T = args["dv"].shape[0]
        out = torch.zeros(T, H, 128, dtype=torch.bfloat16)
        acc = args["h_desc"].base.view(torch.float32)  # the spent h tiles, as the backward
        print(f"H={H} HV={HV} group summed in the CTA, dq/dk {out.dtype}")
        report_gluon(gc._chunk_grads_bwd_gluon_kernel,
                     dict(args, dq=out, dk=out, dq_acc=acc, dk_acc=acc,
                          acc_chunk_stride=HV * 64 * 128, acc_head_stride=HV // H * 64 * 128),
                     dict(GROUP=HV // H, K=128, V=128, BT=64, SUM_GROUP=True),
                     num_warps=gc.GLUON_CHUNK_GRADS_WARPS)


def gluon_grads2_reports() -> None:
    """The persistent Gluon chunk-gradient kernel
    (:mod:`gdn_core.ops.gluon.chunk_grads_pipelined`) beside the one-tile-a-CTA kernel it
    pipelines (:mod:`gdn_core.ops.gluon.chunk_grads`), as their launchers build them:
    bf16, K = V = 128, chunks of 64, H = HV = 16 (group 1, ``dq``/``dk`` rounded into bf16)
    and H = 8, HV = 16 (group 2, fp32 partials), 8 warps."""
    from gdn_core.ops.gluon import chunk_grads as gc
    from gdn_core.ops.gluon import chunk_grads_pipelined as gp

    NT = 16  # gluon_grads_args' chunks
    for H, HV in ((16, 16), (8, 16)):
        args = gluon_grads_args(H, HV)
        meta = dict(GROUP=HV // H, K=128, V=128, BT=64)
        print(f"H={H} HV={HV} dq/dk {args['dq'].dtype}")
        report_gluon(gc._chunk_grads_bwd_gluon_kernel, args, meta,
                     num_warps=gc.GLUON_CHUNK_GRADS_WARPS)
        piped = {k: v for k, v in args.items()
                 if k not in ("dq_acc", "dk_acc", "acc_chunk_stride", "acc_head_stride")}
        report_gluon(gp._chunk_grads_bwd_gluon_pipelined_kernel, dict(piped, n_tiles=NT * HV),
                     meta, num_warps=gp.GLUON_CHUNK_GRADS_PIPELINED_WARPS)


def gluon_state_reports() -> None:
    """The Gluon chunk-state kernel (:mod:`gdn_core.ops.gluon.chunk_state`) as its launcher
    builds it (bf16, K = V = 128, chunks of 64, h, v_new and the final state stored, an
    initial state read; H = HV = 16 and H = 8, HV = 16) at BV = 64 (the launcher's from 128
    programs on), 32 and 128, two ring slots (the launcher's) and three, beside the Triton
    ``_chunk_state_fwd_kernel`` at its pinned configuration for 128+ programs."""
    import torch
    from gdn_core.ops.chunk_state import _chunk_state_fwd_kernel, chunk_state_config
    from gdn_core.ops.gluon import chunk_state as gs

    T, NT, N, K = 1024, 16, 2, 128
    bf = torch.bfloat16
    for H, HV in ((16, 16), (8, 16)):
        k = torch.zeros(T, H, K, dtype=bf)
        wu = torch.zeros(T, HV, K, dtype=bf)
        h = torch.zeros(NT, HV, K, K, dtype=bf)
        st = torch.zeros(N, HV, K, K)
        i32 = torch.zeros(N + 1, dtype=torch.int32)
        for bv, stages in ((64, gs.GLUON_STATE_STAGES), (64, 3), (32, 2), (128, 2)):
            args = dict(gs._descriptors(k, wu, wu, h, wu, bv), G=torch.zeros(T, HV), h0=st,
                        v_new=wu, ht=st, doc_offsets=i32, doc_chunk_offsets=i32, HV=HV)
            print(f"H={H} HV={HV} BV={bv} STAGES={stages}")
            report_gluon(gs._chunk_state_fwd_gluon_kernel, args,
                         dict(K=K, V=K, BT=64, BV=bv, STAGES=stages,
                              USE_H0=True, STORE_H=True, STORE_VNEW=True, STORE_FINAL=True),
                         num_warps=4)
        cfg = chunk_state_config(K, K, 2, programs=128)
        print(f"H={H} HV={HV} Triton BV={cfg['BV']}")
        # k W U G h0 h v_new ht doc_offsets doc_chunk_offsets need doc_order q out scale H HV
        report(_chunk_state_fwd_kernel, ["*bf16", "*bf16", "*bf16", "*fp32", "*fp32", "*bf16",
                                         "*bf16", "*fp32", "*i32", "*i32", "*i32", "*i32",
                                         "*bf16", "*fp32", "fp32", "i32:16", "i32:16"],
               dict(K=K, V=K, VU=K, BT=64, BK=cfg["BK"], BV=cfg["BV"],
                    USE_H0=True, H0_EYE=False, HAS_NEED=False, STORE_H=True, STORE_VNEW=True,
                    STORE_FINAL=True, PREC="tf32", ORDERED=False, GROUP=HV // H,
                    STORE_OUT=False),
               num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def gluon_state_bwd_reports() -> None:
    """The Gluon reverse state recurrence (:mod:`gdn_core.ops.gluon.chunk_state_bwd`) as its
    launcher builds it (bf16, K = V = 128, chunks of 64, ``dht`` fp32, ``store=True``; H = HV
    = 16 and H = 8, HV = 16; ``BV`` 128 on 8 warps, the launcher's, and 64 on 4 warps at 2
    and 3 ring stages; then ``store=False`` with ``need``, the segment path's first pass),
    then the Triton ``_chunk_state_bwd_kernel`` at its
    pinned configuration (:func:`gdn_core.ops.chunk_state_bwd.chunk_state_bwd_config`)."""
    import torch
    from gdn_core.ops.chunk_state_bwd import _chunk_state_bwd_kernel, chunk_state_bwd_config
    from gdn_core.ops.gluon import chunk_state_bwd as gs

    T, NT, N, K = 1024, 16, 2, 128
    bf = torch.bfloat16
    for H, HV in ((16, 16), (8, 16)):
        q = torch.zeros(T, H, K, dtype=bf)
        w = torch.zeros(T, HV, K, dtype=bf)
        dh = torch.zeros(NT, HV, K, K, dtype=bf)
        i32 = torch.zeros(N + 1, dtype=torch.int32)
        st = torch.zeros(N, HV, K, K)
        for bv, stages in ((gs.GLUON_STATE_BWD_BV, gs.GLUON_STATE_BWD_STAGES), (64, 2), (64, 3)):
            args = dict(gs._descriptors(q, q, w, w, w, w, dh, bv), G=torch.zeros(T, HV), dht=st,
                        dv=w, dh0=st, doc_offsets=i32, doc_chunk_offsets=i32, need=i32,
                        scale=0.5, HV=HV)
            print(f"H={H} HV={HV} BV={bv} STAGES={stages}")
            report_gluon(gs._chunk_state_bwd_gluon_kernel, args,
                         dict(K=K, V=K, BT=64, BV=bv, STAGES=stages, USE_DHT=True,
                              HAS_NEED=False, STORE=True), num_warps=bv // 16)
        print(f"H={H} HV={HV} BV={gs.GLUON_STATE_BWD_BV} store=False, need (the segment path)")
        bv = gs.GLUON_STATE_BWD_BV
        args = dict(gs._descriptors(q, q, w, w, w, w, dh, bv), G=torch.zeros(T, HV), dht=st,
                    dv=st, dh0=st, doc_offsets=i32, doc_chunk_offsets=i32, need=i32,
                    scale=0.5, HV=HV)
        report_gluon(gs._chunk_state_bwd_gluon_kernel, args,
                     dict(K=K, V=K, BT=64, BV=bv, STAGES=gs.GLUON_STATE_BWD_STAGES,
                          USE_DHT=True, HAS_NEED=True, STORE=False), num_warps=bv // 16)
        cfg = chunk_state_bwd_config(K, K)
        print(f"H={H} HV={HV} Triton _chunk_state_bwd_kernel BV={cfg['BV']}")
        # q k W G do dv_local dht dh dv dh0 doc_offsets doc_chunk_offsets need scale
        report(_chunk_state_bwd_kernel, ["*bf16"] * 3 + ["*fp32", "*bf16", "*bf16", "*fp32",
                                                          "*bf16", "*bf16", "*fp32", "*i32",
                                                          "*i32", "*i32", "fp32"],
               dict(H=H, HV=HV, K=K, V=K, GROUP=HV // H, BT=64, BK=cfg["BK"], BV=cfg["BV"],
                    USE_DHT=True, HAS_NEED=False, STORE=True, DOT_PREC="tf32"),
               num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def gluon_wy_reports() -> None:
    """The Gluon WY kernel (:mod:`gdn_core.ops.gluon.wy`) as its launcher builds it: bf16,
    K = V = 128, chunks of 64, H = HV = 16 (group 1) and H = 8, HV = 16 (group 2), 4 warps
    (the launcher's) and 8 (two warpgroups), and the inverse alone (``STORE_WU`` off), TMA
    descriptors over ``[T, H·K]`` / ``[T, HV·V]``; then the Triton ``_wy_kernel``
    (inverting, the pinned configuration) beside it."""
    import torch
    from gdn_core.ops.gluon import wy as gw
    from gdn_core.ops.gluon.tma import descriptor

    T, NT, K = 1024, 16, 128
    bf = torch.bfloat16
    for H, HV in ((16, 16), (8, 16)):
        k = torch.zeros(T, H, K, dtype=bf)
        v = torch.zeros(T, HV, K, dtype=bf)
        i32 = torch.zeros(NT, dtype=torch.int32)
        w = torch.zeros(T, HV, K, dtype=bf)
        a16 = torch.zeros(T, HV, 64, dtype=bf)  # the 16-bit inverse the det forward asks for
        args = dict(gw._descriptors(k, v, w, w), a_desc=descriptor(a16.view(T, HV * 64), [64, 64]),
                    beta=torch.zeros(T, HV, dtype=bf), G=torch.zeros(T, HV), A_inv=a16, W=w,
                    U=w, chunk_start=i32, chunk_len=i32, HV=HV)
        for warps, merge, wu in ((gw.GLUON_WY_WARPS, 32, True), (gw.GLUON_WY_WARPS, 16, True),
                                 (8, 32, True), (gw.GLUON_WY_WARPS, 32, False)):
            print(f"H={H} HV={HV} MERGE_K={merge} STORE_WU={wu}")
            report_gluon(gw._wy_fwd_gluon_kernel, args,
                         dict(GROUP=HV // H, K=K, V=K, BT=64, STORE_A=16, MERGE_K=merge,
                              STORE_WU=wu),
                         num_warps=warps, maxnreg=gw.GLUON_WY_MAXNREG)
    _wy_triton_report(invert_modes=(True,))


def gluon_fused_fwd_reports() -> None:
    """The warp-specialised Gluon fused forward (:mod:`gdn_core.ops.gluon.fused_fwd`) as its
    launcher builds it: bf16, K = V = 128, chunks of 64, group 1 and 2, with ``h0`` and the
    final state, ordered documents; registers per partition (``setmaxnreg``), spills,
    shared bytes, barriers and wgmma counts."""
    import torch
    from gdn_core.ops.gluon import fused_fwd as ff

    T, N, K = 1024, 4, 128
    bf = torch.bfloat16
    for H, HV in ((16, 16), (8, 16)):
        q = torch.zeros(T, H, K, dtype=bf)
        w = torch.zeros(T, HV, K, dtype=bf)
        i32 = torch.zeros(N + 1, dtype=torch.int32)
        args = dict(ff._descriptors(q, q, w, w, w), G=torch.zeros(T, HV),
                    h0=torch.zeros(N, HV, K, K), o=w, ht=torch.zeros(N, HV, K, K),
                    doc_offsets=i32, doc_order=i32, scale=0.5, HV=HV)
        print(f"H={H} HV={HV} STAGES={ff.GLUON_FUSED_FWD_STAGES} "
              f"O_REGS={ff.GLUON_FUSED_FWD_O_REGS}")
        out = report_gluon(ff._fused_fwd_gluon_kernel, args,
                           dict(GROUP=HV // H, K=K, V=K, BT=64,
                                STAGES=ff.GLUON_FUSED_FWD_STAGES, USE_H0=True, STORE_FINAL=True,
                                O_REGS=ff.GLUON_FUSED_FWD_O_REGS, ORDERED=True),
                           num_warps=8, maxnreg=ff._MAXNREG)
        print_specialised(out["ptx"])


def gluon_recompute_reports() -> None:
    """The backward's warp-specialised recompute (:mod:`gdn_core.ops.gluon.recompute`: W
    and U formed on chip, ``h`` and ``v_new`` stored) as its launcher builds it: bf16,
    K = V = 128, chunks of 64, group 1 and 2, with entry states, ordered documents."""
    import torch
    from gdn_core.ops.gluon import recompute as rc

    T, N, K = 1024, 4, 128
    bf = torch.bfloat16
    for H, HV in ((16, 16), (8, 16)):
        k = torch.zeros(T, H, K, dtype=bf)
        w = torch.zeros(T, HV, K, dtype=bf)
        a = torch.zeros(T, HV, 64, dtype=bf)
        h = torch.zeros(T // 64, HV, K, K, dtype=bf)
        i32 = torch.zeros(N + 1, dtype=torch.int32)
        args = dict(rc._descriptors(k, w, a, w, h, w), G=torch.zeros(T, HV),
                    beta=torch.zeros(T, HV, dtype=bf), h0=torch.zeros(N, HV, K, K), W=w,
                    v_new=w, doc_offsets=i32, doc_chunk_offsets=i32, doc_order=i32, HV=HV)
        print(f"H={H} HV={HV} STAGES={rc.GLUON_RECOMPUTE_STAGES} "
              f"F_REGS={rc.GLUON_RECOMPUTE_F_REGS}")
        out = report_gluon(rc._recompute_gluon_kernel, args,
                           dict(GROUP=HV // H, K=K, V=K, BT=64, STAGES=rc.GLUON_RECOMPUTE_STAGES,
                                USE_H0=True, F_REGS=rc.GLUON_RECOMPUTE_F_REGS, ORDERED=True),
                           num_warps=8, maxnreg=rc._MAXNREG)
        print_specialised(out["ptx"])


def gluon_fused_fwd_formed_reports() -> None:
    """The fused forward with W and U formed on chip
    (:mod:`gdn_core.ops.gluon.fused_fwd_formed`) as its launcher builds it: bf16, K = V =
    128, chunks of 64, group 1 and 2, with ``h0`` and the final state, ordered documents."""
    import torch
    from gdn_core.ops.gluon import fused_fwd_formed as fm

    T, N, K = 1024, 4, 128
    bf = torch.bfloat16
    for H, HV in ((16, 16), (8, 16)):
        q = torch.zeros(T, H, K, dtype=bf)
        v = torch.zeros(T, HV, K, dtype=bf)
        a = torch.zeros(T, HV, 64, dtype=bf)
        i32 = torch.zeros(N + 1, dtype=torch.int32)
        args = dict(fm._descriptors(q, q, v, a), G=torch.zeros(T, HV),
                    beta=torch.zeros(T, HV, dtype=bf), h0=torch.zeros(N, HV, K, K), o=v,
                    ht=torch.zeros(N, HV, K, K), doc_offsets=i32, doc_order=i32, scale=0.5,
                    HV=HV)
        print(f"H={H} HV={HV} O_REGS={fm.GLUON_FORMED_O_REGS}")
        out = report_gluon(fm._fused_fwd_formed_kernel, args,
                           dict(GROUP=HV // H, K=K, V=K, BT=64, KV_STAGES=fm._KV_STAGES,
                                STAGES=fm._STAGES, USE_H0=True, STORE_FINAL=True,
                                O_REGS=fm.GLUON_FORMED_O_REGS, ORDERED=True),
                           num_warps=8, maxnreg=fm._MAXNREG)
        print_specialised(out["ptx"])


def gluon_dv_local_reports() -> None:
    """The Gluon dv_local kernel (:mod:`gdn_core.ops.gluon.dv_local`) as its launcher builds
    it: bf16, K = V = 128, chunks of 64, H = HV = 16 (group 1) and H = 8, HV = 16 (group 2),
    4 warps at the launcher's register cap (128) and uncapped, and 8 (two warpgroups), with
    the TMA store of full chunks (the launcher's) and without; then the Triton
    ``_dv_local_kernel`` at its pinned configuration
    (:func:`gdn_core.ops.dv_local.dv_local_config`) and at 3 stages."""
    import torch
    from gdn_core.ops.dv_local import _dv_local_kernel, dv_local_config
    from gdn_core.ops.gluon import dv_local as gd

    T, NT, K = 1024, 16, 128
    bf = torch.bfloat16
    for H, HV in ((16, 16), (8, 16)):
        q = torch.zeros(T, H, K, dtype=bf)
        do = torch.zeros(T, HV, K, dtype=bf)
        i32 = torch.zeros(NT, dtype=torch.int32)
        args = dict(gd._descriptors(q, q, do, do), G=torch.zeros(T, HV), dv=do,
                    chunk_start=i32, chunk_len=i32, scale=0.5, HV=HV)
        pinned = (gd.GLUON_DV_LOCAL_WARPS, gd.GLUON_DV_LOCAL_TMA_STORE, gd.GLUON_DV_LOCAL_MAXNREG)
        for warps, tma_store, cap in (pinned, (4, True, None), (4, False, pinned[2]),
                                      (4, False, None), (8, True, None)):
            print(f"H={H} HV={HV} TMA_STORE={tma_store} maxnreg={cap}")
            report_gluon(gd._dv_local_gluon_kernel, args,
                         dict(K=K, V=K, BT=64, TMA_STORE=tma_store),
                         num_warps=warps, **({"maxnreg": cap} if cap else {}))
        cfg = dv_local_config(K, K)
        for stages in (cfg["num_stages"], 3):
            print(f"H={H} HV={HV} Triton _dv_local_kernel BK={cfg['BK']} BV={cfg['BV']}")
            # q k G do dv chunk_start chunk_len scale
            report(_dv_local_kernel, ["*bf16", "*bf16", "*fp32", "*bf16", "*bf16", "*i32", "*i32",
                                      "fp32"],
                   dict(H=H, HV=HV, K=K, V=K, GROUP=HV // H, BT=64, BK=cfg["BK"], BV=cfg["BV"],
                        DOT_PREC="tf32"),
                   num_warps=cfg["num_warps"], num_stages=stages)


def gluon_wy_apply_reports() -> None:
    """The Gluon WY apply kernel (:func:`gdn_core.ops.gluon.wy.wy_apply_gluon`, the
    backward's W, U from the stored inverse) as its launcher builds it: bf16, K = V = 128,
    chunks of 64, the bf16 ``A_inv`` (``inverse_for_backward``'s) through TMA, H = HV = 16
    (group 1) and H = 8, HV = 16 (group 2), 4 warps (the launcher's) and 8 (two
    warpgroups); then the Triton ``_wy_kernel`` non-inverting (``wy_apply``) on the same
    bf16 ``A_inv``."""
    import torch
    from gdn_core.ops.gluon import wy as gw
    from gdn_core.ops.gluon.tma import descriptor, rows_view

    T, NT, K = 1024, 16, 128
    bf = torch.bfloat16
    for H, HV in ((16, 16), (8, 16)):
        k = torch.zeros(T, H, K, dtype=bf)
        v = torch.zeros(T, HV, K, dtype=bf)
        a = torch.zeros(T, HV, 64, dtype=bf)
        i32 = torch.zeros(NT, dtype=torch.int32)
        args = dict(gw._descriptors(k, v, v, v), a_desc=descriptor(rows_view(a), [64, 64]),
                    beta=torch.zeros(T, HV, dtype=bf), G=torch.zeros(T, HV), W=v, U=v,
                    chunk_start=i32, chunk_len=i32, HV=HV)
        for warps, cap in ((gw.GLUON_WY_APPLY_WARPS, gw.GLUON_WY_APPLY_MAXNREG), (4, 96),
                           (8, None)):
            print(f"H={H} HV={HV} maxnreg={cap}")
            report_gluon(gw._wy_apply_gluon_kernel, args, dict(K=K, V=K, BT=64),
                         num_warps=warps, **({} if cap is None else {"maxnreg": cap}))
    _wy_triton_report(invert_modes=(False,), a_type="*bf16")


def _wy_triton_report(invert_modes=(True, False), a_type: str = "*fp32",
                      store_a16: bool = True) -> None:
    """The Triton WY kernel, bf16, K = V = 128, group 1 (``INVERT``: wy_fwd; else wy_apply;
    ``a_type``: ``A_inv``'s, fp32 or the backward's 16-bit copy when not inverting;
    ``store_a16``: the inverting launch also stores the 16-bit inverse, as the forward's
    ``wy_fwd(..., A_inv_for_backward=True)`` does)."""
    from gdn_core.ops.wy import _wy_kernel, wy_config

    cfg = wy_config(128, 128)
    # k v beta G A_inv W U chunk_start chunk_len H HV VT VH A16 (A16 None unless storing:
    # unused, typed here all the same)
    types = ["*bf16", "*bf16", "*bf16", "*fp32", a_type, "*bf16", "*bf16", "*i32", "*i32",
             "i32:16", "i32:16", "i32:16", "i32:16", "*bf16"]
    for invert in invert_modes:  # wy_fwd, wy_apply
        a16 = store_a16 and invert
        print(f"Triton _wy_kernel INVERT={invert} A_inv {a_type[1:]} STORE_A16={a16}")
        report(_wy_kernel, types, {"GROUP": 1, "K": 128, "V": 128, "BK": cfg["BK"],
                                   "BV": cfg["BV"], "PREC": "tf32",
                                   "DOT16": bool(cfg["dot16"]), "INVERT": invert,
                                   "STORE_A16": a16, **_WY_SUBST},
               num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


#: the substitution path's values of the register inverse's constexprs (their defaults)
_WY_SUBST = {"INV_REG": False, "STORE_A32": True, "KP": 16, "VP": 16, "PREFETCH": False}


def wy_inv_reports() -> None:
    """The WY forward's two inverses (``GDN_CORE_WY_INV``), bf16, K = V = 128, group 1, as
    :func:`gdn_core.ops.wy.wy_fwd` launches them: ``subst`` (the default; fp32 ``A_inv``
    always written, the 16-bit copy too as the forward asks), then ``reg`` as the forward
    launches it (``A_inv_for_backward``: the 16-bit copy only), with the fp32 inverse too
    (``wy_fwd``'s default return), and both without the register cap / the L2 prefetch of
    ``v`` (not launched)."""
    from gdn_core.ops.wy import WY_REG_MAXNREG, _wy_kernel, wy_config

    cfg = wy_config(128, 128)
    types = ["*bf16", "*bf16", "*bf16", "*fp32", "*fp32", "*bf16", "*bf16", "*i32", "*i32",
             "i32:16", "i32:16", "i32:16", "i32:16", "*bf16"]
    base = {"GROUP": 1, "K": 128, "V": 128, "BK": cfg["BK"], "BV": cfg["BV"], "PREC": "tf32",
            "DOT16": bool(cfg["dot16"]), "INVERT": True, "STORE_A16": True}
    opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    print("subst (A_inv fp32 + 16-bit copy)")
    report(_wy_kernel, types, {**base, **_WY_SUBST}, **opts)
    reg = {**base, "INV_REG": True, "KP": 128, "VP": 128, "PREFETCH": True}
    for a32, cap, pf in ((False, True, True), (True, True, True), (False, False, True),
                         (False, True, False)):
        print(f"reg STORE_A32={a32} maxnreg={WY_REG_MAXNREG if cap else None} PREFETCH={pf}")
        report(_wy_kernel, types, {**reg, "STORE_A32": a32, "PREFETCH": pf}, **opts,
               **({"maxnreg": WY_REG_MAXNREG} if cap else {}))


def fused_fwd_reports() -> None:
    """The fused forward last phase (:mod:`gdn_core.ops.chunk_fwd_fused`) as its launcher
    builds it (bf16, K = V = 128, chunks of 64, an initial state read and the final state
    stored; H = HV = 16 and H = 8, HV = 16) at the pinned configuration (BV 64, 4 warps, 1
    stage), at 2 and 3 stages, BV = 32 and BV = 128 on 8 warps; then the two kernels it
    replaces at their pinned configurations: ``_chunk_state_fwd_kernel`` (``h``, ``v_new``
    and the final state stored, the BV of 128+ programs) and ``_chunk_output_fwd_kernel``."""
    from gdn_core.ops.chunk_fwd_fused import _chunk_fwd_fused_kernel, chunk_fwd_fused_config
    from gdn_core.ops.chunk_state import _chunk_state_fwd_kernel, chunk_state_config
    from gdn_core.ops.output import _chunk_output_fwd_kernel, chunk_output_config

    K = 128
    bf, f32, i32 = "*bf16", "*fp32", "*i32"
    for H, HV in ((16, 16), (8, 16)):
        hty = "i32:16" if H % 16 == 0 else "i32"
        cfg = chunk_fwd_fused_config(K, K)
        pinned = (cfg["BV"], cfg["num_warps"], cfg["num_stages"])
        for bv, warps, stages, ordered in ((*pinned, False), (*pinned, True), (64, 4, 2, False),
                                           (64, 4, 3, False), (32, 4, 1, False),
                                           (128, 8, 1, False)):
            tag = " (pinned)" if (bv, warps, stages) == pinned else ""
            tag += " ORDERED" if ordered else ""
            print(f"H={H} HV={HV} fused BV={bv}{tag}")
            # q k W U G h0 o ht doc_offsets doc_order scale (H, HV are constexpr)
            report(_chunk_fwd_fused_kernel, [bf] * 4 + [f32, f32, bf, f32, i32, i32, "fp32"],
                   dict(H=H, HV=HV, GROUP=HV // H, K=K, V=K, BT=64, BK=cfg["BK"], BV=bv,
                        USE_H0=True, STORE_FINAL=True, PREC="tf32", ORDERED=ordered),
                   num_warps=warps, num_stages=stages)
        cfg = chunk_state_config(K, K, 2, programs=128)
        print(f"H={H} HV={HV} Triton _chunk_state_fwd_kernel BV={cfg['BV']}")
        # k W U G h0 h v_new ht doc_offsets doc_chunk_offsets need doc_order q out scale H HV
        report(_chunk_state_fwd_kernel, [bf] * 3 + [f32, f32, bf, bf, f32, i32, i32, i32, i32,
                                                    bf, f32, "fp32", hty, "i32:16"],
               dict(K=K, V=K, VU=K, BT=64, BK=cfg["BK"], BV=cfg["BV"],
                    USE_H0=True, H0_EYE=False, HAS_NEED=False, STORE_H=True, STORE_VNEW=True,
                    STORE_FINAL=True, PREC="tf32", ORDERED=False, GROUP=HV // H,
                    STORE_OUT=False),
               num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        cfg = chunk_output_config(K, K)
        print(f"H={H} HV={HV} Triton _chunk_output_fwd_kernel BK={cfg['BK']} BV={cfg['BV']}")
        # q k v_new h G o chunk_start chunk_len scale H HV
        report(_chunk_output_fwd_kernel, [bf] * 4 + [f32, bf, i32, i32, "fp32", hty, "i32:16"],
               dict(GROUP=HV // H, K=K, V=K, BT=64, BK=cfg["BK"], BV=cfg["BV"], PREC="tf32"),
               num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def summary_reports() -> None:
    """The segment summary walk (``_chunk_state_fwd_kernel`` with ``[E | M]``: width
    ``V + K``, an identity entry, ``need``) at its pinned configuration for 128+ programs,
    bf16, K = V = 128, without and with the chunk outputs (``STORE_OUT``: ``o⁰`` and the
    entry-state queries ``q̃``, ``docs/exact_split.md``)."""
    from gdn_core.ops.chunk_state import _chunk_state_fwd_kernel, chunk_state_config

    K = 128
    bf, f32, i32 = "*bf16", "*fp32", "*i32"
    cfg = chunk_state_config(K, 2 * K, 2, programs=128)
    for H, HV in ((16, 16), (8, 16)):
        hty = "i32:16" if H % 16 == 0 else "i32"
        for store_out, warps, stages in ((False, cfg["num_warps"], cfg["num_stages"]),
                                         (True, cfg["num_warps"], cfg["num_stages"]),
                                         (True, 8, cfg["num_stages"]), (True, 8, 2)):
            print(f"H={H} HV={HV} summary BV={cfg['BV']} STORE_OUT={store_out}")
            # k W U G h0 h v_new ht doc_offsets doc_chunk_offsets need doc_order q out scale
            # H HV
            report(_chunk_state_fwd_kernel, [bf] * 3 + [f32, f32, bf, bf, f32, i32, i32, i32,
                                                        i32, bf, f32, "fp32", hty, "i32:16"],
                   dict(K=K, V=2 * K, VU=K, BT=64, BK=cfg["BK"], BV=cfg["BV"], USE_H0=False,
                        H0_EYE=True, HAS_NEED=True, STORE_H=False, STORE_VNEW=False,
                        STORE_FINAL=True, PREC="tf32", ORDERED=True, GROUP=HV // H,
                        STORE_OUT=store_out),
                   num_warps=warps, num_stages=stages)


def fused_state_reports() -> None:
    """The warp-specialised fused state backward (:mod:`gdn_core.ops.gluon.fused_state_bwd`:
    dv_local inside the reverse recurrence) as its launcher builds it (bf16, K = V = 128,
    chunks of 64, ``dht`` fp32; H = HV = 16 and H = 8, HV = 16; ``store=True``, then
    ``store=False`` with ``need`` (at the first pass's ring depth), then ``store=True`` with
    the programs' documents read from ``doc_order``): ptxas figures, shared bytes, the
    ``setmaxnreg`` of each partition in the PTX and its ``bar.sync`` / ``mbarrier`` counts."""
    import torch
    from gdn_core.ops.gluon import fused_state_bwd as fs

    T, NT, N, K = 1024, 16, 2, 128
    bf = torch.bfloat16
    for H, HV in ((16, 16), (8, 16)):
        q = torch.zeros(T, H, K, dtype=bf)
        w = torch.zeros(T, HV, K, dtype=bf)
        dh = torch.zeros(NT, HV, K, K, dtype=bf)
        i32 = torch.zeros(N + 1, dtype=torch.int32)
        st = torch.zeros(N, HV, K, K)
        for store, has_need, ordered in ((True, False, False), (False, True, False),
                                         (True, False, True)):
            args = dict(fs._descriptors(q, q, w, w, w, dh), G=torch.zeros(T, HV), dht=st,
                        dv=w if store else st, dh0=st, doc_offsets=i32, doc_chunk_offsets=i32,
                        need=i32, doc_order=i32, scale=0.5, HV=HV)
            stages = (fs.GLUON_FUSED_STATE_STAGES if store
                      else fs.GLUON_FUSED_STATE_FIRST_PASS_STAGES)
            print(f"H={H} HV={HV} store={store} need={has_need} ordered={ordered} "
                  f"STAGES={stages}"
                  f" DSTAGES={fs.GLUON_FUSED_STATE_DSTAGES} A_REGS={fs.GLUON_FUSED_STATE_A_REGS}")
            out = report_gluon(
                fs._fused_state_bwd_gluon_kernel, args,
                dict(K=K, V=K, BT=64, STAGES=stages,
                     DSTAGES=fs.GLUON_FUSED_STATE_DSTAGES, USE_DHT=True, HAS_NEED=has_need,
                     STORE=store, A_REGS=fs.GLUON_FUSED_STATE_A_REGS, ORDERED=ordered),
                num_warps=8, maxnreg=fs._MAXNREG)
            print_specialised(out["ptx"])


def fused_bwd_reports() -> None:
    """The fused backward (:mod:`gdn_core.ops.gluon.fused_bwd`: the reverse recurrence and
    every chunk gradient in one warp-specialised launch) as its launcher builds it (bf16,
    K = V = 128, chunks of 64, H = HV = 16, ``dht`` fp32, bf16 ``dq``/``dk``; documents in
    index order, then longest first): ptxas figures, shared bytes, the ``setmaxnreg`` of
    each partition and its ``bar.sync`` / ``mbarrier`` counts."""
    import torch
    from gdn_core.ops.gluon import fused_bwd as fb

    T, NT, N, H, K = 1024, 16, 2, 16, 128
    bf = torch.bfloat16
    x = torch.zeros(T, H, K, dtype=bf)
    h = torch.zeros(NT, H, K, K, dtype=bf)
    a = torch.zeros(T, H, 64, dtype=bf)
    i32 = torch.zeros(N + 1, dtype=torch.int32)
    st = torch.zeros(N, H, K, K)
    for ordered in (False, True):
        args = dict(fb._descriptors(x, x, x, x, x, x, h, a), G=torch.zeros(T, H),
                    beta=torch.zeros(T, H, dtype=bf), dht=st, dq=x, dk=x, dv=x,
                    dbeta=torch.zeros(T, H, dtype=bf), dg=torch.zeros(T, H), dh0=st,
                    doc_offsets=i32, doc_chunk_offsets=i32, doc_order=i32, scale=0.5, HV=H,
                    q2d=x, k2d=x, q_stride=H * K, k_stride=H * K,
                    stamps=torch.zeros(8, dtype=torch.int64))
        for prefetch, stamps in ((False, False), (True, False), (False, True)):
            if ordered and (prefetch or stamps):
                continue
            print(f"H=HV={H} ordered={ordered} prefetch={prefetch} stamps={stamps} "
                  f"S_REGS={fb.GLUON_FUSED_BWD_S_REGS}")
            out = report_gluon(fb._fused_bwd_gluon_kernel, args,
                               dict(GROUP=1, K=K, V=K, BT=64, USE_DHT=True,
                                    S_REGS=fb.GLUON_FUSED_BWD_S_REGS, ORDERED=ordered,
                                    PREFETCH=prefetch, STAMPS=stamps),
                               num_warps=8, maxnreg=fb._MAXNREG)
            print_specialised(out["ptx"])


def conv_reports() -> None:
    """The conv1d kernels as :func:`gdn_core.ops.conv1d.conv1d_fwd` and
    :func:`gdn_core.ops.conv1d_bwd.conv1d_bwd` launch them (bf16, W = 4, SiLU, no bias)."""
    from gdn_core.ops.conv1d import CONV_BLOCK_D, CONV_FWD_BLOCK_T, _conv1d_fwd_kernel
    from gdn_core.ops.conv1d_bwd import (
        _REDUCE_COLS,
        _REDUCE_ROWS,
        CONV_BWD_BLOCK_T,
        CONV_BWD_TOKEN_BLOCK,
        _conv1d_bwd_kernel,
        _conv1d_partials_sum_kernel,
    )

    ptr = "*bf16"
    for mode, halo in ((0, False), (1, False), (2, True)):  # rows / cu_seqlens / doc_pos+halo
        print(f"MODE={mode} HAS_HALO={halo}")
        # x, halo, w, bias, y, cu, pos, T, D, n_cu, steps, sxb, sxt, swd
        report(_conv1d_fwd_kernel, [ptr] * 5 + ["*i32", "*i32", "i32:16", "i32:16", "i32",
                                                "i32", "i32:16", "i32:16", "i32"],
               dict(sxd=1, sww=1, W=4, ACT=1, HAS_BIAS=False, HAS_HALO=halo, MODE=mode,
                    BT=CONV_FWD_BLOCK_T, BD=CONV_BLOCK_D))
        # x, halo, w, bias, dy, dx, dhalo, part, ring, cu, pos, T, D, n_cu, steps, sxb, sxt,
        # syb, syt, swd
        report(_conv1d_bwd_kernel, [ptr] * 7 + ["*fp32", "*fp32", "*i32", "*i32", "i32:16",
                                                "i32:16",
                                                "i32", "i32", "i32:16", "i32:16", "i32:16",
                                                "i32:16", "i32"],
               dict(sxd=1, syd=1, sww=1, W=4, WP=8, ACT=1, HAS_BIAS=False, HAS_HALO=halo,
                    MODE=mode, BT=CONV_BWD_BLOCK_T, BD=CONV_BLOCK_D,
                    SUB=CONV_BWD_TOKEN_BLOCK // CONV_BWD_BLOCK_T))
    report(_conv1d_partials_sum_kernel, ["*fp32", ptr, ptr, "i32", "i32:16", "i32"],
           dict(sww=1, W=4, WP=8, HAS_BIAS=True, BR=_REDUCE_ROWS, BM=_REDUCE_COLS))


def bwd_reports() -> None:
    """The two kernels of :func:`gdn_core.ops.chunk_grads_bwd.chunk_grads_bwd` as the
    backward launches them (bf16, K=V=128, the pinned configuration, one value head per
    q/k head: ``dq``/``dk`` rounded into bf16)."""
    from gdn_core.ops.chunk_grads_bwd import _dk_kernel, _dq_dv_kernel, chunk_grads_config

    bf, f32 = "*bf16", "*fp32"
    cfg = chunk_grads_config(128, 128)
    meta = dict(H=16, HV=16, K=128, V=128, GROUP=1, BT=64, BK=cfg["BK"], BV=cfg["BV"],
                T_IN_DK=True, DOT_PREC="tf32")
    # q k v v_new h do du G beta A_inv dq dk dv dT dg_part db_part chunk_start chunk_len
    # scale v_row v_head (v a view of a packed q/k/v projection, as a layer passes it)
    report(_dq_dv_kernel, [bf] * 7 + [f32, bf, bf, bf, bf, bf, bf, f32, f32, "*i32", "*i32",
                                      "fp32", "i32:16", "i32:16"],
           meta, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    # q k v_new h dh do du G beta A_inv dT dg_part db_part dk dbeta dg chunk_start chunk_len
    # scale
    report(_dk_kernel, [bf] * 7 + [f32, bf, bf, bf, f32, f32, bf, bf, bf, "*i32", "*i32", "fp32"],
           meta, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def l2norm_reports() -> None:
    """The L2-norm kernels as :func:`gdn_core.ops.l2norm.l2norm_fwd_pair` and
    :func:`~gdn_core.ops.l2norm.l2norm_bwd_pair` launch them (bf16 q/k, D = 128; the
    backward reads the fp32 ``dq``/``dk`` partials and rounds into bf16)."""
    from gdn_core.ops.l2norm import _l2norm_bwd_kernel, _l2norm_fwd_kernel, _rows

    BR, BD = _rows(128)
    bf, f32 = "*bf16", "*fp32"
    # xa ya ra xb yb rb R H xa_row xa_head xb_row xb_head eps
    report(_l2norm_fwd_kernel, [bf, bf, f32] * 2 + ["i32", "i32"] + ["i32:16"] * 4 + ["fp32"],
           dict(D=128, BR=BR, BD=BD))
    # ya ra dya dxa yb rb dyb dxb R
    report(_l2norm_bwd_kernel, [bf, f32, f32, bf] * 2 + ["i32"], dict(D=128, BR=BR, BD=BD))


if __name__ == "__main__":
    import sys

    modes = {"conv": conv_reports, "bwd": bwd_reports, "gluon": gluon_reports,
             "gluon_grads": gluon_grads_reports, "gluon_grads2": gluon_grads2_reports,
             "gluon_state_bwd": gluon_state_bwd_reports,
             "gluon_wy": gluon_wy_reports,
             "gluon_fused_fwd": gluon_fused_fwd_reports, "gluon_state": gluon_state_reports,
             "gluon_recompute": gluon_recompute_reports,
             "gluon_fused_fwd_formed": gluon_fused_fwd_formed_reports,
             "gluon_dv_local": gluon_dv_local_reports, "gluon_wy_apply": gluon_wy_apply_reports,
             "fused_fwd": fused_fwd_reports, "fused_state": fused_state_reports,
             "fused_bwd": fused_bwd_reports, "summary": summary_reports,
             "l2norm": l2norm_reports,
             "wy_inv": wy_inv_reports}
    if len(sys.argv) == 2 and sys.argv[1] in modes:
        modes[sys.argv[1]]()
        sys.exit(0)
    _wy_triton_report()
