"""Demo: train a tiny GDN language model with context parallelism, and prove the promises.

Run it with ``hatch run demo`` (or ``python -m gdn_det_train_kcp.demo``).

What it does:

1. Builds a tiny Gated DeltaNet language model — a one-hot embedding, two
   blocks of [RMSNorm → the GDN layer :class:`~gdn_det_train_kcp.GatedDeltaNetKCP`
   (q/k/v/gate/beta projections, short causal conv across ranks, the
   ``A_log``/``dt_bias`` gate, GDN with in-kernel q/k L2 norm, gated RMSNorm,
   output projection), residual] and an MLP each, and an untied output head
   (zero-initialised: the loss starts at ln(vocab)).
2. Makes synthetic packed documents of varied lengths (each document repeats
   a short random motif, so the next token is predictable in context) and
   trains for a few steps on ``--world`` ranks (default 2): one process per
   rank over ``torch.distributed`` — gloo on the CPU, NCCL when there is a GPU
   per rank. Every rank holds a contiguous shard of each step's packed
   sequence (documents cross rank boundaries) and a replica of the
   parameters; the parameter gradients are combined by an all-gather and a
   sum **in rank order** (explicit, because an ``all_reduce``'s summation
   order is up to the backend's algorithm).
3. Trains again in fresh processes and checks (a) the final parameters are
   bitwise identical (SHA-256 over every parameter), then trains the same
   model on the whole packed sequence in one process with the single-rank
   deterministic path and checks (b) parameters and loss curve match within a
   stated tolerance.

The single-rank run uses :class:`gdn_core.layers.SingleRankGatedDeltaNet`
(the same parameters; it calls what ``gdn_det_train.GatedDeltaNet`` calls —
``gdn_core``'s deterministic autograd GDN and conv1d) because this package may
import only ``gdn_core`` (``docs/architecture.md``).

``--boundary segment`` cuts the shards only at document starts and on
``--segment-size`` boundaries, and the single-rank run uses segments of that
size too: the GDN kernel's outputs and input gradients are then the
single-rank bits for any ``--world`` (``docs/determinism.md``); the loss and
the parameters still differ in the last bits where sums run over ranks.

Exit status 0 when every check passes, 1 otherwise (2 for bad arguments).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from gdn_core.kcp.nccl import MULTICAST_OFF
from gdn_core.layers import GatedDeltaNetBase, SingleRankGatedDeltaNet
from torch import nn

from gdn_det_train_kcp.layers import GatedDeltaNetKCP
from gdn_det_train_kcp.plan import build_context_det_kcp, partition_det_kcp

__all__ = ["DemoConfig", "TinyGDNLM", "main", "make_batch", "param_digest"]


BOS = 0


@dataclass(frozen=True)
class DemoConfig:
    """Everything that determines a run (every rank and the single-rank run share it)."""

    steps: int = 8
    world: int = 2
    seed: int = 0
    device: str = "cpu"  # "cpu" or "cuda" (resolved from --device)
    seqlen: int = 1024  # tokens per step (one packed sequence)
    min_doc: int = 24
    max_doc: int = 256
    vocab: int = 64
    d_model: int = 64
    heads: int = 2
    head_dim: int = 32
    layers: int = 2
    conv_size: int = 4
    mlp_mult: int = 4
    lr: float = 0.1
    boundary: str = "even"
    segment_size: int = 128  # with boundary="segment" only
    exchange: str = "allgather"

    @property
    def backend(self) -> str:
        """The GDN kernels' backend: the fp32 reference on the CPU, Triton on CUDA."""
        return "triton" if self.device == "cuda" else "reference"


# ------------------------------------------------------------------ data ---


