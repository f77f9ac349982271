"""Context-parallel (KCP) GDN training benchmark, shared by the two package scripts.

``bench_gdn_det_train_kcp.py`` (deterministic: ``gdn_det_train_kcp`` against
``gdn_det_train``) and ``bench_gdn_train_kcp.py`` (non-deterministic:
``gdn_train_kcp`` against ``gdn_train``) are thin wrappers around
:func:`main`, parametrised by a :class:`PackageSpec`.

Arms (``--base``, one or several, comma-separated; all registered always):

* ``local`` — every rank runs the single-rank kernel (``chunk_gdn[_det]_fwd`` /
  ``_bwd`` of the single-rank package) on its own shard, with no state passing
  between ranks: the floor KCP is measured against (its results are *not* the
  whole sequence's — documents crossing a cut restart from zero).
* ``kcp`` — ``chunk_gdn[_det]_fwd_kcp`` / ``_bwd_kcp`` with
  ``exchange="allgather"``.
* ``ring`` — the same with ``exchange="ring"`` (point-to-point sends).

Ranks are real processes over ``torch.distributed`` (gloo on the CPU, NCCL with
one GPU per rank; NVLink multicast is switched off for every process), started
by this script; or, with ``--simulate``, every rank's work runs in this one
process in turn, the exchange answered in memory (the packages' simulated-world
API). Per rank: median ms of the forward and of forward+backward; the slowest
rank; and each arm's slowest rank over the ``local`` arm's.

How a simulated KCP world is timed per rank: each rank's algorithm is a
generator that runs until its next collective (:mod:`gdn_core.kcp.exchange`).
While a simulated call runs, ``gdn_core.kcp.compose.drive_simulated`` is
wrapped so that every stretch a rank's generator runs is timed (CUDA events
on a GPU, the host clock on the CPU) and added to that rank; the in-memory
exchange between stretches is charged to no rank (it stands for communication
that a real world overlaps or pays separately). A stretch's events bracket what
the GPU did between them, so a stretch that starts on an idle GPU is charged the
host's time to enqueue it whenever the host is the slower of the two — on one
GPU that is the rank driven first after each exchange, rank 0, while the others
queue behind it. ``--busy-us N`` puts ``N`` µs of GPU spin (``torch.cuda._sleep``)
in front of every stretch's start event, so that the stretch is enqueued before
it starts; the spin itself is charged to no rank.

An arm whose package (or entry point) is missing stops the run before anything
is timed (exit 2) with a message naming the arm and the package.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402
from common import fmt  # noqa: E402

# NVLink multicast off in this process and every rank process it starts
MULTICAST_OFF = common.import_workspace_module("gdn_core.kcp.nccl").MULTICAST_OFF
_RANKGROUP = common.import_workspace_module("gdn_core.kcp.rankgroup")
init_rank_group, destroy_rank_group = _RANKGROUP.init_rank_group, _RANKGROUP.destroy_rank_group

__all__ = ["ARMS", "PACKAGES", "ArmUnavailable", "PackageSpec", "main"]

ARMS = ("local", "kcp", "ring")



@dataclass(frozen=True)
class PackageSpec:
    """Where one package's KCP API and its single-rank twin live."""

    key: str
    title: str
    kcp_module: str
    local_module: str
    partition: str
    build_context: str
    build_simulated: str
    fwd: str
    bwd: str
    fwd_sim: str
    bwd_sim: str
    workspace: str
    local_fwd: str
    local_bwd: str
    local_workspace: str


