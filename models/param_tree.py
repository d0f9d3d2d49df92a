"""The parameter tree a model expects, without allocating it: shapes and dtypes, logical
axes (for the sharding rules), the leading stacked axes, quantized leaves, and the KV-head
axes that tensor parallelism may repeat."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict

from models.inputs import ModelInputs
from models.quant_weights import scale_leaf
from pallas_kernels.ragged_paged_attention.quant import is_quantized

Path_ = tuple[str, ...]
# Params no checkpoint holds: the KV cache's scales (models/kv_scales.py sets them after
# the load), loaded as ones.
COMPUTED_LEAVES = ("kv_scales", "kv_scales_sliding")


def dummy_inputs(num_tokens: int = 1, num_rows: int = 1, pages_per_row: int = 1) -> ModelInputs:
    """A minimal all-padding batch, for init / eval_shape."""
    z = lambda *s: jnp.zeros(s, jnp.int32)
    return ModelInputs(token_ids=z(num_tokens), positions=z(num_tokens), slot_mapping=z(num_tokens),
                       query_start_loc=z(num_rows + 1), seq_lens=z(num_rows),
                       page_table=z(num_rows, pages_per_row), num_seqs=z(1))


def abstract_params(model: nn.Module, *, boxed: bool = False) -> dict:
    """Param tree of ShapeDtypeStructs, without allocating. boxed=True keeps the
    nn.LogicallyPartitioned wrappers (for nn.get_partition_spec / logical sharding rules)."""
    # init never touches the caches (attention's cache layout belongs to its kernel, a
    # linear-attention layer's state to that layer): an empty placeholder will do.
    variables = jax.eval_shape(model.init, jax.random.key(0), {}, dummy_inputs())
    params = variables["params"]
    return params if boxed else nn.unbox(params)


def placed_abstract_params(model: nn.Module, dtype: Any, shardings: Any) -> dict:
    """What load_params returns (every leaf in `dtype` but quantized kernels and their
    scales, placed by `shardings`) as ShapeDtypeStructs: for compiling ahead of time
    without any weights."""
    expected = flatten_dict(abstract_params(model))
    quant = quantized_leaves(expected)
    return unflatten_dict({
        path: jax.ShapeDtypeStruct(
            sds.shape, sds.dtype if path in quant or path[-1] in COMPUTED_LEAVES else jnp.dtype(dtype),
            sharding=sh)
        for (path, sds), sh in zip(expected.items(), _flat_in_order(shardings, expected))})


def _flat_in_order(tree: Any, expected: dict) -> list:
    flat = flatten_dict(tree)
    return [flat[path] for path in expected]


def quantized_leaves(expected: dict[Path_, Any]) -> dict[Path_, tuple[str, Path_]]:
    """Leaves of a quantized model (models/quantization.py): path -> ("kernel" | "scale",
    the kernel's path)."""
    out: dict[Path_, tuple[str, Path_]] = {}
    for path, sds in expected.items():
        if is_quantized(sds.dtype):
            out[path] = ("kernel", path)
            out[path[:-1] + (scale_leaf(path[-1]),)] = ("scale", path)
    return out


def param_logical_axes(model: nn.Module) -> dict:
    """Tree of PartitionSpecs of logical axis names, same structure as the params."""
    return nn.get_partition_spec(abstract_params(model, boxed=True))


def param_bytes(params: Any) -> int:
    return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(params))


def stacked_axes(model: nn.Module) -> dict[Path_, int]:
    """param path -> its leading stacked axes (scanned layers, experts): each entry is a
    kernel of its own."""
    axes = flatten_dict(param_logical_axes(model))
    out = {}
    for path, spec in axes.items():
        names = tuple(spec)
        n = 0
        while n < len(names) and names[n] in ("layers", "experts"):
            n += 1
        out[path] = n
    return out


def contracted_axes(inner_axes: tuple[str | None, ...]) -> int:
    """How many leading axes of a projection kernel (models/layers.Einsum; its logical axes
    without stacked ones) contract: its leading "embed" axis alone, or else all but its
    last (o_proj [N, H, E], down_proj [F, E], out_proj [Hv, Dv, E])."""
    return 1 if inner_axes[0] == "embed" else len(inner_axes) - 1


# Logical axes of KV heads (Gemma 4's global layers have their own count).
_KV_HEAD_AXES = ("kv_heads", "global_kv_heads")
KVHeadRepeat = int | dict[str, int]


def kv_repeat_axes(model: nn.Module, kv_head_repeat: KVHeadRepeat) -> dict[Path_, tuple[int, int]]:
    """param path -> (its KV-heads axis, the repeat), for the params to repeat.
    kv_head_repeat: one repeat for every KV-heads axis, or one per logical axis name."""
    repeats = kv_head_repeat if isinstance(kv_head_repeat, dict) else \
        dict.fromkeys(_KV_HEAD_AXES, kv_head_repeat)
    out = {}
    for path, spec in flatten_dict(param_logical_axes(model)).items():
        for name in _KV_HEAD_AXES:
            if name in tuple(spec) and repeats.get(name, 1) != 1:
                out[path] = (tuple(spec).index(name), repeats[name])
    return out
