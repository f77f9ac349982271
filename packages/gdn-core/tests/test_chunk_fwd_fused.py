"""The fused forward last phase (``gdn_core.ops.chunk_fwd_fused``) under the interpreter.

Against the two kernels it replaces (``chunk_output_fwd(chunk_state_fwd(...))``, the same
bits wherever ``K`` is one 64-row block — the interpreter's chained dot is ``matmul + acc``,
so for ``K > 64`` it is only close: see the module docstring) and the fp32 reference; packed
documents of uneven lengths (empty, shorter than a chunk, a chunk, several with a short last
one), grouped heads, with and without initial and final states; repeatable, the same bits at
any value block and for a document alone; the routing switch of ``segment_fwd_finish``.
fp32 and fp16 only (``tl.dot`` on bf16 is wrong in the interpreter); bf16 K = V = 128 is
``test_chunk_fwd_fused_gpu.py``'s.
"""

from __future__ import annotations

import types

import pytest
import torch
from gdn_core import reference as R
from gdn_core import segment
from gdn_core.chunking import ChunkIndex
from gdn_core.ops import chunk_fwd_fused as fused_mod
from gdn_core.ops import chunk_output_fwd, chunk_state_fwd
from gdn_core.ops.chunk_fwd_fused import chunk_fwd_fused
from gdn_core.ops.registry import record_launches
from gdn_core.testkit import offsets_of, state_fwd_inputs

TOL = {torch.float32: 1e-4, torch.float16: 5e-3}
LENGTHS = [0, 5, 64, 150, 40]  # empty, shorter than a chunk, one chunk, 3 chunks, short
# (H, HV, K, V): group 2 with K = 48 (padded to 64), group 1 with V = 48
DIMS = [(1, 2, 48, 32), (2, 2, 32, 48)]

_interpreted = type(fused_mod._chunk_fwd_fused_kernel).__name__ == "InterpretedFunction"
needs_interpreter = pytest.mark.skipif(not _interpreted, reason="interpreter test (no GPU)")


def _problem(lengths, H, HV, K, V, dtype, seed=0):
    return state_fwd_inputs(lengths, H, HV, K, V, dtype, seed)


def _fused(p, h0, final=True, scale=0.37):
    return chunk_fwd_fused(p["q"], p["k"], p["W"], p["U"], p["G"], scale, p["index"],
                           p["group"], initial_state=h0, output_final_state=final)


def _two_kernels(p, h0, scale=0.37):
    h, vn, fin = chunk_state_fwd(p["k"], p["W"], p["U"], p["G"], p["index"], p["group"], h0,
                                 output_final_state=True, store_states=True)
    o = chunk_output_fwd(p["q"], p["k"], vn, h, p["G"], scale, p["index"], p["group"])
    return o, fin


