"""The whole GDN layer, forward+backward: ours against fla's ``GatedDeltaNet`` layer.

    python benchmarks/bench_layer.py --compare fla --out benchmarks/results/DATE-h200-bench-layer.md

Default configuration: transformers' Qwen3-Next linear-attention layer (hidden
2048, 16 q/k heads and 32 value heads of 128, conv 4, gated output norm), bf16,
on the anchor token counts (``docs/performance.md``): B1 T8192, B1 T32768, B4
T8192, B1 T32768 in 8 documents, B1 T65536 in 16 documents. Arms:
``gdn_det_train.GatedDeltaNet`` (``det``), ``gdn_train.GatedDeltaNet``
(``fast``) and, with ``--compare fla``, ``fla.layers.GatedDeltaNet`` with the
same weights (ours load fla's state dict unchanged) and the same inputs.

Before timing, a check on a small packed input (2 documents, 4096 tokens):
every arm's output, input gradient and parameter gradients against our layer
in fp32 with the same weights (relative max error). For fla this also checks
the state-dict mapping. Timing: ``triton.testing.do_bench`` median of
forward+backward (and forward alone), parameter and input gradients reset
each call; ``peak``: extra memory of one forward+backward. ``--profile``
adds a torch.profiler table (CUDA time per kernel) of each arm at the first
shape. fla refuses its GDN backward on Hopper with Triton < 3.7.1; as in
``docs/machines.md`` this script then sets
``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True`` (and says so). It stops if
``flash_qla`` is importable (fla would dispatch to it) unless
``--allow-flashqla``.

``--device cpu`` (a smoke run: small shapes given by ``--shape``, our arms
only, wall-clock timing) needs no GPU.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for _pkg in ("gdn_core", "gdn_train", "gdn_det_train"):
    if importlib.util.find_spec(_pkg) is None:  # run from a checkout without installing
        sys.path.insert(0, str(ROOT / "packages" / _pkg.replace("_", "-") / "src"))

QWEN3_NEXT = dict(hidden_size=2048, num_heads=16, num_v_heads=32, head_dim=128, expand_v=1.0,
                  conv_size=4, norm_eps=1e-6, use_gate=True)
# (B, T, documents)
ANCHORS = [(1, 8192, 1), (1, 32768, 1), (4, 8192, 1), (1, 32768, 8), (1, 65536, 16)]


def parse_shape(text: str) -> tuple[int, int, int]:
    """``B:T[:docs]`` → ``(B, T, docs)``."""
    parts = [int(p) for p in text.split(":")]
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected B:T or B:T:docs")
    return (parts[0], parts[1], parts[2] if len(parts) == 3 else 1)


def make_arm(name: str, config: dict, device: torch.device, dtype: torch.dtype,
             state: dict | None) -> torch.nn.Module:
    """An arm's layer on ``device``/``dtype``, loaded with ``state`` when given."""
    if name == "fla":
        layer = importlib.import_module("fla.layers").GatedDeltaNet(**config)
    else:
        module = importlib.import_module({"det": "gdn_det_train", "fast": "gdn_train"}[name])
        layer = module.GatedDeltaNet(**config)
    if state is not None:
        layer.load_state_dict(state)
    return layer.to(device=device, dtype=dtype)


def call(name: str, layer: torch.nn.Module, x: torch.Tensor, cu) -> torch.Tensor:
    """One forward: fla returns ``(o, attentions, cache)``, ours ``(o, final_state)``."""
    return layer(x, cu_seqlens=cu)[0]


def inputs(shape, hidden: int, device, dtype, seed: int = 0):
    """``(x [B,T,hidden], dy, cu_seqlens or None)``: documents of equal length."""
    B, T, docs = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(B, T, hidden, device=device, dtype=dtype, generator=gen)
    dy = torch.randn(B, T, hidden, device=device, dtype=dtype, generator=gen)
    cu = None
    if docs > 1:
        if B != 1:
            raise SystemExit(f"shape {shape}: packed documents need B == 1")
        cu = torch.linspace(0, T, docs + 1, device=device).round().to(torch.int32)
    return x, dy, cu


