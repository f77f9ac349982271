"""Shared helpers for the GDN benchmarks (single-rank and context-parallel).

Nothing here knows about a particular benchmark; the scripts in this folder
import it as ``common`` (they put their own folder on ``sys.path``):

* :func:`import_workspace_module` — import a package of this repo, falling back
  to the checkout's ``packages/*/src`` when it is not installed.
* :class:`GDNShape`, :func:`parse_shapes`, :func:`doc_lengths`,
  :func:`make_gdn_inputs` — problem sizes written like ``B1,T8192,H16,HV32,D8``
  and seeded, layer-like inputs for them (packed documents of varied length);
  :func:`with_anchor_gate` — the same with docs/performance.md's g and beta.
* :func:`time_fn`, :class:`Timing` — median-of-N timing with CUDA events (host
  clock on CPU), with an optional L2 flush between iterations.
* :class:`MemoryTracker` — peak device memory of a region above its baseline.
* :func:`gpu_facts`, :func:`environment_facts` — GPU name, clocks, memory and
  driver through nvidia-ml-py (``pynvml``); versions, command line, git commit.
* :func:`rel_err`, :func:`ieee_fp32` — accuracy against an fp32 reference.
* :func:`markdown_table`, :func:`write_json`, :func:`fmt` — output.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import platform
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent

__all__ = [
    "REPO_ROOT",
    "GDNInputs",
    "GDNShape",
    "MemoryTracker",
    "Timing",
    "doc_lengths",
    "environment_facts",
    "fmt",
    "gpu_facts",
    "ieee_fp32",
    "import_workspace_module",
    "make_gdn_inputs",
    "markdown_table",
    "parse_dtype",
    "parse_shapes",
    "rel_err",
    "time_fn",
    "with_anchor_gate",
    "write_json",
]


# --------------------------------------------------------------- imports ---


def import_workspace_module(name: str) -> Any:
    """Import ``name`` (e.g. ``"gdn_det_train"``) from this repo.

    An installed package wins. If it is not importable, the checkout's
    ``packages/*/src`` folders are added to ``sys.path`` (once) and the import
    is retried, so the benchmarks run from a plain checkout too. Errors other
    than "this very package is missing" propagate unchanged.
    """
    top = name.split(".")[0]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != top:
            raise
    added = False
    for src in sorted((REPO_ROOT / "packages").glob("*/src")):
        if str(src) not in sys.path:
            sys.path.append(str(src))
            added = True
    if added:
        importlib.invalidate_caches()
    return importlib.import_module(name)


def module_origin(module: Any) -> dict[str, Any]:
    """Version and file of an imported module (for the report header)."""
    return {
        "version": getattr(module, "__version__", None),
        "file": getattr(module, "__file__", None),
    }


# ---------------------------------------------------------------- shapes ---

_SHAPE_KEYS = ("B", "T", "H", "HV", "K", "V", "D")


@dataclass(frozen=True)
class GDNShape:
    """One GDN problem size. ``D`` documents packed into ``B == 1`` (``D > 1``)."""

    B: int
    T: int
    H: int
    HV: int | None = None
    K: int = 128
    V: int = 128
    D: int = 1

    def __post_init__(self) -> None:
        if self.HV is None:
            object.__setattr__(self, "HV", self.H)
        for key in _SHAPE_KEYS:
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"shape field {key} must be a positive integer, got {value!r}")
        if self.HV % self.H:
            raise ValueError(f"HV={self.HV} must be a multiple of H={self.H}")
        if self.D > 1 and self.B != 1:
            raise ValueError(f"D={self.D} documents need B=1 (packed), got B={self.B}")
        if self.D > self.T:
            raise ValueError(f"D={self.D} documents do not fit in T={self.T} tokens")

    @property
    def spec(self) -> str:
        """The spec string :func:`parse_shapes` reads back."""
        return f"B{self.B},T{self.T},H{self.H},HV{self.HV},K{self.K},V{self.V},D{self.D}"

    @property
    def label(self) -> str:
        """Short human label: ``B1 T32768 H16 HV32 D8`` (defaults left out)."""
        parts = [f"B{self.B}", f"T{self.T}", f"H{self.H}"]
        if self.HV != self.H:
            parts.append(f"HV{self.HV}")
        if (self.K, self.V) != (128, 128):
            parts.append(f"K{self.K} V{self.V}")
        if self.D > 1:
            parts.append(f"D{self.D}")
        return " ".join(parts)

    @property
    def tokens(self) -> int:
        return self.B * self.T

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "spec": self.spec, "label": self.label}


