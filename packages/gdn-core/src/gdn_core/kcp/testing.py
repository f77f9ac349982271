"""Run a function on every rank of a world of fresh processes (for tests).

:func:`run_world` starts ``world_size`` Python processes, each of which
initialises a process group (``gloo`` on CPU, or ``nccl`` with rank ``r`` on
GPU ``r``; file store), loads a worker file by path, calls
``function(rank, world_size, payload)`` and saves what it returns; the parent
collects the results in rank order. A failing rank's traceback is raised in
the parent. Batch several checks into one call: each process pays the
interpreter and ``torch`` start-up (a few seconds on a small CPU).

Every rank destroys its group before it exits and checks that the group is gone
(:mod:`gdn_core.kcp.rankgroup`: a group that outlives ``destroy_process_group`` is
torn down during interpreter finalisation, where gloo can abort the process), so a
rank exits 0 or 1 — also after a peer raised.

Workers run with ``OMP_NUM_THREADS=1`` and NVLink multicast off
(:data:`gdn_core.kcp.nccl.MULTICAST_OFF`). Gloo workers also get, unless the caller overrides it,
``GDN_CORE_BACKEND=reference`` with ``TRITON_INTERPRET`` unset, so that they use
the fp32 reference on CPU whatever the parent's test environment is.
:func:`run_gloo_world` is ``run_world(..., backend="gloo")``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

from gdn_core.kcp.nccl import MULTICAST_OFF
from gdn_core.kcp.rankgroup import destroy_rank_group, init_rank_group

__all__ = ["run_gloo_world", "run_world"]

BACKENDS = ("gloo", "nccl")


def run_gloo_world(
    world_size: int,
    worker_file: str | os.PathLike,
    function: str,
    payload: Any = None,
    *,
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """:func:`run_world` over gloo (CPU, the reference backend unless ``env`` says otherwise)."""
    return run_world(world_size, worker_file, function, payload, backend="gloo",
                     timeout=timeout, env=env)


def run_world(
    world_size: int,
    worker_file: str | os.PathLike,
    function: str,
    payload: Any = None,
    *,
    backend: str = "gloo",
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``function(rank, world_size, payload)`` of ``worker_file`` on a world.

    ``backend``: ``"gloo"`` or ``"nccl"`` (one GPU per rank: needs
    ``world_size <= torch.cuda.device_count()``). Returns the per-rank results
    (anything ``torch.save`` handles; move CUDA tensors to the CPU first).
    Raises ``ValueError`` for an unknown backend or too few GPUs, and
    ``RuntimeError`` with the failing ranks' output.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(f"an nccl world of {world_size} needs {world_size} GPUs, "
                         f"found {torch.cuda.device_count()}")
    worker_file = str(Path(worker_file).resolve())
    child_env = dict(os.environ)
    if backend == "gloo":
        child_env.pop("TRITON_INTERPRET", None)
        child_env["GDN_CORE_BACKEND"] = "reference"
    child_env["OMP_NUM_THREADS"] = "1"
    child_env.update(MULTICAST_OFF)
    # the children find the same packages as this process, installed or not
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    child_env.update(env or {})
    with tempfile.TemporaryDirectory(prefix="gdn-kcp-") as tmp:
        torch.save(payload, os.path.join(tmp, "payload.pt"))
        procs = []
        for rank in range(world_size):
            cmd = [sys.executable, "-m", "gdn_core.kcp.testing", worker_file, function,
                   str(rank), str(world_size), tmp, backend]
            procs.append(subprocess.Popen(cmd, env=child_env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        outputs, failed = [], []
        for rank, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q in procs:
                    if q.poll() is None:
                        q.kill()
                out, _ = p.communicate()
                out = f"(timed out after {timeout}s)\n{out}"
                p.returncode = -1
            outputs.append(out)
            if p.returncode != 0:
                failed.append(rank)
        if failed:
            text = "\n".join(f"----- rank {r} (exit {procs[r].returncode}) -----\n{outputs[r]}"
                             for r in failed)
            raise RuntimeError(f"{backend} world of {world_size}: ranks {failed} failed\n{text}")
        return [torch.load(os.path.join(tmp, f"result{r}.pt"), weights_only=False)
                for r in range(world_size)]


def _run_worker(worker_file: str, function: str, rank: int, world_size: int, tmp: str) -> int:
    """Load the worker by path, run ``function`` and save its result → the exit code.

    A failure prints its traceback and returns 1: the error is not kept, so its
    frames (which may hold contexts and the group) are freed before the group is
    destroyed (:mod:`gdn_core.kcp.rankgroup`).
    """
    import torch.distributed as dist

    try:
        # the worker is a test file given by path, not a module of this repository
        spec = importlib.util.spec_from_file_location(f"_gdn_kcp_worker_{rank}", worker_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        payload = torch.load(os.path.join(tmp, "payload.pt"), weights_only=False)
        result = getattr(module, function)(rank, world_size, payload)
        torch.save(result, os.path.join(tmp, f"result{rank}.pt"))
        del module, result
        dist.barrier()  # every rank done before any tears down
        return 0
    except BaseException:  # noqa: BLE001 - reported, then the group is torn down cleanly
        traceback.print_exc()
        return 1


def _child(argv: list[str]) -> None:
    worker_file, function, rank, world_size, tmp, backend = argv
    rank, world_size = int(rank), int(world_size)
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    group = init_rank_group(backend, f"file://{os.path.join(tmp, 'store')}", rank, world_size,
                            **kwargs)
    code = _run_worker(worker_file, function, rank, world_size, tmp)
    destroy_rank_group(group)
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    _child(sys.argv[1:])