def fwd_bwd(name, layer, x, dy, cu) -> Callable[[], None]:
    def run() -> None:
        call(name, layer, x, cu).backward(dy)
    return run


def grads_of(name, layer, x, dy, cu) -> dict[str, torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out = call(name, layer, x, cu)
    out.backward(dy)
    got = {"out": out.detach().float(), "dx": x.grad.float()}
    got.update({n: p.grad.float() for n, p in layer.named_parameters() if p.grad is not None})
    return got


_T0 = time.perf_counter()


def say(msg: str) -> None:
    """A progress line on stderr, flushed (a run cut short by a time limit shows how far it
    got: the first call of each arm compiles, and fla's layer autotunes per shape)."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check(arms: list[str], config: dict, device, dtype) -> dict[str, dict[str, float]]:
    """Every arm (``dtype``) against our layer in fp32, same weights, 2 documents."""
    torch.manual_seed(0)
    state = make_arm("det", config, torch.device("cpu"), torch.float32, None).state_dict()
    T = 4096 if device.type == "cuda" else 128
    x, dy, cu = inputs((1, T, 2), config["hidden_size"], device, torch.float32, seed=1)
    want = grads_of("fast", make_arm("fast", config, device, torch.float32, state), x, dy, cu)
    out = {}
    for name in arms:
        got = grads_of(name, make_arm(name, config, device, dtype, state), x.to(dtype),
                       dy.to(dtype), cu)
        params = [rel(got[n], want[n]) for n in want if n not in ("out", "dx")]
        out[name] = {"out": rel(got["out"], want["out"]), "dx": rel(got["dx"], want["dx"]),
                     "params": max(params), "n_params": len(params)}
        say(f"check: {name} {out[name]}")
    return out


def time_arm(name, layer, x, dy, cu, warmup: int, rep: int) -> dict[str, float]:
    params = [p for p in layer.parameters()]
    xg = x.detach().clone().requires_grad_(True)
    run = fwd_bwd(name, layer, xg, dy, cu)

    def fwd() -> None:
        with torch.no_grad():
            call(name, layer, xg, cu)

    if x.device.type != "cuda":
        def wall(fn) -> float:
            fn()
            t0 = time.perf_counter()
            for _ in range(rep):
                fn()
            return (time.perf_counter() - t0) / rep * 1e3
        return {"fwd": wall(fwd), "fwd_bwd": wall(run), "peak_mib": float("nan")}
    from triton.testing import do_bench

    grads = [xg, *params]
    fwd_ms = do_bench(fwd, warmup=warmup, rep=rep, return_mode="median")
    total = do_bench(run, warmup=warmup, rep=rep, grad_to_none=grads, return_mode="median")
    for g in grads:
        g.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return {"fwd": fwd_ms, "fwd_bwd": total, "peak_mib": peak}


def profile_arm(name, layer, x, dy, cu) -> str:
    from torch.profiler import ProfilerActivity, profile

    xg = x.detach().clone().requires_grad_(True)
    run = fwd_bwd(name, layer, xg, dy, cu)
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            run()
        torch.cuda.synchronize()
    table = prof.key_averages()
    try:
        return table.table(sort_by="cuda_time_total", row_limit=25)
    except (AttributeError, KeyError, ValueError):  # newer torch: device_time_total
        return table.table(sort_by="device_time_total", row_limit=25)


def prepare_fla(allow_flashqla: bool) -> list[str]:
    notes = []
    if importlib.util.find_spec("flash_qla") is not None and not allow_flashqla:
        raise SystemExit("flash_qla is importable: fla would dispatch its kernel to FlashQLA. "
                         "Run without it (or pass --allow-flashqla).")
    chunk_o = importlib.import_module("fla.ops.common.chunk_o")
    if getattr(chunk_o, "TRITON_ABOVE_3_7_1", None) is False:
        chunk_o.TRITON_ABOVE_3_7_1 = True
        notes.append("fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 forced to True (fla refuses "
                     "its GDN backward on Hopper with Triton < 3.7.1; docs/machines.md)")
    return notes


def versions() -> str:
    import triton

    parts = [f"torch {torch.__version__}", f"triton {triton.__version__}"]
    for mod in ("gdn_core", "fla"):
        if importlib.util.find_spec(mod) is not None:
            m = importlib.import_module(mod)
            parts.append(f"{mod} {getattr(m, '__version__', '?')}")
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name())
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compare", choices=("fla",), help="also time fla's GatedDeltaNet layer")
    p.add_argument("--arms", default="det,fast", help="our arms: det, fast (default both)")
    p.add_argument("--shape", type=parse_shape, action="append",
                   help="B:T[:docs], repeatable (default: the anchor token counts)")
    p.add_argument("--hidden", type=int, help="override hidden_size (smoke runs)")
    p.add_argument("--heads", type=parse_shape, metavar="H:HV:D",
                   help="override q/k heads, value heads, head dim (smoke runs)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--profile", action="store_true", help="a profile per arm at the first shape")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check")
    p.add_argument("--allow-flashqla", action="store_true")
    p.add_argument("--out", help="also write the report (markdown) here")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU (use --device cpu for a smoke run)")
    dtype = getattr(torch, args.dtype)
    config = dict(QWEN3_NEXT)
    if args.hidden:
        config["hidden_size"] = args.hidden
    if args.heads:
        config.update(num_heads=args.heads[0], num_v_heads=args.heads[1],
                      head_dim=args.heads[2])
    arms = [a for a in args.arms.split(",") if a]
    notes = []
    if args.compare == "fla":
        notes += prepare_fla(args.allow_flashqla)
        arms.append("fla")
    shapes = args.shape or ANCHORS
    lines = [f"# GDN layer forward+backward: {', '.join(arms)}", "",
             f"- {versions()}", f"- layer: {config}, {args.dtype}",
             f"- timing: {'do_bench median' if device.type == 'cuda' else 'wall clock mean'} "
             f"(warmup {args.warmup}, rep {args.rep})"] + [f"- note: {n}" for n in notes]

    if not args.no_check:
        lines += ["", "## Check against our layer in fp32 (relative max error)", "",
                  "| arm | out | dx | worst parameter gradient (of n) |", "|---|---|---|---|"]
        for name, e in check(arms, config, device, dtype).items():
            lines.append(f"| {name} | {e['out']:.2e} | {e['dx']:.2e} | {e['params']:.2e} "
                         f"({e['n_params']}) |")
    header = "| B, T, docs | " + " | ".join(f"{a} fwd / fwd+bwd ms, peak MiB" for a in arms)
    ratios = [a for a in arms if a != "fla"] if "fla" in arms else []
    header += "".join(f" | {a} / fla (fwd+bwd)" for a in ratios) + " |"
    lines += ["", "## Timing", "", header, "|" + "---|" * (1 + len(arms) + len(ratios))]
    profiles = []
    torch.manual_seed(0)
    state = make_arm("det", config, torch.device("cpu"), torch.float32, None).state_dict()
    for i, shape in enumerate(shapes):
        x, dy, cu = inputs(shape, config["hidden_size"], device, dtype)
        res = {}
        for name in arms:
            layer = make_arm(name, config, device, dtype, state)
            res[name] = time_arm(name, layer, x, dy, cu, args.warmup, args.rep)
            say(f"{shape} {name}: {res[name]}")
            if args.profile and i == 0 and device.type == "cuda":
                profiles.append(f"### {name}, shape {shape}\n\n```\n"
                                f"{profile_arm(name, layer, x, dy, cu)}\n```")
                say(f"{shape} {name}: profiled")
            del layer
        row = f"| {shape[0]}, {shape[1]}, {shape[2]} | " + " | ".join(
            f"{res[a]['fwd']:.2f} / {res[a]['fwd_bwd']:.2f}, {res[a]['peak_mib']:.0f}"
            for a in arms)
        row += "".join(f" | {res[a]['fwd_bwd'] / res['fla']['fwd_bwd']:.2f}" for a in ratios)
        lines.append(row + " |")
        print(lines[-1], flush=True)
    if profiles:
        lines += ["", "## Profiles", ""] + profiles
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
