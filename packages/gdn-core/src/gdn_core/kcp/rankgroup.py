"""The process group of one rank process, set up so that destroying it really destroys it.

Why (the gloo teardown abort, exit -6, issue 20): ``torch.distributed.nn.functional``
declares its collectives with ``group=group.WORLD`` as a default argument, which
Python evaluates once, at import. ``torch._dynamo`` imports that module, and the
first call of any ``torch.library`` custom op (every KCP differentiable call is
one) imports ``torch._dynamo``. So in a rank that initialised its group first,
about ten function defaults hold the live default group for the rest of the
process: ``destroy_process_group()`` drops torch's own references but not those,
the gloo backend and its worker threads survive, and they are torn down only in
interpreter finalisation — where a gloo thread that still needs the GIL (to free
a tensor a collective kept) is ended by ``pthread_exit``, whose forced unwind
through a ``noexcept`` C++ frame calls ``std::terminate`` ("terminate called
without an active exception", SIGABRT). A failed rank pins the group the same
way through the traceback of its error (its frames hold contexts and groups).

The library itself closes three holders: importing :mod:`gdn_core.kcp` imports that
module (so a script that imports the KCP packages before it initialises its group is
safe with plain ``init_process_group``), a :class:`~gdn_core.kcp.context.KCPContext`
holds its group weakly, and an eager autograd node drops its saved set (which refers to
the context) when its backward frees the graph (:func:`gdn_core.saved.graph_is_released`),
not when the output is dropped.

:func:`init_rank_group` imports that module *before* the group exists (its
defaults then hold ``None``); :func:`destroy_rank_group` destroys the group and
checks that it is gone, so a rank never reaches finalisation with gloo threads
alive — and a new holder shows up as a clear error instead of a rare abort.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

__all__ = ["destroy_rank_group", "init_rank_group"]


def init_rank_group(backend: str, init_method: str, rank: int, world_size: int,
                    **kwargs: Any) -> weakref.ref:
    """``dist.init_process_group(...)`` after importing the modules that would otherwise
    capture the group at import; returns a weak reference to the default group."""
    import torch.distributed as dist
    import torch.distributed.nn.functional  # noqa: F401  - before the group: see module doc

    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, **kwargs)
    return weakref.ref(dist.group.WORLD)


def destroy_rank_group(group_ref: weakref.ref) -> None:
    """Destroy the default group and make sure it is gone (its threads joined).

    Raises ``RuntimeError`` if something still holds the group: its gloo threads
    would be torn down during interpreter finalisation, which can abort the
    process. Call it after dropping every context, saved set and traceback that
    refers to the group.
    """
    import torch.distributed as dist

    dist.destroy_process_group()
    gc.collect()
    if group_ref() is not None:
        raise RuntimeError(
            "the default process group outlived destroy_process_group(): something still "
            "holds it (a context, a saved set, a traceback, or a module that captured "
            "group.WORLD at import); its gloo threads would be torn down during interpreter "
            "finalisation, which can abort the process (see gdn_core.kcp.rankgroup)"
        )
