"""How a decoder's layers are laid out: their caches and their repeating pattern.

Caches: one array per kind, every layer of that kind stacked on the leading axis, so a
layer's cache is a range of pages (or state slots) of one array, reached by adding an
offset to the page and slot ids:
    "kv"         [A * pages, 2K, S, H]   the full-attention layers' paged KV (A layers;
                                         each layer's page 0 is its null page)
    "conv"       [D * slots, Hk*G*(kc-1)]  the linear-attention layers' state (D layers;
    "recurrent"  [D * slots, Hv, Dk, Dv]    each layer's slot 0 is its null slot)
The layers then differ only by an offset, which is what lets `jax.lax.scan` run one
compiled layer body over all of them (a per-layer array could not be indexed by the
loop counter without copying it).

Pattern: the smallest period after which the layer kinds (attention or linear, dense
MLP or experts) repeat; a scanned model runs num_layers / period blocks of `period`
layers.
"""
from __future__ import annotations

from typing import Any

import jax

from models.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from models.gated_deltanet import state_shapes
from pallas_kernels.ragged_paged_attention import make_kv_cache

KV, CONV, RECURRENT = "kv", "conv", "recurrent"
# A quantized KV cache's scales [A, K, 2] (models/llama.py): a model parameter that rides
# along with the caches through the layers, so each layer reads its slice as it reads
# its pages (scanned layers included).
KV_SCALE = "kv_scale"


def layer_kind(cfg: ModelConfig, i: int) -> tuple[str, bool]:
    return cfg.layer_type(i), cfg.is_moe_layer(i)


def layer_period(cfg: ModelConfig) -> int:
    """Smallest p dividing num_layers with layer i of the same kind as layer i % p."""
    n = cfg.num_layers
    for p in range(1, n + 1):
        if n % p == 0 and all(layer_kind(cfg, i) == layer_kind(cfg, i % p) for i in range(n)):
            return p
    return n


def cache_index(cfg: ModelConfig, i: int) -> int:
    """Layer i's place among the layers of its kind: which slice of its cache it owns."""
    kind = cfg.layer_type(i)
    return sum(cfg.layer_type(j) == kind for j in range(i))


def cache_shapes(cfg: ModelConfig, *, num_pages: int, page_size: int, kv_dtype: Any,
                 num_state_slots: int, conv_state_dtype: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """The stacked caches of every layer (see the module docstring). num_pages and
    num_state_slots are per layer, null page and null slot included; cfg.num_kv_heads
    is the number stored (sharding.kv_head_layout)."""
    out: dict[str, jax.ShapeDtypeStruct] = {}
    attention = sum(cfg.layer_type(i) == FULL_ATTENTION for i in range(cfg.num_layers))
    linear = sum(cfg.layer_type(i) == LINEAR_ATTENTION for i in range(cfg.num_layers))
    if attention:
        # The page layout belongs to the kernel module: ask make_kv_cache for it.
        kv = jax.eval_shape(lambda: make_kv_cache(num_pages, page_size, cfg.num_kv_heads,
                                                  cfg.head_dim, kv_dtype))
        out[KV] = jax.ShapeDtypeStruct((attention * kv.shape[0], *kv.shape[1:]), kv.dtype)
    if linear:
        conv, rec = state_shapes(cfg, num_state_slots, conv_state_dtype)
        out[CONV] = jax.ShapeDtypeStruct((linear * conv.shape[0], *conv.shape[1:]), conv.dtype)
        out[RECURRENT] = jax.ShapeDtypeStruct((linear * rec.shape[0], *rec.shape[1:]), rec.dtype)
    return out


def per_layer(cache: jax.Array, cfg: ModelConfig, layer_type: str) -> int:
    """Pages (the KV cache) or state slots (the recurrent state) each layer of
    `layer_type` owns in its stacked cache."""
    return cache.shape[0] // sum(cfg.layer_type(i) == layer_type for i in range(cfg.num_layers))
