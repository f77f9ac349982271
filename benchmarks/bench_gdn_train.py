#!/usr/bin/env python3
"""Single-rank GDN training benchmark: forward and forward+backward, side by side.

Arms (all called with fla's signature ``(q, k, v, g, beta, scale=None,
initial_state=None, output_final_state=False, cu_seqlens=None,
use_qk_l2norm_in_kernel=False) -> (o, final_state)``):

* ``det``    — ``gdn_det_train.chunk_gated_delta_rule_det`` (deterministic)
* ``nondet`` — ``gdn_train.chunk_gated_delta_rule`` (non-deterministic)
* the anchors (``--compare``; CUDA only; each in a process of its own, see
  ``anchors.py``):

  * ``fla`` — ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` with
    ``flash_qla`` and ``tilelang`` blocked from import: fla's own Triton
    kernels, whatever else is installed. On Hopper with Triton < 3.7.1 fla
    refuses its GDN backward, so ``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1``
    is forced to ``True`` and the report says so.
  * ``fla-tilelang`` — the same with ``tilelang`` importable (``flash_qla``
    blocked): on Hopper fla sends its dq/dk/dw/dg backward kernel to TileLang.
  * ``fla-dispatch`` — fla with nothing blocked: what a user with fla and
    FlashQLA installed gets (fla dispatches to FlashQLA when it can).
  * ``flashqla`` — ``flash_qla.chunk_gated_delta_rule`` as a user calls it
    (``auto_cp=True``: its approximate long-document split may run);
    ``flashqla-exact`` — with ``auto_cp=False`` (no split, exact). K = V = 128
    and bf16/fp16 only: other shapes get a "skipped" row. Without ``flash_qla``
    (or a GPU) these arms are reported as skipped, not as errors.

  Which path each anchor ran (fla's dispatch log, FlashQLA's split) is
  recorded per shape, and so is which of our kernels each of our arms launched
  (one probe call under ``gdn_core.testkit.LaunchAudit``: e.g. the fused state
  backward where it pays, the Triton pair elsewhere).
* ``reference`` — ``gdn_core.reference.chunk_gdn_reference`` (fp32 torch,
  autograd); for smoke tests of this script only.

Every arm of one run gets the same inputs (seeded, layer-like: see
``common.make_gdn_inputs``; ``--gate anchor`` uses docs/performance.md's gate).
Reported per shape and arm: median ms of the forward and of forward+backward
(backward of ``sum(o * do)``, i.e. ``autograd.grad(o, inputs, do)``), ratios
against fla (``fla_ms / arm_ms``, > 1 means the arm is faster) and of every
arm against every anchor (``arm_ms / anchor_ms``, > 1 means the arm is
slower), det/nondet ratios, the peak extra device memory of forward and of
forward+backward, and on small cases the relative error of ``o``, the final
state and every gradient against an fp32 reference, plus whether two identical
calls gave bitwise identical results.

An arm whose package is missing or lacks its entry point stops the run before
anything is timed, with a message saying which and why (FlashQLA's arms are
skipped instead); an arm that fails on one shape is reported as failed there
and the run exits non-zero.

Without CUDA it runs on the CPU (``GDN_CORE_BACKEND=reference`` unless set),
for tiny ``--shapes`` only. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import anchors  # noqa: E402
import common  # noqa: E402
import torch  # noqa: E402
from common import GDNShape, fmt  # noqa: E402

ANCHOR_SHAPES: list[GDNShape] = [
    GDNShape(B=1, T=8192, H=16),
    GDNShape(B=1, T=32768, H=16),
    GDNShape(B=1, T=32768, H=16, D=8),
    GDNShape(B=4, T=8192, H=16),
    GDNShape(B=1, T=65536, H=16, D=16),
    GDNShape(B=1, T=32768, H=16, HV=32, D=8),
]
# fla 0.6.0 on the H200 with Triton 3.6, bf16 (docs/performance.md): (fwd ms, fwd+bwd ms).
ANCHOR_FLA_MS: dict[str, tuple[float, float]] = {
    s.spec: ms for s, ms in zip(ANCHOR_SHAPES, [
        (0.724, 2.352), (1.264, 4.797), (1.174, 3.409),
        (0.940, 3.597), (1.777, 6.520), (1.754, 7.632),
    ])
}
# Small accuracy cases. On CUDA they keep the anchors' head counts so that the
# autotuned arms (fla, nondet) reuse the configs tuned for the timed shapes
# instead of autotuning afresh (minutes of compiling for fla on Triton 3.6).
DEFAULT_ACC_SHAPES = {
    "cuda": "B1,T512,H16;B1,T5000,H16;B1,T512,H16,HV32,D3",  # T5000: two segments
    "cpu": "B1,T128,H2,K32,V32;B1,T128,H1,HV2,K32,V32,D3",
}
# FlashQLA 0.1.3 on the H200, bf16 (docs/performance.md: triton.testing.do_bench,
# g = logsigmoid(randn)/16): (fwd ms, fwd+bwd ms, peak extra MiB of fwd+bwd).
ANCHOR_FLASHQLA_MS: dict[str, tuple[float, float, float]] = {
    s.spec: ms for s, ms in zip(ANCHOR_SHAPES, [
        (0.42, 1.30, 237), (0.49, 1.51, 869), (0.32, 1.22, 853),
        (0.40, 2.04, 845), (0.62, 2.41, 1706), (0.62, 2.54, 1802),
    ])
}
PRESETS = {"anchors": ANCHOR_SHAPES}
# The anchors (--compare): each runs in a process of its own (anchors.py).
COMPARE_ARMS = ("fla", "fla-tilelang", "fla-dispatch", "flashqla", "flashqla-exact")
GATES = ("layer", "anchor")

FLA_PATCH_NOTE = (
    "fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 forced to True: fla refuses its GDN backward "
    "on Hopper with Triton < 3.7.1 (wrong dk from a Triton codegen bug, docs/machines.md); "
    "its accuracy row below says whether its gradients are right here"
)


class ArmUnavailable(RuntimeError):
    """An arm that cannot run here (package missing, entry point missing, no CUDA)."""


@dataclass(frozen=True)
class ArmSpec:
    name: str
    module: str
    attr: str
    what: str
    cuda_only: bool = False
    listed: bool = True
    kwargs: tuple[tuple[str, Any], ...] = ()  # fixed extra keyword arguments of the call
    kind: str = "package"  # package | fla | flashqla | reference
    own_process: bool = False  # run in a process of its own (the anchors)
    block: tuple[str, ...] = ()  # top-level packages made unimportable in that process
    env: tuple[tuple[str, str | None], ...] = ()  # environment of that process (None: unset)
    optional: bool = False  # unavailable -> "skipped" rows, not an error


_FLA = "fla.ops.gated_delta_rule"


ARMS: dict[str, ArmSpec] = {
    a.name: a for a in (
        ArmSpec("det", "gdn_det_train", "chunk_gated_delta_rule_det",
                "gdn-det-train, deterministic"),
        ArmSpec("nondet", "gdn_train", "chunk_gated_delta_rule",
                "gdn-train, non-deterministic"),
        ArmSpec("det-plain", "gdn_det_train", "chunk_gated_delta_rule_det",
                "gdn-det-train without segments (segment_size=0)",
                kwargs=(("segment_size", 0),)),
        ArmSpec("nondet-plain", "gdn_train", "chunk_gated_delta_rule",
                "gdn-train without segments (segment_size=0)",
                kwargs=(("segment_size", 0),)),
        *(ArmSpec(f"det-s{S}", "gdn_det_train", "chunk_gated_delta_rule_det",
                  f"gdn-det-train with segment_size={S}",
                  kwargs=(("segment_size", S),)) for S in (1024, 2048, 4096)),
        ArmSpec("fla", _FLA, "chunk_gated_delta_rule",
                "flash-linear-attention, its own Triton kernels (flash_qla and tilelang "
                "blocked from import)", cuda_only=True, kind="fla", own_process=True,
                block=("flash_qla", "tilelang"),
                env=(("FLA_FLASH_QLA", "0"), ("FLA_TILELANG", "0"))),
        ArmSpec("fla-tilelang", _FLA, "chunk_gated_delta_rule",
                "flash-linear-attention with tilelang importable (flash_qla blocked): on "
                "Hopper its dq/dk/dw/dg backward kernel is TileLang's", cuda_only=True,
                kind="fla", own_process=True, block=("flash_qla",),
                env=(("FLA_FLASH_QLA", "0"), ("FLA_TILELANG", None))),
        ArmSpec("fla-dispatch", _FLA, "chunk_gated_delta_rule",
                "flash-linear-attention as dispatched with nothing blocked (FlashQLA when "
                "flash_qla is importable: what a user with both installed gets)",
                cuda_only=True, kind="fla", own_process=True,
                env=(("FLA_FLASH_QLA", None), ("FLA_TILELANG", None),
                     ("FLA_DISABLE_BACKEND_DISPATCH", None))),
        ArmSpec("flashqla", "flash_qla", "chunk_gated_delta_rule",
                "FlashQLA as a user calls it (auto intra-card CP on: its approximate "
                "long-document split may run)", cuda_only=True, kind="flashqla",
                own_process=True, optional=True, kwargs=(("auto_cp", True),)),
        ArmSpec("flashqla-exact", "flash_qla", "chunk_gated_delta_rule",
                "FlashQLA with its long-document split off (auto_cp=False: exact)",
                cuda_only=True, kind="flashqla", own_process=True, optional=True,
                kwargs=(("auto_cp", False),)),
        ArmSpec("reference", "gdn_core.reference", "chunk_gdn_reference",
                "gdn-core fp32 reference (smoke tests only)", listed=False, kind="reference"),
    )
}


@dataclass
class LoadedArm:
    spec: ArmSpec
    fn: Callable[..., Any]
    info: dict[str, Any]
    fla_log: anchors.FlaDispatchRecorder | None = None
    qla_mode: anchors.FlashQLAModeRecorder | None = None

    @property
    def name(self) -> str:
        return self.spec.name


def shape_skip_reason(spec: ArmSpec, shape: GDNShape, dtype: torch.dtype) -> str | None:
    """Why ``spec`` cannot run ``shape`` at all (FlashQLA's limits), or None."""
    if spec.kind != "flashqla":
        return None
    if (shape.K, shape.V) != (128, 128):
        return f"FlashQLA supports K = V = 128 only (this shape: K={shape.K}, V={shape.V})"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"FlashQLA supports bf16/fp16 q, k, v only (this run: {common.dtype_name(dtype)})"
    return None


def _patch_fla(info: dict[str, Any]) -> None:
    """Let fla run its GDN backward on Hopper with Triton < 3.7.1 (see FLA_PATCH_NOTE)."""
    import importlib

    chunk_o = importlib.import_module("fla.ops.common.chunk_o")
    before = getattr(chunk_o, "TRITON_ABOVE_3_7_1", None)
    info["fla_TRITON_ABOVE_3_7_1_before"] = before
    if before is False:
        chunk_o.TRITON_ABOVE_3_7_1 = True
        info["patch"] = FLA_PATCH_NOTE
    elif before is None:
        info["patch"] = "fla.ops.common.chunk_o has no TRITON_ABOVE_3_7_1 (nothing patched)"


def _isolate(spec: ArmSpec) -> None:
    """Set the arm's ``FLA_*`` switches and block its packages in this process.

    Done wherever the arm is loaded (its own process here, or e.g. profile_gdn.py),
    so that ``fla`` always means fla's own Triton kernels.
    """
    for key, value in spec.env:
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        anchors.block_imports(spec.block)
    except RuntimeError as exc:
        raise ArmUnavailable(f"arm {spec.name!r}: {exc} (it must be loaded before them)") from exc


def load_arm(name: str, device: torch.device) -> LoadedArm:
    spec = ARMS[name]
    if spec.cuda_only and device.type != "cuda":
        raise ArmUnavailable(f"arm {name!r} ({spec.what}) needs a CUDA GPU; running on {device}")
    _isolate(spec)
    top = spec.module.split(".")[0]
    try:
        if spec.kind in ("fla", "flashqla"):
            import importlib

            module = importlib.import_module(spec.module)
        else:
            module = common.import_workspace_module(spec.module)
    except ModuleNotFoundError as exc:
        raise ArmUnavailable(
            f"arm {name!r} needs the package {top!r} ({spec.what}), which is not importable: "
            f"{exc}"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - any import failure makes the arm unavailable
        raise ArmUnavailable(
            f"arm {name!r}: importing {spec.module} failed: {type(exc).__name__}: {exc}"
        ) from exc
    fn = getattr(module, spec.attr, None)
    if not callable(fn):
        origin = sys.modules.get(top)
        where = getattr(origin, "__file__", "?")
        raise ArmUnavailable(
            f"arm {name!r}: {spec.module} (from {where}) has no callable {spec.attr!r} "
            f"— not implemented yet?"
        )
    if spec.kwargs:
        fn = functools.partial(fn, **dict(spec.kwargs))
    top_module = sys.modules[top]
    info: dict[str, Any] = {
        "entry": f"{spec.module}.{spec.attr}" + "".join(f", {k}={v!r}" for k, v in spec.kwargs),
        "what": spec.what,
        **common.module_origin(top_module),
    }
    loaded = LoadedArm(spec, fn, info)
    if spec.kind == "fla":
        _patch_fla(info)
        loaded.fla_log = anchors.FlaDispatchRecorder()
    if spec.kind == "flashqla" or (spec.kind == "fla" and "flash_qla" not in spec.block
                                   and anchors.importable("flash_qla")):
        try:
            loaded.qla_mode = anchors.FlashQLAModeRecorder()
            if loaded.qla_mode.original is None:
                info["flashqla_mode_unknown"] = (f"{anchors.FLASHQLA_CHUNK_MODULE} has no "
                                                 "build_cp_context to watch")
        except Exception as exc:  # noqa: BLE001 - the arm still runs; say why no mode is known
            if spec.kind == "flashqla":
                raise ArmUnavailable(
                    f"arm {name!r}: importing {anchors.FLASHQLA_CHUNK_MODULE} failed: "
                    f"{type(exc).__name__}: {exc}") from exc
            info["flashqla_mode_unknown"] = f"{type(exc).__name__}: {exc}"
    if spec.own_process:
        info["process"] = {
            "own": True, "pid": os.getpid(),
            "blocked_imports": list(spec.block),
            "env": {k: os.environ.get(k) for k, _ in spec.env},
        }
    return loaded


def probe_path(arm: LoadedArm, inputs: common.GDNInputs, out: dict[str, Any]) -> None:
    """One forward+backward with the path recorders on: which kernels this arm ran.

    Writes ``path`` (one line) and the evidence into ``out``, also when the call fails.
    """
    if arm.spec.kind == "reference":
        out["path"] = arm.spec.what
        return
    if arm.spec.kind not in ("fla", "flashqla"):
        out["path"] = our_kernels(arm, inputs)
        return
    if arm.fla_log is not None:
        arm.fla_log.begin()
    if arm.qla_mode is not None:
        arm.qla_mode.begin()
    try:
        o, _ = _call(arm, inputs)
        torch.autograd.grad(o, inputs.leaves, inputs.do.to(o.dtype))
        del o
    finally:
        mode = arm.qla_mode.end() if arm.qla_mode is not None else None
        out["imported"] = anchors.imported_modules()
        if arm.fla_log is not None:
            log_lines = arm.fla_log.end()
            out["fla_backend_log"] = log_lines
            out["path"] = anchors.describe_fla_path(log_lines, mode)
        else:
            out["path"] = "FlashQLA: " + (mode["mode"] if mode else
                                          "mode unknown (its CP context was not seen)")
        if mode is not None:
            out["flashqla"] = mode


def our_kernels(arm: LoadedArm, inputs: common.GDNInputs) -> str:
    """The kernels one forward+backward of our arm launches (:func:`kernel_summary`),
    recorded by :class:`gdn_core.testkit.LaunchAudit` (every launch goes through
    ``gdn_core.ops.launch.cached_launch``)."""
    from gdn_core.testkit import LaunchAudit

    with LaunchAudit() as audit:
        o, _ = _call(arm, inputs)
        torch.autograd.grad(o, inputs.leaves, inputs.do.to(o.dtype))
        del o
    return kernel_summary(audit.events)


def kernel_summary(events: list[tuple[str, str, str]]) -> str:
    """``"kernels: wy ×2, chunk_state_fwd ×2, ..."``: the Triton/Gluon launches among
    :class:`gdn_core.testkit.LaunchAudit` events, in first-launch order with their
    counts (names without the leading ``_`` and the ``_kernel`` suffix)."""
    counts: dict[str, int] = {}
    for kind, name, _ in events:
        if kind == "triton":
            name = name.removeprefix("_").removesuffix("_kernel")
            counts[name] = counts.get(name, 0) + 1
    if not counts:
        return "kernels: none (the fp32 torch reference path)"
    return "kernels: " + ", ".join(f"{n} ×{c}" for n, c in counts.items())


# --------------------------------------------------------------- running ---


def _call(arm: LoadedArm, inputs: common.GDNInputs, output_final_state: bool = False):
    return arm.fn(
        *inputs.leaves, scale=None, initial_state=None, output_final_state=output_final_state,
        **inputs.kwargs(),
    )


# One clock for this process and the anchors' processes it starts (they inherit it).
_T0 = float(os.environ.setdefault("BENCH_GDN_TRAIN_T0", repr(time.time())))


LOG_PREFIX = ""  # an anchor's own process names itself


def log(msg: str) -> None:
    """Progress on stderr, stamped with seconds since start (stdout holds the report)."""
    print(f"[{time.time() - _T0:7.1f}s] {LOG_PREFIX}{msg}", file=sys.stderr, flush=True)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def bench_arm(arm: LoadedArm, inputs: common.GDNInputs, args: argparse.Namespace,
              device: torch.device) -> dict[str, Any]:
    leaves = inputs.leaves
    do_cache: dict[torch.dtype, torch.Tensor] = {}

    def grad_output(o: torch.Tensor) -> torch.Tensor:
        if o.dtype not in do_cache:
            do_cache[o.dtype] = inputs.do.to(o.dtype)
        return do_cache[o.dtype]

    def fwd():
        o, _ = _call(arm, inputs)
        return o

    def fwd_bwd():
        o, _ = _call(arm, inputs)
        return torch.autograd.grad(o, leaves, grad_output(o))

    t_fwd = common.time_fn(fwd, device=device, warmup=args.warmup, iters=args.iters,
                           flush_l2=not args.no_flush)
    t_fb = common.time_fn(fwd_bwd, device=device, warmup=args.warmup, iters=args.iters,
                          flush_l2=not args.no_flush)
    _free(device)
    with common.MemoryTracker(device) as mem_fwd:
        o = fwd()
    del o
    _free(device)
    with common.MemoryTracker(device) as mem_fb:
        grads = fwd_bwd()
    del grads
    _free(device)
    return {
        "fwd_ms": t_fwd.median,
        "fwd_bwd_ms": t_fb.median,
        "fwd_stats": t_fwd.summary(),
        "fwd_bwd_stats": t_fb.summary(),
        "peak_extra_fwd_bytes": mem_fwd.peak_extra_bytes,
        "peak_extra_fwd_bwd_bytes": mem_fb.peak_extra_bytes,
        "baseline_bytes": mem_fb.baseline_bytes,
    }


def _reference_fn(kind: str) -> Callable[..., Any]:
    ref = common.import_workspace_module("gdn_core.reference")
    return ref.naive_recurrent_gdn if kind == "naive" else ref.chunk_gdn_reference


def _run_for_accuracy(arm_fn, inputs: common.GDNInputs):
    o, ht = arm_fn(
        *inputs.leaves, scale=None, initial_state=None, output_final_state=True,
        **inputs.kwargs(),
    )
    grads = torch.autograd.grad(o, inputs.leaves, inputs.do.to(o.dtype), allow_unused=True)
    return [o.detach(), None if ht is None else ht.detach(), *grads]


ACC_FIELDS = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta")


def make_inputs(shape: GDNShape, args: argparse.Namespace, device: torch.device,
                seed: int) -> common.GDNInputs:
    """The inputs every arm gets for ``shape`` (``--gate`` picks g and beta)."""
    inputs = common.make_gdn_inputs(
        shape, dtype=args.dtype, g_dtype=args.g_dtype, device=device, seed=seed,
        use_qk_l2norm_in_kernel=args.qk_l2norm_in_kernel,
    )
    if args.gate == "anchor":
        inputs = common.with_anchor_gate(inputs, seed=seed)
    return inputs


def _reference(shape: GDNShape, base: common.GDNInputs, args: argparse.Namespace,
               device: torch.device) -> list[torch.Tensor | None]:
    """The fp32 reference of one accuracy case, shared through ``--ref-cache`` by the
    anchors' processes (the token loop at T5000 costs seconds on a slow host)."""
    path = None
    if args.ref_cache:
        key = "|".join(map(str, (shape.spec, args.dtype, args.g_dtype, args.seed,
                                 args.qk_l2norm_in_kernel, args.gate, args.ref)))
        path = Path(args.ref_cache) / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".pt")
        if path.exists():
            log(f"  fp32 reference ({args.ref}) from {path}")
            return torch.load(path, map_location=device)
    ref_inputs = base.detached_copy(torch.float32, torch.float32)
    with common.ieee_fp32():
        ref = _run_for_accuracy(_reference_fn(args.ref), ref_inputs)
    log(f"  fp32 reference ({args.ref}) done")
    if path is not None:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save([None if t is None else t.cpu() for t in ref], tmp)
        os.replace(tmp, path)
    return ref


def accuracy_case(shape: GDNShape, arms: list[LoadedArm], args: argparse.Namespace,
                  device: torch.device) -> list[dict[str, Any]]:
    base = make_inputs(shape, args, device, args.seed + 1)
    rows = []
    ref = None
    for arm in arms:
        row: dict[str, Any] = {"case": shape.as_dict(), "arm": arm.name,
                               "reference": args.ref}
        skip = shape_skip_reason(arm.spec, shape, args.dtype)
        if skip:
            row["skipped"] = skip
            rows.append(row)
            continue
        if ref is None:
            ref = _reference(shape, base, args, device)
        try:
            first = _run_for_accuracy(arm.fn, base.detached_copy())
            second = _run_for_accuracy(arm.fn, base.detached_copy())
        except Exception as exc:  # noqa: BLE001 - report the arm's failure, keep going
            row["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
            rows.append(row)
            continue
        log(f"  {arm.name} done")
        errs = {name: common.rel_err(x, r) for name, x, r in zip(ACC_FIELDS, first, ref)}
        row["rel_err"] = errs
        finite = [e for e in errs.values() if e is not None]
        row["max_rel_err"] = max(finite, key=lambda e: (e != e, e)) if finite else None
        row["bitwise_repeatable"] = all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(first, second)
        )
        rows.append(row)
        del first, second
        _free(device)
    return rows


def _timed(r: dict[str, Any] | None) -> bool:
    return r is not None and "error" not in r and "skipped" not in r


def compute_ratios(results: list[dict[str, Any]]) -> None:
    """Add fla/arm, arm/anchor and det/nondet ratios to the result rows in place.

    ``over_anchor[anchor]`` = ``{"fwd": arm ms / anchor ms, "fwd_bwd": ..., "mem": arm
    peak extra fwd+bwd bytes / anchor's}`` for every arm that is not an anchor.
    """
    by_shape: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        by_shape.setdefault(r["shape"]["spec"], {})[r["arm"]] = r
    for arms in by_shape.values():
        fla = arms.get("fla")
        det, nondet = arms.get("det"), arms.get("nondet")
        for name, r in arms.items():
            if not _timed(r):
                continue
            if name not in COMPARE_ARMS:
                over: dict[str, dict[str, float | None]] = {}
                for anchor in COMPARE_ARMS:
                    a = arms.get(anchor)
                    if not _timed(a):
                        continue
                    mem = None
                    if r["peak_extra_fwd_bwd_bytes"] is not None and a["peak_extra_fwd_bwd_bytes"]:
                        mem = r["peak_extra_fwd_bwd_bytes"] / a["peak_extra_fwd_bwd_bytes"]
                    over[anchor] = {"fwd": r["fwd_ms"] / a["fwd_ms"],
                                    "fwd_bwd": r["fwd_bwd_ms"] / a["fwd_bwd_ms"], "mem": mem}
                if over:
                    r["over_anchor"] = over
            if _timed(fla) and name != "fla":
                r["fla_over_arm_fwd"] = fla["fwd_ms"] / r["fwd_ms"]
                r["fla_over_arm_fwd_bwd"] = fla["fwd_bwd_ms"] / r["fwd_bwd_ms"]
                if r["peak_extra_fwd_bwd_bytes"] is not None and fla["peak_extra_fwd_bwd_bytes"]:
                    r["mem_over_fla"] = (r["peak_extra_fwd_bwd_bytes"]
                                         / fla["peak_extra_fwd_bwd_bytes"])
        if _timed(det) and _timed(nondet):
            det["det_over_nondet_fwd"] = det["fwd_ms"] / nondet["fwd_ms"]
            det["det_over_nondet_fwd_bwd"] = det["fwd_bwd_ms"] / nondet["fwd_bwd_ms"]


# ---------------------------------------------------------------- report ---


def _mib(x: int | None) -> float | None:
    return None if x is None else x / (1 << 20)


def render_markdown(report: dict[str, Any]) -> str:
    meta, cfg = report["meta"], report["config"]
    env = meta["environment"]
    lines = ["# GDN single-rank training benchmark", ""]
    lines.append(f"- command: `{env['command']}`")
    lines.append(f"- GPU: {common.describe_gpu(meta['gpu'])}")
    if meta["gpu"].get("gpu") is not None and meta.get("gpu_clocks_end"):
        c = meta["gpu_clocks_end"]
        lines.append(f"- clocks after the run: SM {c.get('sm_clock_mhz', '?')} MHz, "
                     f"mem {c.get('mem_clock_mhz', '?')} MHz")
    commit = env.get("git_commit")
    lines.append(
        f"- torch {env['torch']}, Triton {env['triton']}, Python {env['python']}"
        + (f", git {commit[:12]}{' (dirty)' if env.get('git_dirty') else ''}" if commit else "")
    )
    lines.append(f"- device: {cfg['device']}"
                 + (f", gdn_core backend {cfg['gdn_core_backend']}"
                    if cfg.get("gdn_core_backend") else ""))
    versions = meta.get("anchor_versions") or {}
    if any(a in COMPARE_ARMS for a in cfg["arms"]):
        lines.append("- anchors installed: " + ", ".join(
            f"{d} {v or 'absent'}" for d, v in versions.items()))
    for name, info in meta["arms"].items():
        if info.get("skipped"):
            lines.append(f"- arm `{name}`: `{info['entry']}` — **skipped**: {info['skipped']}")
            continue
        origin = f"{info.get('version') or '?'}, {info.get('file') or '?'}"
        lines.append(f"- arm `{name}`: `{info['entry']}` ({origin})")
        if info.get("patch"):
            lines.append(f"  - note: {info['patch']}")
        proc = info.get("process")
        if proc:
            env_text = ", ".join(f"{k}={'unset' if v is None else v}"
                                 for k, v in proc.get("env", {}).items())
            lines.append(f"  - own process; blocked from import: "
                         f"{', '.join(proc.get('blocked_imports') or []) or 'nothing'}"
                         + (f"; {env_text}" if env_text else ""))
        imported = info.get("imported_at_end")
        if imported:
            lines.append("  - imported by the end: " + ", ".join(
                f"{m} {'yes' if v else 'no'}" for m, v in imported.items()))
        if info.get("paths"):
            lines.append("  - path: " + "; ".join(sorted(set(info["paths"]))))
    lines.append(
        f"- inputs: {cfg['dtype']} (g {cfg['g_dtype']}), seed {cfg['seed']}, q/k "
        + ("L2-normalised in the kernel (use_qk_l2norm_in_kernel=True)"
           if cfg["qk_l2norm_in_kernel"] else "L2-normalised before the call")
        + ("; g = logsigmoid(randn)/16, beta = sigmoid(rand) (docs/performance.md)"
           if cfg.get("gate") == "anchor" else
           "; g = -A·softplus(x + dt_bias), beta = sigmoid(randn) (common.make_gdn_inputs)")
        + "; no initial state, no final state"
    )
    lines.append(
        f"- timing: median of {cfg['iters']} after {cfg['warmup']} warm-up, {cfg['timing']}; "
        "fwd+bwd = forward + autograd.grad of sum(o·do) w.r.t. q, k, v, g, beta; "
        "memory = peak allocated minus the baseline (inputs) at the start"
    )
    lines.append("")

    results = report["results"]
    has_fla = any(r["arm"] == "fla" for r in results)
    headers = ["shape", "arm", "fwd ms", "fwd+bwd ms"]
    if has_fla:
        headers += ["fla/arm fwd", "fla/arm fwd+bwd"]
    headers += ["peak fwd MiB", "peak fwd+bwd MiB"]
    if has_fla:
        headers += ["mem/fla"]
    rows = []
    for r in results:
        if "error" in r:
            cells = [r["shape"]["label"], r["arm"], "FAILED", r["error"][:80]]
            rows.append(cells + [""] * (len(headers) - len(cells)))
            continue
        if "skipped" in r:
            cells = [r["shape"]["label"], r["arm"], "skipped", r["skipped"][:90]]
            rows.append(cells + [""] * (len(headers) - len(cells)))
            continue
        cells = [r["shape"]["label"], r["arm"], fmt(r["fwd_ms"]), fmt(r["fwd_bwd_ms"])]
        if has_fla:
            cells += [fmt(r.get("fla_over_arm_fwd"), 2), fmt(r.get("fla_over_arm_fwd_bwd"), 2)]
        cells += [fmt(_mib(r["peak_extra_fwd_bytes"]), 1),
                  fmt(_mib(r["peak_extra_fwd_bwd_bytes"]), 1)]
        if has_fla:
            cells += [fmt(r.get("mem_over_fla"), 2)]
        rows.append(cells)
    lines += ["## Time and memory", "", common.markdown_table(headers, rows), ""]
    if has_fla:
        lines.append("fla/arm > 1: the arm is faster than fla. mem/fla ≤ 1: the arm's peak extra "
                     "memory of fwd+bwd is at most fla's.")
        lines.append("")

    present = [a for a in COMPARE_ARMS if any(r["arm"] == a and _timed(r) for r in results)]
    over_rows = [r for r in results if r.get("over_anchor")]
    if present and over_rows:
        headers = ["shape", "arm"]
        for a in present:
            headers += [f"/{a} fwd", f"/{a} fwd+bwd", f"mem/{a}"]
        rows = []
        for r in over_rows:
            cells = [r["shape"]["label"], r["arm"]]
            for a in present:
                o = r["over_anchor"].get(a)
                cells += ([fmt(o["fwd"], 2), fmt(o["fwd_bwd"], 2), fmt(o["mem"], 2)] if o
                          else ["—"] * 3)
            rows.append(cells)
        lines += ["## Against the anchors (arm ms / anchor ms)", "",
                  common.markdown_table(headers, rows), "",
                  "> 1: the arm is slower than the anchor (issue 19's target is det ≤ 1.00 "
                  "against flashqla). mem: the arm's peak extra memory of fwd+bwd / the "
                  "anchor's.", ""]
    path_rows = [[r["shape"]["label"], r["arm"], r["path"]] for r in results if r.get("path")]
    if path_rows:
        lines += ["## Which path each arm ran (one probe call per shape: the anchors' dispatch, "
                  "our kernels' launches)", "",
                  common.markdown_table(["shape", "arm", "path"], path_rows), ""]

    det_rows = [
        [r["shape"]["label"], fmt(r["det_over_nondet_fwd"], 3),
         fmt(r["det_over_nondet_fwd_bwd"], 3)]
        for r in results if "det_over_nondet_fwd" in r
    ]
    if det_rows:
        lines += ["## Cost of determinism (det ms / nondet ms)", "",
                  common.markdown_table(["shape", "fwd", "fwd+bwd"], det_rows), ""]

    acc = report["accuracy"]
    if acc:
        ref_name = {"naive": "fp32 token-by-token recurrence (naive_recurrent_gdn)",
                    "chunk": "fp32 chunked reference (chunk_gdn_reference)"}[cfg["ref"]]
        headers = ["case", "arm", *ACC_FIELDS, "max", "bitwise repeat"]
        rows = []
        for a in acc:
            if "error" in a or "skipped" in a:
                cells = [a["case"]["label"], a["arm"], "FAILED" if "error" in a else "skipped",
                         (a.get("error") or a.get("skipped"))[:80]]
                rows.append(cells + [""] * (len(headers) - len(cells)))
                continue
            errs = a["rel_err"]
            rows.append([a["case"]["label"], a["arm"],
                         *(fmt(errs[f], 2) for f in ACC_FIELDS), fmt(a["max_rel_err"], 2),
                         fmt(a["bitwise_repeatable"])])
        lines += [f"## Accuracy: ‖x − ref‖ / ‖ref‖ against the {ref_name}", "",
                  f"Inputs in {cfg['dtype']} (g {cfg['g_dtype']}); the reference runs on the "
                  "same values in fp32 with TF32 off. 'bitwise repeat': two identical calls "
                  "gave identical o, final state and gradients.", "",
                  common.markdown_table(headers, rows), ""]

    if report["errors"]:
        lines += ["## Failures", ""]
        lines += [f"- {e}" for e in report["errors"]]
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------ main ---


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    anchors = "\n".join(f"  {s.spec:40s} {s.label}" for s in ANCHOR_SHAPES)
    p = argparse.ArgumentParser(
        description="Single-rank GDN forward / forward+backward benchmark "
                    "(gdn-det-train, gdn-train, fla).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"Default shapes (preset 'anchors', bf16, K=V=128):\n{anchors}\n\n"
               "A shape is 'B<b>,T<t>,H<h>[,HV<hv>][,K<k>][,V<v>][,D<docs>]'; ';' separates "
               "shapes.\nD > 1 packs D documents of seeded, varied lengths into B=1 with "
               "cu_seqlens.",
    )
    p.add_argument("--shapes", default=None,
                   help="';'-separated shape specs or 'anchors' (default: anchors; on a machine "
                        "without CUDA this is required and must be tiny)")
    p.add_argument("--arms", default="det,nondet",
                   help="comma-separated arms among det, nondet, det-plain, nondet-plain "
                        "(the packages with segment_size=0), det-s1024, det-s2048, det-s4096 "
                        "(explicit segment sizes), or an anchor of --compare (default: det,nondet)")
    p.add_argument("--compare", action="append", default=[], metavar="ARM[,ARM]",
                   help="anchors on the same inputs, each in its own process (repeatable or "
                        "comma-separated): fla (fla's own Triton kernels: flash_qla and "
                        "tilelang blocked), fla-tilelang (flash_qla blocked), fla-dispatch "
                        "(nothing blocked: FlashQLA when installed), flashqla (FlashQLA's "
                        "default, auto_cp=True), flashqla-exact (auto_cp=False)")
    p.add_argument("--gate", choices=GATES, default="layer",
                   help="g and beta: 'layer' (default; common.make_gdn_inputs: the GDN layer's "
                        "gate at initialisation) or 'anchor' (docs/performance.md: g = "
                        "logsigmoid(randn)/16, beta = sigmoid(rand))")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls first (default 10)")
    p.add_argument("--iters", type=int, default=50, help="timed calls, median taken (default 50)")
    p.add_argument("--dtype", default="bf16", help="q, k, v, beta dtype: bf16|fp16|fp32")
    p.add_argument("--g-dtype", default="fp32",
                   help="dtype of g (default fp32, as a real layer computes it); 'same' = --dtype")
    p.add_argument("--qk-l2norm-in-kernel", action="store_true",
                   help="pass raw q, k with use_qk_l2norm_in_kernel=True to every arm "
                        "(default: q, k L2-normalised before the call)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--acc-shapes", default=None,
                   help=f"small cases for the accuracy check, or 'none' (default on CUDA "
                        f"{DEFAULT_ACC_SHAPES['cuda']!r}, on CPU {DEFAULT_ACC_SHAPES['cpu']!r})")
    p.add_argument("--ref", choices=["naive", "chunk"], default="naive",
                   help="fp32 reference: token loop (naive, default) or chunked")
    p.add_argument("--no-flush", action="store_true",
                   help="do not overwrite a 256 MiB buffer (L2 flush) between timed calls")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--warm-compile-jobs", type=int, default=0, metavar="N",
                   help="before timing, run each own-process anchor once per shape, N "
                        "processes at a time, so that one compiling per shape (FlashQLA's "
                        "TileLang kernels) fills its disk cache in parallel (default 0: off)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    # Internal: an anchor's own process (anchors.py) and the shared fp32 references.
    p.add_argument("--arm-process-json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ref-cache", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.dtype = common.parse_dtype(args.dtype)
        args.g_dtype = args.dtype if args.g_dtype == "same" else common.parse_dtype(args.g_dtype)
    except ValueError as exc:
        p.error(str(exc))
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    compare = [c.strip() for item in args.compare for c in item.split(",") if c.strip()]
    bad = [c for c in compare if c not in COMPARE_ARMS]
    if bad:
        p.error(f"unknown --compare arm(s) {', '.join(bad)}; known: {', '.join(COMPARE_ARMS)}")
    arms += [c for c in compare if c not in arms]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        listed = ", ".join(n for n, s in ARMS.items() if s.listed)
        p.error(f"unknown arm(s) {', '.join(unknown)}; known: {listed}")
    if not arms:
        p.error("no arms selected")
    args.arm_names = list(dict.fromkeys(arms))
    if args.warm_compile_jobs < 0:
        p.error("--warm-compile-jobs must be >= 0")
    if args.warmup < 0 or args.iters < 1:
        p.error("--warmup must be >= 0 and --iters >= 1")
    if args.arm_process_json and len(args.arm_names) != 1:
        p.error("--arm-process-json runs exactly one arm")
    args.parser = p
    args.argv = argv
    return args


def _entry(spec: ArmSpec) -> str:
    return f"{spec.module}.{spec.attr}" + "".join(f", {k}={v!r}" for k, v in spec.kwargs)


def _run_shapes(loaded: list[LoadedArm], shapes: list[GDNShape], args: argparse.Namespace,
                device: torch.device, results: list[dict[str, Any]], errors: list[str],
                checkpoint: Callable[[], None]) -> None:
    """Time every arm of ``loaded`` on every shape (rows appended to ``results``)."""
    for shape in shapes:
        log(f"shape {shape.label}")
        try:
            inputs = make_inputs(shape, args, device, args.seed)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory for a custom shape
            for arm in loaded:
                results.append({"shape": shape.as_dict(), "arm": arm.name,
                                "error": f"inputs: {type(exc).__name__}: {exc}"})
            errors.append(f"{shape.label}: making the inputs failed: {exc}")
            continue
        for arm in loaded:
            row: dict[str, Any] = {"shape": shape.as_dict(), "arm": arm.name,
                                   "doc_lengths": inputs.meta.get("doc_lengths"),
                                   "inputs_bytes": inputs.nbytes()}
            skip = shape_skip_reason(arm.spec, shape, args.dtype)
            if skip:
                row["skipped"] = skip
                results.append(row)
                log(f"  {arm.name:9s} skipped: {skip}")
                continue
            try:
                probe_path(arm, inputs, row)
                row.update(bench_arm(arm, inputs, args, device))
                log(f"  {arm.name:9s} fwd {row['fwd_ms']:.3f} ms, "
                    f"fwd+bwd {row['fwd_bwd_ms']:.3f} ms"
                    + (f"  [{row['path']}]" if row.get("path") else ""))
            except Exception as exc:  # noqa: BLE001 - report the arm's failure, keep going
                traceback.print_exc(file=sys.stderr)
                row["error"] = f"{type(exc).__name__}: {exc}"
                errors.append(f"{shape.label}, arm {arm.name}: {row['error']}")
            anchor = ANCHOR_FLA_MS.get(shape.spec)
            if arm.name == "fla" and anchor and args.dtype == torch.bfloat16:
                row["design_anchor_fla_ms"] = {"fwd": anchor[0], "fwd_bwd": anchor[1]}
            qla = ANCHOR_FLASHQLA_MS.get(shape.spec)
            if arm.name == "flashqla" and qla and args.dtype == torch.bfloat16:
                row["design_anchor_flashqla"] = {"fwd_ms": qla[0], "fwd_bwd_ms": qla[1],
                                                 "peak_extra_fwd_bwd_mib": qla[2]}
            results.append(row)
            _free(device)
        del inputs
        _free(device)
        checkpoint()


def _run_accuracy(loaded: list[LoadedArm], acc_shapes: list[GDNShape],
                  args: argparse.Namespace, device: torch.device,
                  errors: list[str]) -> list[dict[str, Any]]:
    accuracy: list[dict[str, Any]] = []
    if not loaded:
        return accuracy
    for shape in acc_shapes:
        log(f"accuracy {shape.label}")
        rows = accuracy_case(shape, loaded, args, device)
        for r in rows:
            if "error" in r:
                errors.append(f"accuracy {shape.label}, arm {r['arm']}: {r['error']}")
            elif r["arm"] == "det" and not r.get("bitwise_repeatable", True):
                print(f"warning: det arm not bitwise repeatable on {shape.label}",
                      file=sys.stderr)
        accuracy += rows
    return accuracy


def _arm_process_main(args: argparse.Namespace, device: torch.device, shapes: list[GDNShape],
                      acc_shapes: list[GDNShape]) -> int:
    """An anchor's own process: block, load, report status, wait for ``go``, run, write JSON."""
    global LOG_PREFIX
    name = args.arm_names[0]
    LOG_PREFIX = f"[{name}] "
    try:
        arm = load_arm(name, device)
    except ArmUnavailable as exc:
        anchors.send_status({"ok": False, "reason": str(exc)})
        return 0
    anchors.send_status({"ok": True, "info": arm.info})
    if not anchors.wait_for_go():
        return 0
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    out = args.arm_process_json

    def write(partial: bool, accuracy: list[dict[str, Any]]) -> None:
        arm.info["imported_at_end"] = anchors.imported_modules()
        arm.info["paths"] = list(dict.fromkeys(r["path"] for r in results if r.get("path")))
        common.write_json(out, {"meta": {"arms": {name: arm.info}}, "results": results,
                                "accuracy": accuracy, "errors": errors, "partial": partial})

    _run_shapes([arm], shapes, args, device, results, errors, lambda: write(True, []))
    accuracy = _run_accuracy([arm], acc_shapes, args, device, errors)
    write(False, accuracy)
    return 1 if errors else 0


def _arm_process_argv(args: argparse.Namespace, name: str, device: torch.device,
                      shapes: list[GDNShape], acc_shapes: list[GDNShape], out: Path,
                      ref_cache: str) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()),
            "--device", str(device), "--arms", name,
            "--shapes", ";".join(s.spec for s in shapes),
            "--acc-shapes", ";".join(s.spec for s in acc_shapes) or "none",
            "--warmup", str(args.warmup), "--iters", str(args.iters),
            "--dtype", common.dtype_name(args.dtype), "--g-dtype", common.dtype_name(args.g_dtype),
            "--seed", str(args.seed), "--ref", args.ref, "--gate", args.gate,
            "--arm-process-json", str(out), "--ref-cache", ref_cache]
    if args.no_flush:
        argv.append("--no-flush")
    if args.qk_l2norm_in_kernel:
        argv.append("--qk-l2norm-in-kernel")
    return argv


