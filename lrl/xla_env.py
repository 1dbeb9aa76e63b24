"""What jax's GPU client reads once, as it starts, set by the entry points that run the loop
(`python -m lrl.main`, the benchmarks that call it or the update) before jax is imported.
Imports nothing of jax."""
from __future__ import annotations

import os
from typing import Optional


# jax's GPU client's cap on pinned host memory when XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB is unset,
# and the share of the host's memory `set_defaults` lets it pin instead.
PINNED_DEFAULT_GB = 64
PINNED_HOST_SHARE = 0.8


def host_memory() -> Optional[int]:
    """Physical memory of this host in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def set_defaults(environ=os.environ) -> None:
    """Leaves whatever the user set."""
    # jax's GPU client takes 75% of the device unless told; the loop plans the rollout's pool
    # and the update's micro-batches from what the client may allocate (`lrl.rl.budget.USABLE`
    # of it): at 75% a quarter of an H200 (35 GiB) went unused.
    environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    # Optimizer offload (`optim.offload`) keeps fp32 masters and Adam moments in pinned host
    # memory, which jax's GPU client caps at 64 GB unless told: Qwen2.5-7B's are ~91 GB, and
    # the H100 host's 7B run stopped at that cap (BENCHMARKS.md "Optimizer offload"). Let it
    # take most of the host.
    host = host_memory()
    if "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" not in environ and host is not None:
        environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] = str(
            max(PINNED_DEFAULT_GB, int(PINNED_HOST_SHARE * host / 2**30)))


def pinned_limit(environ=os.environ) -> int:
    """Bytes of pinned host memory jax's GPU client may allocate: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB
    (as `set_defaults` left it, or the user), read as 10^9 bytes a unit, the smaller reading of
    "GB"."""
    try:
        gb = float(environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", PINNED_DEFAULT_GB))
    except ValueError:
        gb = PINNED_DEFAULT_GB
    return int(gb * 10**9)
