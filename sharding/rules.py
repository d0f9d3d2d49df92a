"""Logical axis names -> mesh axes: one rules table, the checks, the shardings.

Tensor parallelism is Megatron's: column-parallel q/k/v, gate/up and lm_head,
row-parallel o_proj and down_proj. With activations replicated between layers,
XLA's SPMD partitioner then needs exactly one all-reduce of [T, E] after o_proj
and one after down_proj per layer, a masked lookup + all-reduce for the
vocab-parallel embedding, and for sampling one all-gather of the vocab-parallel
[R, V] logits (none for pure greedy: XLA reduces the per-shard argmaxes).
"""
from __future__ import annotations

import logging
import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.mesh import MODEL
from sharding.parallel import heads_spec

logger = logging.getLogger("jaxserve")

# The rules table. Every parameter axis names one of these logical axes (models/layers.py).
RULES: dict[str, str | None] = {
    "vocab": MODEL,      # embedding rows / lm_head columns (vocab-parallel); replicated when
                         # vocab % M != 0 (logged): padding would leak into the logits' shape
    "heads": MODEL,      # q_proj outputs, o_proj inputs
    "kv_heads": MODEL,   # k_proj / v_proj outputs and the KV cache (kv_head_layout below)
    "global_kv_heads": MODEL,   # Gemma 4's global layers' KV heads (a count of their own)
    "linear_key_heads": MODEL,    # Gated DeltaNet: key-head groups (q, k and their v heads),
    "linear_value_heads": MODEL,  # split together; the recurrent state likewise
    "mlp": MODEL,        # gate/up outputs, down inputs of the dense MLP (and shared expert)
    # By default experts are tensor-parallel: each device holds a 1/M slice of every
    # expert's F, the MoE block costs the same single all-reduce as a dense MLP and the
    # work is balanced whatever the routing. --enable-expert-parallel swaps the two
    # (expert_parallel_rules): each device holds X/M whole experts.
    "expert_mlp": MODEL,  # F inside each expert
    "experts": None,      # the stacked experts
    "embed": None,       # the residual stream stays replicated between layers
    "head_dim": None,
    "norm": None,
    "layers": None,      # the stacked layers of a scanned model (models/layer_stack.py)
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_model_axis(mc: Any, m: int, expert_parallel: bool = False) -> None:
    """ValueError naming the first model dimension that M does not divide.

    Must divide: the dimensions the model's family splits over the model axis
    (models/family.py ModelFamily.model_axis_dims: query heads, MLP widths, experts,
    DeltaNet key heads). KV heads need not (kv_head_layout), nor the vocabulary.
    expert_parallel also refuses a dense model and a model axis of one
    (check_expert_parallel).
    """
    if expert_parallel:
        check_expert_parallel(mc, m)
    need = mc.family.model_axis_dims(mc, expert_parallel)
    ok = _divisors(math.gcd(*(v for _, v in need)))
    for name, value in need:
        if value % m:
            why = (" (enable_expert_parallel=True places whole experts, num_experts/M on "
                   "each device)" if name == "num_experts" else "")
            raise ValueError(
                f"mesh model axis M={m} does not divide {name}={value}{why}; model-axis "
                f"sizes that work for this model: {', '.join(map(str, ok))}")


def check_expert_parallel(mc: Any, m: int) -> None:
    """ValueError naming enable_expert_parallel where it would change nothing: a dense
    model has no experts, and on a model axis of one every expert is on the device
    (data-parallel replicas each hold all experts: expert parallelism splits them over
    the model axis only)."""
    if not mc.num_experts:
        raise ValueError(f"enable_expert_parallel=True: {mc.architecture} is a dense model "
                         f"(no experts to split); leave --enable-expert-parallel out")
    if m == 1:
        raise ValueError("enable_expert_parallel=True: the model axis is 1, so every expert is "
                         "on the one device; expert parallelism splits the experts over the "
                         "model axis: give --tensor-parallel-size M (or --mesh DxM) with M > 1")


def kv_head_layout(num_heads: int, num_kv_heads: int, m: int) -> int:
    """KV heads to store across the model axis (a multiple of M).

    K % M == 0: the K heads themselves, K/M per device. Otherwise each KV head is
    replicated on the devices whose query heads read it: K' = lcm(K, M) heads (each
    original head repeated K'/K times, K'/M per device), so a device holds only the
    KV heads its own query heads use. K' divides N whenever M divides N.
    """
    if num_kv_heads % m == 0:
        return num_kv_heads
    stored = math.lcm(num_kv_heads, m)
    if num_heads % stored:
        raise ValueError(f"cannot place {num_kv_heads} KV heads for {num_heads} query heads "
                         f"on a model axis of {m}")
    return stored


def with_stored_kv_heads(mc: Any, m: int) -> Any:
    """The model config with its KV heads as stored on a model axis of M (kv_head_layout),
    Gemma 4's global layers' count included."""
    from dataclasses import replace
    full = mc.full_num_kv_heads and kv_head_layout(mc.num_heads, mc.full_num_kv_heads, m)
    return replace(mc, num_kv_heads=kv_head_layout(mc.num_heads, mc.num_kv_heads, m),
                   full_num_kv_heads=full)


def kv_head_repeats(mc: Any, m: int) -> dict[str, int]:
    """How often each KV head is repeated on a model axis of M, per logical axis of KV
    heads (models/weights.py load_params' kv_head_repeat)."""
    stored = with_stored_kv_heads(mc, m)
    out = {"kv_heads": stored.num_kv_heads // mc.num_kv_heads}
    if mc.full_num_kv_heads:
        out["global_kv_heads"] = stored.full_num_kv_heads // mc.full_num_kv_heads
    return out


def mesh_rules(mc: Any, m: int, expert_parallel: bool = False) -> dict[str, str | None]:
    """RULES for one model: the vocabulary replicated when M does not divide it; with
    expert_parallel, whole experts split over the model axis instead of every expert's F."""
    rules = dict(RULES)
    if expert_parallel:
        rules.update(experts=MODEL, expert_mlp=None)
    if mc.vocab_size % m:
        logger.warning("vocab_size=%d does not divide by the model axis %d: embedding and "
                       "lm_head are replicated on every device", mc.vocab_size, m)
        rules["vocab"] = None
    return rules


def logical_to_mesh(spec: PartitionSpec, rules: dict[str, str | None]) -> PartitionSpec:
    """PartitionSpec of logical names -> PartitionSpec of mesh axes."""
    def one(name):
        if name is None:
            return None
        if name not in rules:
            raise ValueError(f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}")
        return rules[name]
    return PartitionSpec(*(one(n) for n in spec))


def param_shardings(logical_axes: Any, mesh: Mesh, rules: dict[str, str | None]) -> Any:
    """Tree of NamedShardings for a tree of logical PartitionSpecs
    (models.weights.param_logical_axes)."""
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, logical_to_mesh(s, rules)),
                                  logical_axes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def kv_cache_sharding(mesh: Mesh, kv_head_axis: int, ndim: int) -> NamedSharding:
    """The KV cache split by KV head (the cache has a multiple of M heads: kv_head_layout)."""
    return NamedSharding(mesh, heads_spec(ndim, kv_head_axis))


def bytes_per_device(tree: Any) -> int:
    """Bytes the first device of each array's sharding holds (all devices hold the same
    amount: shardings here are even). Leaves may be arrays or ShapeDtypeStructs that
    carry a sharding."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        shape = x.sharding.shard_shape(x.shape)
        total += math.prod(shape) * x.dtype.itemsize
    return total