PACKAGES: dict[str, PackageSpec] = {
    "det": PackageSpec(
        key="det", title="gdn-det-train-kcp (deterministic)",
        kcp_module="gdn_det_train_kcp", local_module="gdn_det_train",
        partition="partition_det_kcp", build_context="build_context_det_kcp",
        build_simulated="build_simulated_contexts_det_kcp",
        fwd="chunk_gdn_det_fwd_kcp", bwd="chunk_gdn_det_bwd_kcp",
        fwd_sim="chunk_gdn_det_fwd_kcp_simulated", bwd_sim="chunk_gdn_det_bwd_kcp_simulated",
        workspace="DetKCPWorkspace",
        local_fwd="chunk_gdn_det_fwd", local_bwd="chunk_gdn_det_bwd",
        local_workspace="DetWorkspace",
    ),
    "nondet": PackageSpec(
        key="nondet", title="gdn-train-kcp (non-deterministic)",
        kcp_module="gdn_train_kcp", local_module="gdn_train",
        partition="partition_kcp", build_context="build_context_kcp",
        build_simulated="build_simulated_contexts_kcp",
        fwd="chunk_gdn_fwd_kcp", bwd="chunk_gdn_bwd_kcp",
        fwd_sim="chunk_gdn_fwd_kcp_simulated", bwd_sim="chunk_gdn_bwd_kcp_simulated",
        workspace="KCPWorkspace",
        local_fwd="chunk_gdn_fwd", local_bwd="chunk_gdn_bwd", local_workspace="Workspace",
    ),
}


class ArmUnavailable(RuntimeError):
    """An arm that cannot run here (its package or an entry point is missing)."""


# ------------------------------------------------------------------ API ---


@dataclass
class Api:
    """The callables of one package (only what the requested arms need)."""

    spec: PackageSpec
    kcp: Any = None
    local: Any = None
    info: dict[str, Any] = field(default_factory=dict)

    def kcp_attr(self, name: str) -> Any:
        return getattr(self.kcp, getattr(self.spec, name))

    def local_attr(self, name: str) -> Any:
        return getattr(self.local, getattr(self.spec, name))


def _import(module: str, why: str) -> Any:
    try:
        return common.import_workspace_module(module)
    except ModuleNotFoundError as exc:
        raise ArmUnavailable(f"{why} needs the package {module!r}, which is not importable: "
                             f"{exc}") from exc
    except Exception as exc:  # noqa: BLE001 - any import failure makes the arm unavailable
        raise ArmUnavailable(f"{why}: importing {module} failed: {type(exc).__name__}: "
                             f"{exc}") from exc


def _require(module: Any, names: list[str], why: str) -> None:
    missing = [n for n in names if not hasattr(module, n)]
    if missing:
        where = getattr(module, "__file__", "?")
        raise ArmUnavailable(f"{why}: {module.__name__} (from {where}) lacks "
                             f"{', '.join(missing)} — not implemented yet?")


def load_api(spec: PackageSpec, arms: list[str], simulate: bool) -> Api:
    """Import what ``arms`` need; :class:`ArmUnavailable` names the arm and package."""
    api = Api(spec)
    for arm in arms:
        why = f"arm {arm!r} ({spec.title})"
        api.kcp = _import(spec.kcp_module, why)  # every arm needs the partition plan
        names = [spec.partition, spec.build_simulated if simulate else spec.build_context]
        if arm == "local":
            api.local = _import(spec.local_module, why)
            _require(api.local, [spec.local_fwd, spec.local_bwd, spec.local_workspace], why)
        elif simulate:
            names += [spec.fwd_sim, spec.bwd_sim, spec.workspace]
        else:
            names += [spec.fwd, spec.bwd, spec.workspace]
        _require(api.kcp, names, why)
    for mod in (api.kcp, api.local):
        if mod is not None:
            api.info[mod.__name__] = common.module_origin(mod)
    return api


def arm_entry(spec: PackageSpec, arm: str) -> str:
    if arm == "local":
        return (f"{spec.local_module}.{spec.local_fwd} / {spec.local_bwd} on each shard "
                "(no state passing)")
    return f"{spec.kcp_module}.{spec.fwd} / {spec.bwd}, exchange={_exchange(arm)!r}"


def _exchange(arm: str) -> str:
    return "allgather" if arm == "kcp" else "ring"


# --------------------------------------------------------------- inputs ---


