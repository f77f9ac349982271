"""Per-layout caches (gdn_core.hostcache): same layout → same cached object,
anything else → another one, bounded size, packed device tables with the values
and dtypes of the tables they replace, and no host→device copy per call."""

from __future__ import annotations

import pytest
import torch
from gdn_core import chunking
from gdn_core.chunking import CHUNK_SIZE, ChunkIndex, chunk_index
from gdn_core.hostcache import LRUCache, device_int_tables, device_key, pack_tables
from gdn_core.segment import SegmentLayout, forward_chains


def _reference_index(offsets, C=CHUNK_SIZE):
    """The per-chunk loop ChunkIndex.build used to run."""
    chunk_doc, chunk_start, chunk_len, chunk_offsets = [], [], [], [0]
    for n, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:])):
        for start in range(bos, eos, C):
            chunk_doc.append(n)
            chunk_start.append(start)
            chunk_len.append(min(C, eos - start))
        chunk_offsets.append(len(chunk_doc))
    return chunk_doc, chunk_start, chunk_len, chunk_offsets


@pytest.mark.parametrize("offsets", [[0, 0], [0, 1], [0, 64], [0, 65, 65, 200, 1000],
                                     [0, 0, 0, 130], [0, 4096, 4100]])
def test_chunk_index_tables(offsets):
    idx = ChunkIndex.build(offsets, "cpu")
    doc, start, length, coffs = _reference_index(offsets)
    assert idx.chunk_doc.tolist() == doc
    assert idx.chunk_start.tolist() == start
    assert idx.chunk_len.tolist() == length
    assert idx.doc_offsets.tolist() == offsets
    assert idx.doc_chunk_offsets.tolist() == coffs
    assert idx.chunk_offsets == tuple(coffs) and idx.offsets == tuple(offsets)
    for t in (idx.chunk_doc, idx.chunk_start, idx.chunk_len, idx.doc_offsets,
              idx.doc_chunk_offsets):
        assert t.dtype == torch.int32 and t.is_contiguous()
        assert t.numel() == 0 or t.data_ptr() % 16 == 0  # Triton's pointer specialisation


def test_pack_tables_values_dtypes_alignment():
    tabs = [([1, 2, 3], torch.int32), ([], torch.int32), ([5, -1, 2**40], torch.int64),
            ([7] * 17, torch.int32), ([0], torch.int64)]
    out = pack_tables(tabs, "cpu")
    assert len(out) == len(tabs)
    for t, (vals, dt) in zip(out, tabs):
        assert t.dtype == dt and t.tolist() == list(vals) and t.is_contiguous()
        assert t.numel() == 0 or t.data_ptr() % 16 == 0
    # one buffer: every table shares the storage of the first
    base = out[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in out)


def test_chunk_index_cache_identity():
    a = chunk_index((0, 100, 300), "cpu")
    assert chunk_index([0, 100, 300], torch.device("cpu")) is a
    assert chunk_index((0, 100, 301), "cpu") is not a
    assert chunk_index((0, 100, 300), "cpu", chunk_size=32) is not a
    assert chunk_index((0, 100, 300), "meta") is not a  # another device: other tensors
    assert chunk_index((0, 100, 300), "meta").chunk_doc.device.type == "meta"


def test_segment_layout_cache_identity():
    offs = (0, 3000, 3100)
    L = SegmentLayout.build(list(offs), 1024)
    assert SegmentLayout.build(offs, 1024) is L
    assert SegmentLayout.build(offs, 512) is not L
    assert SegmentLayout.build((0, 3000, 3101), 1024) is not L
    assert SegmentLayout.build(offs, 1024, has_h0=True) is not L
    assert SegmentLayout.build(offs, 1024, first_continues=True) is not L
    assert SegmentLayout.build(offs, 1024, last_continues=True) is not L
    # per-device tables: built once per device, the same object after
    t = L.tables("cpu")
    assert L.tables(torch.device("cpu")) is t
    assert L.index("cpu") is t.index
    assert L.tables("meta") is not t
    assert t.index.chunk_len.tolist() == _reference_index(list(L.seg_offsets))[2]
    # fold chains: cached per options, equal to a fresh build
    ch = L._chains("fwd", forward_chains, n_remote=0, seeded_first=False, want_exit=False)
    assert ch is L._chains("fwd", forward_chains, n_remote=0, seeded_first=False,
                           want_exit=False)
    assert ch == forward_chains(L)


def test_segment_tables_match_layout():
    L = SegmentLayout.build((0, 2100, 2100, 2500, 5000), 1024, first_continues=True,
                            last_continues=True, has_h0=True)
    t = L.tables("cpu")
    want = [int(e) | (int(m) << 1) for e, m in zip(L.need_E, L.need_M)]
    assert (t.fwd_need.tolist() if t.fwd_need is not None else [3] * len(want)) == want
    need_P = [int(x) for x in L.need_P]
    assert (t.bwd_need.tolist() if t.bwd_need is not None else [1] * len(need_P)) == need_P
    assert t.first_rows.tolist() == list(L.first_rows)
    assert t.last_rows.tolist() == list(L.last_rows)
    N = L.num_docs
    assert t.h0_docs.tolist() == list(range(1, N))
    assert t.h0_rows.tolist() == [L.first_rows[d] for d in range(1, N)]
    assert t.dht_docs.tolist() == list(range(N - 1))
    assert t.dht_rows.tolist() == [L.last_rows[d] for d in range(N - 1)]
    for x in (t.first_rows, t.last_rows, t.h0_docs, t.h0_rows, t.dht_docs, t.dht_rows):
        assert x.dtype == torch.int64


