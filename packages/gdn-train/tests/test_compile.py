"""torch.compile(fullgraph=True) of a small GDN block: short conv → GDN → projection.

The public calls route through the package's custom ops
(``torch.ops.gdn_train.*``), so Dynamo traces the block without a graph
break and AOTAutograd differentiates through the registered backward. On the
CPU reference backend (and, in a subprocess, the Triton interpreter) the
compiled block must give eager's bits (both are deterministic here, whatever
the package promises), for several document layouts and without recompiling
per layout.
"""

from gdn_core.suites.single_rank_compile import *  # noqa: F403 - the shared tests, on this package
