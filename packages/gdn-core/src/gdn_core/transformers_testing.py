"""Checks of a transformers switch (``use_in_transformers``) that the packages' tests run.

* :func:`tiny_qwen3_next_model` — a random ``Qwen3NextForCausalLM`` small enough
  for a CPU test (needs transformers);
* :func:`train_side_by_side` — the model on its own torch path and a switched
  copy, trained the same steps: per step the loss difference and every
  parameter gradient's difference;
* :func:`diff_packed_layer` — a switched GDN layer on packed documents
  (``cu_seq_lens_q``) against the unswitched layer on each document alone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["diff_packed_layer", "tiny_qwen3_next_model", "train_side_by_side"]


def tiny_qwen3_next_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``Qwen3NextForCausalLM``: 3 layers (GDN, full attention, GDN), hidden 32, GDN heads
    2 q/k and 4 value of 16, 4 experts (top 2), vocab 64."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention", "linear_attention"])
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
                       device: str = "cpu", dtype: torch.dtype = torch.float32
                       ) -> list[dict[str, Any]]:
    """Train the model and a ``switch``-ed copy ``steps`` AdamW steps on the same random
    batches → per step ``{"loss", "loss_diff", "grad_diff": {name: max |Δ|},
    "grad_rel": {name: max |Δ| / max |g|}, "missing": names with a gradient on one
    side only, "switched": layer names}``."""
    ref = tiny_qwen3_next_model(seed, dtype).to(device)
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