def test_lru_bounded():
    c = LRUCache(maxsize=3)
    built = []

    def make(k):
        def f():
            built.append(k)
            return object()
        return f

    a = c.get_or_build("a", make("a"))
    c.get_or_build("b", make("b"))
    c.get_or_build("c", make("c"))
    assert c.get_or_build("a", make("a")) is a  # hit: "a" is now the most recent
    c.get_or_build("d", make("d"))  # evicts "b", the least recently used
    assert len(c) == 3 and "b" not in c and "a" in c
    assert built == ["a", "b", "c", "d"]
    c.get_or_build("e", make("e"), store=False)
    assert "e" not in c and len(c) == 3
    with pytest.raises(ValueError):
        LRUCache(0)


def test_module_caches_are_bounded():
    from gdn_core import segment

    for n in range(segment._LAYOUT_CACHE.maxsize + 5):
        SegmentLayout.build((0, 64 * (n + 1)), 64)
        chunk_index((0, n + 1), "cpu")
    assert len(segment._LAYOUT_CACHE) == segment._LAYOUT_CACHE.maxsize
    assert len(chunking._INDEX_CACHE) == chunking._INDEX_CACHE.maxsize


def test_device_int_tables_cached():
    a = device_int_tables(([1, 2], (3,), []), "cpu")
    assert [t.tolist() for t in a] == [[1, 2], [3], []]
    assert device_int_tables([(1, 2), [3], ()], "cpu") is a
    assert device_int_tables([(1, 2), [4], ()], "cpu") is not a
    assert device_key("cpu") == torch.device("cpu")


def test_no_table_copies_per_call(monkeypatch):
    """A second call of a layout builds no index, layout or table again."""
    import gdn_core.chunking as ch  # every layout table is packed there (ChunkIndex.build_with)

    offs = (0, 200, 700)
    L = SegmentLayout.build(offs, 128, has_h0=True)
    L.tables("cpu")
    chunk_index(offs, "cpu")
    calls = []
    monkeypatch.setattr(ch, "pack_tables", lambda *a, **k: calls.append(a))
    assert SegmentLayout.build(offs, 128, has_h0=True).tables("cpu") is L.tables("cpu")
    chunk_index(list(offs), "cpu")
    assert calls == []


def _interpreted() -> bool:
    from gdn_core.ops import chunk_state

    return type(chunk_state._chunk_state_fwd_kernel).__name__ == "InterpretedFunction"


@pytest.mark.skipif(not _interpreted(), reason="needs the Triton interpreter")
@pytest.mark.parametrize("S", [64, 0])
def test_repeated_call_reuses_tables_same_bits(monkeypatch, S):
    from gdn_core.compose import chunk_gdn_bwd, chunk_gdn_fwd

    offs = [0, 150, 170]
    T, H, K = offs[-1], 1, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, H, K, generator=gen) for _ in range(3))
    g = -0.3 * torch.rand(1, T, H, generator=gen)
    beta = torch.rand(1, T, H, generator=gen)
    h0 = torch.randn(2, H, K, K, generator=gen)
    do = torch.randn(1, T, H, K, generator=gen)
    dht = torch.randn(2, H, K, K, generator=gen)

    def run():
        o, fin, saved = chunk_gdn_fwd(q, k, v, g, beta, initial_state=h0,
                                      output_final_state=True, cu_seqlens=offs,
                                      deterministic=True, backend="triton", segment_size=S)
        gr = chunk_gdn_bwd(saved, do, dht, deterministic=True)
        return [o, fin, gr.dq, gr.dk, gr.dv, gr.dg, gr.dbeta, gr.dh0]

    first = run()
    calls = []
    real = chunking.pack_tables  # every layout table is packed there

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(chunking, "pack_tables", counting)
    second = run()
    assert calls == []
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_tensor_values_reads_a_tensor_object_once(monkeypatch):
    """``tensor_values`` reads a tensor's values (``tolist``: a sync on CUDA) once per
    tensor object; another object with the same values is read again."""
    from gdn_core.hostcache import tensor_values

    reads = []
    real = torch.Tensor.tolist

    def counting(self):
        reads.append(1)
        return real(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    assert tensor_values(cu) == (0, 100, 300)
    assert tensor_values(cu) == (0, 100, 300)
    assert len(reads) == 1
    assert tensor_values(cu.clone()) == (0, 100, 300)
    assert len(reads) == 2


def test_an_in_place_write_to_cu_seqlens_makes_a_new_plan():
    """Writing into a ``cu_seqlens`` tensor between calls (its version counter moves)
    makes the next call read it again: its plan has the new documents, never the
    remembered ones."""
    from gdn_core.plan import make_plan

    T, H, K = 300, 1, 16
    q, k, v = (torch.randn(1, T, H, K) for _ in range(3))
    g, beta = -torch.rand(1, T, H), torch.rand(1, T, H)
    cu = torch.tensor([0, 100, T], dtype=torch.int64)

    def docs():
        plan = make_plan(q, k, v, g, beta, deterministic=True, cu_seqlens=cu,
                         backend="reference")
        return plan.segments.doc_offsets

    first = docs()
    assert tuple(first) == (0, 100, T)
    assert docs() == first
    cu[1] = 200
    assert tuple(docs()) == (0, 200, T)
    cu.copy_(torch.tensor([0, 50, T]))
    assert tuple(docs()) == (0, 50, T)
