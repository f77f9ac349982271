"""The segment path (gdn_core.segment): layout and fold tables, the fold chain's
bits, accuracy against the token loop, segment independence, and the kernels'
segment options."""

from __future__ import annotations

import pytest
import torch
from gdn_core.chunking import ChunkIndex
from gdn_core.compose import chunk_gdn_bwd, chunk_gdn_fwd
from gdn_core.kcp import fold
from gdn_core.kcp.fold import fold_chain, fold_step
from gdn_core.ops import chunk_state
from gdn_core.reference import naive_recurrent_gdn
from gdn_core.segment import (
    CHAIN_SEGMENTS,
    DEFAULT_SEGMENT_SIZE,
    SegmentLayout,
    backward_chains,
    choose_segment_size,
    forward_chains,
    resolve_segment_size,
)

GRADS = ("dq", "dk", "dv", "dg", "dbeta")


def _interpreted() -> bool:
    return type(chunk_state._chunk_state_fwd_kernel).__name__ == "InterpretedFunction"


needs_interpreter = pytest.mark.skipif(
    not _interpreted(), reason="needs the Triton interpreter (TRITON_INTERPRET=1) or a GPU test")
BACKENDS = ["reference", pytest.param("triton", marks=needs_interpreter)]


def _offsets(lengths):
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    return offs


def _inputs(lengths, H=1, HV=2, K=16, V=16, seed=0, dtype=torch.float32):
    T, N = sum(lengths), len(lengths)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = -0.4 * torch.rand(1, T, HV, generator=gen)
    beta = torch.rand(1, T, HV, generator=gen)
    h0 = torch.randn(N, HV, K, V, generator=gen)
    do = torch.randn(1, T, HV, V, generator=gen)
    dht = torch.randn(N, HV, K, V, generator=gen)
    return [x.to(dtype) for x in (q, k, v, g, beta, h0, do, dht)]


def _run(ins, offs, *, S, h0=True, dht=True, l2=True, backend=None):
    q, k, v, g, beta, h, do, dh = ins
    o, final, saved = chunk_gdn_fwd(
        q, k, v, g, beta, initial_state=h if h0 else None, output_final_state=True,
        cu_seqlens=offs, use_qk_l2norm_in_kernel=l2, deterministic=True, backend=backend,
        segment_size=S)
    grads = chunk_gdn_bwd(saved, do, dh if dht else None, deterministic=True)
    out = {"o": o, "final": final, **{n: getattr(grads, n) for n in GRADS}}
    if h0:
        out["dh0"] = grads.dh0
    return out, saved


# ------------------------------------------------------------------ layout --


def test_layout_cuts_documents_into_segments():
    L = SegmentLayout.build((0, 100, 100, 330, 331), 128)
    assert L.seg_offsets == (0, 100, 100, 228, 330, 331)
    assert L.doc_segs == (0, 1, 2, 4, 5)
    assert L.is_first == (True, True, True, False, True)
    assert L.is_last == (True, True, False, True, True)
    assert L.need_E == (False, False, True, False, False)
    assert L.need_M == (False, False, False, False, False)  # doc-first without h0
    assert L.need_P == (False, False, False, True, False)
    assert not L.trivial
    with_h0 = SegmentLayout.build((0, 100, 100, 330, 331), 128, has_h0=True)
    assert with_h0.need_M == (False, False, True, False, False)
    assert SegmentLayout.build((0, 128, 256), 128).trivial
    assert SegmentLayout.build((0, 1000), 0).trivial  # no segmentation
    kcp = SegmentLayout.build((0, 200, 300), 128, first_continues=True, last_continues=True)
    assert kcp.is_first == (False, False, True) and kcp.is_last == (False, True, False)
    assert kcp.need_M == (True, False, False) and kcp.need_P == (True, True, False)


