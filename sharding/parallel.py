"""Running a per-shard function over the model axis of the context mesh.

The runner traces its jitted step under `jax.set_mesh(mesh)`; model code that
must see only its own shard (attention over its KV heads: a Pallas kernel is
opaque to XLA's SPMD partitioner, and the paged gathers must stay local) wraps
that part with `over_model_axis`. Without a mesh, or with M = 1, the function
runs as it is.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec

from sharding.mesh import MODEL


def context_model_axis_size() -> int:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or MODEL not in mesh.axis_names:
        return 1
    return mesh.shape[MODEL]


def over_model_axis(fn: Callable, in_specs: Any, out_specs: Any, *, sum_outputs: bool = False
                    ) -> Callable:
    """fn under shard_map over the context mesh (specs name MODEL or nothing).

    sum_outputs: fn returns per-device partial sums; they are all-reduced over the
    model axis (one psum per output), so out_specs should be replicated.
    """
    if context_model_axis_size() == 1:
        return fn
    body = fn
    if sum_outputs:
        body = lambda *args: jax.tree_util.tree_map(lambda y: jax.lax.psum(y, MODEL), fn(*args))
    return jax.shard_map(body, mesh=jax.sharding.get_abstract_mesh(), in_specs=in_specs,
                         out_specs=out_specs, check_vma=False)


def heads_spec(ndim: int, axis: int) -> PartitionSpec:
    """PartitionSpec splitting `axis` of an ndim array over MODEL."""
    spec = [None] * ndim
    spec[axis] = MODEL
    return PartitionSpec(*spec)
