"""Causal depthwise conv1d (the short convolution in front of a GDN layer).

``x: [B, T, D]``, ``weight: [D, W]``, ``bias: [D]`` or ``None``::

    y[t, d] = act( bias[d] + Σ_{j=0}^{W-1} weight[d, W-1-j] · x[t-j, d] )

(``weight[:, -1]`` multiplies the current token, as in ``torch.nn.functional.
conv1d`` with ``padding=W-1`` truncated to the first ``T`` outputs), ``act``
SiLU or the identity. Tokens before a sequence start read zeros: with
``cu_seqlens`` (``B == 1``) no token sees a previous document.

**Halo** (context parallelism). ``halo: [B, W-1, D]`` stands for the ``W-1``
tokens that precede token 0 of each row — the previous rank's last tokens of
the document that continues here; slots before that document's start (all of
them when the document starts here) must be zeros. It is read by the tokens of
the document holding token 0 (the first non-empty document of the row) only;
:func:`causal_conv1d_bwd` returns its gradient ``dhalo`` for the caller to
send back to the rank that owns those tokens (dropping the zero slots').

The backward is explicit: ``dx`` (and ``dhalo``) are dense shifted adds in a
fixed order; ``dweight`` and ``dbias`` are reductions over all tokens, computed
when ``deterministic=True`` as in :func:`gdn_core.gate.ordered_token_sum`
(partials over a fixed grid of token blocks, added in block order). Compute in
fp32 (fp64 for fp64 input), results in the inputs' dtypes.

**Two implementations.** CUDA tensors run the Triton kernels of
:mod:`gdn_core.ops.conv1d` / :mod:`gdn_core.ops.conv1d_bwd` (deterministic
whatever ``deterministic`` says: per-block partials of ``dweight``/``dbias``
added in a fixed order, no atomics; strided inputs read in place). Everything
else runs the vectorised torch code below: CPU tensors (unless
``GDN_CORE_BACKEND=triton`` with ``TRITON_INTERPRET=1``, which runs the kernels
under the interpreter — the tests), fp64, ``GDN_CORE_BACKEND=reference``, and
filters wider than :data:`gdn_core.ops.conv1d.MAX_TRITON_WIDTH`. Both give the
same results within fp32 rounding, keep every document's NaN/Inf in it, and
check their arguments alike.
"""

from __future__ import annotations

import torch

from gdn_core.chunking import host_offsets, require_int_entries
from gdn_core.gate import sum_partials_in_order, token_block_partials
from gdn_core.switches import env_value

__all__ = [
    "ACTIVATIONS",
    "causal_conv1d_fwd",
    "causal_conv1d_bwd",
    "CausalConv1dFunction",
    "causal_conv1d",
    "validate_conv1d_inputs",
]

ACTIVATIONS = (None, "silu", "swish")
_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _require_float_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        names = ", ".join(str(d).removeprefix("torch.") for d in _FLOATS)
        raise TypeError(f"{name} has dtype {x.dtype}; expected one of {names}")
    return x


