"""gdn-core tests: without a GPU, the Triton kernels run under the interpreter.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` function is
defined, i.e. before ``gdn_core.ops`` is imported, hence here — and every
kernel module is imported right away, so that the kernels stay interpreted
when this suite shares a pytest process with another package's (whose
conftest may remove the variable). The variable is also set again for each
test here: backend resolution (:func:`gdn_core.compose.resolve_backend`)
reads it at call time. The interpreter's ``tl.dot`` sums in one fixed order per
element (:func:`gdn_core.testkit.fixed_order_interpreter_dot`), so the tests that
compare bits across tile shapes do not depend on the machine's BLAS.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import gdn_core.conv1d  # noqa: F401,E402
    import gdn_core.gate  # noqa: F401,E402
    import gdn_core.kcp  # noqa: F401,E402
    import gdn_core.ops  # noqa: F401,E402
    import gdn_core.ops.backward  # noqa: F401,E402
    import gdn_core.ops.conv1d  # noqa: F401,E402
    import gdn_core.ops.conv1d_bwd  # noqa: F401,E402
    import gdn_core.ops.group_reduce  # noqa: F401,E402
    from gdn_core.testkit import fixed_order_interpreter_dot  # noqa: E402

    fixed_order_interpreter_dot()


@pytest.fixture(autouse=True)
def _interpreter_without_gpu(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
