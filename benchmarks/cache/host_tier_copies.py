"""The host tier's copy bandwidth (docs/TIERED_CACHE.md) against the host<->device link's.

    python -m benchmarks.cache.host_tier_copies [--layers 16 --kv-heads 8 --head-dim 64]
        [--page-size 16 --pages 1024 --copy-pages 64 --pages-per-call 16] [--repeats 5]
        [--json FILE]

A KV cache in the stacked layout (models/layer_stack.py: --layers x --pages pages of
[2 * kv heads, page size, head dim], bfloat16 as the device holds it: uint16 bits on
CPU) on the default device; HostCopier moves --copy-pages pages to host (offload: gather,
pinned host memory where the device has it, landed in the numpy pool) and back into
other page ids (restore: in place). The link: device_put / device_get of one array of
the same bytes. Reported: GB/s, the median of --repeats runs (the first call of each
program, which compiles, is not timed), and the restore's share of the link's
host->device bandwidth.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runner.host_tier import (HostCopier, HostPageArrays, HostTierLayout,
                                       host_memory_kind)
from models.layer_stack import KV
from pallas_kernels.held_dtypes import held_dtype


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(layers: int, kv_heads: int, head_dim: int, page_size: int, pages: int,
        copy_pages: int, pages_per_call: int, repeats: int) -> dict:
    if not 0 < copy_pages < pages // 2:
        raise ValueError(f"--copy-pages {copy_pages}: must be in (0, {pages // 2})")
    device = jax.devices()[0]
    dtype = held_dtype(jnp.bfloat16, device.platform)
    shape = (layers * pages, 2 * kv_heads, page_size, head_dim)
    caches = {KV: jax.jit(lambda: jnp.ones(shape, dtype))()}
    layout = HostTierLayout.of(caches, {KV: layers})
    host = HostPageArrays(layout, copy_pages + 1)
    kind = host_memory_kind(device)
    copier = HostCopier(layout, {KV: caches[KV].sharding}, pages_per_call=pages_per_call,
                        memory_kind=kind)
    src, dst = list(range(1, copy_pages + 1)), list(range(pages // 2, pages // 2 + copy_pages))
    slots = list(range(1, copy_pages + 1))

    def offload():
        copier.offload(caches, {KV: src}, {KV: slots}).land(host)

    def restore():
        caches[KV] = copier.restore(caches, host, {KV: slots}, {KV: dst})[KV]
        jax.block_until_ready(caches[KV])

    offload(), restore()                        # compile both programs
    nbytes = copy_pages * layout.page_bytes
    block = np.ones(nbytes // np.dtype(dtype).itemsize, dtype)
    on_device = jax.device_put(block, device)

    def to_device():
        jax.block_until_ready(jax.device_put(block, device))

    # Fresh device arrays to fetch (a fetched array keeps its host copy).
    fresh = jax.block_until_ready([on_device + i for i in range(repeats + 1)])
    to_device(), np.asarray(fresh.pop())
    gbs = {name: nbytes / _median_s(fn, repeats) / 1e9
           for name, fn in (("offload", offload), ("restore", restore),
                            ("link_to_device", to_device),
                            ("link_to_host", lambda: np.asarray(fresh.pop())))}
    return {"device": str(device.device_kind), "memory_kind": kind,
            "page_bytes": layout.page_bytes, "copied_bytes": nbytes,
            "gb_per_s": gbs, "restore_share_of_link": gbs["restore"] / gbs["link_to_device"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 16), ("kv-heads", 8), ("head-dim", 64), ("page-size", 16),
                          ("pages", 1024), ("copy-pages", 64), ("pages-per-call", 16),
                          ("repeats", 5)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--json", default=None, help="also write the results to this file")
    a = p.parse_args(argv)
    out = run(a.layers, a.kv_heads, a.head_dim, a.page_size, a.pages, a.copy_pages,
              a.pages_per_call, a.repeats)
    g = out["gb_per_s"]
    print(f"{out['device']} ({out['memory_kind'] or 'default memory'}): "
          f"{out['copied_bytes'] / 2**20:.0f} MiB in {out['page_bytes'] / 2**10:.0f} KiB pages: "
          f"offload {g['offload']:.2f} GB/s, restore {g['restore']:.2f} GB/s; link "
          f"{g['link_to_host']:.2f} GB/s to host, {g['link_to_device']:.2f} GB/s to device "
          f"(restore at {out['restore_share_of_link']:.0%} of it)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