def parse_shape(spec: str) -> GDNShape:
    """Parse ``"B1,T8192,H16,HV16,D1"`` (K, V default 128; HV defaults to H)."""
    fields: dict[str, int] = {}
    for token in re.split(r"[,\s]+", spec.strip()):
        if not token:
            continue
        m = re.fullmatch(r"(HV|[BTHKVD])=?(\d+)", token, flags=re.IGNORECASE)
        if not m:
            raise ValueError(
                f"bad shape token {token!r} in {spec!r}; expected e.g. 'B1,T8192,H16,HV32,D8' "
                f"(keys {', '.join(_SHAPE_KEYS)})"
            )
        key = m.group(1).upper()
        if key in fields:
            raise ValueError(f"shape key {key} given twice in {spec!r}")
        fields[key] = int(m.group(2))
    missing = [k for k in ("B", "T", "H") if k not in fields]
    if missing:
        raise ValueError(f"shape {spec!r} lacks {', '.join(missing)} (B, T and H are required)")
    return GDNShape(**fields)


def parse_shapes(text: str, presets: dict[str, Sequence[GDNShape]] | None = None) -> list[GDNShape]:
    """Parse ``;``-separated shape specs; a preset name expands to its shapes."""
    presets = presets or {}
    shapes: list[GDNShape] = []
    for item in text.split(";"):
        item = item.strip()
        if not item:
            continue
        if item.lower() in presets:
            shapes.extend(presets[item.lower()])
        else:
            shapes.append(parse_shape(item))
    if not shapes:
        raise ValueError(f"no shapes in {text!r}")
    return shapes


def doc_lengths(T: int, D: int, seed: int = 0) -> list[int]:
    """``D`` varied document lengths summing to ``T``, a pure function of its arguments.

    Lengths are log-normally spread (σ = 0.75, a few-fold spread between the
    shortest and the longest), every one at least 1 token, not aligned to
    chunks. Python's ``random`` with an integer seed is stable across versions
    and platforms, so every rank and every machine gets the same layout.
    """
    if D < 1 or T < D:
        raise ValueError(f"cannot cut T={T} tokens into D={D} non-empty documents")
    if D == 1:
        return [T]
    rng = random.Random(1_000_003 * seed + 7919 * T + D)
    weights = [rng.lognormvariate(0.0, 0.75) for _ in range(D)]
    total = sum(weights)
    spare = T - D  # every document gets one token, the rest by weight
    raw = [spare * w / total for w in weights]
    lengths = [1 + math.floor(x) for x in raw]
    remainder = T - sum(lengths)
    by_fraction = sorted(range(D), key=lambda i: (raw[i] - math.floor(raw[i]), -i), reverse=True)
    for i in by_fraction[:remainder]:
        lengths[i] += 1
    assert sum(lengths) == T and min(lengths) >= 1
    return lengths