def validate_conv1d_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | list[int] | None = None,
    halo: torch.Tensor | None = None,
) -> list[int] | None:
    """Check the conv1d arguments; return the host document offsets (or ``None``).

    Raises ``TypeError`` (non-tensor, dtype, a ``cu_seqlens`` entry that is not
    an int) or ``ValueError`` (shape, device, activation, ``cu_seqlens``
    values), naming the public argument.
    """
    _require_float_tensor("x", x)
    _require_float_tensor("weight", weight)
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, D], got shape {tuple(x.shape)}")
    B, T, D = x.shape
    if weight.dim() != 2 or weight.shape[0] != D or weight.shape[1] < 1:
        raise ValueError(
            f"weight must be [D={D}, W] (one filter of width W >= 1 per channel), "
            f"got shape {tuple(weight.shape)}"
        )
    W = weight.shape[1]
    devices = {x.device, weight.device}
    if bias is not None:
        _require_float_tensor("bias", bias)
        if tuple(bias.shape) != (D,):
            raise ValueError(f"bias must have shape ({D},), got {tuple(bias.shape)}")
        devices.add(bias.device)
    if halo is not None:
        _require_float_tensor("halo", halo)
        if tuple(halo.shape) != (B, W - 1, D):
            raise ValueError(
                f"halo must have shape (B={B}, W-1={W - 1}, D={D}) (the W-1 tokens before "
                f"token 0), got {tuple(halo.shape)}"
            )
        devices.add(halo.device)
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens has dtype {cu_seqlens.dtype}; expected int32 or int64")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D [N+1], got shape {tuple(cu_seqlens.shape)}")
    elif isinstance(cu_seqlens, (list, tuple)):
        require_int_entries(cu_seqlens)
    else:
        raise TypeError(
            f"cu_seqlens must be a tensor, a list of ints or None, got {type(cu_seqlens).__name__}"
        )
    if B != 1:
        raise ValueError(f"cu_seqlens requires batch size B == 1 (packed documents), got B={B}")
    offs = host_offsets(cu_seqlens, B, T)
    if len(offs) < 2 or offs[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 and hold at least 2 entries, got {offs}")
    for i in range(1, len(offs)):
        if offs[i] < offs[i - 1]:
            raise ValueError(
                f"cu_seqlens must be non-decreasing, but cu_seqlens[{i}]={offs[i]} < "
                f"cu_seqlens[{i - 1}]={offs[i - 1]}"
            )
    if offs[-1] != T:
        raise ValueError(f"cu_seqlens must end at T={T} (the packed length), got {offs[-1]}")
    return offs


def _compute_dtype(*xs: torch.Tensor | None) -> torch.dtype:
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) \
        else torch.float32


def _lag_masks(offsets: list[int] | None, T: int, W: int, device) -> list | None:
    """Per lag ``j``: ``[T, 1]`` bool mask of tokens allowed to read ``x[t-j]``.

    A token may read lag ``j`` if ``t-j`` lies in its document, or if its
    document starts at token 0 (then ``t-j < 0`` reads the halo/zeros).
    ``None`` when nothing needs masking (no ``cu_seqlens``, or one document).
    The masks *select* (:func:`_masked`), never multiply: a NaN or Inf of one
    document must not reach another (``0 · NaN`` is NaN).
    """
    if offsets is None or len(offsets) <= 2 or W == 1:
        return None
    starts = torch.tensor(offsets[:-1], dtype=torch.int64)
    lengths = torch.tensor([b - a for a, b in zip(offsets[:-1], offsets[1:])], dtype=torch.int64)
    start = torch.repeat_interleave(starts, lengths, output_size=T)
    pos = torch.arange(T, dtype=torch.int64) - start
    return _masks_of(pos, start == 0, W, device)


def _masks_of(pos: torch.Tensor, first: torch.Tensor, W: int, device) -> list:
    """The per-lag bool masks ``[T, 1]`` from each token's position in its document
    (``pos``) and whether its document starts at token 0 (``first``); lag 0: ``None``."""
    return [None] + [((pos >= j) | first).to(device).unsqueeze(-1) for j in range(1, W)]


