"""Device meshes: "DxM" -> a jax Mesh with axes ("data", "model").

The data axis runs D independent engine replicas; the model axis is tensor
parallelism inside one replica. Replica d owns devices d*M .. (d+1)*M - 1 of
the first D*M devices (jax.devices() order: process by process, so with one
process per host a replica stays on one host whenever M divides the devices
per host).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)


def parse_mesh(mesh: str) -> tuple[int, int]:
    """"DxM" -> (D, M), both >= 1."""
    try:
        d, m = (int(x) for x in mesh.lower().split("x"))
    except ValueError:
        raise ValueError(f"mesh={mesh!r}: expected 'DxM', e.g. '1x8'") from None
    if d < 1 or m < 1:
        raise ValueError(f"mesh={mesh!r}: both sizes must be >= 1")
    return d, m


def make_mesh(spec: str | tuple[int, int] | None, devices: Sequence[Any] | None = None) -> Mesh:
    """A ("data", "model") mesh over the first D*M of `devices` (default jax.devices()).

    Axis types are Auto: XLA's SPMD partitioner places the collectives that the
    parameter shardings imply (the Megatron pattern falls out of the rules table).
    """
    d, m = (1, 1) if spec is None else parse_mesh(spec) if isinstance(spec, str) else spec
    devices = list(jax.devices() if devices is None else devices)
    if d * m > len(devices):
        raise ValueError(f"mesh {d}x{m} needs {d * m} devices, but only {len(devices)} exist "
                         f"({devices[0].platform}); use a mesh with D*M <= {len(devices)}")
    grid = np.array(devices[:d * m], dtype=object).reshape(d, m)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One 1xM mesh per data-parallel replica (row d of the grid)."""
    return [Mesh(mesh.devices[d:d + 1], AXES, axis_types=(AxisType.Auto, AxisType.Auto))
            for d in range(mesh.shape[DATA])]


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device of `mesh` holds the whole array (batch inputs, sampled outputs)."""
    return NamedSharding(mesh, PartitionSpec())


def model_axis_size(mesh: Mesh) -> int:
    return mesh.shape[MODEL]
