"""Test helpers of the training packages: inputs, the fp32 oracle, comparisons, subprocesses.

The four training packages share nothing but ``gdn_core``; their test suites
need the same random inputs, token-loop oracle, error measures and
fresh-interpreter runner, so those live here. ``package`` is the training
package (module) whose checkout a child interpreter must import.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import json
import os
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from gdn_core.reference import naive_recurrent_gdn

__all__ = [
    "GRAD_NAMES",
    "LaunchAudit",
    "det_split_api",
    "LiveBytes",
    "assert_close",
    "assert_equal",
    "audit_fwd_bwd",
    "det_split_fwd_bwd",
    "fixed_order_interpreter_dot",
    "kcp_case_inputs",
    "kcp_case_single_device",
    "make_inputs",
    "reference_gdn",
    "rel_err",
    "run_fwd_bwd",
    "run_script",
    "record_calls",
    "sha256",
    "state_bwd_inputs",
    "state_fwd_inputs",
    "subprocess_env",
    "wy_fp64",
    "wy_inputs",
]

GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def fixed_order_interpreter_dot() -> None:
    """Make Triton's interpreter compute ``tl.dot`` in one fixed order per output element.

    The interpreter hands ``tl.dot`` to ``np.matmul``, i.e. to the machine's BLAS, whose
    kernels pick a summation order by CPU type and matrix shape: on some machines the
    first 32 columns of ``A @ B`` differ in their last bits from ``A @ B[:, :32]``. The
    GPU's tensor cores reduce each output element over ``K`` in an order that does not
    depend on how many rows or columns a tile has, and the bit-equality tests under the
    interpreter (a value block of 32 or 64, one document alone or packed) assert exactly
    that property of our kernels. ``np.einsum`` without BLAS (``optimize=False``) sums
    each element over ``K`` in one order, whatever the other dimensions: with it those
    tests check the kernels, not the BLAS. Idempotent; only the interpreter is changed.
    """
    import numpy as np
    import triton.runtime.interpreter as interp

    builder = interp.InterpreterBuilder
    if getattr(builder.create_dot, "_gdn_fixed_order", False):
        return
    plain = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        fp8 = any(x.dtype.primitive_bitwidth == 8 and x.dtype.is_floating() for x in (a, b))
        if fp8:  # the interpreter's own fp8 conversions: not used by these kernels
            return plain(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        prod = np.einsum("...ik,...kj->...ij", a.data.astype(acc), b.data.astype(acc),
                         optimize=False)
        return interp.TensorHandle(prod + d.data, d.dtype.scalar)

    create_dot._gdn_fixed_order = True
    builder.create_dot = create_dot


def make_inputs(lengths=None, B=1, T=None, H=1, HV=2, K=16, V=16, dtype=torch.float32,
                seed=0, device="cpu", initial_state=True, gate=False, cu_as_list=False):
    """Random GDN inputs: ``(inputs, cu_seqlens, cotangents)``.

    ``lengths`` → packed (``B == 1``) with ``cu_seqlens``. ``gate`` → ``g`` is
    the raw gate input and ``A_log``, ``dt_bias`` are given.
    """
    gen = torch.Generator().manual_seed(seed)
    if lengths is not None:
        B, T = 1, sum(lengths)
        offs = [0]
        for n in lengths:
            offs.append(offs[-1] + n)
        cu = offs if cu_as_list else torch.tensor(offs, dtype=torch.int32)
        N = len(lengths)
    else:
        cu, N = None, B
    sdt = torch.float64 if dtype == torch.float64 else torch.float32

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)

    def uni(*shape, lo=0.0, hi=1.0, dt=dtype):
        return (lo + (hi - lo) * torch.rand(*shape, generator=gen)).to(dtype=dt, device=device)

    inputs = {
        "q": rnd(B, T, H, K, scale=K**-0.5),
        "k": rnd(B, T, H, K, scale=K**-0.5),
        "v": rnd(B, T, HV, V),
        "g": None,
        "beta": uni(B, T, HV),
        "initial_state": rnd(N, HV, K, V).to(sdt) if initial_state else None,
        "A_log": None,
        "dt_bias": None,
    }
    if gate:
        inputs["g"] = (torch.randn(B, T, HV, generator=gen)).to(dtype=sdt, device=device)
        inputs["A_log"] = uni(HV, lo=-1.0, hi=0.5, dt=sdt)
        inputs["dt_bias"] = uni(HV, lo=-1.0, hi=1.0, dt=sdt)
    else:
        inputs["g"] = uni(B, T, HV, lo=-1.0, hi=0.0, dt=sdt)
    cot = {"do": rnd(B, T, HV, V), "dht": rnd(N, HV, K, V).to(sdt)}
    return inputs, cu, cot


def kcp_case_inputs(case: dict, device) -> list[torch.Tensor]:
    """``q, k, v, g, beta, do`` ``[1, T, ...]`` of a context-parallel test case.

    ``case``: ``offsets`` (``T = offsets[-1]``), ``H, HV, K, V``, ``seed`` and
    ``dtype`` (a ``torch`` attribute name, e.g. ``"bfloat16"``). Drawn on the CPU
    from the seed, then moved: identical in every rank process and in the parent.
    """
    T = case["offsets"][-1]
    H, HV, K, V = case["H"], case["HV"], case["K"], case["V"]
    gen = torch.Generator().manual_seed(case["seed"])
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(1, T, HV, generator=gen)) * 0.1
    beta = torch.rand(1, T, HV, generator=gen)
    do = torch.randn(1, T, HV, V, generator=gen)
    dtype = getattr(torch, case["dtype"])
    return [x.to(device, dtype) for x in (q, k, v, g, beta, do)]


def kcp_case_single_device(case: dict, device, *, deterministic: bool,
                           segment_size: int | None = None) -> dict[str, torch.Tensor]:
    """A context-parallel test case's whole input through the single-device path
    (in-kernel L2 norm, as the rank workers run it): ``o`` and the gradients of
    ``q, k, v, g, beta`` (``"dq"`` …), on the CPU, to compare gathered ranks with."""
    from gdn_core.compose import chunk_gdn_bwd, chunk_gdn_fwd

    q, k, v, g, beta, do = kcp_case_inputs(case, device)
    o, _, saved = chunk_gdn_fwd(q, k, v, g, beta, cu_seqlens=case["offsets"],
                                deterministic=deterministic, use_qk_l2norm_in_kernel=True,
                                segment_size=segment_size)
    grads = chunk_gdn_bwd(saved, do, deterministic=deterministic)
    return {"o": o.cpu(), **{n: getattr(grads, n).cpu() for n in ("dq", "dk", "dv", "dg", "dbeta")}}


def reference_gdn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, use_qk_l2norm_in_kernel=False, *, use_gate_in_kernel=False,
                  A_log=None, dt_bias=None, workspace=None):
    """Token-by-token fp32 oracle with the gate formula applied in plain torch."""
    del workspace
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    if use_gate_in_kernel:
        g = -A_log.to(dt).exp() * F.softplus(g.to(dt) + dt_bias.to(dt))
    o, ht = naive_recurrent_gdn(
        q.to(dt), k.to(dt), v.to(dt), g.to(dt), beta.to(dt), scale=scale,
        initial_state=None if initial_state is None else initial_state.to(dt),
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    return o, ht


def run_fwd_bwd(fn, inputs, cu, cot, *, l2norm=False, output_final_state=True, scale=None,
                **kwargs):
    """Forward + backward of ``fn``; a dict of outputs and input gradients."""
    leaves = {n: (x.detach().clone().requires_grad_() if x is not None else None)
              for n, x in inputs.items()}
    gate = leaves["A_log"] is not None
    extra = dict(use_gate_in_kernel=True, A_log=leaves["A_log"],
                 dt_bias=leaves["dt_bias"]) if gate else {}
    o, ht = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], scale=scale,
               initial_state=leaves["initial_state"], output_final_state=output_final_state,
               cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm, **extra, **kwargs)
    loss = (o.float() * cot["do"].float()).sum()
    if ht is not None:
        loss = loss + (ht * cot["dht"].to(ht.dtype)).sum()
    loss.backward()
    out = {"o": o.detach(), "ht": None if ht is None else ht.detach()}
    for n in GRAD_NAMES:
        out["d" + n] = None if leaves[n] is None else leaves[n].grad
    return out


def det_split_fwd_bwd(inputs, cu, cot, *, segment_size: int, l2norm: bool = False,
                      workspace: bool = False) -> tuple[dict, object]:
    """A deterministic :mod:`gdn_core.compose` forward+backward of :func:`make_inputs`'
    inputs (initial state in, final state out), with a fresh
    :class:`~gdn_core.ops.backward.BackwardWorkspace` sized from the inputs where
    ``workspace``: ``({"o", "ht", "dq", …}, the workspace or None)``."""
    from gdn_core.compose import chunk_gdn_bwd, chunk_gdn_fwd
    from gdn_core.ops.backward import BackwardWorkspace

    q, v = inputs["q"], inputs["v"]
    o, ht, saved = chunk_gdn_fwd(
        q, inputs["k"], v, inputs["g"], inputs["beta"], initial_state=inputs["initial_state"],
        output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm,
        deterministic=True, segment_size=segment_size)
    ws = None
    if workspace:  # room for the chunks and documents the segments add
        T, H, K = q.shape[1:]
        HV, V = v.shape[2:]
        pieces = len(cu) + T // segment_size + 1
        ws = BackwardWorkspace.for_shapes(
            T=T, H=H, HV=HV, K=K, V=V, num_chunks=T // 64 + pieces, num_docs=pieces,
            dtype=q.dtype, device=q.device, deterministic=True)
    gr = chunk_gdn_bwd(saved, cot["do"], cot["dht"], deterministic=True, workspace=ws)
    return {"o": o, "ht": ht, **vars(gr)}, ws


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖ / ‖b‖`` in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a − b| / max |b|`` in float64, after asserting ``a`` is finite (the Gluon
    kernels' GPU tests)."""
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def offsets_of(lengths) -> list[int]:
    """Document offsets ``[0, n0, n0 + n1, …]`` of packed document ``lengths``."""
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    return offs