def cu_seqlens_of(lengths: Sequence[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------- inputs ---


@dataclass
class GDNInputs:
    """Inputs of one GDN call plus the upstream gradient ``do``.

    ``cu_seqlens`` is an int64 tensor on the device (``None`` for one document
    per batch row); ``offsets`` the same offsets on the host.
    """

    shape: GDNShape
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    do: torch.Tensor
    cu_seqlens: torch.Tensor | None
    offsets: list[int]
    use_qk_l2norm_in_kernel: bool
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def leaves(self) -> tuple[torch.Tensor, ...]:
        """The differentiable inputs, in the order of the call: q, k, v, g, beta."""
        return (self.q, self.k, self.v, self.g, self.beta)

    def kwargs(self) -> dict[str, Any]:
        return {"cu_seqlens": self.cu_seqlens,
                "use_qk_l2norm_in_kernel": self.use_qk_l2norm_in_kernel}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.leaves, self.do))

    def detached_copy(self, dtype: torch.dtype | None = None,
                      g_dtype: torch.dtype | None = None) -> GDNInputs:
        """Fresh leaves (``requires_grad``) with the same values, optionally recast."""
        def leaf(t: torch.Tensor, dt: torch.dtype | None) -> torch.Tensor:
            return t.detach().to(dt or t.dtype).clone().requires_grad_(True)

        return GDNInputs(
            self.shape, leaf(self.q, dtype), leaf(self.k, dtype), leaf(self.v, dtype),
            leaf(self.g, g_dtype or dtype), leaf(self.beta, dtype),
            self.do.detach().to(dtype or self.do.dtype), self.cu_seqlens, list(self.offsets),
            self.use_qk_l2norm_in_kernel, dict(self.meta),
        )


def make_gdn_inputs(
    shape: GDNShape,
    *,
    dtype: torch.dtype = torch.bfloat16,
    g_dtype: torch.dtype | None = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    use_qk_l2norm_in_kernel: bool = False,
    requires_grad: bool = True,
) -> GDNInputs:
    """Seeded inputs that look like a real Gated DeltaNet layer's.

    * ``q, k``: standard normal, L2-normalised over the head dimension here
      (``use_qk_l2norm_in_kernel=False``) or left raw for the kernel to
      normalise (``True``).
    * ``v``: standard normal.
    * ``g``: the Mamba2/GDN gate at initialisation,
      ``g = −A_h · softplus(x + dt_bias_h)`` with ``x ~ N(0, 1)``, ``A_h``
      spread log-uniformly over [1, 16] across value heads and ``dt_bias_h``
      the inverse softplus of a log-uniform step in [1e-3, 1e-1]: strictly
      negative, from ≈ −1e-3 (slow heads) to a few units (fast heads).
    * ``beta = sigmoid(N(0, 1))`` in (0, 1).
    * ``do``: standard normal, the upstream gradient of ``o``.

    Documents: ``D > 1`` packs ``D`` documents of :func:`doc_lengths` into one
    row (``cu_seqlens`` int64 on ``device``); ``D == 1`` passes no
    ``cu_seqlens``. Values are drawn in fp32 by a generator on ``device`` seeded
    with ``seed`` and then cast (``g`` to ``g_dtype``, ``None`` = ``dtype``).
    """
    device = torch.device(device)
    B, T, H, HV, K, V = shape.B, shape.T, shape.H, shape.HV, shape.K, shape.V
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device, dtype=torch.float32)

    q, k = randn(B, T, H, K), randn(B, T, H, K)
    if not use_qk_l2norm_in_kernel:
        q, k = F.normalize(q, p=2.0, dim=-1), F.normalize(k, p=2.0, dim=-1)
    v = randn(B, T, HV, V)
    head = torch.arange(HV, device=device, dtype=torch.float32) / max(HV - 1, 1)
    A = torch.exp(math.log(16.0) * head)  # 1 .. 16
    dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * head.flip(0))
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    g = -A * F.softplus(randn(B, T, HV) + dt_bias)
    beta = torch.sigmoid(randn(B, T, HV))
    do = randn(B, T, HV, V)

    lengths = doc_lengths(T, shape.D, seed) if shape.D > 1 else [T] * B
    offsets = cu_seqlens_of(lengths)
    cu = torch.tensor(offsets, dtype=torch.int64, device=device) if shape.D > 1 else None

    def cast(t: torch.Tensor, dt_: torch.dtype) -> torch.Tensor:
        t = t.to(dt_).contiguous()
        return t.requires_grad_(True) if requires_grad else t

    return GDNInputs(
        shape=shape, q=cast(q, dtype), k=cast(k, dtype), v=cast(v, dtype),
        g=cast(g, g_dtype or dtype), beta=cast(beta, dtype), do=do.to(dtype),
        cu_seqlens=cu, offsets=offsets, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        meta={"seed": seed, "doc_lengths": lengths if shape.D > 1 else None},
    )


