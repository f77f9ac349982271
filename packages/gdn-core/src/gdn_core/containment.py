"""Test helpers: is a non-finite value contained in its document?

Every training package checks that a NaN or Inf planted in one document of a
packed sequence leaves every other document's outputs and gradients bit for
bit those of a clean run; these are the two steps of that check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["GDN_INPUTS", "NON_FINITE", "assert_other_documents_equal", "check_conv_containment",
           "check_gdn_containment", "plant"]

NON_FINITE = (float("nan"), float("inf"), float("-inf"))


def plant(t: torch.Tensor, offsets: Sequence[int], doc: int, value: float) -> torch.Tensor:
    """A copy of ``t [1, T, ...]`` with ``value`` at every token of document ``doc``
    (``offsets``: the host ``cu_seqlens``)."""
    t = t.detach().clone()
    t[0, offsets[doc]:offsets[doc + 1]] = value
    return t


def assert_other_documents_equal(got: torch.Tensor, clean: torch.Tensor,
                                 offsets: Sequence[int], doc: int, what: str) -> None:
    """``got`` equals ``clean`` bit for bit on the tokens of every document but ``doc``
    (``[1, T, ...]`` tensors). Raises ``AssertionError`` naming the first that differs."""
    for n in range(len(offsets) - 1):
        if n == doc:
            continue
        a, b = got[0, offsets[n]:offsets[n + 1]], clean[0, offsets[n]:offsets[n + 1]]
        if not torch.equal(a, b):
            raise AssertionError(f"{what}: document {n} changed by a non-finite value "
                                 f"planted in document {doc}")


def _conv_y_dx(conv: Callable, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
               dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    y = conv(x, w, b)
    y.backward(dy)
    return y.detach(), x.grad


def check_conv_containment(conv: Callable, offsets: Sequence[int], where: str, value: float,
                           doc: int, *, D: int = 4, W: int = 4, seed: int = 0) -> None:
    """Plant ``value`` in document ``doc`` of ``x`` (``where="x"``) or of the output
    gradient (``"dy"``) of ``conv(x [1,T,D], weight [D,W], bias [D]) -> y`` (differentiable
    in ``x``): every other document's ``y`` and ``dx`` must be those of a clean run."""
    gen = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(1, offsets[-1], D, generator=gen) for _ in range(2))
    w, b = torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    y0, dx0 = _conv_y_dx(conv, x, w, b, dy)
    if where == "x":
        x = plant(x, offsets, doc, value)
    else:
        dy = plant(dy, offsets, doc, value)
    y, dx = _conv_y_dx(conv, x, w, b, dy)
    assert_other_documents_equal(y, y0, offsets, doc, "y")
    assert_other_documents_equal(dx, dx0, offsets, doc, "dx")


GDN_INPUTS = ("q", "k", "v", "g", "beta")


def _gdn_outputs(gdn: Callable, ins: dict, do: torch.Tensor) -> dict:
    leaves = {n: t.clone().requires_grad_() for n, t in ins.items()}
    o = gdn(*(leaves[n] for n in GDN_INPUTS))
    o.backward(do)
    return {"o": o.detach(), **{"d" + n: leaves[n].grad for n in GDN_INPUTS}}


def check_gdn_containment(gdn: Callable, offsets: Sequence[int], doc: int, value: float,
                          wheres: Sequence[str] = (*GDN_INPUTS, "do"), *, H: int = 1,
                          HV: int = 2, K: int = 16, V: int = 16, seed: int = 0) -> None:
    """Plant ``value`` in document ``doc`` of one GDN input at a time (``wheres``:
    ``"q"``, ``"k"``, ``"v"``, ``"g"``, ``"beta"``) or of the output gradient
    (``"do"``) of ``gdn(q, k, v, g, beta) -> o`` (packed ``[1, T, ...]`` over
    ``offsets``, differentiable): every other document's ``o`` and input gradients
    must be those of one clean run, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    T = offsets[-1]
    ins = {"q": torch.randn(1, T, H, K, generator=gen),
           "k": torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1),
           "v": torch.randn(1, T, HV, V, generator=gen),
           "g": -torch.rand(1, T, HV, generator=gen),
           "beta": torch.rand(1, T, HV, generator=gen)}
    do = torch.randn(1, T, HV, V, generator=gen)
    clean = _gdn_outputs(gdn, ins, do)
    for where in wheres:
        bad_do = plant(do, offsets, doc, value) if where == "do" else do
        bad = {n: plant(t, offsets, doc, value) if n == where else t for n, t in ins.items()}
        got = _gdn_outputs(gdn, bad, bad_do)
        for name, t in got.items():
            assert_other_documents_equal(t, clean[name], offsets, doc, f"{name} ({value} in "
                                         f"{where})")