def record_calls(monkeypatch, owner, name: str) -> list[tuple[dict, object]]:
    """Replace ``owner.name`` (a keyword-only function) for the test by a wrapper that
    calls it and records ``(keywords, result)`` of every call in the returned list."""
    calls: list[tuple[dict, object]] = []
    real = getattr(owner, name)

    def recorded(**kw):
        res = real(**kw)
        calls.append((kw, res))
        return res

    monkeypatch.setattr(owner, name, recorded)
    return calls


def state_fwd_inputs(lengths, H: int, HV: int, K: int, V: int, dtype: torch.dtype = torch.float32,
                     seed: int = 0) -> dict:
    """CPU inputs of the forward's state pass (and of the fused forward) over packed
    documents of ``lengths``: ``q, k`` ``[T, H, K]`` L2-normalised and ``W, U`` (from the
    fp32 WY reference on the ``dtype``-rounded k, v, β) in ``dtype``; ``G`` fp32; ``index``
    (:class:`~gdn_core.chunking.ChunkIndex`), ``group``, ``bounds`` (document spans) and
    ``h0`` ``[N, HV, K, V]`` fp32, as a dict."""
    from gdn_core import reference as R
    from gdn_core.chunking import ChunkIndex

    gen = torch.Generator().manual_seed(seed)
    offs = offsets_of(lengths)
    T, group = offs[-1], HV // H
    bounds = list(zip(offs[:-1], offs[1:]))
    q = R.l2_normalize(torch.randn(T, H, K, generator=gen))
    k = R.l2_normalize(torch.randn(T, H, K, generator=gen))
    v = torch.randn(T, HV, V, generator=gen)
    g = -torch.rand(T, HV, generator=gen) * 0.3 - 0.01
    beta = torch.rand(T, HV, generator=gen) * 0.9 + 0.05
    G = R.chunk_cumsum_ref(g, bounds)
    ke = k.to(dtype).float().repeat_interleave(group, dim=1)
    _, W, U = R.wy_ref(ke, v.to(dtype).float(), beta.to(dtype).float(), G, bounds)
    h0 = torch.randn(len(lengths), HV, K, V, generator=gen) * 0.5
    return dict(q=q.to(dtype), k=k.to(dtype), W=W.to(dtype), U=U.to(dtype), G=G,
                index=ChunkIndex.build(offs, "cpu"), group=group, bounds=bounds, h0=h0)