def with_anchor_gate(inputs: GDNInputs, *, seed: int = 0) -> GDNInputs:
    """``inputs`` with g and beta redrawn as docs/performance.md's anchor figures were measured.

    ``g = logsigmoid(N(0, 1)) / 16`` (per token ≈ −0.05 on average: every head
    decays at the same moderate rate) and ``beta = sigmoid(U(0, 1))``, drawn in
    fp32 by a generator on the inputs' device seeded from ``seed``, then cast
    to the dtypes (and ``requires_grad``) of the g and beta they replace. q, k,
    v, ``do`` and the documents are kept.
    """
    device = inputs.g.device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 0x5EED)
    size = tuple(inputs.g.shape)
    g = F.logsigmoid(torch.randn(*size, generator=gen, device=device, dtype=torch.float32)) / 16
    beta = torch.sigmoid(torch.rand(*size, generator=gen, device=device, dtype=torch.float32))

    def like(t: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        t = t.to(old.dtype).contiguous()
        return t.requires_grad_(True) if old.requires_grad else t

    return GDNInputs(
        shape=inputs.shape, q=inputs.q, k=inputs.k, v=inputs.v, g=like(g, inputs.g),
        beta=like(beta, inputs.beta), do=inputs.do, cu_seqlens=inputs.cu_seqlens,
        offsets=list(inputs.offsets), use_qk_l2norm_in_kernel=inputs.use_qk_l2norm_in_kernel,
        meta={**inputs.meta, "gate": "anchor: g = logsigmoid(randn)/16, beta = sigmoid(rand)"},
    )


# ---------------------------------------------------------------- timing ---


@dataclass
class Timing:
    """Per-iteration times of one timed callable, in milliseconds."""

    times_ms: list[float]
    method: str

    @property
    def median(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def min(self) -> float:
        return min(self.times_ms)

    @property
    def max(self) -> float:
        return max(self.times_ms)

    def quantile(self, q: float) -> float:
        xs = sorted(self.times_ms)
        pos = q * (len(xs) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    def summary(self) -> dict[str, Any]:
        return {
            "median_ms": self.median, "min_ms": self.min, "max_ms": self.max,
            "p20_ms": self.quantile(0.2), "p80_ms": self.quantile(0.8),
            "mean_ms": statistics.fmean(self.times_ms), "iters": len(self.times_ms),
            "method": self.method,
        }


class _L2Flusher:
    """Overwrites a buffer larger than the L2 cache (``None`` on CPU / when off)."""

    def __init__(self, device: torch.device, nbytes: int = 256 << 20):
        self.buf = torch.empty(nbytes, dtype=torch.int8, device=device)

    def __call__(self) -> None:
        self.buf.zero_()


_FLUSHERS: dict[torch.device, _L2Flusher] = {}


def _flusher(device: torch.device) -> _L2Flusher:
    if device not in _FLUSHERS:
        _FLUSHERS[device] = _L2Flusher(device)
    return _FLUSHERS[device]


def synchronize(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(
    fn: Callable[[], Any],
    *,
    device: torch.device | str,
    warmup: int = 10,
    iters: int = 50,
    flush_l2: bool = True,
    setup: Callable[[], Any] | None = None,
) -> Timing:
    """Time ``fn()`` ``iters`` times after ``warmup`` untimed calls.

    On CUDA each iteration is bracketed by its own pair of CUDA events (so the
    median is over iterations, and host-side launch overhead counts whenever
    the GPU waits for it); between iterations, outside the events, ``setup()``
    runs and, with ``flush_l2``, a 256 MiB buffer is overwritten so no
    iteration starts with its inputs in L2. On CPU the host clock is used. What
    ``fn`` returns is dropped before the next iteration.
    """
    device = torch.device(device)
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    for _ in range(max(warmup, 0)):
        if setup is not None:
            setup()
        fn()
    synchronize(device)
    if device.type == "cuda":
        flush = _flusher(device) if flush_l2 else None
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            if setup is not None:
                setup()
            if flush is not None:
                flush()
            starts[i].record()
            out = fn()
            ends[i].record()
            del out
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        method = "cuda-events" + ("+l2-flush" if flush_l2 else "")
    else:
        times = []
        for _ in range(iters):
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
            del out
        method = "host-clock"
    return Timing(times, method)


# ---------------------------------------------------------------- memory ---


class MemoryTracker:
    """Peak device memory allocated inside a ``with`` block, above its start.

    ``peak_extra_bytes`` is ``torch.cuda.max_memory_allocated()`` during the
    block minus ``memory_allocated()`` at its start (the baseline: the inputs
    and whatever else was alive). On CPU nothing is measured and it is ``None``.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.baseline_bytes: int | None = None
        self.peak_extra_bytes: int | None = None
        self.end_extra_bytes: int | None = None

    def __enter__(self) -> MemoryTracker:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline_bytes = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            self.peak_extra_bytes = peak - self.baseline_bytes
            self.end_extra_bytes = torch.cuda.memory_allocated(self.device) - self.baseline_bytes


# -------------------------------------------------------------- accuracy ---


def rel_err(x: torch.Tensor | None, ref: torch.Tensor | None) -> float | None:
    """``‖x − ref‖ / ‖ref‖`` in float64 (``nan`` if ``x`` is not finite)."""
    if x is None or ref is None:
        return None
    x64, r64 = x.detach().double(), ref.detach().double()
    if x64.shape != r64.shape:
        raise ValueError(f"shape mismatch: {tuple(x64.shape)} vs reference {tuple(r64.shape)}")
    if not torch.isfinite(x64).all():
        return float("nan")
    denom = r64.norm().item()
    num = (x64 - r64).norm().item()
    if denom == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / denom


@contextlib.contextmanager
def ieee_fp32() -> Iterator[None]:
    """Run the block with IEEE fp32 matmuls (no TF32), restoring the settings after."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.backends.cudnn.allow_tf32 = saved[1]
        torch.set_float32_matmul_precision(saved[2])


# ----------------------------------------------------------------- facts ---


def _nvml_str(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def gpu_facts(device: torch.device | str | None = None) -> dict[str, Any]:
    """What the GPU is and how it is clocked, via nvidia-ml-py (``pynvml``).

    Returns ``{"gpu": None, "note": "no GPU"}`` without CUDA. Without
    ``pynvml`` it falls back to what torch knows and says so under ``note``.
    Never raises for a missing or failing NVML.
    """
    if not torch.cuda.is_available():
        return {"gpu": None, "note": "no GPU"}
    device = torch.device(device if device is not None else "cuda")
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    facts: dict[str, Any] = {
        "gpu": props.name,
        "torch_index": index,
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "memory_total_mib": props.total_memory // (1 << 20),
        "cuda_runtime": torch.version.cuda,
    }
    try:
        import pynvml
    except ImportError:
        facts["note"] = "pynvml (nvidia-ml-py) not installed: clocks and driver not read"
        return facts
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVML can fail in many ways; report, don't raise
        facts["note"] = f"NVML init failed: {exc}"
        return facts
    try:
        handle = None
        uuid = getattr(props, "uuid", None)
        if uuid is not None:
            with contextlib.suppress(Exception):
                handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        if handle is None:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        facts["gpu"] = _nvml_str(pynvml.nvmlDeviceGetName(handle))
        facts["driver"] = _nvml_str(pynvml.nvmlSystemGetDriverVersion())
        with contextlib.suppress(Exception):
            v = pynvml.nvmlSystemGetCudaDriverVersion()
            facts["cuda_driver"] = f"{v // 1000}.{(v % 1000) // 10}"
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        facts["memory_total_mib"] = mem.total // (1 << 20)
        facts["memory_used_mib"] = mem.used // (1 << 20)
        facts.update(gpu_clocks(handle, pynvml))
        with contextlib.suppress(Exception):
            facts["power_limit_w"] = pynvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000
        with contextlib.suppress(Exception):
            facts["temperature_c"] = pynvml.nvmlDeviceGetTemperature(
                handle, pynvml.NVML_TEMPERATURE_GPU)
    except Exception as exc:  # noqa: BLE001
        facts["note"] = f"NVML query failed: {exc}"
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return facts


def gpu_clocks(handle: Any = None, nvml: Any = None) -> dict[str, Any]:
    """Current and maximum SM and memory clocks in MHz (empty dict if unreadable)."""
    out: dict[str, Any] = {}
    own = False
    try:
        if nvml is None:
            import pynvml as nvml  # noqa: N813

            nvml.nvmlInit()
            own = True
        if handle is None:
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        for name, clock in (("sm", nvml.NVML_CLOCK_SM), ("mem", nvml.NVML_CLOCK_MEM)):
            with contextlib.suppress(Exception):
                out[f"{name}_clock_mhz"] = nvml.nvmlDeviceGetClockInfo(handle, clock)
            with contextlib.suppress(Exception):
                out[f"{name}_clock_max_mhz"] = nvml.nvmlDeviceGetMaxClockInfo(handle, clock)
    except Exception:  # noqa: BLE001
        return out
    finally:
        if own:
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()
    return out


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def environment_facts(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Versions, host, git commit and the exact command line of this run."""
    argv = list(sys.argv if argv is None else argv)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "command": shlex.join(["python", *argv]),
        "cwd": os.getcwd(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "platform": platform.platform(),
        "hostname": platform.node(),
        "git_commit": commit,
        "git_dirty": bool(dirty) if dirty is not None else None,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "env": {k: os.environ[k] for k in sorted(os.environ)
                if k.startswith(("GDN_", "TRITON_", "CUDA_VISIBLE", "FLA_"))},
    }


def describe_gpu(facts: dict[str, Any]) -> str:
    """One line for the report header."""
    if facts.get("gpu") is None:
        return facts.get("note", "no GPU")
    parts = [str(facts["gpu"])]
    if "capability" in facts:
        parts.append(f"sm_{facts['capability'].replace('.', '')}")
    if "multiprocessors" in facts:
        parts.append(f"{facts['multiprocessors']} SMs")
    if "memory_total_mib" in facts:
        parts.append(f"{facts['memory_total_mib'] / 1024:.0f} GiB")
    if "sm_clock_mhz" in facts:
        parts.append(f"SM clock {facts['sm_clock_mhz']}/{facts.get('sm_clock_max_mhz', '?')} MHz")
    if "mem_clock_mhz" in facts:
        mem_max = facts.get("mem_clock_max_mhz", "?")
        parts.append(f"mem clock {facts['mem_clock_mhz']}/{mem_max} MHz")
    if "driver" in facts:
        parts.append(f"driver {facts['driver']}")
    if facts.get("cuda_runtime"):
        parts.append(f"CUDA {facts['cuda_runtime']}")
    if "note" in facts:
        parts.append(f"({facts['note']})")
    return ", ".join(parts)


# ---------------------------------------------------------------- output ---


def fmt(x: Any, digits: int = 3) -> str:
    """Table cell: floats with ``digits`` significant-ish decimals, ``None`` as ``—``."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf"
        if x != 0 and (abs(x) < 1e-2 or abs(x) >= 1e5):
            return f"{x:.{max(digits - 1, 1)}e}"
        return f"{x:.{digits}f}"
    return str(x)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; cells go through :func:`fmt` unless already strings."""
    cells = [[c if isinstance(c, str) else fmt(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))

    def line(items: Sequence[str]) -> str:
        return "| " + " | ".join(s.ljust(w) for s, w in zip(items, widths)) + " |"

    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(row) for row in cells]
    return "\n".join(out)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.dtype):
        return dtype_name(obj)
    if isinstance(obj, torch.device):
        return str(obj)
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "as_dict"):
        return obj.as_dict()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _finite(obj: Any) -> Any:
    """Replace nan/inf floats by strings so the JSON stays standard."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented standard JSON (nan/inf as strings), creating folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_finite(obj), indent=2, default=_json_default, allow_nan=False)
    path.write_text(text + "\n", encoding="utf-8")