def _warm_compile(args: argparse.Namespace, device: torch.device, shapes: list[GDNShape],
                  names: list[str], work: str) -> None:
    """One untimed forward+backward per (own-process arm, shape), ``--warm-compile-jobs``
    processes at a time, before any timing. An anchor that compiles its kernels for each
    shape (FlashQLA's TileLang kernels: 90-190 s a shape on the H200 machine's host) fills
    its on-disk kernel cache in parallel, and the timed process then loads from it; its
    own warm-up calls are unchanged, so the timing is not. A failure here is only logged:
    the timed run reports the arm's errors."""
    from concurrent.futures import ThreadPoolExecutor

    warm = argparse.Namespace(**{**vars(args), "warmup": 0, "iters": 1})
    jobs = [(name, i, shape) for name in names for i, shape in enumerate(shapes)]

    def one(job: tuple[str, int, GDNShape]) -> str:
        name, i, shape = job
        out = Path(work) / f"warm-{name}-{i}.json"
        argv = _arm_process_argv(warm, name, device, [shape], [], out, work)
        proc = anchors.ArmProcess(f"{name} warm-compile {shape.spec}", argv,
                                  _arm_process_env(ARMS[name]))
        try:
            if not proc.read_status().get("ok"):
                proc.quit()
                return f"{name} {shape.spec}: did not load"
            return f"{name} {shape.spec}: exit {proc.run()}"
        finally:
            proc.kill()

    t0 = time.perf_counter()
    log(f"warm compile: {len(jobs)} untimed runs, {args.warm_compile_jobs} at a time")
    with ThreadPoolExecutor(max_workers=args.warm_compile_jobs) as pool:
        for line in pool.map(one, jobs):
            log(f"warm compile: {line}")
    log(f"warm compile done in {time.perf_counter() - t0:.0f} s")