def state_bwd_inputs(lengths, H: int, group: int, dtype: torch.dtype, device, *,
                     seed: int = 0, dv_local: bool = True):
    """Inputs of the reverse state recurrence (``chunk_state_bwd``'s) for packed documents
    ``lengths``, K = V = 128: ``(offsets, index, (q, k, W, G, do, [dv_local,] dht))`` on
    ``device``; q, k, W, do (and dv_local) in ``dtype``, ``G`` the kernel cumsum of a mild
    fp32 decay, ``dht`` fp32. ``dv_local=False`` leaves it out (for a kernel that forms it
    itself) without changing the other draws."""
    from gdn_core.chunking import ChunkIndex
    from gdn_core.ops.cumsum import chunk_cumsum_fwd

    gen = torch.Generator().manual_seed(seed)
    offs = offsets_of(lengths)
    T, HV, D = offs[-1], H * group, 128
    index = ChunkIndex.build(offs, device)
    q = (torch.randn(T, H, D, generator=gen) * 0.1).to(device, dtype)
    k = F.normalize(torch.randn(T, H, D, generator=gen), dim=-1).to(device, dtype)
    W = (torch.randn(T, HV, D, generator=gen) * 0.05).to(device, dtype)
    do = torch.randn(T, HV, D, generator=gen).to(device, dtype)
    dvl = (torch.randn(T, HV, D, generator=gen).to(device, dtype),) if dv_local else ()
    g = (-torch.rand(T, HV, generator=gen) * 0.3 - 0.01).to(device)
    G = chunk_cumsum_fwd(g, index)
    dht = torch.randn(len(lengths), HV, D, D, generator=gen).to(device)
    return offs, index, (q, k, W, G, do, *dvl, dht)