def make_batch(cfg: DemoConfig, step: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The packed sequence of ``step`` → ``(tokens [T], labels [T], cu_seqlens)``.

    Documents of varied length (``min_doc``..``max_doc``, the last one cut to
    fill ``seqlen``) each start with BOS and repeat a motif of 3–10 tokens.
    A motif follows a fixed random successor table most of the time (a
    pattern learnt in a few steps) and then repeats (a pattern read from
    context, through the conv and the GDN state). ``labels[t]`` is the next
    token of the same document, ``-100`` at a document's last token. A pure
    function of ``(cfg, step)``: every rank builds the same batch.
    """
    table_rng = random.Random(cfg.seed)
    successor = list(range(1, cfg.vocab))
    table_rng.shuffle(successor)  # token t -> successor[t - 1]
    rng = random.Random(1_000_003 * cfg.seed + 7919 * step + 17)
    tokens: list[int] = []
    labels: list[int] = []
    offsets = [0]
    while offsets[-1] < cfg.seqlen:
        n = min(rng.randint(cfg.min_doc, cfg.max_doc), cfg.seqlen - offsets[-1])
        motif = [rng.randrange(1, cfg.vocab)]
        for _ in range(rng.randint(2, 9)):
            follow = rng.random() < 0.8
            motif.append(successor[motif[-1] - 1] if follow else rng.randrange(1, cfg.vocab))
        doc = [BOS] + [motif[i % len(motif)] for i in range(n - 1)]
        tokens += doc
        labels += doc[1:] + [-100]
        offsets.append(offsets[-1] + n)
    return (torch.tensor(tokens, dtype=torch.int64), torch.tensor(labels, dtype=torch.int64),
            offsets)


# ----------------------------------------------------------------- model ---


class _KCPOps:
    """Runs a block's GDN layer on one rank's shard (context parallel, deterministic)."""

    layer_cls = GatedDeltaNetKCP

    def __init__(self, context, cfg: DemoConfig) -> None:
        self.context, self.cfg = context, cfg

    def mix(self, layer: GatedDeltaNetKCP, h: torch.Tensor) -> torch.Tensor:
        return layer(h, self.context, exchange=self.cfg.exchange, backend=self.cfg.backend)


class _SingleRankOps:
    """Runs a block's GDN layer on the whole packed sequence in one process."""

    layer_cls = SingleRankGatedDeltaNet

    def __init__(self, cu_seqlens: list[int], cfg: DemoConfig) -> None:
        self.cu_seqlens, self.cfg = cu_seqlens, cfg
        self.segment_size = cfg.segment_size if cfg.boundary == "segment" else None

    def mix(self, layer: SingleRankGatedDeltaNet, h: torch.Tensor) -> torch.Tensor:
        return layer(h, cu_seqlens=self.cu_seqlens, segment_size=self.segment_size)[0]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, 1e-6)


class GDNBlock(nn.Module):
    """RMSNorm → GDN layer (+res), RMSNorm → MLP (+res)."""

    def __init__(self, cfg: DemoConfig, layer_cls: type[GatedDeltaNetBase]) -> None:
        super().__init__()
        d = cfg.d_model
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.gdn = layer_cls(hidden_size=d, num_heads=cfg.heads, head_dim=cfg.head_dim,
                             expand_v=1.0, conv_size=cfg.conv_size, conv_bias=True)
        self.mlp_norm = nn.Parameter(torch.ones(d))
        self.up = nn.Linear(d, cfg.mlp_mult * d, bias=False)
        self.down = nn.Linear(cfg.mlp_mult * d, d, bias=False)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        x = x + ops.mix(self.gdn, _rms_norm(x, self.attn_norm))
        return x + self.down(F.silu(self.up(_rms_norm(x, self.mlp_norm))))