@dataclass
class Problem:
    """The global inputs, the plan, and each rank's shard."""

    inputs: common.GDNInputs
    plan: Any

    def shard(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        start, stop = self.plan.token_range(rank)
        return t[:, start:stop].contiguous()

    def rank_inputs(self, rank: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        x = self.inputs
        leaves = [self.shard(t.detach(), rank) for t in (x.q, x.k, x.v, x.g, x.beta)]
        return leaves, self.shard(x.do, rank)


def global_offsets(args: argparse.Namespace) -> list[int]:
    """The packed sequence's ``cu_seqlens`` (what ``common.make_gdn_inputs`` uses)."""
    if args.docs == 1:
        return [0, args.seqlen]
    return common.cu_seqlens_of(common.doc_lengths(args.seqlen, args.docs, args.seed))


def make_plan(api: Api, args: argparse.Namespace) -> Any:
    extra = {}
    if args.boundary == "segment" and args.segment_size is not None:
        extra["segment_size"] = args.segment_size
    return api.kcp_attr("partition")(global_offsets(args), args.world, boundary=args.boundary,
                                     **extra)


def make_problem(api: Api, args: argparse.Namespace, device: torch.device) -> Problem:
    """Seeded global inputs (every rank builds the same) and the plan."""
    shape = common.GDNShape(B=1, T=args.seqlen, H=args.heads, HV=args.hv, K=args.dim,
                            V=args.dim, D=args.docs)
    inputs = common.make_gdn_inputs(shape, dtype=args.dtype, device=device, seed=args.seed,
                                    use_qk_l2norm_in_kernel=args.qk_l2norm_in_kernel,
                                    requires_grad=False)
    if inputs.offsets != global_offsets(args):  # pragma: no cover - common.py changed
        raise RuntimeError("common.make_gdn_inputs packed the documents differently")
    return Problem(inputs, make_plan(api, args))


def plan_summary(plan: Any, world: int) -> list[dict[str, Any]]:
    rows = []
    for r in range(world):
        start, stop = plan.token_range(r)
        frags = plan.fragments(r)
        rows.append({
            "rank": r, "start": start, "stop": stop, "tokens": stop - start,
            "fragments": len(frags),
            "continues_from": frags[0].prev_rank if frags and frags[0].continues_from
            else None,
            "continues_into": frags[-1].next_rank if frags and frags[-1].continues_into
            else None,
        })
    return rows


# ---------------------------------------------------------- per-rank work ---


def _local_callables(api: Api, prob: Problem, rank: int, args, device):
    """``(fwd, fwd_bwd)`` of the ``local`` arm on ``rank``'s shard."""
    leaves, do = prob.rank_inputs(rank)
    offs = list(prob.plan.local_offsets(rank))
    if leaves[0].shape[1] == 0:  # an empty shard: nothing to launch
        return (lambda: None), (lambda: None)
    cu = torch.tensor(offs, dtype=torch.int64, device=device)
    fwd_fn, bwd_fn = api.local_attr("local_fwd"), api.local_attr("local_bwd")
    ws = api.local_attr("local_workspace").for_inputs(leaves[0], leaves[2], cu)
    l2 = args.qk_l2norm_in_kernel

    def fwd():
        return fwd_fn(*leaves, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2)[0]

    def fwd_bwd():
        _, _, saved = fwd_fn(*leaves, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2)
        return bwd_fn(saved, do, None, ws)

    return fwd, fwd_bwd


def _kcp_callables(api: Api, prob: Problem, ctx: Any, rank: int, arm: str, args, device):
    """``(fwd, fwd_bwd)`` of a KCP arm on one real rank."""
    leaves, do = prob.rank_inputs(rank)
    fwd_fn, bwd_fn = api.kcp_attr("fwd"), api.kcp_attr("bwd")
    s = prob.inputs.shape
    ws = api.kcp_attr("workspace")(args.world, s.HV, s.K, s.V, device=device)
    kw = dict(use_qk_l2norm_in_kernel=args.qk_l2norm_in_kernel, exchange=_exchange(arm))

    def fwd():
        return fwd_fn(*leaves, ctx, **kw)[0]

    def fwd_bwd():
        _, saved = fwd_fn(*leaves, ctx, **kw)
        return bwd_fn(saved, do, ws)

    return fwd, fwd_bwd


def _stats(t: common.Timing) -> dict[str, Any]:
    return t.summary()


def time_real_rank(api: Api, prob: Problem, rank: int, args, device) -> list[dict[str, Any]]:
    """This rank's timings of every requested arm (inside a process group)."""
    import torch.distributed as dist

    def align():
        dist.barrier()
        common.synchronize(device)

    ctx = None
    if any(a != "local" for a in args.base):
        ctx = api.kcp_attr("build_context")(prob.plan, rank, device=device)
    out = []
    for arm in args.base:
        if arm == "local":
            fwd, fwd_bwd = _local_callables(api, prob, rank, args, device)
        else:
            fwd, fwd_bwd = _kcp_callables(api, prob, ctx, rank, arm, args, device)
        row = {"arm": arm, "rank": rank}
        for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
            t = common.time_fn(fn, device=device, warmup=args.warmup, iters=args.iters,
                               flush_l2=not args.no_flush, setup=align)
            row[f"{name}_ms"] = t.median
            row[f"{name}_stats"] = _stats(t)
        out.append(row)
        align()
    return out


#: GPU clock cycles per µs of ``--busy-us`` spin (the H200's 1980 MHz SM clock, rounded)
_SPIN_CYCLES_PER_US = 2000


class _SegmentClock:
    """Per-rank time of a simulated world: every stretch a rank's generator runs
    between two collectives is timed and charged to that rank."""

    def __init__(self, device: torch.device, world: int, busy_us: float = 0.0) -> None:
        self.device, self.world = device, world
        self.pending: list[tuple[int, Any, Any]] = []
        self.totals = [0.0] * world
        self.busy_cycles = int(busy_us * _SPIN_CYCLES_PER_US)

    def _start(self, rank: int):
        if self.device.type == "cuda":
            if self.busy_cycles:  # the GPU spins while the host enqueues the stretch
                torch.cuda._sleep(self.busy_cycles)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _stop(self, rank: int, start) -> None:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.pending.append((rank, start, ev))
        else:
            self.totals[rank] += (time.perf_counter() - start) * 1e3

    def wrap(self, rank: int, steps):
        """A generator that forwards ``steps``' requests and answers, timing its stretches."""
        answer = None
        first = True
        while True:
            t0 = self._start(rank)
            try:
                req = next(steps) if first else steps.send(answer)
            except StopIteration as stop:
                self._stop(rank, t0)
                return stop.value
            self._stop(rank, t0)
            first = False
            answer = yield req

    def collect(self) -> list[float]:
        """Per-rank ms since the last collect."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            for rank, a, b in self.pending:
                self.totals[rank] += a.elapsed_time(b)
        out, self.totals, self.pending = self.totals, [0.0] * self.world, []
        return out


@contextlib.contextmanager
def _timed_simulation(clock: _SegmentClock):
    """Wrap ``gdn_core.kcp.compose.drive_simulated`` so the clock sees every rank."""
    compose = importlib.import_module("gdn_core.kcp.compose")
    original = getattr(compose, "drive_simulated", None)
    if original is None:
        raise RuntimeError("cannot time the ranks of a simulated world: "
                           "gdn_core.kcp.compose.drive_simulated is gone")

    def timed(all_steps):
        return original([clock.wrap(r, s) for r, s in enumerate(all_steps)])

    compose.drive_simulated = timed
    try:
        yield
    finally:
        compose.drive_simulated = original


def _simulated_callables(api: Api, prob: Problem, ctxs: list, arm: str, args, device):
    """``(fwd, fwd_bwd)`` of a KCP arm over every rank of a simulated world, one call each."""
    W = args.world
    per_rank = [prob.rank_inputs(r) for r in range(W)]
    cols = [[rk[0][i] for rk in per_rank] for i in range(5)]
    dos = [rk[1] for rk in per_rank]
    fwd_sim, bwd_sim = api.kcp_attr("fwd_sim"), api.kcp_attr("bwd_sim")
    s = prob.inputs.shape
    ws_cls = api.kcp_attr("workspace")
    workspaces = [ws_cls(W, s.HV, s.K, s.V, device=device) for _ in range(W)]
    kw = dict(use_qk_l2norm_in_kernel=args.qk_l2norm_in_kernel, exchange=_exchange(arm))

    def fwd():
        return fwd_sim(*cols, ctxs, **kw)[0]

    def fwd_bwd():
        _, saveds = fwd_sim(*cols, ctxs, **kw)
        return bwd_sim(saveds, dos, workspaces)

    return fwd, fwd_bwd


def _time_simulated_kcp(api: Api, prob: Problem, ctxs: list, arm: str, args,
                        device) -> list[dict[str, Any]]:
    """A KCP arm of a simulated world: per-rank times from the stretch clock."""
    W = args.world
    fwd, fwd_bwd = _simulated_callables(api, prob, ctxs, arm, args, device)
    clock = _SegmentClock(device, W, args.busy_us)
    samples: list[list[float]] = []

    def timed(fn):
        def call():
            with _timed_simulation(clock):
                res = fn()
            samples.append(clock.collect())
            return res
        return call

    rows = [{"arm": arm, "rank": r} for r in range(W)]
    method = ("cuda-events" if device.type == "cuda" else "host-clock") + "-per-rank-stretches"
    for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        samples.clear()
        total = common.time_fn(timed(fn), device=device, warmup=args.warmup, iters=args.iters,
                               flush_l2=not args.no_flush)
        kept = samples[-args.iters:]  # drop the warm-up calls
        for r in range(W):
            t = common.Timing([smp[r] for smp in kept], method)
            rows[r][f"{name}_ms"] = t.median
            rows[r][f"{name}_stats"] = _stats(t)
            rows[r][f"{name}_world_total_ms"] = total.median
    return rows


def time_simulated(api: Api, prob: Problem, args, device) -> list[dict[str, Any]]:
    """Every requested arm on every rank of a simulated world, in this process."""
    W = args.world
    ctxs = None
    if any(a != "local" for a in args.base):
        ctxs = api.kcp_attr("build_simulated")(prob.plan, device=device)
    out = []
    for arm in args.base:
        if arm != "local":
            out.extend(_time_simulated_kcp(api, prob, ctxs, arm, args, device))
            continue
        for r in range(W):
            row = {"arm": arm, "rank": r}
            fwd, fwd_bwd = _local_callables(api, prob, r, args, device)
            for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
                t = common.time_fn(fn, device=device, warmup=args.warmup, iters=args.iters,
                                   flush_l2=not args.no_flush)
                row[f"{name}_ms"] = t.median
                row[f"{name}_stats"] = _stats(t)
            out.append(row)
    return out


# ---------------------------------------------------------- distributed ---


def _rank_main(spec: PackageSpec, args: argparse.Namespace) -> int:
    """One rank of a real world (a process started by :func:`run_world`)."""

    os.environ.update(MULTICAST_OFF)
    rank, W = args.rank, args.world
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    # the group must die at destroy (gloo aborts a process that tears it down in
    # interpreter finalisation): see gdn_core.kcp.rankgroup
    group = init_rank_group(backend, f"file://{os.path.join(args.run_dir, 'store')}", rank, W)
    code = _time_rank(spec, args, rank, device)
    destroy_rank_group(group)
    return code


def _time_rank(spec: PackageSpec, args: argparse.Namespace, rank: int, device) -> int:
    """Time this rank and write its rows → the exit code (1 after printing an error, whose
    frames are dropped here so that they do not keep the group alive)."""
    import torch.distributed as dist

    try:
        api = load_api(spec, args.base, simulate=False)
        prob = make_problem(api, args, device)
        rows = time_real_rank(api, prob, rank, args, device)
        with open(os.path.join(args.run_dir, f"rank{rank}.json"), "w") as f:
            json.dump(rows, f)
        del api, prob
        dist.barrier()
        return 0
    except Exception:  # noqa: BLE001 - reported; the group is then torn down cleanly
        traceback.print_exc()
        return 1


def run_world(script: str, argv: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start ``args.world`` rank processes of ``script`` and collect their rows."""
    env = dict(os.environ)
    env.update(MULTICAST_OFF)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="gdn-kcp-bench-") as tmp:
        procs, logs = [], []
        for rank in range(args.world):
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
            cmd = [sys.executable, script, *argv, "--device", args.device,
                   "--rank", str(rank), "--run-dir", tmp]
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
            logs.append(log)
        failed = _wait_all(procs, args.timeout)
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
        if failed:
            text = "\n".join(f"----- rank {r} (exit {procs[r].returncode}) -----\n{outputs[r]}"
                             for r in failed)
            raise RuntimeError(f"world of {args.world}: ranks {failed} failed\n{text}")
        rows = []
        for r in range(args.world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                rows.extend(json.load(f))
    return rows


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
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


# --------------------------------------------------------------- report ---


def summarise(rows: list[dict[str, Any]], arms: list[str], plan_rows, spec) -> list[dict]:
    """One result per arm: per-rank rows, slowest rank, ratio over ``local``."""
    results = []
    for arm in arms:
        ranks = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["rank"])
        for r in ranks:
            r["tokens"] = plan_rows[r["rank"]]["tokens"]
        res: dict[str, Any] = {"arm": arm, "entry": arm_entry(spec, arm), "per_rank": ranks}
        for name in ("fwd", "fwd_bwd"):
            slow = max(ranks, key=lambda r: r[f"{name}_ms"])
            res[f"slowest_{name}_ms"] = slow[f"{name}_ms"]
            res[f"slowest_{name}_rank"] = slow["rank"]
        results.append(res)
    local = next((r for r in results if r["arm"] == "local"), None)
    for res in results:
        for name in ("fwd", "fwd_bwd"):
            ratio = None
            if local is not None and local[f"slowest_{name}_ms"] > 0:
                ratio = res[f"slowest_{name}_ms"] / local[f"slowest_{name}_ms"]
            res[f"over_local_{name}"] = ratio
    return results


def render_markdown(report: dict[str, Any]) -> str:
    meta, cfg = report["meta"], report["config"]
    env = meta["environment"]
    mode = (f"simulated world of {cfg['world']} in one process" if cfg["simulate"]
            else f"{cfg['world']} processes over torch.distributed ({cfg['dist_backend']})")
    lines = [
        f"# GDN context-parallel training benchmark: {cfg['package_title']}", "",
        f"- command: `{env['command']}`",
        f"- device: {cfg['device']} — {common.describe_gpu(meta['gpu'])}",
        f"- torch {env['torch']}, Triton {env['triton']}, Python {env['python']}, "
        f"git {str(env['git_commit'])[:12]}{' (dirty)' if env['git_dirty'] else ''}",
        f"- problem: T={cfg['seqlen']} in {cfg['docs']} document(s), H={cfg['heads']} "
        f"HV={cfg['hv']} K=V={cfg['dim']}, {cfg['dtype']}, "
        f"qk L2 norm in kernel: {fmt(cfg['qk_l2norm_in_kernel'])}",
        f"- world: {mode}; boundary={cfg['boundary']}; kernels: {cfg['gdn_core_backend']}",
        f"- timing: median of {cfg['iters']} after {cfg['warmup']} warm-up calls"
        + ("" if cfg["device"] != "cuda" else
           f", L2 {'kept warm' if cfg['no_flush'] else 'flushed'} between calls"
           + (f", {cfg['busy_us']} µs of GPU spin before each simulated rank stretch"
              if cfg["simulate"] and cfg["busy_us"] else "")),
        "",
        "Shards:", "",
    ]
    lines.append(common.markdown_table(
        ["rank", "tokens", "range", "fragments", "from rank", "into rank"],
        [[p["rank"], p["tokens"], f"[{p['start']}, {p['stop']})", p["fragments"],
          p["continues_from"], p["continues_into"]] for p in report["plan"]["ranks"]]))
    lines += ["", "Slowest rank per arm (ms):", ""]
    lines.append(common.markdown_table(
        ["arm", "fwd ms", "rank", "fwd+bwd ms", "rank", "fwd / local", "fwd+bwd / local"],
        [[r["arm"], r["slowest_fwd_ms"], r["slowest_fwd_rank"], r["slowest_fwd_bwd_ms"],
          r["slowest_fwd_bwd_rank"], r["over_local_fwd"], r["over_local_fwd_bwd"]]
         for r in report["results"]]))
    lines += ["", "Per rank (median ms):", ""]
    lines.append(common.markdown_table(
        ["arm", "rank", "tokens", "fwd ms", "fwd+bwd ms"],
        [[r["arm"], p["rank"], p["tokens"], p["fwd_ms"], p["fwd_bwd_ms"]]
         for r in report["results"] for p in r["per_rank"]]))
    lines += ["", "Arms:", ""]
    lines += [f"- `{r['arm']}`: {r['entry']}" for r in report["results"]]
    if cfg["simulate"]:
        lines += ["", "Simulated world: a rank's time is the sum of the stretches its own work "
                  "ran between collectives; the in-memory exchange is charged to no rank."]
    for err in report["errors"]:
        lines += ["", f"**error**: {err}"]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------- main ---


def _csv_arms(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise argparse.ArgumentTypeError(
            f"unknown arm(s) {', '.join(bad) or text!r}; choose from {', '.join(ARMS)}")
    return list(dict.fromkeys(arms))


def parse_args(spec: PackageSpec, argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=f"Context-parallel GDN training benchmark of {spec.title}: per-rank "
                    "forward and forward+backward of the local floor, the all-gather and the "
                    "ring exchange.")
    p.add_argument("--base", type=_csv_arms, default=list(ARMS),
                   help="arm(s), comma-separated: local (single-rank kernel per shard, no "
                        "state passing), kcp (all-gather), ring (point-to-point); "
                        "default all three")
    p.add_argument("--boundary", choices=("even", "chunk", "doc", "segment"), default="chunk",
                   help="partition policy (default chunk; segment: cuts on fixed segments, "
                        "bits independent of the world size)")
    p.add_argument("--segment-size", type=int, default=None,
                   help="segment size of --boundary segment (default: the package's, 1024)")
    p.add_argument("--seqlen", type=int, default=None,
                   help="total tokens of the packed sequence (default 65536 on CUDA; "
                        "required on the CPU)")
    p.add_argument("--docs", type=int, default=16, help="documents (default 16)")
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--simulate", action="store_true",
                   help="run every rank in this process in turn, exchange in memory")
    p.add_argument("--heads", type=int, default=None, help="q/k heads H (default 16)")
    p.add_argument("--hv", type=int, default=None, help="value heads HV (default H)")
    p.add_argument("--dim", type=int, default=None, help="head dim K = V (default 128)")
    p.add_argument("--dtype", type=common.parse_dtype, default=torch.bfloat16,
                   help="q, k, v, beta dtype: bf16 (default), fp16, fp32 (g is fp32)")
    p.add_argument("--qk-l2norm-in-kernel", action="store_true",
                   help="raw q, k with use_qk_l2norm_in_kernel=True (default: pre-normalised)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls (default 5)")
    p.add_argument("--iters", type=int, default=20, help="timed calls (default 20)")
    p.add_argument("--no-flush", action="store_true", help="keep L2 warm between calls")
    p.add_argument("--busy-us", type=float, default=0.0,
                   help="simulated worlds on a GPU: µs of GPU spin before every rank stretch, "
                        "so a stretch is not charged the host's enqueue time (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when available (default)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds the rank processes may take together (default 1800)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    if args.device == "cpu" and (args.seqlen is None or args.heads is None or args.dim is None):
        p.error("on the CPU pass tiny sizes explicitly: --seqlen, --heads and --dim "
                "(e.g. --seqlen 300 --docs 3 --heads 1 --dim 16)")
    args.seqlen = 65536 if args.seqlen is None else args.seqlen
    args.heads = 16 if args.heads is None else args.heads
    args.dim = 128 if args.dim is None else args.dim
    args.hv = args.heads if args.hv is None else args.hv
    for name in ("seqlen", "docs", "world", "heads", "hv", "dim", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.docs > args.seqlen:
        p.error(f"--docs {args.docs} documents do not fit in --seqlen {args.seqlen} tokens")
    if args.hv % args.heads:
        p.error(f"--hv {args.hv} must be a multiple of --heads {args.heads}")
    if (args.device == "cuda" and not args.simulate and args.rank is None
            and torch.cuda.device_count() < args.world):
        p.error(f"--world {args.world} needs one GPU per rank ({torch.cuda.device_count()} "
                "here); use --simulate to run every rank on one GPU")
    return args


def _log(msg: str) -> None:
    print(f"[kcp-bench] {msg}", file=sys.stderr, flush=True)


def main(package: str, script: str, argv: list[str] | None = None) -> int:
    """Entry point of a package script (``script``: its path, run again for each rank)."""
    spec = PACKAGES[package]
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(spec, raw)
    os.environ.update(MULTICAST_OFF)
    if args.device == "cpu":
        os.environ.setdefault("GDN_CORE_BACKEND", "reference")
    if args.rank is not None:  # one rank of a real world
        return _rank_main(spec, args)

    try:
        api = load_api(spec, args.base, simulate=args.simulate)
    except ArmUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    plan = make_plan(api, args)  # the ranks (or the simulated world) build the same
    plan_rows = plan_summary(plan, args.world)
    errors: list[str] = []
    _log(f"{spec.title}: arms {', '.join(args.base)}, world {args.world} "
         f"({'simulated' if args.simulate else 'processes'}), T={args.seqlen}, "
         f"{args.docs} docs, H={args.heads} HV={args.hv} K=V={args.dim}")
    rows: list[dict[str, Any]] = []
    try:
        if args.simulate:
            rows = time_simulated(api, make_problem(api, args, device), args, device)
        else:  # this process touches no GPU: each rank takes its own
            rows = run_world(script, _strip_device(raw), args)
    except Exception as exc:  # noqa: BLE001 - report, exit non-zero
        traceback.print_exc(file=sys.stderr)
        errors.append(f"{type(exc).__name__}: {exc}")
    results = summarise(rows, args.base, plan_rows, spec) if not errors else []
    backend = os.environ.get("GDN_CORE_BACKEND") or (
        "triton" if args.device == "cuda" else "reference")
    report = {
        "meta": {
            "environment": common.environment_facts(),
            "gpu": common.gpu_facts(),
            "packages": api.info,
        },
        "config": {
            "package": spec.key, "package_title": spec.title, "base": args.base,
            "boundary": args.boundary, "segment_size": args.segment_size,
            "seqlen": args.seqlen, "docs": args.docs,
            "world": args.world, "simulate": args.simulate, "heads": args.heads,
            "hv": args.hv, "dim": args.dim, "dtype": common.dtype_name(args.dtype),
            "qk_l2norm_in_kernel": args.qk_l2norm_in_kernel, "warmup": args.warmup,
            "iters": args.iters, "no_flush": args.no_flush, "busy_us": args.busy_us,
            "seed": args.seed,
            "device": args.device, "gdn_core_backend": backend,
            "dist_backend": None if args.simulate else
            ("nccl" if args.device == "cuda" else "gloo"),
            "multicast_env": MULTICAST_OFF,
        },
        "plan": {"digest": plan.digest(), "boundary": args.boundary, "ranks": plan_rows,
                 "doc_lengths": plan_lengths(plan)},
        "results": results,
        "ratios": {f"{r['arm']}_over_local": {"fwd": r["over_local_fwd"],
                                              "fwd_bwd": r["over_local_fwd_bwd"]}
                   for r in results if r["arm"] != "local"},
        "errors": errors,
    }
    print(render_markdown(report), end="")
    if args.json:
        common.write_json(args.json, report)
        _log(f"JSON written to {args.json}")
    return 1 if errors else 0


def plan_lengths(plan: Any) -> list[int] | None:
    offs = getattr(plan, "offsets", None) or getattr(plan, "cu_seqlens", None)
    if offs is None:
        return None
    offs = list(offs)
    return [b - a for a, b in zip(offs[:-1], offs[1:])]


def _strip_device(argv: list[str]) -> list[str]:
    """``argv`` without ``--device X`` (the ranks get the resolved device)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--device":
            skip = True
            continue
        if a.startswith("--device="):
            continue
        out.append(a)
    return out