def wy_inputs(lengths, H: int, group: int, K: int, V: int, kind: str = "normal",
              seed: int = 0) -> tuple[list[int], tuple[torch.Tensor, ...]]:
    """Inputs of the WY stage for packed documents ``lengths``: ``(offsets, (k [T,H,K], v
    [T,HV,V], beta [T,HV], g [T,HV]))``, fp32 on the CPU (the caller casts and moves them),
    keys L2-normalised. ``kind``: ``"normal"`` (``β`` uniform, ``g = −softplus(N(0,1))``),
    ``"decay"`` (that ``g`` × 40) or ``"coupled"`` (nearly parallel keys, ``β = 0.99``, no
    decay: large inverse entries)."""
    from gdn_core.reference import l2_normalize

    gen = torch.Generator().manual_seed(seed)
    offs = offsets_of(lengths)
    T, HV = offs[-1], H * group
    if kind == "coupled":
        base = torch.randn(1, 1, K, generator=gen)
        k = l2_normalize(base + 0.05 * torch.randn(T, H, K, generator=gen))
        beta = torch.full((T, HV), 0.99)
        g = torch.zeros(T, HV)
    else:
        k = l2_normalize(torch.randn(T, H, K, generator=gen))
        beta = torch.rand(T, HV, generator=gen)
        g = -torch.nn.functional.softplus(torch.randn(T, HV, generator=gen))
        if kind == "decay":
            g = 40 * g
    v = torch.randn(T, HV, V, generator=gen)
    return offs, (k, v, beta, g)


def wy_fp64(k, v, beta, G, offsets, group: int):
    """``(A_inv, W, U)`` of the WY stage in float64 (:func:`gdn_core.reference.wy_ref`, a
    triangular solve of ``I + A``) on the given (rounded) values, on their device;
    ``offsets``: the document offsets, ``group``: value heads per key head."""
    from gdn_core.reference import wy_ref

    return wy_ref(k.double().repeat_interleave(group, dim=1), v.double(), beta.double(),
                  G.double(), list(zip(offsets[:-1], offsets[1:])))


def assert_close(got: dict, ref: dict, rtol: float) -> None:
    """Relative Frobenius error of every tensor in ``ref`` (``None`` must match)."""
    for key, b in ref.items():
        a = got[key]
        if b is None:
            assert a is None, key
            continue
        assert a is not None, key
        assert a.shape == b.shape, (key, a.shape, b.shape)
        assert torch.isfinite(a).all(), f"{key}: non-finite values"
        err = rel_err(a, b)
        assert err < rtol, f"{key}: relative error {err:.2e} >= {rtol:.0e}"