def test_segment_size_validation():
    assert resolve_segment_size(None) == DEFAULT_SEGMENT_SIZE == 4096
    assert resolve_segment_size(0) == 0 and resolve_segment_size(192) == 192
    for bad in (100, -64, 1.5, True):
        with pytest.raises(ValueError, match="segment_size"):
            resolve_segment_size(bad)
    q, k, v, g, beta, *_ = _inputs([70])
    with pytest.raises(ValueError, match="segment_size"):
        chunk_gdn_fwd(q, k, v, g, beta, deterministic=True, segment_size=96)


@needs_interpreter
@pytest.mark.parametrize("S", [64, 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_saved_inverse_gives_the_recomputed_bits(S, dtype):
    """The forward saves A_inv as the backward reads it (16-bit for 16-bit
    inputs); a backward from it equals one that recomputes the inverse, bit for
    bit, with and without segments."""
    import dataclasses

    ins = _inputs([150, 1, 90], H=1, HV=2, K=32, V=16, seed=31)
    ins = [x.to(dtype) if i < 5 or i == 6 else x for i, x in enumerate(ins)]
    offs = [0, 150, 151, 241]
    q, k, v, g, beta, h, do, dh = ins
    _, _, saved = chunk_gdn_fwd(q, k, v, g, beta, initial_state=h, output_final_state=True,
                                cu_seqlens=offs, use_qk_l2norm_in_kernel=True,
                                deterministic=True, segment_size=S)
    assert saved.A_inv is not None and saved.A_inv.dtype == dtype
    from gdn_core.ops import record_launches

    with record_launches() as launches:
        with_inv = chunk_gdn_bwd(saved, do, dh, deterministic=True)
    names = [x.name.rsplit(".", 1)[-1] for x in launches]
    assert "wy_apply" in names and "wy_fwd" not in names, names
    recomputed = chunk_gdn_bwd(dataclasses.replace(saved, A_inv=None), do, dh,
                               deterministic=True)
    for n in (*GRADS, "dh0"):
        assert torch.equal(getattr(with_inv, n), getattr(recomputed, n)), n


def test_default_segment_size_by_mode():
    """Deterministic calls always segment (bits independent of the batch); a
    non-deterministic default segments only where the segments pay: a document longer
    than CHAIN_SEGMENTS segments (a shorter chain), or enough segment programs for the
    fused reverse pass where the documents alone have too few; explicit sizes are kept
    (and validated) in both modes."""
    from gdn_core.ops.backward import FUSED_STATE_MIN_PROGRAMS

    S = DEFAULT_SEGMENT_SIZE
    assert CHAIN_SEGMENTS == 2 and FUSED_STATE_MIN_PROGRAMS == 96
    short = [0, S, 2 * S]  # no document longer than a segment: the plain path either way
    two = [0, 2 * S]  # one document of two segments (B1 T8192)
    long_doc = [0, 2 * S + 64]  # the chain shortens
    four = [i * 2 * S for i in range(5)]  # four documents of two segments (B4 T8192)
    for offs, HV, nondet in ((short, 16, S), (two, 16, 0), (two, 47, 0), (two, 48, S),
                             (two, 96, 0), (long_doc, 1, S), (long_doc, 256, S),
                             (four, 16, S), (four, 11, 0), (four, 12, S), (four, 24, 0),
                             ([0, 0, 2 * S], 40, S), ([0, S], 256, S)):
        assert choose_segment_size(None, offs, HV, deterministic=True) == DEFAULT_SEGMENT_SIZE
        assert choose_segment_size(None, offs, HV, deterministic=False) == nondet, (offs, HV)
        for explicit in (0, 128):
            for det in (True, False):
                assert choose_segment_size(explicit, offs, HV, deterministic=det) == explicit
    with pytest.raises(ValueError, match="segment_size"):
        choose_segment_size(100, two, 1, deterministic=False)


@pytest.mark.parametrize("deterministic", [True, False])
def test_default_segment_size_reaches_the_saved_set(deterministic):
    """With the default size, one document of ``2·S + 1`` tokens at HV=2 (longer than
    :data:`CHAIN_SEGMENTS` segments: the segments shorten its chain) is segmented in
    both modes."""
    q, k, v, g, beta, *_ = _inputs([CHAIN_SEGMENTS * DEFAULT_SEGMENT_SIZE + 1], H=1, HV=2,
                                   K=16, V=16)
    *_, saved = chunk_gdn_fwd(q, k, v, g, beta, deterministic=deterministic,
                              backend="reference")
    assert saved.segments is not None and saved.segments.segment_size == DEFAULT_SEGMENT_SIZE


def test_fold_tables():
    L = SegmentLayout.build((0, 300, 310), 128, has_h0=True)  # doc 0: segs 0,1,2; doc 1: seg 3
    f = forward_chains(L)
    assert f.items == (0, 1) and f.prev == (0, 1) and f.dst == (1, 2) and f.ptr == (0, 2)
    b = backward_chains(L)
    assert b.items == (2, 1) and b.prev == (-1, 1) and b.dst == (1, 0)
    # a KCP rank: the first document continues (2 remote segments before it),
    # the last goes on (its exit state asked for)
    K = SegmentLayout.build((0, 200, 330), 128, first_continues=True, last_continues=True)
    f = forward_chains(K, n_remote=2, want_exit=True)
    # remote 0 -> scratch row 4, remote 1 -> row 0 (entry of seg 0), seg 0 -> row 1,
    # then doc 1: seg 2 (no seed) -> row 3, seg 3 -> exit row 5
    assert f.items == (4, 5, 0, 2, 3) and f.prev == (-1, 4, 0, -1, 3)
    assert f.dst == (4, 0, 1, 3, 5) and f.extra_row == 5 and f.ptr == (0, 3, 5)
    b = backward_chains(K, n_remote=1, want_first=True)
    # doc 0: seg 1 (its last) -> row 0, seg 0 -> first row; doc 1: remote -> row 3, seg 3 -> 2
    assert b.items == (1, 0, 4, 3) and b.prev == (-1, 0, -1, 3) and b.dst == (0, 4, 3, 2)
    assert b.extra_row == 4


# ------------------------------------------------------------------- fold --


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("transpose", [False, True])
def test_fold_chain_is_fold_step_bits(impl, transpose):
    gen = torch.Generator().manual_seed(0)
    P, HV, K, V = 7, 2, 16, 32
    pool = torch.randn(P, HV, K, V + K, generator=gen)
    E, M = pool[..., :V], pool[..., V:]
    out = torch.zeros(10, HV, K, V)
    out[0] = torch.randn(HV, K, V, generator=gen)
    out[6] = torch.randn(HV, K, V, generator=gen)
    items, prev, dst, ptr = [1, 2, 3, 4, 5, 6], [0, 1, 2, -1, 8, 6], [1, 2, 3, 8, 9, 7], [0, 3,
                                                                                          5, 6]
    want = out.clone()
    for s in range(len(items)):
        e = E[items[s]].contiguous()
        want[dst[s]] = e if prev[s] < 0 else fold_step(
            M[items[s]].contiguous(), want[prev[s]], e, transpose=transpose, impl=impl)
    got = fold_chain(E, M, out.clone(), items, prev, dst, ptr, transpose=transpose, impl=impl)
    assert torch.equal(got, want)  # each step: fold_step's bits (same impl)
    if impl == "triton":  # and the torch fold's value, to fp32 rounding
        ref = fold_chain(E, M, out.clone(), items, prev, dst, ptr, transpose=transpose,
                         impl="torch")
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5


def test_fold_chain_triton_kernel_is_interpreted_here():
    # the CPU test run exercises the kernel through the interpreter
    if _interpreted():
        assert type(fold._kcp_fold_chain_kernel).__name__ == "InterpretedFunction"


# --------------------------------------------------------------- accuracy --


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths,H,HV,S", [
    ([300, 1, 40, 329], 1, 2, 128),    # several segments, a one-token document
    ([200, 70], 2, 4, 64),             # GQA, 64-token segments
])
def test_segment_path_vs_token_loop(backend, lengths, H, HV, S):
    offs = _offsets(lengths)
    ins = _inputs(lengths, H=H, HV=HV, seed=1)
    got, saved = _run(ins, offs, S=S, backend=backend)
    assert saved.segments is not None and saved.seg_states is not None
    q, k, v, g, beta, h0, do, dht = ins
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o, final = naive_recurrent_gdn(*leaves[:5], initial_state=leaves[5],
                                   output_final_state=True, cu_seqlens=torch.tensor(offs),
                                   use_qk_l2norm_in_kernel=True)
    ((o * do).sum() + (final * dht).sum()).backward()
    want = {"o": o.detach(), "final": final.detach(),
            **{"d" + n: x.grad for n, x in zip(("q", "k", "v", "g", "beta", "h0"), leaves)}}
    for name, ref in want.items():
        err = ((got[name].double() - ref.double()).norm() / ref.double().norm()).item()
        assert err < 1e-4, (name, err)