class TinyGDNLM(nn.Module):
    """One-hot embedding (a matmul: deterministic everywhere), GDN blocks, untied head.

    ``layer_cls``: the blocks' GDN layer (:class:`GatedDeltaNetKCP` on the ranks,
    :class:`~gdn_core.layers.SingleRankGatedDeltaNet` in one process: the same
    parameters, so a seeded model has the same bits either way)."""

    def __init__(self, cfg: DemoConfig,
                 layer_cls: type[GatedDeltaNetBase] = GatedDeltaNetKCP) -> None:
        super().__init__()
        self.vocab = cfg.vocab
        self.embed = nn.Parameter(torch.randn(cfg.vocab, cfg.d_model))
        self.blocks = nn.ModuleList(GDNBlock(cfg, layer_cls) for _ in range(cfg.layers))
        self.final_norm = nn.Parameter(torch.ones(cfg.d_model))
        self.head = nn.Linear(cfg.d_model, cfg.vocab)  # untied; zero: loss starts at ln(vocab)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, tokens: torch.Tensor, ops) -> torch.Tensor:
        """``tokens [T]`` (a shard, possibly empty) → logits ``[T, vocab]``."""
        x = (F.one_hot(tokens, self.vocab).to(self.embed.dtype) @ self.embed)[None]
        for block in self.blocks:
            x = block(x, ops)
        return self.head(_rms_norm(x[0], self.final_norm))


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy over the labelled tokens (one-hot form: only
    elementwise ops and reductions, deterministic on every device)."""
    mask = labels >= 0
    onehot = F.one_hot(labels.clamp(min=0), logits.shape[-1]).to(logits.dtype)
    nll = torch.logsumexp(logits, dim=-1) - (logits * onehot).sum(-1)
    return (nll * mask.to(nll.dtype)).sum()


def build_model(cfg: DemoConfig, device: torch.device,
                layer_cls: type[GatedDeltaNetBase] = GatedDeltaNetKCP) -> TinyGDNLM:
    """Seeded on the CPU, then moved: the same bits on every rank and in every run."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(cfg.seed)
    try:
        model = TinyGDNLM(cfg, layer_cls)
    finally:
        torch.random.set_rng_state(gen_state)
    return model.to(device)


def make_optimizer(model: nn.Module, cfg: DemoConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, foreach=False)


def param_digest(model: nn.Module) -> str:
    """SHA-256 over every parameter's name, dtype, shape and bytes (in order)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()


def _cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to("cpu").clone() for n, p in model.named_parameters()}


# -------------------------------------------------------------- progress ---


class _Progress:
    """A tqdm bar on a terminal (when tqdm is installed), plain lines otherwise; the
    per-step loss either way."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = None
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None and sys.stdout.isatty():
            self.bar = tqdm(total=total, desc=desc, unit="step", file=sys.stdout,
                            dynamic_ncols=True, leave=True)
        self.total, self.desc = total, desc

    def step(self, i: int, loss: float, seconds: float, extra: str = "") -> None:
        if not self.enabled:
            return
        line = f"  step {i + 1}/{self.total}  loss {loss:.4f}  ({seconds:.2f}s){extra}"
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}")
            self.bar.update(1)
            self.bar.write(line)
        else:
            print(f"{self.desc} {line}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------ one rank ---


def _sync_grads(params: list[nn.Parameter], local_loss: torch.Tensor, world: int) -> float:
    """All-gather every rank's gradients (and loss sum) and add them in rank order.

    Returns the global loss sum. Deterministic by construction: the same
    additions in the same order on every rank and in every run.
    """
    import torch.distributed as dist

    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params] + [local_loss.detach().reshape(1)])
    if world > 1:
        parts = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(parts, flat)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
    else:
        total = flat
    pos = 0
    for p in params:
        n = p.numel()
        p.grad = total[pos:pos + n].view_as(p).clone()
        pos += n
    return float(total[-1])


def _setup_determinism(device: torch.device) -> None:
    torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        torch.set_num_threads(1)


def _rank_main(rank: int, world: int, cfg_dict: dict, tmp: str, run_name: str) -> None:
    """One rank of a run (in a fresh process started by :func:`run_world`)."""
    import torch.distributed as dist
    import torch.distributed.nn.functional  # noqa: F401  - before init: see gdn_core.kcp.rankgroup

    os.environ.update(MULTICAST_OFF)
    cfg = DemoConfig(**cfg_dict)
    if cfg.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    _setup_determinism(device)
    dist.init_process_group(backend, init_method=f"file://{os.path.join(tmp, 'store')}",
                            rank=rank, world_size=world)
    try:
        model = build_model(cfg, device)
        params = list(model.parameters())
        opt = make_optimizer(model, cfg)
        progress = _Progress(cfg.steps, f"{run_name} ({world} ranks)", enabled=rank == 0)
        losses, layout = [], []
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            tokens, labels, offsets = make_batch(cfg, step)
            n_labels = int((labels >= 0).sum())
            plan = partition_det_kcp(offsets, world, boundary=cfg.boundary,
                                     **_segment_kwargs(cfg))
            ctx = build_context_det_kcp(plan, rank, device=device,
                                        conv_kernel_size=cfg.conv_size)
            start, stop = plan.token_range(rank)
            opt.zero_grad(set_to_none=True)
            logits = model(tokens[start:stop].to(device), _KCPOps(ctx, cfg))
            local = loss_sum(logits, labels[start:stop].to(device))
            (local / n_labels).backward()
            loss = _sync_grads(params, local, world) / n_labels
            opt.step()
            losses.append(loss)
            layout.append([_rank_layout(plan, r) for r in range(world)])
            progress.step(step, loss, time.perf_counter() - t0)
        progress.close()
        out: dict[str, Any] = {"digest": param_digest(model), "losses": losses}
        if rank == 0:
            out["state"] = _cpu_state(model)
            out["layout"] = layout
        torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _segment_kwargs(cfg: DemoConfig) -> dict[str, int]:
    return {"segment_size": cfg.segment_size} if cfg.boundary == "segment" else {}


