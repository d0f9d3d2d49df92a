"""JAX's device memory pool, sized from --gpu-memory-utilization before JAX starts.

vLLM's --gpu-memory-utilization is the share of the whole device the engine may hold:
weights, KV cache and the programs' temporaries. On a GPU every byte JAX allocates comes
from its client's pool, which is XLA_PYTHON_CLIENT_MEM_FRACTION of the device's memory
(JAX's default: 75%), fixed when the backend is made. So the engine sets that fraction to
hbm_utilization first, and its cache plan then splits the pool (build/kv_budget.py).
A TPU's pool is the chip's memory less what the runtime keeps; the CPU has no pool
(there hbm_utilization keeps its own meaning: a share of the free host RAM).
"""
from __future__ import annotations

import logging
import os

from jaxserve.config import DEFAULT_HBM_UTILIZATION

logger = logging.getLogger("jaxserve")

POOL_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
JAX_DEFAULT_GPU_FRACTION = 0.75   # JAX's GPU pool without POOL_ENV


def backends_ready() -> bool:
    """Whether JAX has made its backends (after which XLA_FLAGS and the pool are fixed)."""
    from jax._src import xla_bridge   # (this module is read before jax starts)
    return xla_bridge.backends_are_initialized()


def set_device_pool(hbm_utilization: float | None) -> str:
    """Make JAX's GPU pool hbm_utilization (None: the accelerators' default) of the
    device, unless the environment already sets it or JAX already made its backends;
    says which, for the log. Harmless on CPU and TPU, which do not read it."""
    share = hbm_utilization or DEFAULT_HBM_UTILIZATION
    if POOL_ENV in os.environ:
        return (f"{POOL_ENV}={os.environ[POOL_ENV]} is set: JAX's GPU pool is that share of "
                f"the device; the engine takes at most {share} of the device from it")
    if backends_ready():
        return (f"JAX started before the engine: its GPU pool keeps the share it was made "
                f"with ({JAX_DEFAULT_GPU_FRACTION} by default); the engine takes at most "
                f"{share} of the device from it")
    os.environ[POOL_ENV] = str(share)
    return f"JAX's GPU memory pool: {share} of the device (--gpu-memory-utilization)"


def pool_fraction(platform: str) -> float:
    """The share of the device JAX's pool (bytes_limit) is on `platform`."""
    if platform != "gpu":
        return 1.0
    try:
        return float(os.environ.get(POOL_ENV, JAX_DEFAULT_GPU_FRACTION))
    except ValueError:
        return JAX_DEFAULT_GPU_FRACTION