def assert_equal(a: dict, b: dict) -> None:
    """Bitwise equality (``torch.equal``, same dtype) of every tensor of two result dicts."""
    assert a.keys() == b.keys()
    for key in a:
        if a[key] is None:
            assert b[key] is None, key
        else:
            assert a[key].dtype == b[key].dtype, key
            assert torch.equal(a[key], b[key]), f"{key} differs between runs"


def sha256(x: torch.Tensor) -> str:
    """Hash of a tensor's bytes (compares results across processes)."""
    return hashlib.sha256(x.detach().contiguous().cpu().view(torch.uint8).numpy()
                          .tobytes()).hexdigest()


def subprocess_env(package: ModuleType, **extra: str) -> dict:
    """Environment for a child interpreter that imports this checkout's ``gdn_core``
    and ``package`` (the training package's module, imported by the caller);
    OMP_NUM_THREADS=1, no TRITON_INTERPRET unless in ``extra``."""
    import gdn_core

    paths = [str(Path(m.__file__).resolve().parents[1]) for m in (package, gdn_core)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.pop("TRITON_INTERPRET", None)
    env.update(extra)
    return env


def run_script(script: str, *args: str, package: ModuleType, processes: int = 1, timeout: int = 300,
               **env: str) -> list[dict]:
    """Run ``script`` in ``processes`` fresh interpreters concurrently; each prints one
    JSON line last, returned parsed in process order. A failing child fails the test."""
    procs = [
        subprocess.Popen([sys.executable, "-c", script, *args],
                         env=subprocess_env(package, **env),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(processes)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


class LiveBytes(TorchDispatchMode):
    """Peak memory of the tensors allocated inside the mode (any device, CPU included).

    Every new storage an aten op returns is counted until its tensor is freed;
    views and aliases of an argument are not (they share its storage). ``current``
    and ``peak`` are bytes. Tensors made before the mode (the inputs) are not counted:
    ``peak`` is the extra memory, as ``torch.cuda.max_memory_allocated`` after a
    reset would show it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, n = storage.data_ptr(), storage.nbytes()
        if n == 0 or key in self.live:
            return
        self.live[key] = n
        self.current += n
        self.peak = max(self.peak, self.current)

        def free(key: int = key, n: int = n) -> None:
            if self.live.pop(key, None) is not None:
                self.current -= n

        weakref.finalize(t, free)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat, _ = torch.utils._pytree.tree_flatten((args, kwargs))
        inputs = {x.untyped_storage().data_ptr() for x in flat if isinstance(x, torch.Tensor)}
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs:
                self._track(o)
        return out


# ------------------------------------------------------------ launch audit --

#: aten ops that only alias (no device work, no allocation)
_VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "slice", "select", "as_strided", "t", "transpose",
    "unsqueeze", "squeeze", "expand", "alias", "detach", "unbind", "split", "flatten",
    "permute", "split_with_sizes", "chunk", "narrow", "view_as", "_reshape_alias",
    "unflatten", "movedim", "diagonal", "_neg_view", "_conj", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "is_same_size",
})
_ALLOC_OPS = frozenset({"empty", "empty_strided", "new_empty", "empty_like",
                        "new_empty_strided"})


def _op_kind(name: str) -> str:
    base = name.split(".")[1]
    return "view" if base in _VIEW_OPS else "alloc" if base in _ALLOC_OPS else "work"


def _caller() -> str:
    """The innermost ``gdn_*`` frame outside the launch cache (``module:line function``)."""
    f = sys._getframe(2)
    while f is not None:
        mod = f.f_globals.get("__name__", "")
        if mod.startswith("gdn_") and mod not in ("gdn_core.ops.launch", __name__):
            return f"{mod.removeprefix('gdn_core.')}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return "?"


class LaunchAudit(TorchDispatchMode):
    """Records the device work of the code run inside it, in order: ``("triton", kernel,
    caller)`` for every Triton kernel launch (every launch site goes through
    :func:`gdn_core.ops.launch.cached_launch`) and ``(kind, aten op, caller)`` for every
    other op, ``kind`` ``"work"`` (a fill, copy, cast, gather, arithmetic: a device launch
    on CUDA), ``"alloc"`` (``empty*``: host time only) or ``"view"``. The ops an
    interpreted kernel runs are not recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str, str]] = []
        self._inside = 0
        self._restore = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside:
            name = str(func)
            self.events.append((_op_kind(name), name, _caller()))
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from gdn_core.ops import launch

        audit, getitem = self, launch.CachedLauncher.__getitem__

        def counted_getitem(launcher, grid):
            run = getitem(launcher, grid)

            def counted(*a, **k):
                audit.events.append(("triton", launcher.kernel.__name__, _caller()))
                audit._inside += 1
                try:
                    return run(*a, **k)
                finally:
                    audit._inside -= 1
            return counted

        launch.CachedLauncher.__getitem__ = counted_getitem
        self._restore = (launch.CachedLauncher, getitem)
        return super().__enter__()

    def __exit__(self, *exc):
        cls, getitem = self._restore
        cls.__getitem__ = getitem
        return super().__exit__(*exc)

    def counts(self) -> dict[str, int]:
        """``{"triton": kernel launches, "work": aten ops with device work, "alloc": ...}``."""
        c = collections.Counter(kind for kind, _, _ in self.events)
        return {"triton": c["triton"], "work": c["work"], "alloc": c["alloc"]}

    def listing(self) -> list[str]:
        """One line per launch or non-view op."""
        return [f"{kind:6} {op:40} {where}" for kind, op, where in self.events
                if kind != "view"]


def audit_fwd_bwd(fn, lengths, segment_size: int | None, *, h0: bool, final: bool,
                  l2norm: bool = True, H: int = 2, D: int = 16, dtype=torch.float16,
                  cuda_like: bool = True) -> LaunchAudit:
    """The :class:`LaunchAudit` of one forward+backward of the autograd call ``fn`` (a
    package's ``chunk_gated_delta_rule[_det]``) on packed documents of ``lengths``, after
    a warm-up call of the same layout (the host caches filled). ``cuda_like``: route the
    forward's last phase through the fused kernel and the fold through its Triton kernel,
    as a CUDA call at K = V = 128, 16-bit, takes them (on the CPU: the interpreter)."""
    import gdn_core.kcp.fold as fold
    from gdn_core import segment

    ins, cu, cot = make_inputs(lengths=lengths, H=H, HV=H, K=D, V=D, dtype=dtype,
                               initial_state=h0, cu_as_list=True)

    def step(ctx):
        leaves = {n: (x.detach().clone().requires_grad_() if x is not None else None)
                  for n, x in ins.items()}
        with ctx:
            o, ht = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                       initial_state=leaves["initial_state"], output_final_state=final,
                       cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm,
                       segment_size=segment_size)
            outs, grads = ([o, ht], [cot["do"], cot["dht"]]) if final else ([o], [cot["do"]])
            torch.autograd.backward(outs, grads)

    fused, resolve = segment.fused_fwd_wanted, fold.resolve_fold_impl
    if cuda_like:
        segment.fused_fwd_wanted = lambda x, K, V: True
        fold.resolve_fold_impl = lambda d, t, impl=None: (
            "triton" if impl is None and t == torch.float32 else resolve(d, t, impl))
    try:
        step(contextlib.nullcontext())
        audit = LaunchAudit()
        step(audit)
    finally:
        segment.fused_fwd_wanted, fold.resolve_fold_impl = fused, resolve
    return audit


@functools.cache
def det_split_api() -> tuple[Callable, Callable, type]:
    """A deterministic split API of gdn_core's own — the training packages' front end
    (:class:`gdn_core.frontend.SingleRankAPI`) in the test namespace
    ``torch.ops.gdn_core_testkit`` — as ``(fwd, bwd, workspace class)``, so that gdn-core's
    suite needs no training package. Made once a process (its custom ops are registered)."""
    from gdn_core.frontend import SingleRankAPI
    from gdn_core.package_types import single_rank_types

    saved, workspace, grads = single_rank_types("gdn_core_testkit", deterministic=True)
    api = SingleRankAPI("gdn_core_testkit", deterministic=True, saved_cls=saved,
                        workspace_cls=workspace, grads_cls=grads)
    fwd = api.split_fwd("fwd", autograd="chunk_gdn_autograd", bwd="bwd")
    bwd = api.split_bwd("bwd", fwd="fwd", other="none")
    return fwd, bwd, workspace
