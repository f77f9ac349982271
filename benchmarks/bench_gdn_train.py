#!/usr/bin/env python3
"""Single-rank GDN training benchmark: forward and forward+backward, side by side.

Arms (all called with fla's signature ``(q, k, v, g, beta, scale=None,
initial_state=None, output_final_state=False, cu_seqlens=None,
use_qk_l2norm_in_kernel=False) -> (o, final_state)``):

* ``det``    — ``gdn_det_train.chunk_gated_delta_rule_det`` (deterministic)
* ``nondet`` — ``gdn_train.chunk_gated_delta_rule`` (non-deterministic)
* ``fla``    — ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (``--compare fla``;
  CUDA only). On Hopper with Triton < 3.7.1 fla refuses its GDN backward, so
  ``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1`` is forced to ``True`` and the
  report says so.
* ``reference`` — ``gdn_core.reference.chunk_gdn_reference`` (fp32 torch,
  autograd); for smoke tests of this script only.

Every arm of one run gets the same inputs (seeded, layer-like: see
``common.make_gdn_inputs``). Reported per shape and arm: median ms of the
forward and of forward+backward (backward of ``sum(o * do)``, i.e.
``autograd.grad(o, inputs, do)``), ratios against fla (``fla_ms / arm_ms``,
> 1 means the arm is faster), det/nondet ratios, the peak extra device memory
of forward and of forward+backward, and on small cases the relative error of
``o``, the final state and every gradient against an fp32 reference, plus
whether two identical calls gave bitwise identical results.

An arm whose package is missing or lacks its entry point stops the run before
anything is timed, with a message saying which and why; an arm that fails on
one shape is reported as failed there and the run exits non-zero.

Without CUDA it runs on the CPU (``GDN_CORE_BACKEND=reference`` unless set),
for tiny ``--shapes`` only. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

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
PRESETS = {"anchors": ANCHOR_SHAPES}

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
        ArmSpec("fla", "fla.ops.gated_delta_rule", "chunk_gated_delta_rule",
                "flash-linear-attention", cuda_only=True),
        ArmSpec("reference", "gdn_core.reference", "chunk_gdn_reference",
                "gdn-core fp32 reference (smoke tests only)", listed=False),
    )
}


@dataclass
class LoadedArm:
    spec: ArmSpec
    fn: Callable[..., Any]
    info: dict[str, Any]

    @property
    def name(self) -> str:
        return self.spec.name


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


def load_arm(name: str, device: torch.device) -> LoadedArm:
    spec = ARMS[name]
    if spec.cuda_only and device.type != "cuda":
        raise ArmUnavailable(f"arm {name!r} ({spec.what}) needs a CUDA GPU; running on {device}")
    top = spec.module.split(".")[0]
    try:
        if name == "fla":
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
    if name == "fla":
        _patch_fla(info)
    return LoadedArm(spec, fn, info)


# --------------------------------------------------------------- running ---


def _call(arm: LoadedArm, inputs: common.GDNInputs, output_final_state: bool = False):
    return arm.fn(
        *inputs.leaves, scale=None, initial_state=None, output_final_state=output_final_state,
        **inputs.kwargs(),
    )


_T0 = time.perf_counter()


def log(msg: str) -> None:
    """Progress on stderr, stamped with seconds since start (stdout holds the report)."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


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


def accuracy_case(shape: GDNShape, arms: list[LoadedArm], args: argparse.Namespace,
                  device: torch.device) -> list[dict[str, Any]]:
    base = common.make_gdn_inputs(
        shape, dtype=args.dtype, g_dtype=args.g_dtype, device=device, seed=args.seed + 1,
        use_qk_l2norm_in_kernel=args.qk_l2norm_in_kernel,
    )
    ref_inputs = base.detached_copy(torch.float32, torch.float32)
    with common.ieee_fp32():
        ref = _run_for_accuracy(_reference_fn(args.ref), ref_inputs)
    log(f"  fp32 reference ({args.ref}) done")
    rows = []
    for arm in arms:
        row: dict[str, Any] = {"case": shape.as_dict(), "arm": arm.name,
                               "reference": args.ref}
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


