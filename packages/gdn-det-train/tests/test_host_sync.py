"""Issue 18: a deterministic call's steady state reads nothing back from the device and
copies no Python data to it (on a GPU either would be a host synchronisation: a
device→host read, or a host→device copy from pageable memory).

CPU tensors cannot show a transfer directly, so the child process (the Triton kernels
under ``TRITON_INTERPRET=1``, the path CUDA tensors take) counts every way the library
could make one: reading a tensor's values on the host (``item``, ``tolist``,
``bool``/``int``/``float``/``index`` of a tensor, ``cpu``, ``numpy``, ``nonzero``,
``torch.equal``, ``torch.unique``, ``masked_select``), making a tensor from Python data
(``torch.tensor``, ``as_tensor``, ``asarray``, ``frombuffer``, ``from_numpy``,
``new_tensor``), a ``.to`` naming a device, ``pin_memory`` and ``torch.cuda.synchronize``.
Calls inside an interpreted kernel are the kernel, not host work, and are not counted;
reads of tensors that live on the host in a GPU run too (a CPU ``cu_seqlens``, the
custom ops' handle scalars) are allowed by identity.

The first calls of a layout build and cache its tables (one packed copy per layout,
:mod:`gdn_core.hostcache`); the calls counted are the third and later ones.
"""

from __future__ import annotations

import textwrap

_SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    import triton.runtime.interpreter as interp
    from gdn_core import plan as gdn_plan
    from gdn_det_train import (DetWorkspace, VarlenLayout, chunk_gated_delta_rule_det,
                               chunk_gdn_det_bwd, chunk_gdn_det_fwd)

    in_kernel = [0]
    real_run = interp.InterpretedFunction.run

    def run(self, *a, **kw):
        in_kernel[0] += 1
        try:
            return real_run(self, *a, **kw)
        finally:
            in_kernel[0] -= 1

    interp.InterpretedFunction.run = run

    hits, allowed, counting = [], set(), [False]

    def note(name):
        import traceback
        where = [f"{f.filename.split('/src/')[-1]}:{f.lineno}" for f in
                 traceback.extract_stack()[:-2] if "/packages/" in f.filename]
        hits.append(f"{name} at {' < '.join(where[::-1][:3]) or '(outside the packages)'}")

    def reader(owner, name):
        real = getattr(owner, name)

        def wrapped(self, *a, **kw):
            if counting[0] and not in_kernel[0] and id(self) not in allowed:
                note(f"Tensor.{name}")
            return real(self, *a, **kw)
        setattr(owner, name, wrapped)

    def maker(owner, name):
        real = getattr(owner, name)

        def wrapped(*a, **kw):
            if counting[0] and not in_kernel[0]:
                note(f"{getattr(owner, '__name__', owner)}.{name}")
            return real(*a, **kw)
        setattr(owner, name, wrapped)

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu",
                 "numpy", "nonzero", "equal", "unique", "masked_select", "pin_memory",
                 "new_tensor"):
        reader(torch.Tensor, name)
    for name in ("tensor", "as_tensor", "asarray", "frombuffer", "from_numpy", "equal",
                 "nonzero", "unique", "masked_select"):
        maker(torch, name)
    maker(torch.cuda, "synchronize")
    real_to = torch.Tensor.to

    def to(self, *a, **kw):
        if counting[0] and not in_kernel[0] and (
                "device" in kw or any(isinstance(x, (str, torch.device, torch.Tensor))
                                      for x in a)):
            note("Tensor.to(device)")
        return real_to(self, *a, **kw)
    torch.Tensor.to = to

    torch.manual_seed(0)
    lengths = [5, 64, 70]
    T, H, HV, K, V = sum(lengths), 1, 2, 16, 32
    offs = [0, 5, 69, 139]
    cu_cpu = torch.tensor(offs, dtype=torch.int32)
    allowed.add(id(cu_cpu))
    q, k = torch.randn(1, T, H, K), torch.randn(1, T, H, K)
    v, g, beta = torch.randn(1, T, HV, V), -torch.rand(1, T, HV), torch.rand(1, T, HV)
    A_log, dt_bias = torch.rand(HV) - 0.5, torch.rand(HV) - 0.5
    h0 = torch.randn(3, HV, K, V)
    do, dht = torch.randn(1, T, HV, V), torch.randn(3, HV, K, V)
    ws = DetWorkspace.for_shapes(T=T, H=H, HV=HV, K=K, V=V, num_docs=3, device="cpu",
                                 dtype=torch.float32)
    layout = VarlenLayout(offs, device="cpu", max_docs=4)
    allowed.add(id(layout.handle))
    # the benchmark's call (benchmarks/host_overhead_gpu.py): B=1, no cu_seqlens, no options
    qb, kb = torch.nn.functional.normalize(torch.randn(2, 128, 2, 16), dim=-1).unbind(0)
    qb, kb = qb[None], kb[None]
    vb, gb, bb = torch.randn(1, 128, 2, 16), -torch.rand(1, 128, 2) / 16, torch.rand(1, 128, 2)
    dob = torch.randn(1, 128, 2, 16)

    def autograd(ins, do, **kw):
        xs = [t.clone().requires_grad_() for t in ins]
        o, ht = chunk_gated_delta_rule_det(*xs[:5], **kw, **(
            {"initial_state": xs[5], "output_final_state": True} if len(xs) > 5 else {}))
        loss = (o * do).sum() + ((ht * dht).sum() if ht is not None else 0)
        loss.backward()

    def split(**kw):
        o, ht, saved = chunk_gdn_det_fwd(q, k, v, g, beta, initial_state=h0,
                                         output_final_state=True, **kw)
        chunk_gdn_det_bwd(saved, do, dht)

    full = (q, k, v, g, beta, h0)
    gate = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                dt_bias=dt_bias)
    cases = {
        "benchmark call (no cu_seqlens)": lambda: autograd((qb, kb, vb, gb, bb), dob),
        "list cu_seqlens, h0, final state": lambda: autograd(full, do, cu_seqlens=offs),
        "CPU tensor cu_seqlens, L2 norm, gate": lambda: autograd(full, do, cu_seqlens=cu_cpu,
                                                                 **gate),
        "segments (64), h0, final state": lambda: autograd(full, do, cu_seqlens=offs,
                                                           segment_size=64),
        "VarlenLayout (padded to 4 documents)": lambda: autograd(full[:5], do,
                                                                 cu_seqlens=layout),
        "workspace": lambda: autograd(full, do, cu_seqlens=offs, workspace=ws),
        "split API, segments (64)": lambda: split(cu_seqlens=offs, segment_size=64),
    }
    out = {}
    for name, fn in cases.items():
        fn(), fn()  # the layout's tables are built and cached
        if hasattr(ws, "_gdn_op_handle"):
            allowed.add(id(ws._gdn_op_handle))
        # the plans' CPU offsets, which the custom ops receive (CPU tensors on a GPU too)
        allowed.update(id(p.cu_host) for p in gdn_plan._PLANS.values() if p.cu_host is not None)
        hits.clear()
        counting[0] = True
        fn()
        fn()
        counting[0] = False
        out[name] = sorted(set(hits))
    print(json.dumps(out))
    """
)


def test_steady_state_makes_no_host_transfer(run_script):
    (got,) = run_script(_SCRIPT, TRITON_INTERPRET="1", timeout=600)
    assert len(got) == 7, got
    bad = {case: hits for case, hits in got.items() if hits}
    assert not bad, bad
