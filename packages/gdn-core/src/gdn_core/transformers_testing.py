"""Checks of a transformers switch (``use_in_transformers``) that the packages' tests run.

* :func:`tiny_qwen3_next_model` — a random ``Qwen3NextForCausalLM`` small enough
  for a CPU test (needs transformers);
* :func:`train_side_by_side` — the model on its own torch path and a switched
  copy, trained the same steps: per step the loss difference and every
  parameter gradient's difference;
* :func:`diff_packed_layer` — a switched GDN layer on packed documents
  (``cu_seq_lens_q``) against the unswitched layer on each document alone;
* :class:`SwitchChecks`, :class:`SwitchChecksGPU` — the tests themselves, which
  each package's test module subclasses with its own names.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

__all__ = ["SwitchChecks", "SwitchChecksGPU", "diff_packed_layer", "tiny_qwen3_next_model",
           "train_side_by_side"]


def tiny_qwen3_next_model(seed: int = 0, dtype: torch.dtype = torch.float32, *,
                          dense_mlp: bool = False) -> torch.nn.Module:
    """``Qwen3NextForCausalLM``: 3 layers (GDN, full attention, GDN), hidden 32, GDN heads
    2 q/k and 4 value of 16, 4 experts (top 2), vocab 64; ``dense_mlp``: a dense MLP in
    every layer instead (no top-k routing: in bf16 a routing decision flips on the
    rounding of its logits, and the experts' gradients then differ by whole tokens)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_only_layers=[0, 1, 2] if dense_mlp else [])
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Qwen3NextForCausalLM(cfg).to(dtype)
    finally:
        torch.random.set_rng_state(state)
    return model


def _step(model: torch.nn.Module, ids: torch.Tensor, opt: torch.optim.Optimizer, **kw: Any):
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, **kw).loss
    loss.backward()
    loss = loss.detach()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    opt.step()
    return float(loss), grads