def compute_ratios(results: list[dict[str, Any]]) -> None:
    """Add fla/arm and det/nondet ratios to the result rows in place."""
    by_shape: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        by_shape.setdefault(r["shape"]["spec"], {})[r["arm"]] = r
    for arms in by_shape.values():
        fla = arms.get("fla")
        det, nondet = arms.get("det"), arms.get("nondet")
        for name, r in arms.items():
            if "error" in r:
                continue
            if fla is not None and "error" not in fla and name != "fla":
                r["fla_over_arm_fwd"] = fla["fwd_ms"] / r["fwd_ms"]
                r["fla_over_arm_fwd_bwd"] = fla["fwd_bwd_ms"] / r["fwd_bwd_ms"]
                if r["peak_extra_fwd_bwd_bytes"] is not None and fla["peak_extra_fwd_bwd_bytes"]:
                    r["mem_over_fla"] = (r["peak_extra_fwd_bwd_bytes"]
                                         / fla["peak_extra_fwd_bwd_bytes"])
        if det and nondet and "error" not in det and "error" not in nondet:
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
    for name, info in meta["arms"].items():
        origin = f"{info.get('version') or '?'}, {info.get('file') or '?'}"
        lines.append(f"- arm `{name}`: `{info['entry']}` ({origin})")
        if info.get("patch"):
            lines.append(f"  - note: {info['patch']}")
    lines.append(
        f"- inputs: {cfg['dtype']} (g {cfg['g_dtype']}), seed {cfg['seed']}, q/k "
        + ("L2-normalised in the kernel (use_qk_l2norm_in_kernel=True)"
           if cfg["qk_l2norm_in_kernel"] else "L2-normalised before the call")
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
            if "error" in a:
                cells = [a["case"]["label"], a["arm"], "FAILED", a["error"][:80]]
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
                        "(explicit segment sizes), fla (default: det,nondet)")
    p.add_argument("--compare", action="append", default=[], choices=["fla"],
                   help="also run fla's chunk_gated_delta_rule on the same inputs")
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
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    args = p.parse_args(argv)
    try:
        args.dtype = common.parse_dtype(args.dtype)
        args.g_dtype = args.dtype if args.g_dtype == "same" else common.parse_dtype(args.g_dtype)
    except ValueError as exc:
        p.error(str(exc))
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    arms += [c for c in args.compare if c not in arms]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        listed = ", ".join(n for n, s in ARMS.items() if s.listed)
        p.error(f"unknown arm(s) {', '.join(unknown)}; known: {listed}")
    if not arms:
        p.error("no arms selected")
    args.arm_names = list(dict.fromkeys(arms))
    if args.warmup < 0 or args.iters < 1:
        p.error("--warmup must be >= 0 and --iters >= 1")
    args.parser = p
    return args


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

    loaded, failures = [], []
    for name in args.arm_names:
        try:
            loaded.append(load_arm(name, device))
        except ArmUnavailable as exc:
            failures.append(str(exc))
    if failures:
        for msg in failures:
            print(f"error: {msg}", file=sys.stderr)
        print("error: not running: every requested arm must be available "
              "(choose arms with --arms / --compare)", file=sys.stderr)
        return 2
    if acc_shapes:
        try:
            _reference_fn(args.ref)
        except ModuleNotFoundError as exc:
            print(f"error: the accuracy check needs gdn_core.reference: {exc} "
                  "(or pass --acc-shapes none)", file=sys.stderr)
            return 2

    config = {
        "device": str(device), "gdn_core_backend": backend,
        "shapes": [s.as_dict() for s in shapes], "acc_shapes": [s.as_dict() for s in acc_shapes],
        "arms": args.arm_names, "warmup": args.warmup, "iters": args.iters,
        "dtype": common.dtype_name(args.dtype), "g_dtype": common.dtype_name(args.g_dtype),
        "qk_l2norm_in_kernel": args.qk_l2norm_in_kernel, "seed": args.seed, "ref": args.ref,
        "flush_l2": not args.no_flush and device.type == "cuda",
        "timing": ("CUDA events per call" + ("" if args.no_flush else ", L2 flushed between calls")
                   if device.type == "cuda" else "host clock per call"),
        "fwd_bwd": "o = f(q, k, v, g, beta); torch.autograd.grad(o, (q, k, v, g, beta), do)",
        "forward_inputs_require_grad": True,
    }
    meta = {
        "environment": common.environment_facts([sys.argv[0], *(
            sys.argv[1:] if argv is None else argv)]),
        "gpu": common.gpu_facts(device if device.type == "cuda" else None),
        "arms": {a.name: a.info for a in loaded},
    }

    results: list[dict[str, Any]] = []
    errors: list[str] = []
    for shape in shapes:
        log(f"shape {shape.label}")
        try:
            inputs = common.make_gdn_inputs(
                shape, dtype=args.dtype, g_dtype=args.g_dtype, device=device, seed=args.seed,
                use_qk_l2norm_in_kernel=args.qk_l2norm_in_kernel,
            )
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
            try:
                row.update(bench_arm(arm, inputs, args, device))
                log(f"  {arm.name:9s} fwd {row['fwd_ms']:.3f} ms, "
                    f"fwd+bwd {row['fwd_bwd_ms']:.3f} ms")
            except Exception as exc:  # noqa: BLE001 - report the arm's failure, keep going
                traceback.print_exc(file=sys.stderr)
                row["error"] = f"{type(exc).__name__}: {exc}"
                errors.append(f"{shape.label}, arm {arm.name}: {row['error']}")
            anchor = ANCHOR_FLA_MS.get(shape.spec)
            if arm.name == "fla" and anchor and args.dtype == torch.bfloat16:
                row["design_anchor_fla_ms"] = {"fwd": anchor[0], "fwd_bwd": anchor[1]}
            results.append(row)
            _free(device)
        del inputs
        _free(device)
        if args.json:  # so far: a run cut short by a time limit still leaves its figures
            common.write_json(args.json, {"meta": meta, "config": config, "results": results,
                                          "partial": True, "errors": errors})
    compute_ratios(results)

    accuracy: list[dict[str, Any]] = []
    for shape in acc_shapes:
        log(f"accuracy {shape.label}")
        rows = accuracy_case(shape, loaded, args, device)
        for r in rows:
            if "error" in r:
                errors.append(f"accuracy {shape.label}, arm {r['arm']}: {r['error']}")
            elif r["arm"] == "det" and not r["bitwise_repeatable"]:
                print(f"warning: det arm not bitwise repeatable on {shape.label}",
                      file=sys.stderr)
        accuracy += rows

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
