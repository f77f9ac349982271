"""Partition plans: cuts, fragments, flags and chains against cu_seqlens; policy promises."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
import torch
from gdn_core.kcp.plan import BOUNDARIES, KCPPlan, partition


def random_offsets(rng: random.Random) -> list[int]:
    sizes = [0, 1, 2, 3, 7, 31, 63, 64, 65, 127, 128, 129, 200, 500]
    offs = [0]
    for _ in range(rng.randint(0, 7)):
        offs.append(offs[-1] + rng.choice(sizes))
    return offs


def docs_of(offs):
    return [(n, a, b) for n, (a, b) in enumerate(zip(offs[:-1], offs[1:])) if b > a]


def check_plan(plan: KCPPlan, offs: list[int]) -> None:
    W, T = plan.world_size, offs[-1]
    cuts = plan.cuts
    assert len(cuts) == W + 1 and cuts[0] == 0 and cuts[-1] == T
    assert all(a <= b for a, b in zip(cuts, cuts[1:]))
    holders: dict[int, list[int]] = {}
    for r in range(W):
        start, stop = plan.token_range(r)
        assert (start, stop) == (cuts[r], cuts[r + 1])
        frags = plan.fragments(r)
        pos = start
        for f in frags:
            assert f.global_start == pos and f.global_stop > f.global_start
            assert f.local_start == pos - start and f.local_stop == f.global_stop - start
            assert offs[f.doc] == f.doc_start and offs[f.doc + 1] == f.doc_stop
            assert f.doc_start <= f.global_start and f.global_stop <= f.doc_stop
            assert f.continues_from == (f.global_start > f.doc_start)
            assert f.continues_into == (f.global_stop < f.doc_stop)
            holders.setdefault(f.doc, []).append(r)
            pos = f.global_stop
        assert pos == stop
        assert plan.local_offsets(r) == (0,) + tuple(f.local_stop for f in frags)
        # only the first/last fragment may continue
        for f in frags[1:]:
            assert not f.continues_from
        for f in frags[:-1]:
            assert not f.continues_into
    # every non-empty document is covered, in rank order, prev/next consistent
    for n, a, b in docs_of(offs):
        ranks = holders[n]
        assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)
        covered = sum(f.length for r in ranks for f in plan.fragments(r) if f.doc == n)
        assert covered == b - a
        for i, r in enumerate(ranks):
            f = next(f for f in plan.fragments(r) if f.doc == n)
            assert f.prev_rank == (ranks[i - 1] if i else None)
            assert f.next_rank == (ranks[i + 1] if i + 1 < len(ranks) else None)
    # rank tables: flags and fold chains
    for r in range(W):
        tab = plan.rank_table(r)
        frags = plan.fragments(r)
        assert tab.empty == (not frags) == (tab.num_tokens == 0)
        if not frags:
            assert not (tab.first_continues or tab.last_continues or tab.passthrough)
            continue
        first, last = frags[0], frags[-1]
        assert tab.first_continues == first.continues_from
        assert tab.last_continues == last.continues_into
        assert tab.passthrough == (len(frags) == 1 and first.continues_from
                                   and first.continues_into)
        if tab.first_continues:
            chain = holders[first.doc]
            assert tab.fwd_chain == tuple(chain[: chain.index(r)])
            assert plan.fragments(tab.fwd_chain[0])[-1].global_start == first.doc_start
            for j in tab.fwd_chain[1:]:
                assert plan.rank_table(j).passthrough
        else:
            assert tab.fwd_chain == ()
        if tab.last_continues:
            chain = holders[last.doc]
            assert tab.bwd_chain == tuple(chain[chain.index(r) + 1:])
            assert plan.fragments(tab.bwd_chain[-1])[0].global_stop == last.doc_stop
            for j in tab.bwd_chain[:-1]:
                assert plan.rank_table(j).passthrough
        else:
            assert tab.bwd_chain == ()


def check_policy(plan: KCPPlan, offs: list[int]) -> None:
    W, T, C = plan.world_size, offs[-1], plan.chunk_size
    bounds = set(offs)
    docs = docs_of(offs)

    def doc_at(c):  # the document a cut at c splits (c strictly inside it)
        return next(((a, b) for _, a, b in docs if a < c < b), None)

    for r in range(1, W):
        c, ideal = plan.cuts[r], Fraction(r * T, W)
        d = doc_at(c)
        if plan.boundary == "even":
            assert abs(c - ideal) < 1
        elif plan.boundary == "chunk":
            assert d is None or (c - d[0]) % C == 0
            assert abs(c - ideal) <= Fraction(C, 2)
        elif plan.boundary == "segment":
            assert d is None or (c - d[0]) % plan.segment_size == 0
            assert abs(c - ideal) <= Fraction(plan.segment_size, 2)
        elif plan.boundary == "doc":
            slack = Fraction(plan.doc_slack) * Fraction(T, W)
            if d is not None:
                assert (c - d[0]) % C == 0
                assert all(abs(b - ideal) > slack for b in bounds), (c, ideal)
            elif T >= W * C and any(abs(b - ideal) <= slack for b in bounds):
                # a boundary within the slack is taken: the nearest one
                assert abs(c - ideal) == min(abs(b - ideal) for b in bounds)


@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_random_plans(boundary):
    rng = random.Random(BOUNDARIES.index(boundary))
    seen_empty = False
    for _ in range(150):
        offs = random_offsets(rng)
        W = rng.randint(1, 8)
        kw = {"segment_size": 128} if boundary == "segment" else {}
        plan = partition(offs, W, boundary=boundary, **kw)
        check_plan(plan, offs)
        check_policy(plan, offs)
        seen_empty |= any(plan.num_tokens(r) == 0 for r in range(W))
        again = partition(torch.tensor(offs), W, boundary=boundary, **kw)
        assert again.cuts == plan.cuts and again.digest() == plan.digest()
    assert seen_empty


def test_empty_and_tiny_sequences():
    for offs in ([0], [0, 0], [0, 0, 0]):
        plan = partition(offs, 3)
        assert plan.cuts == (0, 0, 0, 0)
        assert all(plan.fragments(r) == () for r in range(3))
    plan = partition([0, 2, 5], 4, boundary="chunk")
    check_plan(plan, [0, 2, 5])
    assert [plan.num_tokens(r) for r in range(4)] == [2, 0, 3, 0]


def test_document_spanning_many_ranks_with_an_empty_rank():
    plan = partition([0, 200], 4, boundary="chunk")
    assert plan.cuts == (0, 64, 128, 128, 200)
    tab = plan.rank_table(3)
    assert tab.first_continues and tab.fwd_chain == (0, 1)
    assert plan.rank_table(0).bwd_chain == (1, 3)
    assert plan.rank_table(1).passthrough
    assert plan.rank_table(2).empty


def test_doc_policy_prefers_document_boundaries():
    # a boundary 4 tokens from the balanced cut wins over splitting a document
    plan = partition([0, 96, 200], 2, boundary="doc")
    assert plan.cuts == (0, 96, 200)
    # a single long document must be split, on its chunk grid
    plan = partition([0, 1000], 4, boundary="doc")
    assert all(c % 64 == 0 for c in plan.cuts[1:-1])


def test_digest_is_sensitive():
    base = partition([0, 100, 300], 2)
    assert base.digest() == partition([0, 100, 300], 2).digest()
    for other in (partition([0, 101, 300], 2), partition([0, 100, 300], 3),
                  partition([0, 100, 300], 2, boundary="even"),
                  partition([0, 100, 300], 2, chunk_size=32)):
        assert other.digest() != base.digest()
    words = base.digest_words()
    assert len(words) == 4 and all(-(2**63) <= w < 2**63 for w in words)


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        partition([0, 5], 0)
    with pytest.raises(ValueError, match="boundary"):
        partition([0, 5], 2, boundary="tokens")
    with pytest.raises(ValueError, match="start at 0"):
        partition([1, 5], 2)
    with pytest.raises(ValueError, match="non-decreasing"):
        partition([0, 5, 4], 2)
    with pytest.raises(TypeError, match="dtype"):
        partition(torch.tensor([0.0, 5.0]), 2)
    with pytest.raises(ValueError, match="segment_size"):
        partition([0, 5], 2, boundary="segment", segment_size=100)
    with pytest.raises(ValueError, match="segment_size"):
        partition([0, 5], 2, segment_size=128)
    with pytest.raises(ValueError, match="rank"):
        partition([0, 5], 2).token_range(2)
