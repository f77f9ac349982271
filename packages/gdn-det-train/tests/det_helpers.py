"""The gdn-det-train tests' helpers: :mod:`gdn_core.testkit`, children importing gdn_det_train."""

from __future__ import annotations

from functools import partial

import gdn_det_train
from gdn_core import testkit
from gdn_core.testkit import (  # noqa: F401 - re-exported for the tests
    GRAD_NAMES,
    assert_close,
    assert_equal,
    make_inputs,
    reference_gdn,
    rel_err,
    run_fwd_bwd,
    sha256,
)

run_script = partial(testkit.run_script, package=gdn_det_train)
subprocess_env = partial(testkit.subprocess_env, gdn_det_train)