def _rank_layout(plan, rank: int) -> dict[str, Any]:
    start, stop = plan.token_range(rank)
    frags = plan.fragments(rank)
    return {"start": start, "stop": stop, "fragments": len(frags),
            "from_prev": frags[0].prev_rank if frags and frags[0].continues_from else None,
            "into_next": frags[-1].next_rank if frags and frags[-1].continues_into else None}


# ----------------------------------------------------------------- runs ---


def run_world(cfg: DemoConfig, run_name: str, *, timeout: float = 600.0) -> dict[str, Any]:
    """Train on ``cfg.world`` fresh processes → rank 0's results plus every rank's digest.

    Each rank is ``python -m gdn_det_train_kcp.demo --rank R --run-dir DIR``
    (a fresh interpreter: nothing is inherited but the environment). Rank 0
    writes to this process's stdout (progress bar, per-step loss); the other
    ranks' output is kept and shown only if a rank fails, in which case every
    rank is stopped and ``RuntimeError`` raised.
    """
    env = dict(os.environ)
    env.update(MULTICAST_OFF)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    if cfg.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="gdn-kcp-demo-") as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump({"cfg": asdict(cfg), "run_name": run_name}, f)
        procs, logs = [], []
        for rank in range(cfg.world):
            log = None if rank == 0 else open(os.path.join(tmp, f"rank{rank}.log"), "w+")
            cmd = [sys.executable, "-m", "gdn_det_train_kcp.demo", "--rank", str(rank),
                   "--run-dir", tmp]
            procs.append(subprocess.Popen(cmd, env=env, stdout=log,
                                          stderr=subprocess.STDOUT if log else None))
            logs.append(log)
        failed = _wait_all(procs, timeout)
        outputs = []
        for log in logs:
            if log is None:
                outputs.append("(rank 0 wrote to this terminal)")
            else:
                log.seek(0)
                outputs.append(log.read())
                log.close()
        if failed:
            text = "\n".join(f"----- rank {r} (exit {procs[r].returncode}) -----\n{outputs[r]}"
                             for r in failed)
            raise RuntimeError(f"{run_name}: ranks {failed} failed\n{text}")
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
                 for r in range(cfg.world)]
    out = ranks[0]
    out["rank_digests"] = [r["digest"] for r in ranks]
    return out


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Wait for every rank; when one fails (or time runs out) stop the others.
    Returns the ranks that failed."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return [r for r, c in enumerate(codes) if c != 0]
        if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            return [r for r, p in enumerate(procs) if p.returncode != 0]
        time.sleep(0.05)


def _rank_entry(rank: int, run_dir: str) -> int:
    with open(os.path.join(run_dir, "config.json")) as f:
        spec = json.load(f)
    cfg = DemoConfig(**spec["cfg"])
    _rank_main(rank, cfg.world, asdict(cfg), run_dir, spec["run_name"])
    return 0


def run_single_rank(cfg: DemoConfig, show: bool = True) -> dict[str, Any]:
    """The same training on the whole packed sequence in this process (single-rank path)."""
    device = torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu")
    threads = torch.get_num_threads()
    _setup_determinism(device)
    try:
        model = build_model(cfg, device, SingleRankGatedDeltaNet)
        opt = make_optimizer(model, cfg)
        progress = _Progress(cfg.steps, "single rank", enabled=show)
        losses = []
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            tokens, labels, offsets = make_batch(cfg, step)
            n_labels = int((labels >= 0).sum())
            opt.zero_grad(set_to_none=True)
            logits = model(tokens.to(device), _SingleRankOps(offsets, cfg))
            total = loss_sum(logits, labels.to(device))
            (total / n_labels).backward()
            opt.step()
            losses.append(float(total.detach()) / n_labels)
            progress.step(step, losses[-1], time.perf_counter() - t0)
        progress.close()
        return {"digest": param_digest(model), "losses": losses, "state": _cpu_state(model)}
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)