@pytest.mark.parametrize("backend", BACKENDS)
def test_segment_path_without_initial_state_or_dht(backend):
    lengths = [260, 5]
    offs = _offsets(lengths)
    ins = _inputs(lengths, seed=2)
    ins[1] = ins[1] / ins[1].norm(dim=-1, keepdim=True)  # stable without the in-kernel norm
    got, _ = _run(ins, offs, S=64, h0=False, dht=False, l2=False, backend=backend)
    q, k, v, g, beta, _, do, _ = ins
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    o, _ = naive_recurrent_gdn(*leaves, cu_seqlens=torch.tensor(offs))
    (o * do).sum().backward()
    assert ((got["o"] - o).norm() / o.norm()).item() < 1e-4
    for n, x in zip(GRADS, leaves):
        assert ((got[n] - x.grad).norm() / x.grad.norm()).item() < 1e-4, n


@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_views_of_a_packed_projection(backend, l2):
    # q, k, v, g, beta as a model hands them over: views of one [T, C] projection
    # (row stride C). A kernel reading them with unit-stride rows would see the
    # wrong tokens; the result must be exactly the contiguous inputs' result.
    lengths, H, HV, K, V = [200, 5, 70], 1, 2, 16, 16
    offs = _offsets(lengths)
    ins = _inputs(lengths, H=H, HV=HV, K=K, V=V, seed=4)
    if not l2:
        ins[1] = ins[1] / ins[1].norm(dim=-1, keepdim=True)
    T = offs[-1]
    widths = [H * K, H * K, HV * V, HV, HV]
    packed = torch.cat([x.reshape(1, T, w) for x, w in zip(ins[:5], widths)], dim=-1)
    views = [part.reshape(x.shape) for part, x in zip(packed.split(widths, dim=-1), ins[:5])]
    assert not any(x.is_contiguous() for x in views)
    want, _ = _run(ins, offs, S=64, l2=l2, backend=backend)
    got, saved = _run(views + ins[5:], offs, S=64, l2=l2, backend=backend)
    assert saved.segments is not None
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_short_documents_take_the_plain_path(backend):
    lengths = [64, 100, 3]
    offs = _offsets(lengths)
    ins = _inputs(lengths, seed=3)
    a, saved = _run(ins, offs, S=128, backend=backend)
    b, plain = _run(ins, offs, S=0, backend=backend)
    assert saved.segments is None and plain.segments is None
    for n in a:
        assert torch.equal(a[n], b[n]), n


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_documents_bits_do_not_depend_on_its_neighbours(backend):
    """Every segment is its own program set: a document run alone or among
    others gives the same bits (the property the KCP segment path rests on)."""
    lengths = [30, 290, 70]
    offs = _offsets(lengths)
    ins = _inputs(lengths, seed=4)
    full, _ = _run(ins, offs, S=128, backend=backend)
    a, b = offs[1], offs[2]
    alone_ins = [x[:, a:b] for x in ins[:5]] + [ins[5][1:2], ins[6][:, a:b], ins[7][1:2]]
    alone, _ = _run([x.contiguous() for x in alone_ins], [0, b - a], S=128, backend=backend)
    for n in ("o",) + GRADS:
        assert torch.equal(full[n][:, a:b], alone[n]), n
    for n in ("final", "dh0"):
        assert torch.equal(full[n][1:2], alone[n]), n


