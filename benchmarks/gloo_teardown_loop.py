"""Loop a gloo world and count how its rank processes exit (the teardown abort of issue 20).

    python benchmarks/gloo_teardown_loop.py peer 50   # a KCP rank raises while its peer
                                                      #   is in a collective: both must exit 1
    python benchmarks/gloo_teardown_loop.py test 50   # test_gloo_world_matches_single_rank[2]
                                                      #   (gdn-det-train-kcp): must pass

Prints one line per run and a summary; exits 1 if any run ended otherwise (an
exit -6 / 134 is the abort). CPU only, a tiny world: affordable on 2 cores.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = ROOT / "packages/gdn-det-train-kcp/tests/test_det_kcp_distributed.py"


def kcp_peer_raises(rank: int, world_size: int, payload: dict) -> None:
    """Gloo worker: both ranks run the differentiable KCP conv (a custom op: it imports
    torch._dynamo), then rank 1 raises holding its context while rank 0 enters the
    KCP GDN forward's all-gather."""
    import gdn_det_train_kcp as kcp
    import torch

    plan = kcp.partition_det_kcp([0, 40, 70], world_size)
    ctx = kcp.build_context_det_kcp(plan, rank, conv_kernel_size=4)
    n = plan.num_tokens(rank)
    x = torch.randn(1, n, 8, requires_grad=True)
    kcp.causal_conv1d_det_kcp(x, torch.randn(8, 4), None, ctx).sum().backward()
    if rank == 1:
        raise ValueError(f"rank 1 fails on purpose (holding {ctx!r})")
    q = k = torch.nn.functional.normalize(torch.randn(1, n, 1, 16), dim=-1)
    v, g, b = torch.randn(1, n, 2, 16), -torch.rand(1, n, 2), torch.rand(1, n, 2)
    kcp.chunk_gated_delta_rule_det_kcp(q, k, v, g, b, context=ctx)


def _peer_run() -> tuple[str, str]:
    from gdn_core.kcp.testing import run_gloo_world

    try:
        run_gloo_world(2, __file__, "kcp_peer_raises", timeout=180)
    except RuntimeError as err:
        codes = ",".join(re.findall(r"\(exit (-?\d+)\)", str(err)))
        return ("clean" if codes == "1,1" else f"exits {codes}"), str(err)
    return "no error raised", ""


def _test_run() -> tuple[str, str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TEST),
           "-k", "test_gloo_world_matches_single_rank and 2"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    return ("clean" if p.returncode == 0 else f"pytest rc {p.returncode}"), p.stdout + p.stderr


def main(argv: list[str]) -> int:
    kind, n = argv[0], int(argv[1])
    run = {"peer": _peer_run, "test": _test_run}[kind]
    counts: collections.Counter[str] = collections.Counter()
    for i in range(n):
        outcome, text = run()
        counts[outcome] += 1
        print(f"{kind} run {i + 1}/{n}: {outcome}", flush=True)
        if outcome != "clean":
            print(text[-3000:], flush=True)
    print(f"{kind}: {dict(counts)}", flush=True)
    return 0 if counts["clean"] == n else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