def train_side_by_side(switch: Callable[[torch.nn.Module], list[str]], steps: int = 3,
                       seed: int = 0, shape: tuple[int, int] = (2, 48), *,
                       device: str = "cpu", dtype: torch.dtype = torch.float32,
                       dense_mlp: bool = False) -> list[dict[str, Any]]:
    """Train the model and a ``switch``-ed copy ``steps`` AdamW steps on the same random
    batches → per step ``{"loss", "loss_diff", "grad_diff": {name: max |Δ|},
    "grad_rel": {name: max |Δ| / max |g|}, "missing": names with a gradient on one
    side only, "switched": layer names}``."""
    ref = tiny_qwen3_next_model(seed, dtype, dense_mlp=dense_mlp).to(device)
    ours = copy.deepcopy(ref)
    switched = switch(ours)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
    gen = torch.Generator().manual_seed(seed + 1)
    report = []
    for _ in range(steps):
        ids = torch.randint(0, ref.config.vocab_size, shape, generator=gen).to(device)
        loss_r, g_r = _step(ref, ids, opts[0])
        loss_o, g_o = _step(ours, ids, opts[1])
        report.append({
            "loss": loss_r, "loss_diff": abs(loss_r - loss_o), "switched": switched,
            "missing": sorted(g_r.keys() ^ g_o.keys()),
            "grad_diff": {n: float((g_o[n] - g).abs().max()) for n, g in g_r.items()
                          if n in g_o},
            "grad_rel": {n: float((g_o[n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
                         for n, g in g_r.items() if n in g_o},
        })
    return report


def diff_packed_layer(switch: Callable[[torch.nn.Module], list[str]],
                      lengths: tuple[int, ...] = (20, 7, 45), seed: int = 0, *,
                      device: str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """A switched GDN layer of :func:`tiny_qwen3_next_model` on packed documents
    (``cu_seq_lens_q``) against the unswitched layer on each document → max |Δ|
    relative to the largest output magnitude."""
    model = tiny_qwen3_next_model(seed, dtype).to(device)
    layer = model.model.layers[0].linear_attn
    gen = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(1, sum(lengths), model.config.hidden_size, generator=gen).to(device, dtype)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                           device=device)
    with torch.no_grad():
        alone = torch.cat([layer(x[:, a:b]) for a, b in zip(offsets[:-1], offsets[1:])], dim=1)
        switch(model)
        packed = layer(x, cu_seq_lens_q=offsets)
    return float((packed - alone).abs().max() / alone.abs().max())


LAYERS = ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]


class SwitchChecks:
    """pytest checks of a package's ``use_in_transformers`` (CPU, fp32). A package's
    test module subclasses it as ``Test…`` and sets ``package`` (the imported package),
    ``integrations`` (its ``integrations`` module) and ``kernel``, ``conv`` (the names
    that module calls)."""

    package: Any
    integrations: Any
    kernel: str
    conv: str

    @pytest.fixture
    def calls(self, monkeypatch) -> dict[str, int]:
        """Counts the package kernel's, conv's and norm's calls made through the switch."""
        integrations = self.integrations
        counts = {"gdn": 0, "conv": 0, "norm": 0}

        def counted(name: str, fn: Callable) -> Callable:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                counts[name] += 1
                return fn(*args, **kwargs)
            return wrapper

        for name, attr in (("gdn", self.kernel), ("conv", self.conv), ("norm", "rms_norm_gated")):
            monkeypatch.setattr(integrations, attr, counted(name, getattr(integrations, attr)))
        return counts

    def test_switched_model_trains_like_its_torch_path(self, calls):
        report = train_side_by_side(self.package.use_in_transformers, steps=3)
        assert report[0]["switched"] == LAYERS
        # 2 GDN layers x 3 steps (forward; the backward is the kernel's own)
        assert calls == {"gdn": 6, "conv": 6, "norm": 6}
        n_params = len(report[0]["grad_diff"])
        assert n_params > 20
        for step in report:
            assert step["missing"] == [] and len(step["grad_diff"]) == n_params
            assert step["loss_diff"] < 1e-5, step["loss_diff"]
            assert max(step["grad_diff"].values()) < 2e-5, step["grad_diff"]

    def test_packed_documents_through_cu_seq_lens_q(self, calls):
        assert diff_packed_layer(self.package.use_in_transformers) < 1e-5
        assert calls == {"gdn": 1, "conv": 1, "norm": 1}

    def test_restore_gives_the_model_back_its_own_path(self, calls):
        model = tiny_qwen3_next_model()
        self.package.use_in_transformers(model)
        assert self.package.restore_transformers(model) == LAYERS
        model(input_ids=torch.randint(0, 64, (1, 16)))
        assert calls == {"gdn": 0, "conv": 0, "norm": 0}

    def test_greedy_generation_matches_its_own_path(self, calls):
        """Prefill through our kernel and conv (with transformers' cache), then
        transformers' own single-token decoding: the same tokens."""
        ref = tiny_qwen3_next_model()
        ours = copy.deepcopy(ref)
        self.package.use_in_transformers(ours)
        ids = torch.randint(1, 64, (2, 20), generator=torch.Generator().manual_seed(3))
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(ids, **kw), ref.generate(ids, **kw))
        # the prefill of each GDN layer; the norm also in each of the 5 decoding steps
        assert calls == {"gdn": 2, "conv": 2, "norm": 12}

    def test_another_model_on_the_same_hook_qwen3_5(self, calls):
        """Qwen3.5 (its own GDN layer class and modeling module, the same hook)."""
        transformers = pytest.importorskip("transformers")
        if not hasattr(transformers, "Qwen3_5ForCausalLM"):
            pytest.skip("this transformers has no Qwen3.5")
        cfg = transformers.Qwen3_5TextConfig(
            vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            layer_types=["linear_attention", "full_attention"])
        torch.manual_seed(0)
        ref = transformers.Qwen3_5ForCausalLM(cfg)
        ours = copy.deepcopy(ref)
        assert self.package.use_in_transformers(ours) == ["model.layers.0.linear_attn"]
        ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(4))
        losses = [m(input_ids=ids, labels=ids).loss for m in (ref, ours)]
        for loss in losses:
            loss.backward()
        assert abs(float(losses[0].detach()) - float(losses[1].detach())) < 1e-5
        assert max(float((p.grad - q.grad).abs().max()) for p, q in
                   zip(ref.parameters(), ours.parameters()) if p.grad is not None) < 2e-5
        assert calls == {"gdn": 1, "conv": 1, "norm": 1}

    def test_the_kernel_itself_stays_strict(self):
        q = torch.randn(1, 8, 1, 16)
        with pytest.raises(TypeError, match="use_cache"):
            getattr(self.package, self.kernel)(q, q, q, -torch.rand(1, 8, 1),
                                               torch.rand(1, 8, 1), use_cache=False)

    def test_a_model_without_gdn_layers_is_refused(self):
        with pytest.raises(ValueError, match="GDN"):
            self.package.use_in_transformers(torch.nn.Linear(2, 2))


class SwitchChecksGPU:
    """The same in bf16 on CUDA (``pytest -m gpu``), with the packed path at larger
    sizes; subclass with ``package``. Run where fla is not installed: with fla,
    transformers' own path is fla's kernel."""

    package: Any
    pytestmark = [pytest.mark.gpu,
                  pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

    @pytest.fixture(autouse=True)
    def _warn_only(self):
        """transformers' own ops (its MoE's ``index_add_`` on CUDA) may lack a
        deterministic implementation: warn instead of raising, here only."""
        was = torch.are_deterministic_algorithms_enabled()
        warn = torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        yield
        torch.use_deterministic_algorithms(was, warn_only=warn)

    def test_bf16_switched_model_trains_like_its_own_path(self):
        # dense MLPs: on the H200 (2026-12-01) the MoE model's expert gradients differed by
        # up to 16% between two bf16 runs whose GDN-layer gradients agreed within 1.6%
        report = train_side_by_side(self.package.use_in_transformers, steps=3,
                                    shape=(2, 256), device="cuda", dtype=torch.bfloat16,
                                    dense_mlp=True)
        for step in report:
            assert step["missing"] == []
            assert step["loss_diff"] < 2e-2 * step["loss"], step["loss_diff"]
            assert max(step["grad_rel"].values()) < 5e-2, step["grad_rel"]

    def test_bf16_packed_documents_through_cu_seq_lens_q(self):
        diff = diff_packed_layer(self.package.use_in_transformers, lengths=(100, 7, 300, 64),
                                 device="cuda", dtype=torch.bfloat16)
        assert diff < 2e-2, diff
