"""CPU smoke tests of benchmarks/bench_gdn_train.py and its helpers in benchmarks/common.py.

The script runs as a subprocess at tiny sizes on the CPU (the packages' reference
backend) and its JSON is checked for the fields users and later scripts read.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "benchmarks" / "bench_gdn_train.py"

TINY_SHAPES = "B1,T80,H2,K32,V32;B1,T150,H1,HV2,K32,V32,D3"
TINY_ACC = "B1,T70,H1,HV2,K32,V32,D2"


def _load(name: str, path: Path):
    """The script at ``path`` imported as module ``name`` (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


common = _load("gdn_bench_common", REPO_ROOT / "benchmarks" / "common.py")


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "GDN_CORE_BACKEND", "CUDA_VISIBLE_DEVICES")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, env=env,
    )
    print(f"rc={proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def _smoke(tmp_path: Path, arms: str) -> dict:
    out = tmp_path / "bench.json"
    proc = _run("--arms", arms, "--shapes", TINY_SHAPES, "--acc-shapes", TINY_ACC,
                "--warmup", "0", "--iters", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "# GDN single-rank training benchmark" in proc.stdout
    assert "no GPU" in proc.stdout
    report = json.loads(out.read_text())

    env = report["meta"]["environment"]
    assert env["torch"] == torch.__version__
    assert "triton" in env and "bench_gdn_train.py" in env["command"]
    assert "--shapes" in env["command"]
    assert report["meta"]["gpu"]["gpu"] is None
    cfg = report["config"]
    assert cfg["device"] == "cpu" and cfg["gdn_core_backend"] == "reference"
    assert cfg["dtype"] == "bfloat16" and cfg["iters"] == 2
    assert [s["spec"] for s in cfg["shapes"]] == [
        "B1,T80,H2,HV2,K32,V32,D1", "B1,T150,H1,HV2,K32,V32,D3"]

    names = arms.split(",")
    assert report["errors"] == []
    assert len(report["results"]) == 2 * len(names)
    for r in report["results"]:
        assert r["arm"] in names
        for key in ("fwd_ms", "fwd_bwd_ms"):
            assert isinstance(r[key], float) and r[key] > 0
        assert r["fwd_stats"]["iters"] == 2 and r["fwd_stats"]["method"] == "host-clock"
        assert r["peak_extra_fwd_bwd_bytes"] is None  # not measured on CPU
    packed = [r for r in report["results"] if r["shape"]["D"] == 3]
    assert all(sum(r["doc_lengths"]) == 150 and len(r["doc_lengths"]) == 3 for r in packed)

    assert len(report["accuracy"]) == len(names)
    for a in report["accuracy"]:
        assert set(a["rel_err"]) == {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta"}
        # bf16 inputs and bf16 gradients against the fp32 token loop
        assert all(e is not None and e < 2e-2 for e in a["rel_err"].values()), a
        assert isinstance(a["bitwise_repeatable"], bool)
    return report


def test_smoke_reference_arm(tmp_path):
    report = _smoke(tmp_path, "reference")
    assert report["accuracy"][0]["bitwise_repeatable"] is True


def test_smoke_det_and_nondet_arms(tmp_path):
    report = _smoke(tmp_path, "det,nondet,det-plain,nondet-plain")
    det = [r for r in report["results"] if r["arm"] == "det"]
    assert all(r["det_over_nondet_fwd"] > 0 and r["det_over_nondet_fwd_bwd"] > 0 for r in det)
    acc_det = [a for a in report["accuracy"] if a["arm"] == "det"]
    assert acc_det and all(a["bitwise_repeatable"] for a in acc_det)
    info = report["meta"]["arms"]
    assert info["det"]["entry"] == "gdn_det_train.chunk_gated_delta_rule_det"
    assert info["nondet"]["entry"] == "gdn_train.chunk_gated_delta_rule"
    assert info["det-plain"]["entry"] == "gdn_det_train.chunk_gated_delta_rule_det, segment_size=0"
    assert info["nondet-plain"]["entry"] == "gdn_train.chunk_gated_delta_rule, segment_size=0"
    for arm in ("det-plain", "nondet-plain"):
        assert [r["arm"] for r in report["results"]].count(arm) == 2  # both tiny shapes
        assert all("error" not in r for r in report["results"] if r["arm"] == arm)
    # which of our kernels ran is recorded per shape (none on the CPU's reference path)
    assert all(r["path"].startswith("kernels: none") for r in report["results"])


def test_kernel_summary_counts_launches_in_order():
    bench = _load("gdn_bench_gdn_train", SCRIPT)
    events = [("alloc", "aten.empty", "x"), ("triton", "_wy_kernel", "a"),
              ("triton", "_chunk_state_fwd_kernel", "b"), ("work", "aten.zeros", "c"),
              ("triton", "_wy_kernel", "d"), ("triton", "_fused_state_bwd_gluon_kernel", "e")]
    assert bench.kernel_summary(events) == ("kernels: wy ×2, chunk_state_fwd ×1, "
                                            "fused_state_bwd_gluon ×1")
    assert bench.kernel_summary(events[:1]).startswith("kernels: none")


def test_fla_arm_on_cpu_fails_clearly():
    proc = _run("--arms", "reference", "--compare", "fla", "--shapes", "B1,T64,H1,K16,V16",
                "--acc-shapes", "none", "--iters", "1")
    assert proc.returncode == 2
    assert "'fla'" in proc.stderr and "CUDA" in proc.stderr
    assert "fwd ms" not in proc.stdout  # nothing was timed


def test_missing_package_fails_clearly(tmp_path):
    """An arm whose entry point is absent stops the run with a message naming it."""
    fake = tmp_path / "gdn_det_train"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "0.0.0"\n')
    env = {k: v for k, v in os.environ.items() if k != "GDN_CORE_BACKEND"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--arms", "det,reference",
         "--shapes", "B1,T64,H1,K16,V16", "--acc-shapes", "none", "--iters", "1"],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=env,
    )
    assert proc.returncode == 2, proc.stderr
    assert "arm 'det'" in proc.stderr and "chunk_gated_delta_rule_det" in proc.stderr


def test_cpu_needs_explicit_shapes():
    proc = _run("--arms", "reference")
    assert proc.returncode == 2
    assert "--shapes" in proc.stderr


# ------------------------------------------------------------ common.py ---


def test_parse_shapes():
    s = common.parse_shape("B1,T8192,H16,HV32,D8")
    assert (s.B, s.T, s.H, s.HV, s.K, s.V, s.D) == (1, 8192, 16, 32, 128, 128, 8)
    assert common.parse_shape(s.spec) == s
    assert s.label == "B1 T8192 H16 HV32 D8"
    assert common.parse_shape("b4 t64 h2").HV == 2
    shapes = common.parse_shapes("B1,T64,H1;preset", {"preset": [s, s]})
    assert len(shapes) == 3
    for bad in ("B1,T64", "B2,T64,H1,D2", "B1,T64,H2,HV3", "B1,X4,T8,H1", "B1,T4,H1,D5"):
        with pytest.raises(ValueError):
            common.parse_shape(bad)


def test_doc_lengths_deterministic_and_varied():
    a = common.doc_lengths(65536, 16, seed=0)
    assert a == common.doc_lengths(65536, 16, seed=0)
    assert sum(a) == 65536 and len(a) == 16 and min(a) >= 1
    assert max(a) > 1.5 * min(a)  # varied
    assert a != common.doc_lengths(65536, 16, seed=1)
    assert common.doc_lengths(5, 5) == [1] * 5
    assert common.doc_lengths(100, 1) == [100]
    with pytest.raises(ValueError):
        common.doc_lengths(3, 4)


def test_make_gdn_inputs():
    shape = common.GDNShape(B=1, T=200, H=2, HV=4, K=32, V=16, D=3)
    x = common.make_gdn_inputs(shape, dtype=torch.bfloat16, seed=3)
    assert x.q.shape == (1, 200, 2, 32) and x.v.shape == (1, 200, 4, 16)
    assert x.g.shape == x.beta.shape == (1, 200, 4)
    assert x.q.dtype == torch.bfloat16 and x.g.dtype == torch.float32
    assert all(t.requires_grad for t in x.leaves)
    assert (x.g < 0).all() and ((x.beta > 0) & (x.beta < 1)).all()
    norms = x.k.float().norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-2)
    assert x.cu_seqlens.dtype == torch.int64 and x.cu_seqlens.tolist() == x.offsets
    assert x.offsets[-1] == 200 and len(x.offsets) == 4
    y = common.make_gdn_inputs(shape, dtype=torch.bfloat16, seed=3)
    assert torch.equal(x.q, y.q) and torch.equal(x.g, y.g)
    raw = common.make_gdn_inputs(common.GDNShape(B=2, T=64, H=1, K=16, V=16),
                                 use_qk_l2norm_in_kernel=True)
    assert raw.cu_seqlens is None and raw.offsets == [0, 64, 128]
    assert raw.kwargs()["use_qk_l2norm_in_kernel"] is True
    assert not torch.allclose(raw.q.float().norm(dim=-1), torch.ones(2, 64, 1), atol=1e-2)


def test_time_fn_rel_err_and_tables(tmp_path):
    calls = []
    t = common.time_fn(lambda: calls.append(1), device="cpu", warmup=2, iters=5)
    assert len(calls) == 7 and len(t.times_ms) == 5 and t.summary()["method"] == "host-clock"
    assert t.min <= t.median <= t.max
    with common.MemoryTracker("cpu") as m:
        pass
    assert m.peak_extra_bytes is None
    ref = torch.tensor([3.0, 4.0])
    assert common.rel_err(ref, ref) == 0.0
    assert abs(common.rel_err(torch.tensor([3.0, 5.0]), ref) - 0.2) < 1e-12
    assert math.isnan(common.rel_err(torch.tensor([float("nan"), 4.0]), ref))
    table = common.markdown_table(["a", "b"], [[1.5, None], ["x", True]])
    assert table.splitlines()[0].startswith("| a")
    assert "—" in table and "yes" in table
    common.write_json(tmp_path / "d" / "x.json", {"v": float("nan"), "s": common.GDNShape(1, 2, 1)})
    data = json.loads((tmp_path / "d" / "x.json").read_text())
    assert data["v"] == "nan" and data["s"]["spec"] == "B1,T2,H1,HV1,K128,V128,D1"
    assert common.gpu_facts()["gpu"] is None or torch.cuda.is_available()
