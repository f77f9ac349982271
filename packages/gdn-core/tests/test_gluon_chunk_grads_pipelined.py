"""The persistent (next-tile-prefetching) Gluon chunk-gradient launcher without a GPU: it
imports, it is declared atomic-free, it refuses what the one-tile kernel refuses (the
shared checks, tested over both launchers in ``test_gluon_chunk_grads.py``), and
what changed against that kernel — which CTA computes a tile, in what order, and where
each tile's operands sit in the ring of shared-memory slots while the next tile's are
loaded — is emulated here: every tile computed once, and no prefetch lands in a buffer
the current tile still reads (or is read before it has landed). The arithmetic per tile
is the one-tile kernel's (its helpers, imported; the emulated dataflow in
``test_gluon_chunk_grads.py``); the bits on the GPU: ``*_gpu.py``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from gdn_core.ops.gluon import chunk_grads as gc
from gdn_core.ops.gluon import chunk_grads_pipelined as gp


def test_declared_atomic_free():
    info = gp.chunk_grads_bwd_gluon_pipelined.launcher_info
    assert info.uses_atomics is False
    assert info.kernels == (gp._chunk_grads_bwd_gluon_pipelined_kernel,)


def test_per_tile_arithmetic_is_the_one_tile_kernels():
    """Every phase of the per-tile arithmetic (the vectors, the short-chunk zeroing, phases
    A–D, the dg/dβ stores) and the launch checks are the original module's objects, not
    copies: the two kernels differ only in where tiles sit and when they are loaded."""
    for name in ("_chunk_vectors", "_zero_short_chunk", "_phase_a_scores", "_phase_a_values",
                 "_phase_b_dq", "_phase_b_dt", "_phase_c", "_phase_d_state", "_phase_d_c",
                 "_phase_d_dk", "_store_dg_dbeta", "_store_rows", "prepare_launch"):
        assert getattr(gp, name) is getattr(gc, name), name


# ------------------------------------------------- which CTA, in what order


@pytest.mark.parametrize("tiles,sms", [(1, 132), (7, 132), (132, 132), (133, 132),
                                       (8192, 132), (37, 5)])
def test_every_tile_once_in_a_fixed_order(tiles, sms):
    grid = gp.persistent_grid(tiles, sms)
    assert 1 <= grid <= min(tiles, sms)
    order = gp.tile_order(tiles, grid)
    assert sorted(t for ts in order for t in ts) == list(range(tiles))
    assert all(ts and ts == sorted(ts) for ts in order)  # no idle CTA; ascending walk
    assert max(map(len, order)) - min(map(len, order)) <= 1
    assert order == gp.tile_order(tiles, grid)


# ------------------------------------------------- the ring of slots, emulated

# The kernel's events at one tile, in program order (``wait`` a barrier group, ``read`` /
# ``write`` a buffer by role, ``issue`` the next tile's load of a role into the buffer a
# current role occupies). Roles Q, dO, V, K, dU live in the ring (V's slot later holds
# dW); the others in their own buffers.
_TILE = [
    ("wait", "do"), ("wait", "vn"), ("read", "do"), ("read", "vn"),      # A: dO V'ᵀ
    ("wait", "qk"), ("read", "q"), ("read", "k"),                        # Q Kᵀ
    ("wait", "a"), ("wait", "uv"), ("read", "a"), ("read", "du"), ("read", "v"),  # Tᵀ dU, dU Vᵀ
    ("wait", "h"), ("read", "do"), ("read", "h"), ("read", "du"),        # B: dO Sᵀ, dU Sᵀ
    ("read", "q"), ("read", "k"), ("write", "v"),                        # q·dQ, ds K, dW
    ("issue", "q", "do"), ("issue", "k", "du"),                          # P1
    ("read", "v"), ("read", "k"),                                        # dW Kᵀ
    ("read", "a"), ("read", "k"),                                        # C: dT Tᵀ, K Kᵀ, Tᵀ(.)
    ("read", "a"), ("read", "v"), ("wait", "dh"), ("read", "vn"), ("read", "dh"),  # D
    ("read", "h"), ("read", "dh"),                                       # ⟨S, dS⟩
    ("issue", "do", "v"), ("issue", "a", "a"),                           # P2a
    ("read", "k"),                                                       # k rows, E' K
    ("issue", "vn", "vn"), ("issue", "h", "h"), ("issue", "dh", "dh"),   # P2b
    ("read", "k"), ("read", "q"),                                        # (βE')ᵀ K, dsᵀ Q
    ("issue", "du", "q"), ("issue", "v", "k"),                           # P4
]
_GROUP = {"q": "qk", "k": "qk", "do": "do", "vn": "vn", "a": "a", "du": "uv", "v": "uv",
          "h": "h", "dh": "dh"}
_SHORT = [("wait", "do"), ("wait", "vn"), ("wait", "qk"), ("wait", "a"), ("wait", "uv")] + [
    ("write", r) for r in ("q", "k", "v", "vn", "do", "du", "a")]


def _buffer(role, j):
    if role in gp.SLOT:
        return ("ring", (j + gp.SLOT[role]) % gp.RING)
    return (role,)


@pytest.mark.parametrize("short", [False, True])
def test_prefetches_land_in_spent_buffers_and_where_the_next_tile_reads(short):
    """A CTA's walk over 12 tiles: each buffer holds (role, tile) once its load has
    landed; a load is in flight from its issue until its group's wait. Every read or
    write of tile j finds tile j's data in place and no load in flight into it; every
    prefetch goes to a buffer the rest of tile j never touches; each barrier group
    completes once per tile (its j-th wait is on parity j & 1)."""
    tiles = 12
    content, flight = {}, {}  # buffer -> (role, tile) landed / in flight (+ its group)
    for role in _GROUP:  # the prologue: tile 0's loads
        flight[_buffer(role, 0)] = (role, 0)
    for j in range(tiles):
        events = (_SHORT if short else []) + _TILE
        waited = set()
        for i, ev in enumerate(events):
            if ev[0] == "wait":
                for buf, (role, jj) in list(flight.items()):
                    if _GROUP[role] == ev[1] and jj == j:
                        content[buf] = flight.pop(buf)
                waited.add(ev[1])
            elif ev[0] in ("read", "write"):
                buf = _buffer(ev[1], j)
                assert buf not in flight, (j, i, ev, "load in flight")
                assert content.get(buf) == (ev[1], j), (j, i, ev, content.get(buf))
                assert _GROUP[ev[1]] in waited, (j, i, ev, "read before its wait")
            else:  # issue the next tile's `role` into the buffer of the current `holder`
                _, role, holder = ev
                buf = _buffer(holder, j)
                assert buf == _buffer(role, j + 1), (j, ev, "next tile reads elsewhere")
                rest = [e[1] for e in events[i + 1:] if e[0] in ("read", "write")]
                assert all(_buffer(r, j) != buf for r in rest), (j, ev, "still read")
                if j + 1 < tiles:  # the last tile issues nothing
                    content.pop(buf, None)
                    flight[buf] = (role, j + 1)
    assert not flight


def test_kernel_uses_the_emulated_slots():
    """The kernel's ``ring.index((j + o) % 5)`` per role is :data:`SLOT`, and its prefetch
    targets are the emulated ones (the source, since the kernel needs a GPU)."""
    src = Path(gp.__file__).read_text()
    names = {"q": "q_s", "do": "do_s", "v": "v_s", "k": "k_s", "du": "du_s"}
    for role, off in gp.SLOT.items():
        idx = "j % 5" if off == 0 else rf"\(j \+ {off}\) % 5"
        assert re.search(rf"{names[role]} = ring\.index\({idx}\)", src), role
    assert gp.RING == 5 and sorted(gp.SLOT.values()) == list(range(5))
    descs = {"q": "q_desc", "k": "k_desc", "do": "do_desc", "vn": "vn_desc", "a": "a_desc",
             "h": "h_desc", "dh": "dh_desc", "du": "du_desc", "v": "v_desc"}
    bufs = {"do": "do_s", "du": "du_s", "v": "dw_s", "a": "a_s", "vn": "vn_s", "h": "h_s",
            "dh": "dh_s", "q": "q_s", "k": "k_s"}
    issued = re.findall(r"async_copy_global_to_shared\((\w+), \[[^\]]*\], \w+, (\w+), "
                        r"pred=more\)", src)
    want = [(descs[r], bufs[h]) for e in _TILE if e[0] == "issue" for _, r, h in [e]]
    assert issued == want
