"""Run a transformers model's Gated DeltaNet layers on our kernels (``docs/transformers.md``).

transformers' Qwen3-Next (and every model built the same way) calls two
module-level kernel hooks from its GDN layer's ``forward``:
``torch_chunk_gated_delta_rule(query, key, value, g=, beta=, initial_state=,
output_final_state=, use_qk_l2norm_in_kernel=, cu_seqlens=, **kwargs)`` and
``causal_conv1d_fn(hidden_states [B, D, T], weight [D, W], bias, activation=,
**kwargs)``, where ``kwargs`` are the model's forward keyword arguments
(``cu_seq_lens_q``, ``position_ids``, ``use_cache``, ``output_router_logits``, …).

:func:`switch_model` finds the layers whose ``forward`` calls the GDN hook,
puts a dispatcher in place of each hook in that module (once; it calls the
original hook unless a switched layer is running) and wraps each layer's
``forward`` so that, while it runs, the hooks call our adapters: other models
in the process keep their own path. The adapters take what transformers
passes and call our kernel with its strict signature: they use ``cu_seqlens``
(the conv reads ``cu_seq_lens_q``) and drop the model's other keyword
arguments and ``chunk_size`` (our chunk size is fixed; the result does not
depend on it beyond rounding). Training path only: single-token decoding with
a cache (``torch_recurrent_gated_delta_rule``, ``causal_conv1d_update``) keeps
transformers' functions. With ``norm``, the layer's gated RMSNorm submodule
(``Qwen3NextRMSNormGated``: ``weight``, ``variance_epsilon``, ``activation``)
runs ``norm(x, gate, weight, eps, activation)`` instead of its own forward.

Nothing here imports transformers.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch

__all__ = ["CHUNK_HOOK", "CONV_HOOK", "restore_model", "switch_model"]

CHUNK_HOOK = "torch_chunk_gated_delta_rule"
CONV_HOOK = "causal_conv1d_fn"

_ACTIVE: ContextVar[dict[str, Callable] | None] = ContextVar("gdn_transformers_switch",
                                                             default=None)
_ORIGINAL_FORWARD = "_gdn_original_forward"


class _Dispatch:
    """Stands in for a kernel hook of a modeling module: the adapter of the switched
    layer that is running, else the module's original function."""

    def __init__(self, name: str, original: Callable) -> None:
        self.name, self.original = name, original
        functools.update_wrapper(self, original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        active = _ACTIVE.get()
        fn = active.get(self.name) if active else None
        return (fn or self.original)(*args, **kwargs)


def chunk_adapter(kernel: Callable) -> Callable:
    """transformers' ``torch_chunk_gated_delta_rule`` call → ``kernel`` (one of our
    ``chunk_gated_delta_rule*``) with its own arguments only."""

    def adapter(query, key, value, g, beta, chunk_size: int = 64, initial_state=None,
                output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                cu_seqlens=None, scale: float | None = None, **model_kwargs: Any):
        del chunk_size, model_kwargs  # see the module docstring
        return kernel(query, key, value, g, beta, scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    return adapter


def conv_adapter(conv: Callable) -> Callable:
    """transformers' ``causal_conv1d_fn`` call (channels first) → ``conv`` (one of our
    ``causal_conv1d*``, tokens first), documents kept apart by ``cu_seq_lens_q``."""

    def adapter(hidden_states: torch.Tensor, weight: torch.Tensor, bias=None,
                activation: str | None = None, **model_kwargs: Any) -> torch.Tensor:
        cu_seqlens = model_kwargs.get("cu_seq_lens_q")
        x = hidden_states.transpose(1, 2).contiguous()
        return conv(x, weight, bias, activation, cu_seqlens).transpose(1, 2)

    return adapter


def _calls_hook(cls: type) -> bool:
    """Whether ``cls.forward`` (decorators unwrapped) calls the GDN hook by name."""
    forward = getattr(cls, "forward", None)
    code = getattr(inspect.unwrap(forward), "__code__", None) if callable(forward) else None
    return code is not None and CHUNK_HOOK in code.co_names


def _install(module: Any, name: str) -> bool:
    hook = getattr(module, name, None)
    if hook is None:
        return False
    if not isinstance(hook, _Dispatch):
        setattr(module, name, _Dispatch(name, hook))
    return True


def switch_model(model: torch.nn.Module, *, gdn: Callable, conv: Callable | None,
                 norm: Callable | None = None) -> list[str]:
    """Make ``model``'s GDN layers call ``gdn`` (a ``chunk_gated_delta_rule``), unless
    ``None`` ``conv`` (a ``causal_conv1d``) and ``norm`` (a ``rms_norm_gated``). Returns
    the switched layers' names; raises ``ValueError`` when the model has none. Calling
    it again rebinds."""
    adapters = {CHUNK_HOOK: chunk_adapter(gdn)}
    if conv is not None:
        adapters[CONV_HOOK] = conv_adapter(conv)
    switched = []
    for name, layer in model.named_modules():
        module = sys.modules.get(type(layer).__module__)
        if module is None or not _calls_hook(type(layer)) or not _install(module, CHUNK_HOOK):
            continue
        if conv is not None:
            _install(module, CONV_HOOK)
        _wrap_forward(layer, adapters)
        gated_norm = getattr(layer, "norm", None)
        if norm is not None and hasattr(gated_norm, "variance_epsilon"):
            _replace_forward(gated_norm, functools.partial(_norm_forward, gated_norm, norm))
        switched.append(name)
    if not switched:
        raise ValueError(f"{type(model).__name__} has no layer whose module defines the GDN "
                         f"kernel hook {CHUNK_HOOK!r} (a transformers Qwen3-Next-style model)")
    return switched


def _norm_forward(module: torch.nn.Module, norm: Callable, hidden_states: torch.Tensor,
                  gate: torch.Tensor) -> torch.Tensor:
    return norm(hidden_states, gate, module.weight, module.variance_epsilon,
                getattr(module, "activation", "silu"))


def _replace_forward(module: torch.nn.Module, forward: Callable) -> None:
    """``module.forward = forward``, remembering the original for :func:`restore_model`."""
    original = getattr(module, _ORIGINAL_FORWARD, None) or module.forward
    object.__setattr__(module, _ORIGINAL_FORWARD, original)
    module.forward = forward


def _wrap_forward(layer: torch.nn.Module, adapters: dict[str, Callable]) -> None:
    original = getattr(layer, _ORIGINAL_FORWARD, None) or layer.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        token = _ACTIVE.set(adapters)
        try:
            return original(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)

    _replace_forward(layer, forward)


def restore_model(model: torch.nn.Module) -> list[str]:
    """Undo :func:`switch_model` on ``model`` → the names of the layers restored."""
    restored = []
    for name, module in model.named_modules():
        if getattr(module, _ORIGINAL_FORWARD, None) is not None:
            del module.forward
            object.__delattr__(module, _ORIGINAL_FORWARD)
            if _calls_hook(type(module)):
                restored.append(name)
    return restored