def _arm_process_env(spec: ArmSpec) -> dict[str, str]:
    env = dict(os.environ)
    for key, value in spec.env:
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _sort_rows(rows: list[dict[str, Any]], key: str, shapes: list[GDNShape],
               arm_names: list[str]) -> list[dict[str, Any]]:
    order = {}
    for i, s in enumerate(shapes):
        order.setdefault(s.spec, i)
    arm_order = {a: i for i, a in enumerate(arm_names)}
    return sorted(rows, key=lambda r: (order.get(r[key]["spec"], len(order)),
                                       arm_order.get(r["arm"], len(arm_order))))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    p = args.parser
    if args.device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            p.error("--device cuda requested but CUDA is not available")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)

    if args.shapes is None and device.type != "cuda":
        p.error("no CUDA here: the anchor shapes are far too large for the CPU reference backend; "
                "pass tiny --shapes, e.g. --shapes 'B1,T128,H2,K32,V32;B1,T256,H2,HV4,K32,V32,D3'")
    try:
        shapes = common.parse_shapes(args.shapes or "anchors", PRESETS)
        acc_text = args.acc_shapes or DEFAULT_ACC_SHAPES["cuda" if device.type == "cuda" else "cpu"]
        acc_shapes = ([] if acc_text.strip().lower() == "none"
                      else common.parse_shapes(acc_text, PRESETS))
    except ValueError as exc:
        p.error(str(exc))

    backend = None
    if device.type != "cuda":
        # CPU: the packages' reference backend (the Triton interpreter cannot do bf16 dots).
        os.environ.setdefault("GDN_CORE_BACKEND", "reference")
        backend = os.environ["GDN_CORE_BACKEND"]

    if args.arm_process_json:
        return _arm_process_main(args, device, shapes, acc_shapes)

    # A time limit's SIGTERM unwinds through the `finally` below: no anchor process outlives us.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = tempfile.mkdtemp(prefix="bench-gdn-train-")
    procs: dict[str, anchors.ArmProcess] = {}
    try:
        return _main(args, device, shapes, acc_shapes, backend, work, procs)
    finally:
        for proc in procs.values():
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)


