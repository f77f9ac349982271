"""CPU smoke tests of the context-parallel benchmarks (benchmarks/bench_gdn*_kcp.py).

Both scripts run as subprocesses at tiny sizes on the CPU (the packages'
reference backend): every arm (local, kcp, ring) over a real gloo world of two
processes and in a simulated world, the all-empty-but-one-token case
(``--seqlen 1 --docs 1 --world 2``), and the clear failures. The JSON is
checked for the fields users and later scripts read.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {
    "det": REPO_ROOT / "benchmarks" / "bench_gdn_det_train_kcp.py",
    "nondet": REPO_ROOT / "benchmarks" / "bench_gdn_train_kcp.py",
}
ENTRIES = {
    "det": ("gdn_det_train.chunk_gdn_det_fwd", "gdn_det_train_kcp.chunk_gdn_det_fwd_kcp"),
    "nondet": ("gdn_train.chunk_gdn_fwd", "gdn_train_kcp.chunk_gdn_fwd_kcp"),
}
TINY = ["--seqlen", "300", "--docs", "3", "--heads", "1", "--hv", "2", "--dim", "16",
        "--warmup", "1", "--iters", "2"]


def _env(extra_path: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "GDN_CORE_BACKEND", "CUDA_VISIBLE_DEVICES")}
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([extra_path, env.get("PYTHONPATH", "")])
    return env


def _run(package: str, *args: str, timeout: float = 300,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS[package]), "--device", "cpu", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT,
        env=env if env is not None else _env(),
    )
    print(f"rc={proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def _check_report(report: dict, package: str, *, arms: list[str], world: int, simulate: bool,
                  seqlen: int) -> None:
    cfg = report["config"]
    assert cfg["package"] == package and cfg["base"] == arms
    assert cfg["world"] == world and cfg["simulate"] is simulate
    assert cfg["device"] == "cpu" and cfg["gdn_core_backend"] == "reference"
    assert cfg["dist_backend"] == (None if simulate else "gloo")
    assert cfg["multicast_env"]["NCCL_NVLS_ENABLE"] == "0"
    env = report["meta"]["environment"]
    assert SCRIPTS[package].name in env["command"]
    assert report["meta"]["gpu"]["gpu"] is None
    assert report["errors"] == []

    ranks = report["plan"]["ranks"]
    assert [r["rank"] for r in ranks] == list(range(world))
    assert sum(r["tokens"] for r in ranks) == seqlen
    assert isinstance(report["plan"]["digest"], str)

    results = {r["arm"]: r for r in report["results"]}
    assert list(results) == arms
    for arm, res in results.items():
        assert len(res["per_rank"]) == world
        for rank, row in enumerate(res["per_rank"]):
            assert row["rank"] == rank and row["arm"] == arm
            assert row["tokens"] == ranks[rank]["tokens"]
            for key in ("fwd_ms", "fwd_bwd_ms"):
                assert isinstance(row[key], float) and row[key] >= 0
            assert row["fwd_stats"]["iters"] == 2
        for key in ("fwd", "fwd_bwd"):
            slow = max(res["per_rank"], key=lambda r: r[f"{key}_ms"])
            assert res[f"slowest_{key}_ms"] == slow[f"{key}_ms"]
            assert res[f"slowest_{key}_rank"] == slow["rank"]
        if arm == "local":
            assert ENTRIES[package][0] in res["entry"]
        else:
            assert ENTRIES[package][1] in res["entry"]
            assert ("'ring'" if arm == "ring" else "'allgather'") in res["entry"]
    if "local" in results:
        assert results["local"]["over_local_fwd"] == pytest.approx(1.0)
        for arm in arms:
            if arm != "local" and results["local"]["slowest_fwd_bwd_ms"] > 0:
                ratio = report["ratios"][f"{arm}_over_local"]["fwd_bwd"]
                assert ratio == pytest.approx(results[arm]["slowest_fwd_bwd_ms"]
                                              / results["local"]["slowest_fwd_bwd_ms"])
    else:
        assert all(r["over_local_fwd"] is None for r in results.values())


@pytest.mark.parametrize("simulate", [False, True], ids=["gloo", "simulate"])
@pytest.mark.parametrize("package", ["det", "nondet"])
def test_every_arm(tmp_path, package, simulate):
    out = tmp_path / "kcp.json"
    arms = ["local", "kcp", "ring"]
    proc = _run(package, "--base", ",".join(arms), "--boundary", "even", "--world", "2",
                *TINY, *(["--simulate"] if simulate else []), "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "# GDN context-parallel training benchmark" in proc.stdout
    assert "Slowest rank per arm" in proc.stdout and "no GPU" in proc.stdout
    report = json.loads(out.read_text())
    _check_report(report, package, arms=arms, world=2, simulate=simulate, seqlen=300)
    # boundary "even" over 300 tokens: a document crosses the cut
    assert report["plan"]["ranks"][0]["continues_into"] == 1


@pytest.mark.parametrize("simulate", [False, True], ids=["gloo", "simulate"])
@pytest.mark.parametrize("package", ["det", "nondet"])
def test_empty_shard_on_every_arm(tmp_path, package, simulate):
    """``--seqlen 1 --docs 1 --world 2``: one rank holds no token."""
    out = tmp_path / "kcp.json"
    proc = _run(package, "--base", "local,kcp,ring", "--seqlen", "1", "--docs", "1",
                "--world", "2", "--heads", "1", "--dim", "16", "--warmup", "0", "--iters", "2",
                *(["--simulate"] if simulate else []), "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    _check_report(report, package, arms=["local", "kcp", "ring"], world=2, simulate=simulate,
                  seqlen=1)
    assert sorted(r["tokens"] for r in report["plan"]["ranks"]) == [0, 1]


def test_single_arm_and_world_three(tmp_path):
    """One arm alone (no ratio without ``local``), three simulated ranks, doc boundary."""
    out = tmp_path / "kcp.json"
    proc = _run("det", "--base", "ring", "--boundary", "doc", "--world", "3", "--simulate",
                *TINY, "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    _check_report(report, "det", arms=["ring"], world=3, simulate=True, seqlen=300)
    assert report["ratios"]["ring_over_local"]["fwd"] is None


def test_missing_package_fails_clearly(tmp_path):
    """An arm whose package lacks its entry points stops the run, naming arm and package."""
    fake = tmp_path / "gdn_train_kcp"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "0.0.0"\n')
    proc = _run("nondet", "--base", "local,kcp", "--world", "2", "--simulate", *TINY,
                env=_env(str(tmp_path)))
    assert proc.returncode == 2, proc.stderr
    assert "arm 'local'" in proc.stderr and "gdn_train_kcp" in proc.stderr
    assert "partition_kcp" in proc.stderr
    assert "Slowest rank" not in proc.stdout  # nothing was timed


def test_cpu_needs_explicit_sizes_and_valid_arms():
    proc = _run("det", "--world", "2")
    assert proc.returncode == 2 and "--seqlen" in proc.stderr
    proc = _run("det", "--base", "local,bogus", *TINY)
    assert proc.returncode == 2 and "bogus" in proc.stderr


def test_kcp_host_cpu_times_every_rank_of_the_world():
    """``kcp_host_cpu.py`` (launches stubbed) reports each rank's local and KCP host time and
    the slowest rank's ratio, for the world asked."""
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "kcp_host_cpu.py"), "--world", "3",
         "--seqlen", "600", "--docs", "3", "--heads", "1", "--dim", "16", "--iters", "2"],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=_env())
    assert proc.returncode == 0, proc.stderr
    ranks = re.findall(r"rank (\d): local (\d+\.\d+), kcp (\d+\.\d+), kcp / local (\S+)",
                       proc.stdout)
    assert [r[0] for r in ranks] == ["0", "1", "2"], proc.stdout
    # 600 tokens cut only at document starts (segments of 4096): the last shard is empty
    assert [r[3] == "-" for r in ranks] == [False, False, True], proc.stdout
    assert all(float(kcp) > 0 for _, _, kcp, _ in ranks)
    assert re.search(r"slowest rank: local \d+\.\d+, kcp \d+\.\d+, kcp / local \d+\.\d+",
                     proc.stdout), proc.stdout