def test_segments_repeat_bitwise_and_float64_gradcheck():
    lengths = [150]
    offs = _offsets(lengths)
    ins = _inputs(lengths, seed=5)
    a, _ = _run(ins, offs, S=64, backend="reference")
    b, _ = _run(ins, offs, S=64, backend="reference")
    for n in a:
        assert torch.equal(a[n], b[n]), n

    d = _inputs([140], H=1, HV=1, K=16, V=16, seed=6, dtype=torch.float64)
    q, k, v, g, beta, h0 = (x.clone().requires_grad_(True) for x in d[:6])

    def fn(q, k, v, g, beta, h0):
        from gdn_core.autograd import chunk_gdn_autograd

        o, final = chunk_gdn_autograd(q, k, v, g, beta, initial_state=h0,
                                      output_final_state=True, use_qk_l2norm_in_kernel=True,
                                      deterministic=True, backend="reference", segment_size=64)
        return o, final

    assert torch.autograd.gradcheck(fn, (q, k, v, g, beta, h0), fast_mode=True)


# ---------------------------------------------------------- kernel options --


@needs_interpreter
def test_summary_columns_are_the_two_separate_recurrences():
    """``state_width = V + K`` with ``identity_state``: ``[E | M]`` in one launch."""
    from gdn_core.ops.chunk_state import chunk_state_fwd
    from gdn_core.ops.cumsum import chunk_cumsum_fwd
    from gdn_core.ops.wy import wy_fwd

    offs = [0, 130, 200, 200]
    idx = ChunkIndex.build(offs, "cpu")
    q, k, v, g, beta, *_ = _inputs([130, 70, 0], seed=7)
    k = k[0] / k[0].norm(dim=-1, keepdim=True)
    v, g, beta = v[0], g[0], beta[0]
    G = chunk_cumsum_fwd(g, idx)
    _, W, U = wy_fwd(k, v, beta, G, idx, 2, output_A_inv=False)
    _, _, E = chunk_state_fwd(k, W, U, G, idx, 2, output_final_state=True, store_states=False)
    eye = torch.eye(16).expand(3, 2, 16, 16)
    _, _, M = chunk_state_fwd(k, W, torch.zeros_like(W), G, idx, 2, eye,
                              output_final_state=True, store_states=False)
    h, vn, both = chunk_state_fwd(k, W, U, G, idx, 2, output_final_state=True,
                                  store_states=False, state_width=32, identity_state=True,
                                  store_v_new=False)
    assert h is None and vn is None
    torch.testing.assert_close(both[..., :16], E, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[..., 16:], M, rtol=1e-5, atol=1e-5)
    # need flags: only the wanted columns are written, with the same bits
    need = torch.tensor([1, 2, 0], dtype=torch.int32)
    _, _, part = chunk_state_fwd(k, W, U, G, idx, 2, output_final_state=True,
                                 store_states=False, state_width=32, identity_state=True,
                                 store_v_new=False, need=need)
    assert torch.equal(part[0, ..., :16], both[0, ..., :16])
    assert torch.equal(part[1, ..., 16:], both[1, ..., 16:])


