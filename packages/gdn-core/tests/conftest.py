"""gdn-core tests: without a GPU, the Triton kernels run under the interpreter.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` function is
defined, i.e. before ``gdn_core.ops`` is imported, hence here.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