def _main(args: argparse.Namespace, device: torch.device, shapes: list[GDNShape],
          acc_shapes: list[GDNShape], backend: str | None, work: str,
          procs: dict[str, anchors.ArmProcess]) -> int:
    loaded, failures = [], []
    arm_info: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    outs: dict[str, Path] = {}
    remote = [n for n in args.arm_names if ARMS[n].own_process]
    for name in args.arm_names:
        spec = ARMS[name]
        if not spec.own_process:
            try:
                arm = load_arm(name, device)
                loaded.append(arm)
                arm_info[name] = arm.info
            except ArmUnavailable as exc:
                failures.append(str(exc))
            continue
        top = spec.module.split(".")[0]
        reason = None
        if spec.optional and not anchors.importable(top):
            reason = f"{top} is not importable here (installing it: benchmarks/README.md)"
        elif spec.cuda_only and device.type != "cuda":
            reason = (f"arm {name!r} needs a CUDA GPU; running on {device}" if spec.optional
                      else f"arm {name!r} ({spec.what}) needs a CUDA GPU; running on {device}")
        if reason is not None:
            if spec.optional:
                skipped[name] = reason
            else:
                failures.append(reason)
    if acc_shapes:
        try:
            _reference_fn(args.ref)
        except ModuleNotFoundError as exc:
            print(f"error: the accuracy check needs gdn_core.reference: {exc} "
                  "(or pass --acc-shapes none)", file=sys.stderr)
            return 2
    if not failures and args.warm_compile_jobs > 0:
        _warm_compile(args, device, shapes, [n for n in remote if n not in skipped], work)
    if not failures:  # start every anchor's process; each loads its arm and reports
        for name in remote:
            if name in skipped:
                continue
            outs[name] = (Path(args.json).with_suffix(f".{name}.json") if args.json
                          else Path(work) / f"{name}.json")
            outs[name].unlink(missing_ok=True)
            argv = _arm_process_argv(args, name, device, shapes, acc_shapes, outs[name], work)
            procs[name] = anchors.ArmProcess(name, argv, _arm_process_env(ARMS[name]))
        for name, proc in procs.items():
            status = proc.read_status()
            if status.get("ok"):
                arm_info[name] = status["info"]
                log(f"arm {name} loaded in its own process (pid {proc.proc.pid})")
            elif ARMS[name].optional:
                skipped[name] = status.get("reason", "?")
            else:
                failures.append(status.get("reason", f"arm {name!r} did not load"))
        for name in list(procs):
            if name in skipped:
                procs.pop(name).quit()
    if failures:
        for proc in procs.values():
            proc.quit()
        for msg in failures:
            print(f"error: {msg}", file=sys.stderr)
        print("error: not running: every requested arm must be available "
              "(choose arms with --arms / --compare)", file=sys.stderr)
        return 2
    for name, reason in skipped.items():
        spec = ARMS[name]
        arm_info[name] = {"entry": _entry(spec), "what": spec.what, "skipped": reason}
        print(f"warning: arm {name} skipped: {reason}", file=sys.stderr)

    config = {
        "device": str(device), "gdn_core_backend": backend,
        "shapes": [s.as_dict() for s in shapes], "acc_shapes": [s.as_dict() for s in acc_shapes],
        "arms": args.arm_names, "warmup": args.warmup, "iters": args.iters,
        "dtype": common.dtype_name(args.dtype), "g_dtype": common.dtype_name(args.g_dtype),
        "qk_l2norm_in_kernel": args.qk_l2norm_in_kernel, "seed": args.seed, "ref": args.ref,
        "gate": args.gate,
        "flush_l2": not args.no_flush and device.type == "cuda",
        "timing": ("CUDA events per call" + ("" if args.no_flush else ", L2 flushed between calls")
                   if device.type == "cuda" else "host clock per call"),
        "fwd_bwd": "o = f(q, k, v, g, beta); torch.autograd.grad(o, (q, k, v, g, beta), do)",
        "forward_inputs_require_grad": True,
        "anchors_in_own_process": remote,
    }
    meta = {
        "environment": common.environment_facts([sys.argv[0], *(
            sys.argv[1:] if args.argv is None else args.argv)]),
        "gpu": common.gpu_facts(device if device.type == "cuda" else None),
        "anchor_versions": anchors.anchor_versions(),
        "arms": {n: arm_info[n] for n in args.arm_names if n in arm_info},
    }

    results: list[dict[str, Any]] = []
    accuracy: list[dict[str, Any]] = []
    errors: list[str] = []
    for name, reason in skipped.items():
        results += [{"shape": s.as_dict(), "arm": name, "skipped": reason} for s in shapes]
        accuracy += [{"case": s.as_dict(), "arm": name, "skipped": reason} for s in acc_shapes]

    def checkpoint() -> None:  # so far: a run cut short by a time limit still leaves its figures
        if args.json:
            common.write_json(args.json, {"meta": meta, "config": config, "results": results,
                                          "accuracy": accuracy, "partial": True,
                                          "errors": errors})

    _run_shapes(loaded, shapes, args, device, results, errors, checkpoint)
    args.ref_cache = work if procs else None  # the anchors' processes reuse the references
    accuracy += _run_accuracy(loaded, acc_shapes, args, device, errors)
    checkpoint()

    for name, proc in procs.items():
        log(f"arm {name}: running in its own process")
        rc = proc.run()
        got: dict[str, Any] = {}
        if outs[name].exists():
            try:
                got = json.loads(outs[name].read_text())
            except (OSError, ValueError) as exc:
                errors.append(f"arm {name}: its JSON {outs[name]} is unreadable: {exc}")
        if rc not in (0, 1):
            errors.append(f"arm {name}: its process exited with rc {rc}"
                          + (" (partial results kept)" if got.get("partial") else ""))
        meta["arms"][name].update(got.get("meta", {}).get("arms", {}).get(name, {}))
        rows = got.get("results", [])
        done = {r["shape"]["spec"] for r in rows}
        rows += [{"shape": s.as_dict(), "arm": name, "error": f"not run (process rc {rc})"}
                 for s in shapes if s.spec not in done]
        results += rows
        accuracy += got.get("accuracy", [])
        errors += got.get("errors", [])
        checkpoint()

    results = _sort_rows(results, "shape", shapes, args.arm_names)
    accuracy = _sort_rows(accuracy, "case", acc_shapes, args.arm_names)
    compute_ratios(results)

    if device.type == "cuda":
        meta["gpu_clocks_end"] = common.gpu_clocks()
    report = {"meta": meta, "config": config, "results": results, "accuracy": accuracy,
              "errors": errors}
    print(render_markdown(report))
    if args.json:
        common.write_json(args.json, report)
        log(f"wrote {args.json}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
