"""Test suites shared by the training packages: one body, run on each package.

The twin packages (``gdn_train`` / ``gdn_det_train``) keep the same contracts,
so the tests of those contracts are written once here. A package's test file
imports a suite's tests::

    from gdn_core.suites.single_rank_autograd import *  # noqa: F403

and its ``conftest.py`` provides the ``api`` fixture: the package's
:class:`gdn_core.frontend.SingleRankAPI` (its public functions ``autograd``,
``fwd``, ``bwd``, ``conv``, its classes ``saved_cls``, ``workspace_cls``,
``grads_cls``, ``deterministic`` and ``mode``). The ``kcp_*`` suites serve the KCP
twins the same way through the ``kcp_api`` (the package's
:class:`gdn_core.kcp_frontend.KCPAPI`), ``kcp_package`` and ``kcp_agree_worker``
fixtures. The suites import ``gdn_core``
and ``pytest`` only, so each package's suite still runs with only that package
and ``gdn-core`` installed. Tests whose assertions differ by mode stay in the
packages.
"""