def _masked(t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``t`` where ``mask`` holds, else zero — a select, so non-finite values masked out
    stay out."""
    return t if mask is None else torch.where(mask, t, t.new_zeros(()))


def _lag_masks_from_pos(doc_pos: torch.Tensor, x: torch.Tensor, W: int) -> list | None:
    """:func:`_lag_masks` from a device tensor: ``doc_pos [T]``, each token's position in
    its document (as kept by :class:`gdn_core.layout.VarlenLayout`). Device ops only
    (no host data of the layout), so a CUDA graph replays it for another layout."""
    _check_doc_pos(doc_pos, x)
    T = x.shape[1]
    if W == 1:
        return None
    pos = doc_pos.to(torch.int64)
    first = pos == torch.arange(T, dtype=torch.int64, device=pos.device)
    return _masks_of(pos, first, W, pos.device)


def _check_doc_pos(doc_pos: torch.Tensor, x: torch.Tensor) -> None:
    B, T, _ = x.shape
    if B != 1:
        raise ValueError(f"doc_pos requires batch size B == 1 (packed documents), got B={B}")
    if not isinstance(doc_pos, torch.Tensor) or tuple(doc_pos.shape) != (T,) \
            or doc_pos.dtype not in (torch.int32, torch.int64) or doc_pos.device != x.device:
        raise ValueError(f"doc_pos must be an int32/int64 tensor of shape ({T},) on {x.device}")


def _kernel_doc_pos(offsets, doc_pos, x):
    """``doc_pos`` checked for the kernels (the checks of the torch path)."""
    if doc_pos is None:
        return None
    if offsets is not None:
        raise ValueError("pass cu_seqlens or doc_pos, not both")
    _check_doc_pos(doc_pos, x)
    return doc_pos


def _use_kernels(x, weight, bias, halo) -> bool:
    """Whether the Triton kernels (:mod:`gdn_core.ops.conv1d`) run this call: CUDA
    tensors, or CPU ones with ``GDN_CORE_BACKEND=triton`` under ``TRITON_INTERPRET=1``
    (the tests); not with ``GDN_CORE_BACKEND=reference``, fp64, or a filter wider
    than the kernels unroll."""
    backend = env_value("GDN_CORE_BACKEND")
    if backend == "reference":
        return False
    if not x.is_cuda and not (backend == "triton" and env_value("TRITON_INTERPRET") == "1"):
        return False
    if any(t is not None and t.dtype == torch.float64 for t in (x, weight, bias, halo)):
        return False
    from gdn_core.ops.conv1d import MAX_TRITON_WIDTH

    return weight.shape[1] <= MAX_TRITON_WIDTH


def _masks(offsets, doc_pos, x, W):
    if doc_pos is not None:
        if offsets is not None:
            raise ValueError("pass cu_seqlens or doc_pos, not both")
        return _lag_masks_from_pos(doc_pos, x, W)
    return _lag_masks(offsets, x.shape[1], W, x.device)


def _pre_activation(xpad, w, bias, T, W, masks, dt):
    B, _, D = xpad.shape
    acc = bias.to(dt).expand(B, T, D).clone() if bias is not None else xpad.new_zeros(B, T, D)
    for j in range(W):
        term = xpad[:, W - 1 - j : W - 1 - j + T] * w[:, W - 1 - j]
        acc += _masked(term, masks[j] if masks is not None else None)
    return acc


def _padded(x, halo, W, dt):
    B, T, D = x.shape
    left = halo.to(dt) if halo is not None else x.new_zeros(B, W - 1, D, dtype=dt)
    return torch.cat([left, x.to(dt)], dim=1)


def causal_conv1d_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | list[int] | None = None,
    halo: torch.Tensor | None = None,
    *,
    deterministic: bool = False,
    doc_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Forward: ``y [B, T, D]`` in ``x``'s dtype. See the module docstring.

    (The forward has no cross-token reduction; ``deterministic`` is accepted
    for symmetry with the backward.) ``doc_pos`` (instead of ``cu_seqlens``):
    each token's position in its document, a device tensor ``[T]`` — the
    document masks are then made on the device (same bits).
    """
    del deterministic
    offsets = validate_conv1d_inputs(x, weight, bias, activation, cu_seqlens, halo)
    if _use_kernels(x, weight, bias, halo):
        from gdn_core.ops.conv1d import conv1d_fwd

        return conv1d_fwd(x, weight, bias, activation, offsets, halo,
                          _kernel_doc_pos(offsets, doc_pos, x))
    B, T, D = x.shape
    W = weight.shape[1]
    dt = _compute_dtype(x, weight, bias, halo)
    masks = _masks(offsets, doc_pos, x, W)
    pre = _pre_activation(_padded(x, halo, W, dt), weight.to(dt), bias, T, W, masks, dt)
    y = torch.nn.functional.silu(pre) if activation is not None else pre
    return y.to(x.dtype)


def causal_conv1d_bwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dy: torch.Tensor,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | list[int] | None = None,
    halo: torch.Tensor | None = None,
    *,
    deterministic: bool,
    doc_pos: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Backward: ``(dx, dweight, dbias, dhalo)``.

    ``dbias`` is ``None`` without ``bias``; ``dhalo`` (``[B, W-1, D]``) is
    ``None`` without ``halo``. ``dweight``/``dbias`` are token reductions in a
    fixed order when ``deterministic``. ``doc_pos``: as in :func:`causal_conv1d_fwd`.
    """
    offsets = validate_conv1d_inputs(x, weight, bias, activation, cu_seqlens, halo)
    if not isinstance(dy, torch.Tensor):
        raise TypeError(f"dy must be a torch.Tensor, got {type(dy).__name__}")
    if dy.shape != x.shape or dy.device != x.device:
        raise ValueError(f"dy must match x ({tuple(x.shape)} on {x.device}), got "
                         f"{tuple(dy.shape)} on {dy.device}")
    if _use_kernels(x, weight, bias, halo):
        from gdn_core.ops.conv1d_bwd import conv1d_bwd

        return conv1d_bwd(x, weight, bias, dy, activation, offsets, halo,
                          _kernel_doc_pos(offsets, doc_pos, x))
    B, T, D = x.shape
    W = weight.shape[1]
    dt = _compute_dtype(x, weight, bias, halo)
    masks = _masks(offsets, doc_pos, x, W)
    xpad = _padded(x, halo, W, dt)
    w = weight.to(dt)
    dpre = dy.to(dt)
    if activation is not None:
        pre = _pre_activation(xpad, w, bias, T, W, masks, dt)
        s = torch.sigmoid(pre)
        dpre = dpre * (s * (1 + pre * (1 - s)))
        del pre, s
    dxpad = torch.zeros_like(xpad)
    # per lag j: token-block partials (deterministic) or plain sums of dpre·x[t-j]
    reduce = token_block_partials if deterministic else (lambda t: t.sum(0, keepdim=True))
    dw_parts = []
    for j in range(W):
        g = _masked(dpre, masks[j] if masks is not None else None)
        dxpad[:, W - 1 - j : W - 1 - j + T] += g * w[:, W - 1 - j]
        prod = g * xpad[:, W - 1 - j : W - 1 - j + T]
        dw_parts.append(reduce(prod.reshape(B * T, D)))
    if bias is not None:
        dw_parts.append(reduce(dpre.reshape(B * T, D)))
    # [blocks, W (+1), D]: the partials of every column added in block order at once
    sums = sum_partials_in_order(torch.stack(dw_parts, dim=1))
    # column W-1-j holds lag j
    dweight = sums[:W].flip(0).T.contiguous().to(weight.dtype)
    dbias = sums[W].to(bias.dtype) if bias is not None else None
    dx = dxpad[:, W - 1 :].to(x.dtype)
    dhalo = dxpad[:, : W - 1].to(halo.dtype) if halo is not None else None
    return dx, dweight, dbias, dhalo


class CausalConv1dFunction(torch.autograd.Function):
    """Autograd over :func:`causal_conv1d_fwd` / :func:`causal_conv1d_bwd`.

    ``apply(x, weight, bias, halo, activation, cu_seqlens, deterministic)``;
    ``bias`` and ``halo`` may be ``None``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, halo, activation, cu_seqlens, deterministic):
        y = causal_conv1d_fwd(x, weight, bias, activation, cu_seqlens, halo)
        ctx.save_for_backward(x, weight, bias, halo)
        ctx.activation = activation
        # validated host offsets: the backward does not sync on a device tensor again
        ctx.cu_seqlens = None if cu_seqlens is None else host_offsets(cu_seqlens, 1, x.shape[1])
        ctx.deterministic = deterministic
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, halo = ctx.saved_tensors
        dx, dweight, dbias, dhalo = causal_conv1d_bwd(
            x, weight, bias, dy.contiguous(), ctx.activation, ctx.cu_seqlens, halo,
            deterministic=ctx.deterministic,
        )
        return dx, dweight, dbias, dhalo, None, None, None


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | list[int] | None = None,
    halo: torch.Tensor | None = None,
    *,
    deterministic: bool = False,
) -> torch.Tensor:
    """Differentiable causal depthwise conv1d (see the module docstring).

    Validates before anything runs; gradients flow to ``x``, ``weight``,
    ``bias`` and ``halo``.
    """
    validate_conv1d_inputs(x, weight, bias, activation, cu_seqlens, halo)
    return CausalConv1dFunction.apply(x, weight, bias, halo, activation, cu_seqlens,
                                      deterministic)
