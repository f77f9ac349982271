"""Run a script (``sys.argv[1]``) as ``__main__`` under torchrun and report, when the
script calls ``destroy_process_group()``, whether its default group is really gone.

A group that something still holds at that point (a context, an autograd node, a
module default captured at import) lives on into interpreter finalisation, where
gloo's threads can abort the process (exit -6): :mod:`gdn_core.kcp.rankgroup`.
"""

import gc
import os
import runpy
import sys
import weakref

import torch.distributed as dist

_refs: list[weakref.ref] = []
_init, _destroy = dist.init_process_group, dist.destroy_process_group


def _recording_init(*args, **kwargs):
    _init(*args, **kwargs)
    _refs.append(weakref.ref(dist.group.WORLD))


def _checking_destroy(*args, **kwargs):
    _destroy(*args, **kwargs)
    gc.collect()
    state = "alive" if any(r() is not None for r in _refs) else "released"
    print(f"rank {os.environ['RANK']}: group {state} after destroy_process_group", flush=True)


dist.init_process_group, dist.destroy_process_group = _recording_init, _checking_destroy
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
