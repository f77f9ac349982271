"""The demo (``python -m gdn_det_train_kcp.demo``): it runs, and it reports both checks passed.

The demo starts its own gloo worlds (fresh processes) on the CPU; these tests
run it as a subprocess, the way a user does, with few steps.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from gdn_det_train_kcp import demo


def _run_demo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)}
    # the demo and its ranks find the same packages as this test, installed or not
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run([sys.executable, "-m", "gdn_det_train_kcp.demo", "--device", "cpu",
                           *args], capture_output=True, text=True, timeout=timeout, env=env)
    print(f"rc={proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def _line(out: str, prefix: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, f"expected one line starting with {prefix!r}"
    return lines[0]


def test_demo_two_ranks_passes_both_checks():
    proc = _run_demo("--steps", "3", "--world", "2")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "2 ranks (gloo on CPU)" in out
    a = _line(out, "(a) bitwise repeat")
    b = _line(out, "(b) matches single-rank")
    assert a.endswith("PASS") and "DIFFERENT" not in a
    assert "PASS" in b and "FAIL" not in b
    assert "ALL CHECKS PASSED" in out
    # a document crossed the rank boundary: state really passed between ranks
    assert "hands a document on to rank 1" in out
    # per-step loss of every run (2 distributed runs and the single-rank run)
    for run in ("run 1", "run 2", "single rank"):
        assert sum(f"step {i}/3" in ln and run in ln for ln in out.splitlines()
                   for i in (1, 2, 3)) == 3, run
    assert "(falling)" in out


def test_demo_world_one_is_bitwise_the_single_rank_run():
    """At world size 1 the KCP path is the single-rank deterministic path, bit for bit."""
    proc = _run_demo("--steps", "2", "--world", "1")
    assert proc.returncode == 0, proc.stderr
    b = _line(proc.stdout, "(b) matches single-rank")
    assert "max |param diff| 0.00e+00" in b and "[bitwise equal]" in b


def test_demo_segment_boundary_cuts_documents_on_segments():
    proc = _run_demo("--steps", "2", "--world", "2", "--boundary", "segment",
                     "--segment-size", "64")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "boundary=segment (segments of 64)" in out and "ALL CHECKS PASSED" in out
    crossed = re.search(r"over 2 steps, (\d+) document\(s\) crossed a rank boundary", out)
    assert crossed and int(crossed.group(1)) >= 1
    assert _line(out, "(b) matches single-rank").endswith("PASS")


def test_demo_rejects_bad_arguments():
    proc = _run_demo("--steps", "0", timeout=60)
    assert proc.returncode == 2
    assert "--steps" in proc.stderr
    proc = _run_demo("--boundary", "segment", "--segment-size", "100", timeout=60)
    assert proc.returncode == 2 and "--segment-size" in proc.stderr


def test_make_batch_is_packed_documents_with_in_document_labels():
    cfg = demo.DemoConfig(seqlen=700)
    tokens, labels, offsets = demo.make_batch(cfg, step=3)
    again = demo.make_batch(cfg, step=3)
    assert torch.equal(tokens, again[0]) and offsets == again[2]
    assert offsets[0] == 0 and offsets[-1] == 700 == tokens.numel() == labels.numel()
    lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    assert len(lengths) >= 3 and len(set(lengths)) > 1 and min(lengths) >= 1
    for a, b in zip(offsets[:-1], offsets[1:]):
        assert tokens[a] == demo.BOS and labels[b - 1] == -100
        assert torch.equal(labels[a:b - 1], tokens[a + 1:b])
    assert demo.make_batch(cfg, step=4)[2] != offsets


@pytest.mark.parametrize("world", [1, 3])
def test_param_digest_is_order_and_bit_sensitive(world):
    cfg = demo.DemoConfig(world=world)
    m1 = demo.build_model(cfg, torch.device("cpu"))
    m2 = demo.build_model(cfg, torch.device("cpu"))
    assert demo.param_digest(m1) == demo.param_digest(m2)
    with torch.no_grad():
        p = next(m2.parameters())
        p.view(-1)[0] = torch.nextafter(p.view(-1)[0], torch.tensor(float("inf")))
    assert demo.param_digest(m1) != demo.param_digest(m2)
