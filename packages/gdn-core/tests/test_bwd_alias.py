"""GDN_CORE_BWD_ALIAS: which chunk-gradient results the backward writes over its own
inputs (:func:`gdn_core.ops.backward.plan_aliases`, one test per condition), and that on
the Triton pair (here: no GPU) nothing is aliased and the switch changes no bit.

The aliasing itself runs only with the Gluon one-tile kernel: ``test_bwd_alias_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from gdn_core.chunking import ChunkIndex
from gdn_core.ops import backward
from gdn_core.ops.backward import grads_kernel, plan_aliases
from gdn_core.ops.chunk_grads_bwd import chunk_grads_bwd
from gdn_core.switches import BWD_ALIAS_ENV, switch_setting
from gdn_core.testkit import record_calls

T, H, D = 70, 2, 128
BF = torch.bfloat16


def _case(**kw):
    """``plan_aliases`` keywords of a valid one-tile call (group 1, final 16-bit dq, fresh
    v_new and dV'), with ``kw`` replacing some."""
    args = dict(
        kernel="gluon", group=1, dq=((T, H, D), BF), dv=((T, H, D), BF),
        v_new=torch.empty(T, H, D, dtype=BF), du=torch.empty(T, H, D, dtype=BF),
        v_new_owned=True, du_owned=True, workspace=False, out=False, setting=True,
    )
    args.update(kw)
    return args


def test_valid_call_aliases_both():
    assert plan_aliases(**_case()) == (True, True)


def test_on_by_default():
    """Unset (``None``) is on where valid, as ``1`` is (the H200 ran it in session 16)."""
    assert plan_aliases(**_case(setting=None)) == (True, True)


@pytest.mark.parametrize("kernel", ["triton", "gluon_persistent"])
def test_only_the_one_tile_kernel(kernel):
    """The Triton pair's second kernel re-reads V' and dV' after the first stored dq, dv;
    the persistent kernel is not proven safe."""
    assert plan_aliases(**_case(kernel=kernel)) == (False, False)


def test_switch_off():
    assert plan_aliases(**_case(setting=False)) == (False, False)


@pytest.mark.parametrize("field", ["workspace", "out"])
def test_no_alias_with_a_workspace_or_given_results(field):
    assert plan_aliases(**_case(**{field: True})) == (False, False)


def test_grouped_heads_alias_only_dv():
    HV = 2 * H
    args = _case(group=2, dv=((T, HV, D), BF), v_new=torch.empty(T, HV, D, dtype=BF),
                 du=torch.empty(T, HV, D, dtype=BF), dq=((T, H, D), BF))
    assert plan_aliases(**args) == (True, False)


def test_fp32_dq_partials_alias_only_dv():
    """With the in-kernel L2 norm (or a group reduction) dq is an fp32 partial."""
    assert plan_aliases(**_case(dq=None)) == (True, False)


def test_not_owned():
    assert plan_aliases(**_case(v_new_owned=False)) == (True, False)
    assert plan_aliases(**_case(du_owned=False)) == (False, True)


def test_dtype_or_shape_mismatch():
    assert plan_aliases(**_case(dq=((T, H, D), torch.float16))) == (True, False)
    assert plan_aliases(**_case(dv=((T, H, D), torch.float16))) == (False, True)
    assert plan_aliases(**_case(dq=((T, H, 64), BF))) == (True, False)
    assert plan_aliases(**_case(du=torch.empty(T, H, 64, dtype=BF))) == (False, True)


def test_views_are_not_aliased():
    """A strided view, an offset view or a view of a larger buffer is not handed out."""
    wide = torch.empty(T, H, 2 * D, dtype=BF)
    big = torch.empty(T + 1, H, D, dtype=BF)
    for view in (wide[..., :D], big[1:], big[:T], torch.empty(H, T, D, dtype=BF).transpose(0, 1)):
        assert plan_aliases(**_case(v_new=view, du=view)) == (False, False)
    assert plan_aliases(**_case(v_new=None)) == (True, False)


def test_switch_values(monkeypatch):
    for raw, want in (("", None), ("1", True), ("0", False)):
        monkeypatch.setenv(BWD_ALIAS_ENV, raw)
        assert switch_setting(BWD_ALIAS_ENV) is want
    monkeypatch.setenv(BWD_ALIAS_ENV, "yes")
    with pytest.raises(ValueError, match="GDN_CORE_BWD_ALIAS"):
        switch_setting(BWD_ALIAS_ENV)


def test_grads_kernel_names_the_launcher():
    from gdn_core.ops.gluon.chunk_grads import chunk_grads_bwd_gluon
    from gdn_core.ops.gluon.chunk_grads_pipelined import chunk_grads_bwd_gluon_pipelined

    assert grads_kernel(chunk_grads_bwd) == "triton"
    assert grads_kernel(chunk_grads_bwd_gluon) == "gluon"
    assert grads_kernel(chunk_grads_bwd_gluon_pipelined) == "gluon_persistent"


def _spy(monkeypatch):
    """Record every :func:`plan_aliases` call's keywords and result."""
    return record_calls(monkeypatch, backward, "plan_aliases")


@pytest.mark.parametrize("group, l2", [(1, False), (2, True)])
def test_triton_pair_aliases_nothing_and_the_switch_keeps_bits(monkeypatch, group, l2):
    from gdn_core.ops.backward import chunk_gdn_backward
    from gdn_core.ops.forward import gdn_forward_triton

    calls = _spy(monkeypatch)
    lengths, K = [5, 70], 16
    offs = [0, 5, 75]
    index = ChunkIndex.build(offs, "cpu")
    gen = torch.Generator().manual_seed(3)
    Tn, HV = sum(lengths), H * group
    q, k = torch.randn(Tn, H, K, generator=gen), torch.randn(Tn, H, K, generator=gen)
    v, do = torch.randn(Tn, HV, K, generator=gen), torch.randn(Tn, HV, K, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(Tn, HV, generator=gen) + 2.0) * 0.5
    beta = torch.rand(Tn, HV, generator=gen)
    fwd = gdn_forward_triton(q, k, v, g, beta, scale=K**-0.5, index=index, initial_state=None,
                             output_final_state=False, use_qk_l2norm_in_kernel=l2)

    def run():
        return chunk_gdn_backward(fwd.q_used, fwd.k_used, v, g, beta, fwd.G, scale=K**-0.5,
                                  index=index, initial_state=None, do=do, dht=None,
                                  deterministic=True, q_rstd=fwd.q_rstd, k_rstd=fwd.k_rstd)

    res = {}
    for raw in ("", "0", "1"):
        monkeypatch.setenv(BWD_ALIAS_ENV, raw)
        res[raw] = run()
    assert [c[1] for c in calls] == [(False, False)] * 3
    assert all(c[0]["kernel"] == "triton" and c[0]["v_new_owned"] and c[0]["du_owned"]
               for c in calls)
    for raw in ("0", "1"):
        assert all(torch.equal(a, b) for a, b in zip(res[raw], res[""], strict=True))


def test_segment_path_hands_over_its_buffers(monkeypatch):
    """The autograd path (``segment_bwd_finish``) donates v_new and dV' without a workspace,
    and with one (its dV' is the workspace's) asks for no alias."""
    from gdn_core.testkit import det_split_api

    chunk_gdn_det_fwd, chunk_gdn_det_bwd, DetWorkspace = det_split_api()
    calls = _spy(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    Tn, K = 75, 16
    q, k = (torch.nn.functional.normalize(torch.randn(1, Tn, H, K, generator=gen), dim=-1)
            for _ in range(2))
    v, do = torch.randn(1, Tn, H, K, generator=gen), torch.randn(1, Tn, H, K, generator=gen)
    g, beta = -torch.rand(1, Tn, H, generator=gen) / 8, torch.rand(1, Tn, H, generator=gen)
    _, _, saved = chunk_gdn_det_fwd(q, k, v, g, beta, cu_seqlens=[0, 5, Tn])
    chunk_gdn_det_bwd(saved, do)
    ws = DetWorkspace.for_shapes(T=Tn, H=H, HV=H, K=K, V=K, num_docs=2, device="cpu",
                                 dtype=torch.float32)
    chunk_gdn_det_bwd(saved, do, workspace=ws)
    if not calls:
        pytest.skip("the backward ran on the reference backend (no kernels)")
    (kw0, _), (kw1, res1) = calls
    assert kw0["v_new_owned"] and kw0["du_owned"] and not kw0["workspace"]
    assert kw1["workspace"] and not kw1["du_owned"] and res1 == (False, False)
