"""Multi-process gloo worlds (2, 3 and 4 ranks) against the single-rank run.

Each world runs all its cases in one set of processes (start-up is the
expensive part). Checked per case: every rank's output and gradients (GDN and
conv) against the single-rank fp32 reference; the explicit API (twice through
one workspace) against the autograd form; the same world simulated in this
process; and ring against allgather — all within tolerance (this package
promises no bits; ``gdn_det_train_kcp`` tests those).
Every world also checks that a plan-digest mismatch raises on every rank.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gdn_train_kcp as kcp
import pytest
import torch
from gdn_core.compose import chunk_gdn_bwd, chunk_gdn_fwd
from gdn_core.conv1d import causal_conv1d
from gdn_core.kcp.testing import run_gloo_world

WORKER = Path(__file__).with_name("kcp_worker.py")
_spec = importlib.util.spec_from_file_location("kcp_worker", WORKER)
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta")

CASES = {
    2: [
        # a one-token document in the middle; chunk-aligned cut
        dict(offsets=[0, 100, 101, 250], boundary="chunk", exchange="allgather"),
        dict(offsets=[0, 100, 101, 250], boundary="chunk", exchange="ring"),
        # GQA and L2 norm, cut off the chunk grid
        dict(offsets=[0, 100, 101, 250], boundary="even", exchange="ring", l2=True, H=2, HV=4),
    ],
    3: [
        # a document spanning all three ranks (the middle one a pass-through)
        dict(offsets=[0, 20, 260, 300], boundary="even", exchange="allgather", l2=True),
        dict(offsets=[0, 20, 260, 300], boundary="even", exchange="ring", l2=True),
        # 7 tokens over 3 ranks: the last rank's conv halo spans two ranks
        dict(offsets=[0, 7], boundary="even", exchange="ring"),
    ],
    4: [
        # rank 2 holds no token in the middle of a document
        dict(offsets=[0, 200], boundary="chunk", exchange="allgather"),
        dict(offsets=[0, 200], boundary="chunk", exchange="ring"),
        # two empty ranks, tiny documents
        dict(offsets=[0, 2, 5], boundary="chunk", exchange="allgather"),
        # "doc" policy: one document over four ranks, GQA, L2 norm
        dict(offsets=[0, 37, 38, 300, 333], boundary="doc", exchange="ring", l2=True, H=2,
             HV=4),
    ],
}


def reference(case: dict) -> dict:
    t = W.make_inputs(case)
    ins = [t[n] for n in ("q", "k", "v", "g", "beta")]
    o, _, saved = chunk_gdn_fwd(*ins, cu_seqlens=case["offsets"], deterministic=True,
                                use_qk_l2norm_in_kernel=case.get("l2", False),
                                backend="reference")
    grads = chunk_gdn_bwd(saved, t["do"], deterministic=True)
    x = t["x"].clone().requires_grad_(True)
    w = t["w"].clone().requires_grad_(True)
    b = t["b"].clone().requires_grad_(True)
    y = causal_conv1d(x, w, b, "silu", case["offsets"], deterministic=True)
    y.backward(t["dy"])
    out = {"o": o, "y": y.detach(), "dx": x.grad, "dw": w.grad, "db": b.grad}
    out.update({n: getattr(grads, n) for n in GRAD_NAMES})
    return out


def simulated(case: dict, world_size: int) -> list[dict]:
    plan = W.plan_of(case, world_size)
    ctxs = kcp.build_simulated_contexts_kcp(plan)
    t = W.make_inputs(case)
    ins = [[W.shard(t[n], plan, r) for r in range(world_size)]
           for n in ("q", "k", "v", "g", "beta")]
    os_, saveds = kcp.chunk_gdn_fwd_kcp_simulated(
        *ins, ctxs, exchange=case["exchange"], use_qk_l2norm_in_kernel=case.get("l2", False))
    grads = kcp.chunk_gdn_bwd_kcp_simulated(
        saveds, [W.shard(t["do"], plan, r) for r in range(world_size)])
    return [{"o": o, **{n: getattr(gr, n) for n in GRAD_NAMES}} for o, gr in zip(os_, grads)]


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=what)


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_gloo_world_matches_single_rank(world_size):
    cases = CASES[world_size]
    got = run_gloo_world(world_size, WORKER, "world_checks", {"cases": cases})
    for r in range(world_size):
        assert got[r]["mismatch"] is not None and "digest" in got[r]["mismatch"], got[r]
    by_key = {}
    for i, case in enumerate(cases):
        ref = reference(case)
        ranks = [got[r]["results"][i] for r in range(world_size)]
        for r, res in enumerate(ranks):
            assert res["repeat"], f"case {i} rank {r}: explicit API disagrees"
        outs = [res["out"] for res in ranks]
        for name, ref_name in [("o", "o"), ("y", "y"), ("dx", "dx")] + [
            ("d" + n, "d" + n) for n in ("q", "k", "v", "g", "beta")
        ]:
            cat = torch.cat([o[name] for o in outs], dim=1)
            _close(cat, ref[ref_name], f"case {i} {name}")
        for name in ("dw", "db"):
            total = outs[0][name]
            for o in outs[1:]:
                total = total + o[name]
            _close(total, ref[name], f"case {i} {name}")
        # the simulated world in this process agrees
        sim = simulated(case, world_size)
        for r in range(world_size):
            for n in ("o",) + GRAD_NAMES:
                _close(sim[r][n], outs[r][n], f"case {i} rank {r} {n}")
        key = (tuple(case["offsets"]), case["boundary"], case.get("l2", False),
               case.get("HV", 2))
        if key in by_key:  # the same problem with the other exchange
            for a, b in zip(by_key[key], outs):
                for n in a:
                    _close(a[n], b[n], f"case {i}: ring vs allgather, {n}")
        by_key[key] = outs
