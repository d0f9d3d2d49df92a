"""Meshes, the logical-axis rules table and the shardings built from it (DESIGN.md §6)."""
from sharding.mesh import AXES, DATA, MODEL, make_mesh, model_axis_size, replica_meshes, replicated
from sharding.parallel import context_model_axis_size, heads_spec, over_model_axis
from sharding.rules import (RULES, bytes_per_device, check_model_axis, kv_cache_sharding,
                            kv_head_layout, kv_head_repeats, logical_to_mesh, mesh_rules,
                            param_shardings, with_stored_kv_heads)

__all__ = ["AXES", "DATA", "MODEL", "make_mesh", "model_axis_size", "replica_meshes",
           "replicated", "context_model_axis_size", "heads_spec", "over_model_axis", "RULES",
           "bytes_per_device", "check_model_axis", "kv_cache_sharding", "kv_head_layout",
           "kv_head_repeats", "logical_to_mesh", "mesh_rules", "param_shardings",
           "with_stored_kv_heads"]
