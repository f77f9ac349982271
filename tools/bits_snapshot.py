"""Bitwise snapshot of the GDN training calls: save once, check after every change.

Runs a fixed set of deterministic calls — both single-rank packages (autograd
and split API, workspace), plain and segmented layouts, packed documents,
grouped value heads (``HV = 2H``), L2 norm on/off, initial/final state, the
in-kernel gate, a :class:`~gdn_core.layout.VarlenLayout`, ``gdn_core``'s own
composition, and simulated KCP worlds of both KCP packages — and saves every
output and gradient. ``--check`` reruns them and compares with
``torch.equal`` (dtype and shape included), listing every difference.

Each backend runs in its own child interpreter: ``reference`` (CPU fp32 torch
reference: ``TRITON_INTERPRET`` unset) and ``interp`` (``TRITON_INTERPRET=1``:
the Triton kernels interpreted, fp32 and fp16) on a CPU machine; ``cuda``
(the compiled kernels, fp32/fp16/bf16) on a GPU machine.

    python tools/bits_snapshot.py save  /tmp/bits.pt [--backends reference,interp]
    python tools/bits_snapshot.py check /tmp/bits.pt [--backends reference,interp]

Exit status of ``check``: 0 all equal, 1 differences (listed), 2 cases missing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator

BACKENDS = ("reference", "interp", "cuda")


def _cases(backend: str) -> Iterator[tuple[str, Callable[[], dict]]]:
    """``(name, run)`` pairs; ``run()`` returns a dict of tensors (or ``None``)."""
    import gdn_det_train as det
    import gdn_train as fast
    import torch
    from gdn_core import testkit
    from gdn_core.compose import chunk_gdn_bwd, chunk_gdn_fwd
    from gdn_core.layout import VarlenLayout

    device = "cuda" if backend == "cuda" else "cpu"
    dtypes = {"reference": [torch.float32], "interp": [torch.float32, torch.float16],
              "cuda": [torch.float32, torch.float16, torch.bfloat16]}[backend]
    pkgs = {"det": (det.chunk_gated_delta_rule_det, det.chunk_gdn_det_fwd,
                    det.chunk_gdn_det_bwd, det.DetWorkspace),
            "fast": (fast.chunk_gated_delta_rule, fast.chunk_gdn_fwd, fast.chunk_gdn_bwd,
                     fast.Workspace)}
    # (name, make_inputs kwargs, call kwargs)
    layouts = [
        ("batch2", dict(B=2, T=70, H=1, HV=2), dict()),
        ("packed", dict(lengths=[40, 90, 20], H=1, HV=2), dict(l2norm=True)),
        ("packed_h1", dict(lengths=[65, 1, 62], H=2, HV=2), dict()),
        ("seg64", dict(lengths=[200, 30, 130], H=1, HV=2), dict(l2norm=True, segment_size=64)),
        ("seg64_nol2", dict(lengths=[150], H=2, HV=4), dict(segment_size=64)),
        ("gate", dict(lengths=[70, 50], H=1, HV=2, gate=True), dict(l2norm=True)),
        ("noh0", dict(lengths=[100, 28], H=1, HV=2, initial_state=False),
         dict(output_final_state=False, segment_size=64)),
    ]

    def tensors(d):
        return {k: v.detach().cpu() for k, v in d.items() if v is not None}

    for dtype in dtypes:
        dn = str(dtype).removeprefix("torch.")
        for pname, (auto, fwd, bwd, ws_cls) in pkgs.items():
            for lname, mk, kw in layouts:
                def run(mk=mk, kw=kw, auto=auto, dtype=dtype):
                    ins, cu, cot = testkit.make_inputs(**mk, dtype=dtype, device=device)
                    return tensors(testkit.run_fwd_bwd(auto, ins, cu, cot, **kw))

                yield f"{backend}/{dn}/{pname}/autograd/{lname}", run

            def split(fwd=fwd, bwd=bwd, ws_cls=ws_cls, dtype=dtype):
                ins, cu, cot = testkit.make_inputs(lengths=[90, 60], H=1, HV=2, dtype=dtype,
                                                   device=device)
                o, ht, saved = fwd(ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"],
                                   initial_state=ins["initial_state"], output_final_state=True,
                                   cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
                ws = ws_cls.for_inputs(ins["q"], ins["v"], cu)
                gr = bwd(saved, cot["do"], cot["dht"], workspace=ws)
                gr2 = bwd(saved, cot["do"], cot["dht"], workspace=ws)  # workspace reused
                return tensors({"o": o, "ht": ht, **gr.as_dict(),
                                **{f"again_{k}": v for k, v in gr2.as_dict().items()}})

            yield f"{backend}/{dn}/{pname}/split/ws", split

            def layout_call(auto=auto, dtype=dtype):
                ins, cu, cot = testkit.make_inputs(lengths=[70, 40], H=1, HV=2, dtype=dtype,
                                                   device=device, initial_state=False)
                lay = VarlenLayout([0, 70, 110], device=device, max_docs=4)
                return tensors(testkit.run_fwd_bwd(auto, ins, lay, cot, l2norm=True,
                                                   output_final_state=False))

            yield f"{backend}/{dn}/{pname}/autograd/varlen_layout", layout_call

        def core(dtype=dtype):
            ins, cu, cot = testkit.make_inputs(lengths=[130, 64], H=1, HV=2, dtype=dtype,
                                               device=device)
            out = {}
            for det_mode in (True, False):
                o, ht, saved = chunk_gdn_fwd(
                    ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"],
                    initial_state=ins["initial_state"], output_final_state=True,
                    cu_seqlens=cu, deterministic=det_mode, segment_size=64)
                gr = chunk_gdn_bwd(saved, cot["do"], cot["dht"], deterministic=det_mode)
                out.update({f"{det_mode}_{k}": v for k, v in
                            {"o": o, "ht": ht, **vars(gr)}.items()})
            return tensors(out)

        yield f"{backend}/{dn}/core/segment64", core

        for kname in ("gdn_det_train_kcp", "gdn_train_kcp"):
            for boundary, seg in (("chunk", None), ("segment", 64), ("even", None)):
                def kcp(kname=kname, boundary=boundary, seg=seg, dtype=dtype):
                    return _kcp_world(kname, boundary, seg, dtype, device)

                yield f"{backend}/{dn}/{kname}/sim3/{boundary}", kcp


def _kcp_world(kname: str, boundary: str, seg, dtype, device) -> dict:
    import importlib

    import torch
    from gdn_core import testkit

    m = importlib.import_module(kname)
    sfx = "_det" if kname.startswith("gdn_det") else ""
    case = {"offsets": [0, 150, 170, 300], "H": 1, "HV": 2, "K": 16, "V": 16, "seed": 3,
            "dtype": str(dtype).removeprefix("torch.")}
    q, k, v, g, beta, do = testkit.kcp_case_inputs(case, device)
    kw = {} if seg is None else {"segment_size": seg}
    plan = getattr(m, f"partition{sfx}_kcp")(case["offsets"], 3, boundary=boundary, **kw)
    ctxs = getattr(m, f"build_simulated_contexts{sfx}_kcp")(plan, device=device)

    def shards(t):
        return [t[:, slice(*plan.token_range(r))].contiguous() for r in range(3)]

    sh = [shards(t) for t in (q, k, v, g, beta, do)]
    os_, saveds = getattr(m, f"chunk_gdn{sfx}_fwd_kcp_simulated")(
        *sh[:5], ctxs, use_qk_l2norm_in_kernel=True)
    grads = getattr(m, f"chunk_gdn{sfx}_bwd_kcp_simulated")(saveds, sh[5])
    out = {"o": torch.cat(os_, 1)}
    for n in ("dq", "dk", "dv", "dg", "dbeta"):
        out[n] = torch.cat([getattr(gr, n) for gr in grads], 1)
    return {k: v.detach().cpu() for k, v in out.items()}


def _child(backend: str, out_path: str) -> None:
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    results, errors = {}, {}
    for name, run in _cases(backend):
        try:
            results[name] = run()
        except Exception as e:  # noqa: BLE001 - recorded: a case that raises is a difference
            errors[name] = f"{type(e).__name__}: {e}"
        print(name, "error" if name in errors else "ok", flush=True)
    torch.save({"results": results, "errors": errors}, out_path)


def _run_backend(backend: str) -> dict:
    env = dict(os.environ)
    env.pop("GDN_CORE_BACKEND", None)
    env.pop("TRITON_INTERPRET", None)
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if backend == "interp":
        env["TRITON_INTERPRET"] = "1"
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "part.pt")
        subprocess.run([sys.executable, __file__, "_child", backend, path], env=env, check=True)
        return torch.load(path)


def _compare(want: dict, got: dict) -> list[str]:
    import torch

    diffs = []
    for key in sorted(set(want) | set(got)):
        a, b = want.get(key), got.get(key)
        if a is None or b is None:
            diffs.append(f"  {key}: {'missing now' if b is None else 'new'}")
        elif a.dtype != b.dtype or a.shape != b.shape:
            diffs.append(f"  {key}: {a.dtype}{tuple(a.shape)} -> {b.dtype}{tuple(b.shape)}")
        elif not torch.equal(a, b):
            err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
            diffs.append(f"  {key}: values differ (relative {err:.1e})")
    return diffs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("action", choices=("save", "check", "_child"))
    p.add_argument("path")
    p.add_argument("extra", nargs="?")
    p.add_argument("--backends", default=None,
                   help="comma separated, of " + ", ".join(BACKENDS) +
                        " (default: cuda on a GPU machine, else reference,interp)")
    args = p.parse_args()
    if args.action == "_child":
        _child(args.path, args.extra)
        return 0
    import torch

    backends = (args.backends.split(",") if args.backends else
                ["cuda"] if torch.cuda.is_available() else ["reference", "interp"])
    snap = {"results": {}, "errors": {}}
    for b in backends:
        part = _run_backend(b)
        snap["results"].update(part["results"])
        snap["errors"].update(part["errors"])
    if args.action == "save":
        torch.save(snap, args.path)
        n = sum(len(v) for v in snap["results"].values())
        print(f"saved {len(snap['results'])} cases ({n} tensors), "
              f"{len(snap['errors'])} raising, to {args.path}")
        for name, err in snap["errors"].items():
            print(f"  raises: {name}: {err}")
        return 0
    want = torch.load(args.path)
    status, bad = 0, 0
    for name in sorted(set(want["results"]) | set(snap["results"]) | set(want["errors"])
                       | set(snap["errors"])):
        if not name.startswith(tuple(f"{b}/" for b in backends)):
            continue
        if name in want["errors"] or name in snap["errors"]:
            if want["errors"].get(name) != snap["errors"].get(name):
                print(f"{name}: raised {want['errors'].get(name)!r} before, "
                      f"{snap['errors'].get(name)!r} now")
                status, bad = 1, bad + 1
            continue
        if name not in want["results"] or name not in snap["results"]:
            print(f"{name}: {'not in the snapshot' if name not in want['results'] else 'missing'}")
            status = max(status, 2)
            continue
        diffs = _compare(want["results"][name], snap["results"][name])
        if diffs:
            print(f"{name}: DIFFERS")
            print("\n".join(diffs))
            status, bad = 1, bad + 1
    total = sum(1 for n in snap["results"] if n.startswith(tuple(f"{b}/" for b in backends)))
    print(f"{total} cases checked: {'all bitwise equal' if status == 0 else f'{bad} differ'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
