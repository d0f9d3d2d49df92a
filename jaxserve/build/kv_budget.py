"""The memory the caches may take. On an accelerator, as vLLM's --gpu-memory-utilization:
the engine gets hbm_utilization of the device's memory for everything it holds, and the
caches get that share less the weights and a reserve for the programs' temporaries
(memory_split). On CPU: a share of the free host RAM, leaving out of it at least the
same reserve (cpu_cache_bytes). build/cache_plan.py turns the
budget into pages and state slots; the planner makes the same split for a device that is
not here."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import jax

from jaxserve.build.device_pool import pool_fraction
from models.config import ModelConfig

logger = logging.getLogger("jaxserve")

_CPU_RAM_FRACTION = 0.25  # on CPU never take more than this share of available RAM
# The reserve's floor, as a share of the engine's memory: XLA's workspace beyond the
# activation estimate (autotuning, collectives' buffers, the allocator's fragmentation).
WORKSPACE_SHARE = 0.05
# Live float32 [rows, vocab] arrays in the costliest sampler program (penalties, top-k/p
# sort, logprobs): XLA:TPU gives it 2.85 GB of temporaries at 256 x 248,320 (11.2 copies).
SAMPLER_COPIES = 12


def activation_bytes(mc: ModelConfig, m: int, tokens: int, rows: int, itemsize: int,
                     max_model_len: int) -> int:
    """Rough peak of one program's temporaries per device, the larger of the forward's
    and the sampler's. Forward: the widest per-layer temporaries of a token bucket
    (the model family's activation_width per token, models/family.py). Sampler: float32
    logits [rows, V], gathered whole, SAMPLER_COPIES of them, and the penalties' int32
    token history [rows, max_model_len] (268 MB at 256 x 262,144) it is given each step."""
    per_token = mc.family.activation_width(mc, m) * itemsize
    sampler = SAMPLER_COPIES * rows * mc.vocab_size * 4 + rows * max_model_len * 4
    return max(tokens * per_token, sampler)


@dataclass(frozen=True)
class MemorySplit:
    """One device's memory as the engine takes it (bytes)."""
    device_bytes: int        # the device's memory: what hbm_utilization is a share of
    engine_bytes: int        # hbm_utilization of it, at most JAX's pool (bytes_limit)
    weight_bytes: int        # held before the caches are made (weights, a drafter's)
    reserve_bytes: int       # the programs' temporaries: activations and XLA's workspace
    later_bytes: int = 0     # held beside the caches, made after them (the encoder cache)

    @property
    def cache_bytes(self) -> int:
        """What the caches (KV pages, state slots, snapshots) may take."""
        return max(0, self.engine_bytes - self.weight_bytes - self.later_bytes
                   - self.reserve_bytes)

    @property
    def outside_bytes(self) -> int:
        """The device's memory the engine leaves alone (other processes, the runtime)."""
        return self.device_bytes - self.engine_bytes


def memory_split(device_bytes: int, hbm_utilization: float, weight_bytes: int,
                 activation: int, pool_bytes: int | None = None,
                 later_bytes: int = 0) -> MemorySplit:
    """hbm_utilization of the device for the engine (never more than JAX's pool, when
    one is given), of which the reserve is the estimated activation peak, at least
    WORKSPACE_SHARE of it. later_bytes: made after the caches but held beside them."""
    engine = int(device_bytes * hbm_utilization)
    if pool_bytes is not None:
        engine = min(engine, pool_bytes)
    reserve = max(activation, int(engine * WORKSPACE_SHARE))
    return MemorySplit(device_bytes, engine, weight_bytes, reserve, later_bytes)


@dataclass(frozen=True)
class DeviceMemory:
    """What a device holds as the caches are sized: its memory, JAX's pool on it
    (bytes_limit) and the bytes already in use (the weights)."""
    device_bytes: int
    pool_bytes: int
    in_use_bytes: int


def device_memory(device: jax.Device) -> DeviceMemory | None:
    """From the device's allocator (None where it reports none): the pool is
    bytes_limit, a share of the device (build/device_pool.py)."""
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    limit = stats["bytes_limit"]
    return DeviceMemory(int(limit / pool_fraction(device.platform)), limit,
                        stats.get("bytes_in_use", 0))


def available_host_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


def cpu_cache_bytes(free_bytes: int, share: float, activation: int, later_bytes: int) -> int:
    """The caches' bytes on CPU: `share` of the host's free RAM (read after the weights
    are loaded, so it has them out already), less what is made after the caches
    (later_bytes). The programs' temporaries (activation: the larger of the step's and
    the largest encoder call's, as on an accelerator) live in the RAM outside the share,
    so a share so large that the rest cannot hold them is cut to leave them room. Unlike
    an accelerator's, the reserve is not taken from the share itself: the share is the
    caches' alone (the rest of the host is the engine's too), and a step's temporaries
    come and go with the step."""
    return max(0, min(int(free_bytes * share), free_bytes - activation) - later_bytes)


def cache_budget_bytes(*, kv_cache_memory_bytes: int | None, hbm_utilization: float | None,
                       activation_bytes: int, device: jax.Device | None,
                       memory: DeviceMemory | None = None,
                       later_bytes: int = 0) -> tuple[int, bool]:
    """(bytes per device the caches may take, whether to stop at what max_num_seqs
    sequences need) for build.cache_plan.plan_caches: kv_cache_memory_bytes when
    given; on a CPU device hbm_utilization of the host's free RAM (None: a quarter, taken
    only as far as needed), leaving the rest room for activation_bytes (cpu_cache_bytes);
    else memory_split's cache bytes of `memory` (or the
    device's). later_bytes: allocated after the caches and held beside them (the
    encoder cache): out of every budget but the one given in bytes, which is the
    caches' own."""
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes, False
    if memory is None and device.platform == "cpu":
        share = _CPU_RAM_FRACTION if hbm_utilization is None else hbm_utilization
        return cpu_cache_bytes(available_host_bytes(), share, activation_bytes,
                               later_bytes), hbm_utilization is None
    if hbm_utilization is None:
        raise ValueError("hbm_utilization: None is the CPU's default; EngineConfig."
                         "for_platform gives accelerators theirs")
    memory = memory or device_memory(device)
    if memory is None:
        raise ValueError(f"{device.platform} device {device} reports no memory limit: give "
                         f"--kv-cache-memory-bytes")
    split = memory_split(memory.device_bytes, hbm_utilization, memory.in_use_bytes,
                         activation_bytes, memory.pool_bytes, later_bytes)
    return split.cache_bytes, False
