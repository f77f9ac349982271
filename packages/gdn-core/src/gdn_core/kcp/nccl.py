"""The environment every process that may talk NCCL must carry.

On shared multi-GPU hosts NVLink multicast (NVLS) can take the GPUs out of
service, so it stays off in NCCL, PyTorch's symmetric memory and NVSHMEM: set
:data:`MULTICAST_OFF` in this process before the first collective and in the
environment of every rank process started from it.
"""

from __future__ import annotations

__all__ = ["MULTICAST_OFF"]

MULTICAST_OFF: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
