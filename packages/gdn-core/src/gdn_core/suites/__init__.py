"""Test suites shared by the training packages: one body, run on each package.

The twin packages (``gdn_train`` / ``gdn_det_train``) keep the same contracts,
so the tests of those contracts are written once here. A package's test file
imports a suite's tests::

    from gdn_core.suites.single_rank_autograd import *  # noqa: F403

and its ``conftest.py`` imports the shared fixtures
(:mod:`~gdn_core.suites.single_rank_fixtures`) and provides ``package`` (the
imported package: :mod:`~gdn_core.suites.package_fixture`), from which the
``api`` fixture comes: the package's :class:`gdn_core.frontend.SingleRankAPI` (its
public functions ``autograd``, ``fwd``, ``bwd``, ``conv``, its classes ``saved_cls``,
``workspace_cls``, ``grads_cls``, ``deterministic`` and ``mode``). The ``kcp_*`` suites
serve the KCP twins the same way through :mod:`~gdn_core.suites.kcp_fixtures`: ``kcp_api`` (the
package's :class:`gdn_core.kcp_frontend.KCPAPI`) from ``kcp_package``, and the
paths of the package's worker scripts (``kcp_world_worker``, ``kcp_agree_worker``,
``kcp_compile_worker``, ``kcp_nccl_worker``) from its ``kcp_worker_prefix``; a
worker script is a shim passing the package's API to a body here (gdn_core imports
no training package). The suites import ``gdn_core`` and ``pytest`` only, so each
package's suite still runs with only that package and ``gdn-core`` installed.

Where the modes promise different things (bits against tolerance, the deterministic
package's extra repeat and ring == allgather checks), a suite branches on the API's
``deterministic``: both promises are tested, each on its package. Tests of one
package alone stay in that package.
"""