@needs_interpreter
def test_state_backward_dh0_only():
    from gdn_core.ops.chunk_state_bwd import chunk_state_bwd

    offs = [0, 100, 228]
    idx = ChunkIndex.build(offs, "cpu")
    gen = torch.Generator().manual_seed(8)
    T, HV, K, V = 228, 2, 16, 16
    q, k = torch.randn(T, 1, K, generator=gen), torch.randn(T, 1, K, generator=gen)
    W = torch.randn(T, HV, K, generator=gen) * 0.1
    G = -torch.rand(T, HV, generator=gen)
    do, dvl = torch.randn(T, HV, V, generator=gen), torch.randn(T, HV, V, generator=gen)
    dht = torch.randn(2, HV, K, V, generator=gen)
    _, _, full = chunk_state_bwd(q, k, W, G, do, dvl, dht, 0.25, idx, 2)
    dh, dv, only = chunk_state_bwd(q, k, W, G, do, dvl, dht, 0.25, idx, 2, store=False,
                                   need=torch.tensor([0, 1], dtype=torch.int32))
    assert dh is None and dv is None
    assert torch.equal(only[1], full[1])


# --------------------------------------------------------------------- GPU --


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-4)])
def test_gpu_segment_path_vs_fp32_reference(dtype, tol):
    """Long documents (several 1024-token segments) at K=V=128: accuracy,
    bitwise repeat, and a document's bits independent of its neighbours."""
    lengths = [4096, 300, 2500]
    offs = _offsets(lengths)
    ins = [x.cuda() for x in _inputs(lengths, H=2, HV=4, K=128, V=128, seed=9)]
    low = [x.to(dtype) if i < 5 or i == 6 else x for i, x in enumerate(ins)]
    got, saved = _run(low, offs, S=1024)
    assert saved.backend == "triton" and saved.segments is not None
    want, _ = _run(ins, offs, S=0, backend="triton")  # plain path, fp32 inputs
    for n in got:
        assert _rel(got[n], want[n]) < tol, n
    again, _ = _run(low, offs, S=1024)
    for n in got:
        assert torch.equal(got[n], again[n]), n
    a, b = offs[1], offs[3]
    alone_ins = [x[:, a:b] for x in low[:5]] + [low[5][1:3], low[6][:, a:b], low[7][1:3]]
    alone, _ = _run([x.contiguous() for x in alone_ins], [0, 300, 2800], S=1024)
    for n in ("o",) + GRADS:
        assert torch.equal(got[n][:, a:b], alone[n]), n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("K,V", [(128, 128), (64, 128), (16, 48)])
def test_gpu_fold_chain_is_fold_step_and_the_fp64_fold(K, V, transpose):
    """On the GPU a chain of fold steps gives fold_step's bits at every step, and the
    fp64 fold's value to fp32 rounding."""
    gen = torch.Generator().manual_seed(10)
    P, HV = 9, 4
    pool = torch.randn(P, HV, K, V + K, generator=gen) * 0.2
    E, M = pool[..., :V], pool[..., V:]
    out = torch.zeros(P + 2, HV, K, V)
    out[0] = torch.randn(HV, K, V, generator=gen)
    items = list(range(P))
    prev = [0] + list(range(1, P))
    dst = list(range(1, P + 1))
    ptr = [0, P]
    gpu = fold_chain(E.cuda(), M.cuda(), out.cuda(), items, prev, dst, ptr, transpose=transpose)
    steps = out.cuda()
    for s in range(P):
        steps[dst[s]] = fold_step(M[s].cuda(), steps[prev[s]], E[s].cuda(), transpose=transpose)
    assert torch.equal(gpu, steps)
    ref = fold_chain(E.double(), M.double(), out.double(), items, prev, dst, ptr,
                     transpose=transpose)
    assert ((gpu.cpu().double() - ref).norm() / ref.norm()).item() < 1e-5
