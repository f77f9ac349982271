"""Partition-invariant training: ``boundary="segment"`` plans give ``gdn_det_train``'s bits.

The same global input (documents of assorted lengths: several spanning
several segments, one shorter than a chunk, a one-token one) runs through
``gdn_det_train.chunk_gated_delta_rule_det`` (one rank) and through
``gdn_det_train_kcp`` over gloo with 2, 3 and 4 ranks, both exchanges; the
gathered outputs and every gradient must be ``torch.equal`` — on the fp32
reference backend (the oracle in this process, the ranks in others) and on
the Triton kernels under the interpreter (every process with
``TRITON_INTERPRET=1``; rank 0 also runs the one-rank call and the simulated
world). The simulated world (every rank in this process) is checked for world
sizes 1 to 5.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import gdn_det_train_kcp as kcp
import pytest
import torch
from gdn_core.kcp.testing import run_gloo_world

if importlib.util.find_spec("gdn_det_train") is None:
    # an environment with this package only: the oracle from the checkout's source
    # (sys.path reaches the gloo workers too)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gdn-det-train" / "src"))

WORKER = Path(__file__).with_name("det_kcp_worker.py")
_spec = importlib.util.spec_from_file_location("det_kcp_worker_segment", WORKER)
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)

OUTS = W.GDN_OUTPUTS

# 5 tokens (shorter than a chunk), 325 (three 128-token segments), 1, 120
MIXED = [0, 5, 330, 331, 451]
CASES = [
    dict(offsets=MIXED, boundary="segment", segment_size=128, exchange="allgather"),
    dict(offsets=MIXED, boundary="segment", segment_size=128, exchange="ring"),
    # GQA and the in-kernel L2 norm; a 563-token document over several ranks
    dict(offsets=[0, 37, 600, 601, 700], boundary="segment", segment_size=128,
         exchange="allgather", l2=True, H=2, HV=4),
    # 64-token segments: at four ranks one rank is empty inside the document
    dict(offsets=[0, 200], boundary="segment", segment_size=64, exchange="ring", l2=True),
]


def _gathered(ranks: list[dict]) -> dict:
    return {n: torch.cat([r[n] for r in ranks], dim=1) for n in OUTS}


def _assert_equal(got: dict, want: dict, what: str) -> None:
    for n in OUTS:
        assert got[n].shape == want[n].shape, f"{what}: {n} shape"
        assert torch.equal(got[n], want[n]), (
            f"{what}: {n} differs (max |diff| {(got[n] - want[n]).abs().max().item():.3e})")


@pytest.fixture(scope="module")
def oracles() -> list[dict]:
    """gdn_det_train on one rank, in this process (fp32 reference backend)."""
    import os

    before = os.environ.get("GDN_CORE_BACKEND")
    os.environ["GDN_CORE_BACKEND"] = "reference"
    det = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return [W.single_rank_det(case) for case in CASES]
    finally:
        torch.use_deterministic_algorithms(det)
        if before is None:
            os.environ.pop("GDN_CORE_BACKEND", None)
        else:
            os.environ["GDN_CORE_BACKEND"] = before


def test_segment_plans_cut_on_segment_boundaries():
    for case in CASES:
        S = case["segment_size"]
        offs = case["offsets"]
        for world in range(1, 7):
            plan = W.plan_of(case, world)
            for r in range(world):
                for f in plan.fragments(r):
                    assert f.offset_in_doc % S == 0, (offs, world, f)
            rows = plan.segment_slots()  # fixed by T, world and S
            assert rows == -(-offs[-1] // (world * S)) + 1
            for r in range(world):
                for f in plan.fragments(r)[:1] + plan.fragments(r)[-1:]:
                    assert plan.fragment_segments(f) <= rows
    with pytest.raises(ValueError, match="segment_size"):
        kcp.partition_det_kcp([0, 100], 2, boundary="segment", segment_size=100)
    assert kcp.partition_det_kcp([0, 5000], 2, boundary="segment").segment_size == 4096


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gloo_segment_worlds_are_bitwise_gdn_det_train(world_size, oracles):
    got = run_gloo_world(world_size, WORKER, "segment_checks",
                         {"cases": CASES, "explicit": True})
    for i, case in enumerate(CASES):
        ranks = [got[r]["results"][i] for r in range(world_size)]
        what = f"world {world_size}, case {i} ({case['exchange']}, cuts {ranks[0]['cuts']})"
        _assert_equal(_gathered([r["out"] for r in ranks]), oracles[i], what)
        for rep in range(2):  # the explicit API through one workspace, twice
            _assert_equal(_gathered([r["explicit"][rep] for r in ranks]), oracles[i],
                          f"{what}, explicit #{rep}")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_simulated_segment_worlds_are_bitwise_gdn_det_train(world_size, oracles):
    for i, case in enumerate(CASES):
        plan = W.plan_of(case, world_size)
        t = W.make_inputs(case)
        ctxs = kcp.build_simulated_contexts_det_kcp(plan)
        ins = [[W.shard(t[n], plan, r) for r in range(world_size)]
               for n in ("q", "k", "v", "g", "beta")]
        ws = [kcp.DetKCPWorkspace(world_size, case.get("HV", 2), 16, 16, device="cpu")
              for _ in range(world_size)]
        for rep in range(2 if world_size == 3 else 1):  # a repeat through the workspaces
            os_, saveds = kcp.chunk_gdn_det_fwd_kcp_simulated(
                *ins, ctxs, exchange=case["exchange"],
                use_qk_l2norm_in_kernel=case.get("l2", False))
            grads = kcp.chunk_gdn_det_bwd_kcp_simulated(
                saveds, [W.shard(t["do"], plan, r) for r in range(world_size)], ws)
            ranks = [{"o": o, **{n: getattr(g, n) for n in OUTS[1:]}}
                     for o, g in zip(os_, grads)]
            _assert_equal(_gathered(ranks), oracles[i],
                          f"simulated world {world_size}, case {i}, repeat {rep}")


# 5 tokens, 257 (segments of 128, 128 and 1 token), 1, 67: at four ranks one is empty
SMALL = [0, 5, 262, 263, 330]
INTERP_CASES = [
    dict(offsets=SMALL, boundary="segment", segment_size=128, exchange="allgather", l2=True,
         simulate=True),
    dict(offsets=SMALL, boundary="segment", segment_size=128, exchange="ring", l2=True),
]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gloo_segment_worlds_under_the_triton_interpreter(world_size):
    """The Triton kernels (interpreted, fp32): one rank == every world, bitwise."""
    got = run_gloo_world(
        world_size, WORKER, "segment_checks",
        {"cases": INTERP_CASES, "single_on_rank0": True},
        env={"TRITON_INTERPRET": "1", "GDN_CORE_BACKEND": "triton"}, timeout=1200)
    for i, case in enumerate(INTERP_CASES):
        ranks = [got[r]["results"][i] for r in range(world_size)]
        single = ranks[0]["single"]
        what = f"interpreter, world {world_size}, {case['exchange']}"
        _assert_equal(_gathered([r["out"] for r in ranks]), single, what)
        if case.get("simulate"):
            _assert_equal(ranks[0]["simulated"], single, what + " (simulated)")


def test_other_policies_with_segments_inside_ranks(monkeypatch):
    """Other policies keep their guarantees when fragments are longer than a
    segment (the local path then runs segments; the pass-through rank's extra
    backward slices its saved segments): close to one rank, and world 1 bitwise.
    The default segment size is set to 1024 here to keep the shapes small."""
    import gdn_core.segment

    monkeypatch.setattr(gdn_core.segment, "DEFAULT_SEGMENT_SIZE", 1024)
    boundary, world = "even", 3
    case = dict(offsets=[0, 30, 3330, 3400], boundary=boundary, exchange="ring", l2=True)
    t = W.make_inputs(case)
    ins = [t[n] for n in ("q", "k", "v", "g", "beta")]
    from gdn_core.compose import chunk_gdn_bwd, chunk_gdn_fwd

    o_ref, _, saved = chunk_gdn_fwd(*ins, cu_seqlens=case["offsets"], deterministic=True,
                                    use_qk_l2norm_in_kernel=True, backend="reference")
    assert saved.segments is not None  # a 3300-token document: four 1024-token segments
    g_ref = chunk_gdn_bwd(saved, t["do"], deterministic=True)
    ref = {"o": o_ref, **{n: getattr(g_ref, n) for n in OUTS[1:]}}
    for w in (1, world):
        plan = kcp.partition_det_kcp(case["offsets"], w, boundary=boundary)
        tabs = [plan.rank_table(r) for r in range(w)]
        if w > 1:  # a pass-through rank holding two segments of the long document
            assert tabs[1].passthrough and plan.num_tokens(1) > 1024
        ctxs = kcp.build_simulated_contexts_det_kcp(plan)
        sh = [[W.shard(t[n], plan, r) for r in range(w)] for n in ("q", "k", "v", "g", "beta")]
        for exchange in ("allgather",) if w == 1 else ("ring",):
            os_, saveds = kcp.chunk_gdn_det_fwd_kcp_simulated(
                *sh, ctxs, exchange=exchange, use_qk_l2norm_in_kernel=True)
            grads = kcp.chunk_gdn_det_bwd_kcp_simulated(
                saveds, [W.shard(t["do"], plan, r) for r in range(w)])
            got = _gathered([{"o": o, **{n: getattr(g, n) for n in OUTS[1:]}}
                             for o, g in zip(os_, grads)])
            if w == 1:
                _assert_equal(got, ref, f"{boundary} world 1 {exchange}")
                continue
            for n in OUTS:
                scale = max(1.0, ref[n].abs().max().item())
                torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-5 * scale,
                                           msg=f"{boundary} world {w} {exchange} {n}")
