"""What each layer of a model keeps between steps: one cache spec per layer.

The model declares, layer by layer, what memory it needs across steps -- a paged KV
cache (heads, head dim, dtype, an optional sliding window), a fixed recurrent state
per sequence (its arrays' shapes), or nothing of its own (it reads another layer's
KV). jaxserve/planning/cache_plan.py turns the specs and a memory budget into the
one CachePlan the engine allocates, schedules and prints; models/layer_stack.py
lays the same caches out as stacked arrays.

Specs describe the model as it runs on a mesh (KV heads as stored, replicated when
they do not divide by the model axis) but whole, not per device: the plan divides
by the model axis, which splits every cache by head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from models.config import KV_LAYER_TYPES, LINEAR_ATTENTION, SLIDING_ATTENTION, ModelConfig
from models.gated_deltanet import state_shapes


@dataclass(frozen=True)
class PagedKVSpec:
    """A full-attention layer: K and V of every token, in pages."""
    num_kv_heads: int
    head_dim: int
    dtype: Any
    sliding_window: int | None = None   # tokens a query sees; None = all of them

    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class RecurrentStateSpec:
    """A linear-attention layer: a fixed state per sequence (one slot each), e.g. Gated
    DeltaNet's conv window and delta-rule state."""
    shapes: tuple[tuple[int, ...], ...]   # one slot's arrays
    dtypes: tuple[Any, ...]

    def bytes_per_slot(self) -> int:
        return sum(int(np.prod(s)) * np.dtype(d).itemsize
                   for s, d in zip(self.shapes, self.dtypes))


@dataclass(frozen=True)
class SharedKVSpec:
    """A layer that reads the KV another layer wrote and keeps nothing of its own."""
    source_layer: int


CacheSpec = Union[PagedKVSpec, RecurrentStateSpec, SharedKVSpec]


def layer_cache_specs(cfg: ModelConfig, *, kv_dtype: Any, conv_state_dtype: Any
                      ) -> tuple[CacheSpec, ...]:
    """One spec per layer, in layer order. cfg's KV heads: as stored on the mesh."""
    specs: list[CacheSpec] = []
    for i in range(cfg.num_layers):
        kind = cfg.layer_type(i)
        if kind in KV_LAYER_TYPES and cfg.is_kv_shared(i):
            specs.append(SharedKVSpec(cfg.kv_source(i)))
        elif kind in KV_LAYER_TYPES:
            window = cfg.sliding_window if kind == SLIDING_ATTENTION else None
            specs.append(PagedKVSpec(cfg.layer_num_kv_heads(i), cfg.layer_head_dim(i),
                                     np.dtype(kv_dtype), window))
        elif kind == LINEAR_ATTENTION:
            arrays = state_shapes(cfg, 1, conv_state_dtype)
            specs.append(RecurrentStateSpec(tuple(a.shape[1:] for a in arrays),
                                            tuple(np.dtype(a.dtype) for a in arrays)))
        else:
            raise ValueError(f"layer {i}: no cache spec for layer type {kind!r}")
    return tuple(specs)
