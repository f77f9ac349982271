"""torch.compile(fullgraph=True) of a small KCP GDN block: the shared suite
(:mod:`gdn_core.suites.kcp_compile`) on this package, and its static contexts on the
Triton interpreter (the code is gdn_core's: run here once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from gdn_core.suites.kcp_compile import *  # noqa: F403 - the shared tests, on this package
from gdn_core.suites.kcp_compile import LAYOUTS

_INTERPRETER = textwrap.dedent(
    """
    import json, sys, torch
    import gdn_det_train_kcp as kcp
    from gdn_core.suites import kcp_compile_block
    C = kcp_compile_block.on(kcp.ops.API)
    torch.use_deterministic_algorithms(True)
    layouts = json.loads(sys.argv[1])
    params = C.make_params(layouts[0][-1], seed=6)
    static = kcp.build_context_det_kcp(kcp.partition_det_kcp(layouts[0], 1), 0, max_docs=4)
    compiled = torch.compile(C.rank_block, fullgraph=True, backend="aot_eager")
    equal = []
    for offs in layouts:
        plan = kcp.partition_det_kcp(offs, 1)
        kcp.update_context_det_kcp(static, plan)
        want = C.rank_step(C.rank_block, params, plan, 0, kcp.build_context_det_kcp(plan, 0))
        got = C.rank_step(compiled, params, plan, 0, static)
        equal.append(all(torch.equal(a, b) for a, b in zip(got, want)))
    print(json.dumps(equal))
    """
)


def test_static_context_on_the_triton_interpreter():
    # the real kernels over the static context's fixed-size tables (padding documents
    # and chunks), compiled, against the ordinary context's exact tables
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env.pop("GDN_CORE_BACKEND", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETER, json.dumps(list(LAYOUTS[:2]))],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [True, True]
