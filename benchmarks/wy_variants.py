"""WY forward kernel: the current launcher against a baseline module, and config variants.

Times ``gdn_core.ops.wy.wy_fwd`` and ``wy_apply`` under patched ``wy_config``
(num_warps 4/8 × 16-bit or TF32 W/U dots × 1/2 stages) against ``wy_fwd`` of a
baseline module file (another revision's ``ops/wy.py``), bf16, T=32768, H=16,
K=V=128, one document and four; CUDA-event medians of 20 after 3 warm-ups, no L2
flush; accuracy of each against ``gdn_core.reference.wy_ref`` on a small case.
GPU only.

    git show e53fc76:packages/gdn-core/src/gdn_core/ops/wy.py > /tmp/wy_base.py
    python benchmarks/wy_variants.py --baseline /tmp/wy_base.py
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools

import torch


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _median_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", required=True, help="path of another revision's ops/wy.py")
    args = p.parse_args()
    from gdn_core import reference as R
    from gdn_core.chunking import ChunkIndex
    from gdn_core.ops import wy as cur
    from gdn_core.ops.cumsum import chunk_cumsum_fwd

    base = _load(args.baseline, "wy_baseline")
    T, H, D = 32768, 16, 128
    gen = torch.Generator().manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(T, H, D, generator=gen), dim=-1)
    k = k.cuda().bfloat16()
    v = torch.randn(T, H, D, generator=gen).cuda().bfloat16()
    beta = torch.rand(T, H, generator=gen).cuda().bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(T, H, generator=gen)).cuda()

    offs_s = [0, 100, 1000, 1001, 2048]
    idx_s = ChunkIndex.build(offs_s, "cuda")
    small = [x[:2048, :2].contiguous() for x in (k, v, beta, g)]
    G_s = chunk_cumsum_fwd(small[3], idx_s)
    refs = R.wy_ref(*(x.float().cpu() for x in small[:3]), G_s.cpu(),
                    list(zip(offs_s[:-1], offs_s[1:])))

    def accuracy(mod) -> str:
        out = mod.wy_fwd(*small[:3], G_s, idx_s, 1)
        errs = [((x.float().cpu() - r).norm() / r.norm()).item() for x, r in zip(out, refs)]
        return "rel err A {:.2e} W {:.2e} U {:.2e}".format(*errs)

    print("baseline", accuracy(base))
    cfg0 = cur.wy_config
    for offs in ([0, T], list(range(0, T + 1, 8192))):
        idx = ChunkIndex.build(offs, "cuda")
        G = chunk_cumsum_fwd(g, idx)
        ms = _median_ms(functools.partial(base.wy_fwd, k, v, beta, G, idx, 1))
        print(f"--- {len(offs) - 1} docs, T={T}: baseline wy_fwd {ms:.3f} ms")
        ref_A = base.wy_fwd(k, v, beta, G, idx, 1)[0]
        for nw, d16, st in itertools.product((4, 8), (0, 1), (1, 2)):
            if st == 2 and d16 == 0:
                continue
            cur.wy_config = lambda K, V, nw=nw, d16=d16, st=st: {
                **cfg0(K, V), "num_warps": nw, "dot16": d16, "num_stages": st}
            try:
                A, W, U = cur.wy_fwd(k, v, beta, G, idx, 1)
                t_fwd = _median_ms(functools.partial(cur.wy_fwd, k, v, beta, G, idx, 1))
                t_apply = _median_ms(functools.partial(cur.wy_apply, k, v, beta, G, A, idx, 1))
                W2, U2 = cur.wy_apply(k, v, beta, G, A, idx, 1)
                same = torch.equal(W2, W) and torch.equal(U2, U)
                print(f"  warps {nw} dot16 {d16} stages {st}: wy_fwd {t_fwd:.3f} ms, "
                      f"wy_apply {t_apply:.3f} ms; max|dA| vs baseline "
                      f"{(A - ref_A).abs().max().item():.1e}; apply==fwd {same}; "
                      f"{accuracy(cur) if len(offs) == 2 else ''}")
            finally:
                cur.wy_config = cfg0


if __name__ == "__main__":
    main()
