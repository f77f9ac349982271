"""gdn-core: the one shared package of the GDN training libraries.

Triton kernels for the chunked Gated DeltaNet forward and backward
(:mod:`gdn_core.ops`), fp32 reference implementations
(:mod:`gdn_core.reference`), input validation, and the composition every
training package calls (:func:`chunk_gdn_fwd`, :func:`chunk_gdn_bwd`).
"""

from gdn_core.chunking import CHUNK_SIZE, ChunkIndex
from gdn_core.compose import GDNGrads, GDNSaved, chunk_gdn_bwd, chunk_gdn_fwd, resolve_backend
from gdn_core.reference import chunk_gdn_reference, naive_recurrent_gdn
from gdn_core.validation import GDNShapes, validate_gdn_inputs

__version__ = "0.1.0"

__all__ = [
    "CHUNK_SIZE",
    "ChunkIndex",
    "GDNGrads",
    "GDNSaved",
    "GDNShapes",
    "chunk_gdn_bwd",
    "chunk_gdn_fwd",
    "chunk_gdn_reference",
    "naive_recurrent_gdn",
    "resolve_backend",
    "validate_gdn_inputs",
]

# Zero-argument entry points the import-independence checker runs.
__smoke__ = ["gdn_core.smoke:run"]