# ----------------------------------------------------------------- main ---


def _resolve_device(name: str, world: int) -> str:
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "auto":
        return "cuda" if n_gpu >= world else "cpu"
    if name == "cuda" and n_gpu < world:
        print(f"error: --device cuda needs one GPU per rank: {world} ranks, {n_gpu} GPU(s)",
              file=sys.stderr)
        raise SystemExit(2)
    return name


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m gdn_det_train_kcp.demo",
        description="Train a tiny GDN language model with deterministic context parallelism "
                    "and check bitwise repeatability and agreement with single-rank training.")
    p.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    p.add_argument("--world", type=int, default=2, help="ranks (processes), default 2")
    p.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA/NCCL with one GPU per rank, else CPU/gloo (default)")
    p.add_argument("--seqlen", type=int, default=1024, help="tokens per step (default 1024)")
    p.add_argument("--lr", type=float, default=0.1,
                   help="SGD (momentum 0.9) learning rate (default 0.1)")
    p.add_argument("--boundary", choices=("even", "chunk", "doc", "segment"), default="even",
                   help="where the shard cuts fall (default even: anywhere, mid-chunk; "
                        "segment: document starts and --segment-size boundaries only, "
                        "the single-rank bits for any --world)")
    p.add_argument("--segment-size", type=int, default=128,
                   help="segment length with --boundary segment (a multiple of 64, "
                        "default 128)")
    p.add_argument("--exchange", choices=("allgather", "ring"), default="allgather",
                   help="how document states cross ranks (default allgather)")
    p.add_argument("--param-tol", type=float, default=1e-4,
                   help="max |param difference| allowed against single-rank (default 1e-4)")
    p.add_argument("--loss-tol", type=float, default=1e-4,
                   help="max |loss difference| allowed against single-rank (default 1e-4)")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("steps", "world", "seqlen"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.segment_size < 64 or args.segment_size % 64:
        p.error("--segment-size must be a positive multiple of 64")
    return args


def _fmt_layout(layout: list[list[dict[str, Any]]]) -> str:
    """Step 1's shards, and how many documents crossed a rank boundary over the run."""
    rows = []
    for r, lay in enumerate(layout[0]):
        flags = []
        if lay["from_prev"] is not None:
            flags.append(f"continues a document from rank {lay['from_prev']}")
        if lay["into_next"] is not None:
            flags.append(f"hands a document on to rank {lay['into_next']}")
        rows.append(f"    rank {r}: tokens [{lay['start']}, {lay['stop']}), "
                    f"{lay['fragments']} document fragment(s)"
                    + (f" — {', '.join(flags)}" if flags else ""))
    crossings = sum(lay["into_next"] is not None for step in layout for lay in step)
    rows.append(f"  over {len(layout)} steps, {crossings} document(s) crossed a rank boundary "
                "(their state passed between ranks in forward and backward)")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    os.environ.update(MULTICAST_OFF)
    if args.rank is not None:  # one rank of a run started by run_world
        return _rank_entry(args.rank, args.run_dir)
    device = _resolve_device(args.device, args.world)
    if device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    else:
        # CPU: the fp32 torch reference kernels, whatever the caller's environment says
        os.environ.pop("TRITON_INTERPRET", None)
        os.environ["GDN_CORE_BACKEND"] = "reference"
    cfg = DemoConfig(steps=args.steps, world=args.world, seed=args.seed, device=device,
                     seqlen=args.seqlen, lr=args.lr, boundary=args.boundary,
                     segment_size=args.segment_size, exchange=args.exchange)
    t_start = time.perf_counter()
    probe = TinyGDNLM(cfg)
    n_params = sum(p.numel() for p in probe.parameters())
    _, _, offsets0 = make_batch(cfg, 0)
    engine = "NCCL on CUDA" if device == "cuda" else "gloo on CPU"
    print(f"== gdn-det-train-kcp demo: tiny GDN LM trained on {cfg.world} ranks ({engine}) ==")
    print(f"model: vocab {cfg.vocab}, d_model {cfg.d_model}, {cfg.layers} blocks of "
          f"[GatedDeltaNetKCP ({cfg.heads} heads x {cfg.head_dim}, conv {cfg.conv_size}) + MLP], "
          "untied head, "
          f"{n_params:,} parameters, fp32, kernels: {cfg.backend}")
    print(f"data: {cfg.seqlen} tokens per step, packed documents of {cfg.min_doc}-"
          f"{cfg.max_doc} tokens repeating short motifs ({len(offsets0) - 1} documents at "
          f"step 1); {cfg.steps} steps of SGD (momentum 0.9) lr {cfg.lr}, seed {cfg.seed}")
    segments = f" (segments of {cfg.segment_size})" if cfg.boundary == "segment" else ""
    print(f"context parallel: boundary={cfg.boundary}{segments}, exchange={cfg.exchange}; "
          "gradients all-gathered and summed in rank order")
    print()

    t0 = time.perf_counter()
    print("[1/3] training, run 1 (fresh processes)", flush=True)
    run1 = run_world(cfg, "run 1")
    t_run1 = time.perf_counter() - t0
    print("  shards at step 1:\n" + _fmt_layout(run1["layout"]), flush=True)

    t0 = time.perf_counter()
    print("[2/3] training, run 2 (fresh processes, same seed)", flush=True)
    run2 = run_world(cfg, "run 2")
    t_run2 = time.perf_counter() - t0

    t0 = time.perf_counter()
    print("[3/3] training on one rank: the whole packed sequence in this process", flush=True)
    single = run_single_rank(cfg)
    t_single = time.perf_counter() - t0

    # (a) bitwise repeat, and every replica identical
    replicas_ok = len(set(run1["rank_digests"])) == 1 and len(set(run2["rank_digests"])) == 1
    repeat_ok = run1["digest"] == run2["digest"] and run1["losses"] == run2["losses"]
    # (b) single-rank agreement
    param_diff = max(float((run1["state"][n] - single["state"][n]).abs().max())
                     for n in single["state"])
    loss_diff = max(abs(a - b) for a, b in zip(run1["losses"], single["losses"]))
    bitwise_single = run1["digest"] == single["digest"]
    match_ok = param_diff <= args.param_tol and loss_diff <= args.loss_tol
    finite = all(math.isfinite(x) for x in run1["losses"])
    total = time.perf_counter() - t_start

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    print()
    print("== summary ==")
    print("loss per step (run 1 | single rank):")
    for i, (a, b) in enumerate(zip(run1["losses"], single["losses"])):
        print(f"  step {i + 1:3d}: {a:.6f} | {b:.6f}   |diff| {abs(a - b):.2e}")
    fell = run1["losses"][-1] < run1["losses"][0]
    print(f"loss {run1['losses'][0]:.4f} -> {run1['losses'][-1]:.4f} "
          f"({'falling' if fell else 'not falling'})")
    print(f"(a) bitwise repeat across fresh processes: run 1 sha256 {run1['digest'][:16]}…, "
          f"run 2 sha256 {run2['digest'][:16]}…, loss curves "
          f"{'identical' if run1['losses'] == run2['losses'] else 'DIFFERENT'}; every rank's "
          f"replica {'identical' if replicas_ok else 'DIFFERENT'} -> "
          f"{verdict(repeat_ok and replicas_ok)}")
    print(f"(b) matches single-rank training: max |param diff| {param_diff:.2e} "
          f"(tol {args.param_tol:.0e}), max |loss diff| {loss_diff:.2e} "
          f"(tol {args.loss_tol:.0e}) -> {verdict(match_ok and finite)}"
          + ("  [bitwise equal]" if bitwise_single else ""))
    print(f"time: run 1 {t_run1:.1f}s, run 2 {t_run2:.1f}s, single rank {t_single:.1f}s, "
          f"total {total:.1f}s")
    ok = repeat_ok and replicas_ok and match_ok and finite
    print("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
