"""`plan --compile --kv-offloading-size`: the host tier's copy programs for a TPU target.

The engine's HostTier (runner/host_tier.py) builds a HostCopier over the runner's caches:
their shardings, their page layout, the offload's result in pinned host memory. Here the
same copier is built over an abstract runner's caches (planning/plan_compile.py) and its
two programs are lowered with one call's arguments, for the caller to compile and report
("host_offload"; "host_restore", the caches donated).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.runner.host_tier import PINNED_HOST, HostCopier
from jaxserve.runner.model_runner import ModelRunner
from sharding import bytes_per_device

Result = TypeVar("Result")
# compile_one(lower, name, per-device input bytes beside the resident arrays) -> a result
CompileOne = Callable[[Callable[[], Any], str, int], Result]


def compile_host_copies(runner: ModelRunner, compile_one: CompileOne) -> list[Result]:
    """[offload's result, restore's result], each from compile_one."""
    caches = runner.host_tier_caches()
    copier = HostCopier.for_caches(caches, runner.host_tier_layers(), PINNED_HOST)
    mine = {k: caches[k] for k in copier.layout.rows}
    ids, values = copier.abstract_call(NamedSharding(runner.mesh, PartitionSpec()))
    programs = copier.programs()

    def lowering(name: str, *args: Any) -> Callable[[], Any]:
        def lower() -> Any:
            with jax.set_mesh(runner.mesh):
                return programs[name].lower(*args)
        return lower
    return [compile_one(lowering("offload", mine, ids), "host_offload", bytes_per_device(ids)),
            compile_one(lowering("restore", mine, ids, values), "host_restore",
                        bytes_per_device([ids, values]))]
