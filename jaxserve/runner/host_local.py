"""A process's own part of an array sharded over several processes (multi-host), as one
numpy block, and back: what the host tier keeps of each page (runner/host_tier.py).

On one process an array is fully addressable and its part is the whole array. Under
jax.distributed a cache split by KV head over every device of every process (one replica
whose model axis spans the hosts: engine/multihost.py) has, on each process, the rows of
its devices' heads: every process keeps those in host memory, in the same slots (the
leader's scheduler picks them for all), so a restore sends each device what it held.
"""
from __future__ import annotations

import jax
import numpy as np


def local_box(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """The smallest box of the global `shape` holding every index this process's devices
    hold (their shards tile it: a cache's heads are split in contiguous runs)."""
    starts, stops = [None] * len(shape), [None] * len(shape)
    for index in sharding.addressable_devices_indices_map(shape).values():
        for d, s in enumerate(index):
            a, b, _ = s.indices(shape[d])
            starts[d] = a if starts[d] is None else min(starts[d], a)
            stops[d] = b if stops[d] is None else max(stops[d], b)
    return tuple(slice(a, b) for a, b in zip(starts, stops))


def to_local(x: jax.Array) -> np.ndarray:
    """x's process-local block (all of x where it is fully addressable)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    box = local_box(x.sharding, x.shape)
    out = np.empty(tuple(b.stop - b.start for b in box), x.dtype)
    for shard in x.addressable_shards:
        out[tuple(slice(s.indices(n)[0] - b.start, s.indices(n)[1] - b.start)
                  for s, b, n in zip(shard.index, box, x.shape))] = np.asarray(shard.data)
    return out


def from_local(local: np.ndarray, sharding: jax.sharding.Sharding,
               shape: tuple[int, ...]) -> jax.Array:
    """The global array of `shape` placed by `sharding` whose process-local block is
    `local` (every process passes its own)."""
    if sharding.is_fully_addressable:
        return jax.device_put(local, sharding)
    return jax.make_array_from_process_local_data(sharding, local, shape)
