"""Multi-process gloo worlds (2, 3 and 4 ranks) against the single-rank run.

Each world runs all its cases in one set of processes (start-up is the expensive
part; the body is :func:`gdn_core.suites.kcp_world_cases.world_checks`). Checked per
case: every rank's output and gradients (GDN and conv) against the single-rank fp32
reference; the explicit calls (twice through one workspace) repeat the autograd
form; the same world simulated in this process; and ring against allgather. The
deterministic package promises bits for the last three (across processes), the
other one agreement within tolerance. Every world also checks that a plan-digest
mismatch raises on every rank. Run on a KCP package by its test module
(``from … import *``) with its ``kcp_api`` and ``kcp_world_worker`` (the path of its
gloo worker script) fixtures.
"""

from __future__ import annotations

import pytest
import torch

from gdn_core.compose import chunk_gdn_bwd, chunk_gdn_fwd
from gdn_core.conv1d import causal_conv1d
from gdn_core.kcp.testing import run_gloo_world
from gdn_core.suites import kcp_world_cases as W
from gdn_core.suites.kcp_mode import agree, close

GRAD_NAMES = W.GDN_OUTPUTS[1:]

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
    """The single-rank fp32 reference (deterministic) of the case: GDN and conv."""
    t = W.make_inputs(case)
    ins = [t[n] for n in W.GDN_INPUTS]
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


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_gloo_world_matches_single_rank(kcp_api, kcp_world_worker, world_size):
    det = kcp_api.deterministic
    cases = CASES[world_size]
    got = run_gloo_world(world_size, kcp_world_worker, "world_checks", {"cases": cases})
    for r in range(world_size):
        assert got[r]["mismatch"] is not None and "digest" in got[r]["mismatch"], got[r]
    by_key = {}
    for i, case in enumerate(cases):
        ref = reference(case)
        ranks = [got[r]["results"][i] for r in range(world_size)]
        for r, res in enumerate(ranks):
            assert res["repeat"], (f"case {i} rank {r}: not bitwise repeatable" if det else
                                   f"case {i} rank {r}: explicit API disagrees")
        outs = [res["out"] for res in ranks]
        for name in ("o", "y", "dx") + GRAD_NAMES:
            cat = torch.cat([o[name] for o in outs], dim=1)
            close(cat, ref[name], f"case {i} {name}")
        for name in ("dw", "db"):
            total = outs[0][name]
            for o in outs[1:]:
                total = total + o[name]
            close(total, ref[name], f"case {i} {name}")
        # across processes: the simulated world here agrees (deterministic: the same bits)
        sim = W.simulated_ranks(kcp_api, case, world_size)
        for r in range(world_size):
            for n in W.GDN_OUTPUTS:
                agree(det, sim[r][n], outs[r][n], f"case {i} rank {r} {n}")
        key = (tuple(case["offsets"]), case["boundary"], case.get("l2", False),
               case.get("HV", 2))
        if key in by_key:  # the same problem with the other exchange (deterministic: same bits)
            for a, b in zip(by_key[key], outs):
                for n in a:
                    agree(det, a[n], b[n], f"case {i}: ring vs allgather, {n}")
        by_key[key] = outs