def _reference(p, h0, scale=0.37):
    group = p["group"]
    qe, ke = (p[x].float().repeat_interleave(group, dim=1) for x in ("q", "k"))
    h, vn, fin = R.chunk_states_ref(ke, p["W"].float(), p["U"].float(), p["G"], p["bounds"], h0)
    return R.chunk_output_ref(qe, ke, vn, h, p["G"], scale, p["bounds"]), fin


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@needs_interpreter
@pytest.mark.parametrize("with_h0", [True, False], ids=["h0", "no-h0"])
@pytest.mark.parametrize("dims", DIMS, ids=["g2-K48", "g1-V48"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_matches_two_kernels_bitwise_and_reference(dtype, dims, with_h0):
    p = _problem(LENGTHS, *dims, dtype, seed=1)
    h0 = p["h0"] if with_h0 else None
    o, fin = _fused(p, h0)
    assert o.dtype == dtype and fin.dtype == torch.float32
    assert o.shape == (p["q"].shape[0], dims[1], dims[3]) and fin.shape == p["h0"].shape
    o2, fin2 = _two_kernels(p, h0)
    assert torch.equal(o, o2) and torch.equal(fin, fin2)  # K ≤ 64: one block, the same bits
    o_ref, fin_ref = _reference(p, h0)
    assert _rel(o, o_ref) <= TOL[dtype] and _rel(fin, fin_ref) <= TOL[dtype]
    # the empty document passes its initial state (or zeros) through
    assert torch.equal(fin[0], h0[0] if h0 is not None else torch.zeros_like(fin[0]))
    # repeatable; the final state optional, o the same bits without it
    o3, fin3 = _fused(p, h0)
    assert torch.equal(o3, o) and torch.equal(fin3, fin)
    o4, none = _fused(p, h0, final=False)
    assert none is None and torch.equal(o4, o)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_bits_do_not_depend_on_value_block_or_batch(dtype, monkeypatch):
    """BV = 32 (two value blocks of V = 48) gives the pinned BV = 64's bits, and a document
    launched alone gives its bits in the packed launch."""
    p = _problem(LENGTHS, 1, 2, 32, 48, dtype, seed=2)
    o, fin = _fused(p, p["h0"])
    monkeypatch.setattr(fused_mod, "CONFIG_OVERRIDE", {"BV": 32})
    o32, fin32 = _fused(p, p["h0"])
    assert torch.equal(o32, o) and torch.equal(fin32, fin)
    monkeypatch.setattr(fused_mod, "CONFIG_OVERRIDE", None)
    for d, (bos, eos) in enumerate(p["bounds"]):
        if eos - bos not in (5, 150):
            continue
        sl = slice(bos, eos)
        one = dict(p, index=ChunkIndex.build([0, eos - bos], "cpu"),
                   **{x: p[x][sl] for x in ("q", "k", "W", "U", "G")})
        o1, f1 = _fused(one, p["h0"][d:d + 1])
        assert torch.equal(o1, o[sl]) and torch.equal(f1[0], fin[d]), d


@needs_interpreter
def test_fused_at_k128_in_the_interpreter():
    """K = 128: two 64-row blocks in the output kernel. The state path is the same
    operations (final state: the same bits); the output's ``Q h`` / ``Q Kᵀ`` are one
    ``matmul`` here against the output kernel's ``matmul + matmul`` (o differs in most
    fp32 elements, a few fp16 ones) — within fp32 rounding of it and of the reference."""
    p = _problem([70, 3], 1, 1, 128, 64, torch.float32, seed=3)
    o, fin = _fused(p, p["h0"])
    o2, fin2 = _two_kernels(p, p["h0"])
    o_ref, fin_ref = _reference(p, p["h0"])
    assert torch.equal(fin, fin2)
    assert _rel(o, o2) <= 1e-6
    assert _rel(o, o_ref) <= 1e-5 and _rel(fin, fin_ref) <= 1e-5


@needs_interpreter
def test_fused_empty_and_errors():
    p = _problem([0, 0], 1, 1, 16, 16, torch.float32)
    o, fin = _fused(p, p["h0"])
    assert o.shape == (0, 1, 16) and torch.equal(fin, p["h0"])
    o, fin = _fused(p, None)
    assert torch.equal(fin, torch.zeros_like(p["h0"]))
    p = _problem([10], 1, 1, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="initial_state"):
        _fused(p, torch.zeros(2, 1, 16, 16))
    with pytest.raises(ValueError, match="shape mismatch"):
        chunk_fwd_fused(p["q"][:5], p["k"], p["W"], p["U"], p["G"], 1.0, p["index"], 1)
    with pytest.raises(ValueError, match="share a dtype"):
        chunk_fwd_fused(p["q"].half(), p["k"], p["W"], p["U"], p["G"], 1.0, p["index"], 1)
    assert chunk_fwd_fused.launcher_info.uses_atomics is False


# ---------------------------------------------------------------- routing ---


def test_fused_fwd_wanted(monkeypatch):
    """Unset: on for CUDA bf16/fp16 at K = V = 128 (measured), off elsewhere; ``1`` on for
    any CUDA call, ``0`` off; never on CPU tensors; anything else raises."""
    def cuda_like(dtype):
        return types.SimpleNamespace(is_cuda=True, dtype=dtype)

    cpu = torch.zeros(1, dtype=torch.bfloat16)
    want = segment.fused_fwd_wanted
    for value in (None, ""):
        if value is None:
            monkeypatch.delenv(segment.FUSED_FWD_ENV, raising=False)
        else:
            monkeypatch.setenv(segment.FUSED_FWD_ENV, value)
        assert want(cuda_like(torch.bfloat16), 128, 128)
        assert want(cuda_like(torch.float16), 128, 128)
        assert not want(cuda_like(torch.float32), 128, 128)
        assert not want(cuda_like(torch.bfloat16), 64, 128)
        assert not want(cpu, 128, 128)  # the CPU / interpreter path keeps two kernels
    monkeypatch.setenv(segment.FUSED_FWD_ENV, "0")
    assert not want(cuda_like(torch.bfloat16), 128, 128)
    monkeypatch.setenv(segment.FUSED_FWD_ENV, "1")
    assert want(cuda_like(torch.float32), 64, 32)
    assert not want(cpu, 128, 128)
    monkeypatch.setenv(segment.FUSED_FWD_ENV, "true")  # a typo must not pick silently
    with pytest.raises(ValueError, match=segment.FUSED_FWD_ENV):
        want(cuda_like(torch.bfloat16), 128, 128)


@needs_interpreter
@pytest.mark.parametrize("h0", [True, False])
def test_segment_finish_routes_to_the_fused_kernel(monkeypatch, h0):
    """With the switch on (forced for CPU tensors here), a segmented deterministic forward
    runs the fused kernel in its last phase instead of the two kernels, with the same o and
    final state bits (K ≤ 64) and the same saved set."""
    from gdn_core.compose import chunk_gdn_fwd

    lengths, H, HV, K, V = [150, 5, 70], 1, 2, 16, 16
    T, gen = sum(lengths), torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(1, T, HV, V, generator=gen)
    g = -0.4 * torch.rand(1, T, HV, generator=gen)
    beta = torch.rand(1, T, HV, generator=gen)
    init = torch.randn(len(lengths), HV, K, V, generator=gen) if h0 else None

    def run():
        with record_launches() as launches:
            o, fin, saved = chunk_gdn_fwd(
                q, k, v, g, beta, initial_state=init, output_final_state=True,
                cu_seqlens=offsets_of(lengths), use_qk_l2norm_in_kernel=True, deterministic=True,
                backend="triton", segment_size=64)
        return o, fin, saved, [x.name.rsplit(".", 1)[-1] for x in launches]

    monkeypatch.delenv(segment.FUSED_FWD_ENV, raising=False)
    o, fin, saved, names = run()
    assert "chunk_output_fwd" in names and "chunk_fwd_fused" not in names
    monkeypatch.setattr(segment, "fused_fwd_wanted", lambda x, K, V: True)
    o2, fin2, saved2, names2 = run()
    assert "chunk_fwd_fused" in names2 and "chunk_output_fwd" not in names2
    assert names2.count("chunk_state_fwd") == names.count("chunk_state_fwd") - 1  # summaries
    assert torch.equal(o2, o) and torch.equal(fin2, fin)
    assert torch.equal(saved2.seg_states, saved.seg_states) and saved2.segments == saved.segments


@needs_interpreter
def test_fused_touches_only_its_arguments():
    """``tools/interp_memcheck.py``: every active load/store lane inside an argument —
    documents ending mid-chunk at the token axis' end, an empty one, K and V padded."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "tools" / "interp_memcheck.py"
    spec = importlib.util.spec_from_file_location("interp_memcheck", path)
    memcheck = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memcheck)
    for lengths, dims in (([70, 0, 5], (1, 2, 48, 32)), ([3, 130], (2, 2, 32, 48))):
        p = _problem(lengths, *dims, torch.float16, seed=5)
        with memcheck.checking() as violations:
            _fused(p, p["h0"])
            _fused(p, None, final=False)
        assert not violations, violations
