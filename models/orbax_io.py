"""A param pytree to and from an orbax checkpoint directory, array by array.

save_params writes each array's shards as they lie on their devices (a replicated one
once); restore_params reads each device's slice straight into an array placed by the
target's shardings, in the stored dtype: no host copy of the whole tree, no cast. A
target sharded differently from the saved arrays (another mesh) is resharded by the
read itself, since every device reads its own slice of the stored array.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

logger = logging.getLogger("jaxserve")

# Bytes in flight while restoring: orbax's default (96 GB) would let the host stage a
# whole large model before it reaches the devices; a few GB keeps the reads parallel.
RESTORE_CONCURRENT_GB = 4


def _checkpointer() -> Any:
    import orbax.checkpoint as ocp
    # No compression: weights barely compress (a bf16 mantissa is noise) and every
    # load would pay the decompression on the host.
    handler = ocp.PyTreeCheckpointHandler(use_compression=False,
                                          restore_concurrent_gb=RESTORE_CONCURRENT_GB)
    return ocp.Checkpointer(handler)


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
    """orbax logs a dozen INFO lines per save or restore through absl; our one line says
    what they say. (The checkpointer is synchronous: no orbax thread outlives this.)"""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        absl.setLevel(level)


def tree_bytes(tree: Any) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def save_params(path: str | Path, params: Any, *, what: str = "params") -> int:
    """Writes `params` (jax arrays, any shardings) to the new directory `path`; returns
    the bytes of the arrays. ValueError if `path` exists."""
    import orbax.checkpoint as ocp
    path = Path(path).absolute()
    if path.exists():
        raise ValueError(f"{str(path)!r} already exists: orbax writes a new directory")
    nbytes = tree_bytes(params)
    t0 = time.perf_counter()
    with _quiet_orbax(), _checkpointer() as ckptr:
        ckptr.save(path, args=ocp.args.PyTreeSave(params))
    dt = time.perf_counter() - t0
    logger.info("wrote %s: %.2f GiB in %.1f s (%.2f GiB/s) to %s", what, nbytes / 2**30, dt,
                nbytes / 2**30 / max(dt, 1e-9), path)
    return nbytes


def restore_params(path: str | Path, target: Any, *, what: str = "params") -> Any:
    """The tree saved at `path`, as `target` says: a pytree of jax.ShapeDtypeStruct
    with the same structure, each with its shape, the stored dtype and a sharding. The
    caller checks shapes and dtypes first (orbax would cast a dtype silently)."""
    import orbax.checkpoint as ocp
    path = Path(path).absolute()
    if not path.is_dir():
        raise ValueError(f"orbax checkpoint {str(path)!r} does not exist")
    missing = [jax.tree_util.keystr(k) for k, x in jax.tree_util.tree_leaves_with_path(target)
               if getattr(x, "sharding", None) is None]
    if missing:
        raise ValueError(f"restore target has no sharding for {', '.join(missing[:5])}")
    nbytes = tree_bytes(target)
    t0 = time.perf_counter()
    with _quiet_orbax(), _checkpointer() as ckptr:
        out = ckptr.restore(path, args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
    out = jax.block_until_ready(out)
    dt = time.perf_counter() - t0
    logger.info("restored %s: %.2f GiB in %.1f s (%.2f GiB/s) from %s", what, nbytes / 2**30,
                dt, nbytes / 2**30 / max(dt, 1e-9), path)
    return out
