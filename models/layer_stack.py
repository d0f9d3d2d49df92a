"""How a decoder's layers are laid out: their caches and their repeating pattern.

Caches: one array per kind, every layer of that kind stacked on the leading axis, so a
layer's cache is a range of pages (or state slots) of one array, reached by adding an
offset to the page and slot ids:
    "kv"         [A * pages, 2K, S, H]   the full-attention layers' paged KV (A layers;
                                         each layer's page 0 is its null page)
    "kv_sliding" [W * pages', 2K', S, H']  Gemma 4's sliding-window layers' (W layers, their
                                         own pages: a KV group of its own, the plan's
                                         num_sliding_pages)
    "conv"       [D * slots, Hk*G*(kc-1)]  the linear-attention layers' state (D layers;
    "recurrent"  [D * slots, Hv, Dk, Dv]    each layer's slot 0 is its null slot)
Layers that share another's KV (Gemma 4's last layers) own no slice: they read their
source layer's (ModelConfig.kv_source). The layers then differ only by an offset, which is what lets `jax.lax.scan` run one
compiled layer body over all of them (a per-layer array could not be indexed by the
loop counter without copying it).

Pattern: the smallest period after which the layer kinds (attention or linear, dense
MLP or experts) repeat; a scanned model runs num_layers / period blocks of `period`
layers.
"""
from __future__ import annotations

from typing import Any

import jax

from models.config import FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION, ModelConfig
from models.gated_deltanet import state_shapes
from pallas_kernels.ragged_paged_attention import make_kv_cache

KV, KV_SLIDING, CONV, RECURRENT = "kv", "kv_sliding", "conv", "recurrent"
# The paged KV array of each layer type that has one.
KV_KIND = {FULL_ATTENTION: KV, SLIDING_ATTENTION: KV_SLIDING}
# A quantized KV cache's scales [A, K, 2] (models/llama.py): a model parameter that rides
# along with the caches through the layers, so each layer reads its slice as it reads
# its pages (scanned layers included). Per KV array: (the param, its rider's key).
KV_SCALE = "kv_scale"
KV_SCALES = {KV: ("kv_scales", KV_SCALE), KV_SLIDING: ("kv_scales_sliding", "kv_scale_sliding")}


def layer_kind(cfg: ModelConfig, i: int) -> tuple[str, bool, bool]:
    return cfg.layer_type(i), cfg.is_moe_layer(i), cfg.is_kv_shared(i)


def owns_cache(cfg: ModelConfig, i: int) -> bool:
    return not cfg.is_kv_shared(i)


def num_owners(cfg: ModelConfig, layer_type: str, layers: range | None = None) -> int:
    """Layers of `layer_type` (among `layers`, default all) that own a cache slice."""
    return sum(cfg.layer_type(i) == layer_type and owns_cache(cfg, i)
               for i in (layers if layers is not None else range(cfg.num_layers)))


def layer_period(cfg: ModelConfig) -> int:
    """Smallest p dividing num_layers with layer i of the same kind as layer i % p."""
    n = cfg.num_layers
    for p in range(1, n + 1):
        if n % p == 0 and all(layer_kind(cfg, i) == layer_kind(cfg, i % p) for i in range(n)):
            return p
    return n


def cache_index(cfg: ModelConfig, i: int) -> int:
    """Layer i's place among the cache-owning layers of its kind: which slice of its
    cache it owns (a KV-sharing layer: its source's)."""
    i = cfg.kv_source(i)
    return num_owners(cfg, cfg.layer_type(i), range(i))


def cache_shapes(cfg: ModelConfig, *, num_pages: int, page_size: int, kv_dtype: Any,
                 num_state_slots: int, conv_state_dtype: Any, num_sliding_pages: int | None = None
                 ) -> dict[str, jax.ShapeDtypeStruct]:
    """The stacked caches of every layer (see the module docstring). num_pages (the
    global layers'), num_sliding_pages (the sliding-window layers'; None: num_pages) and
    num_state_slots are per layer, null page and null slot included; the KV heads are
    as stored (sharding.kv_head_layout)."""
    out: dict[str, jax.ShapeDtypeStruct] = {}
    linear = num_owners(cfg, LINEAR_ATTENTION)
    for layer_type, kind in KV_KIND.items():
        owners = cfg.kv_layers(layer_type)
        if not owners:
            continue
        pages = num_pages if layer_type == FULL_ATTENTION or num_sliding_pages is None \
            else num_sliding_pages
        i = owners[0]
        # The page layout belongs to the kernel module: ask make_kv_cache for it.
        kv = jax.eval_shape(lambda: make_kv_cache(pages, page_size, cfg.layer_num_kv_heads(i),
                                                  cfg.layer_head_dim(i), kv_dtype))
        out[kind] = jax.ShapeDtypeStruct((len(owners) * kv.shape[0], *kv.shape[1:]), kv.dtype)
    if linear:
        conv, rec = state_shapes(cfg, num_state_slots, conv_state_dtype)
        out[CONV] = jax.ShapeDtypeStruct((linear * conv.shape[0], *conv.shape[1:]), conv.dtype)
        out[RECURRENT] = jax.ShapeDtypeStruct((linear * rec.shape[0], *rec.shape[1:]), rec.dtype)
    return out


def per_layer(cache: jax.Array, cfg: ModelConfig, layer_type: str) -> int:
    """Pages (the KV cache) or state slots (the recurrent state) each layer of
    `layer_type` owns in its stacked cache."""
    return cache.shape[0] // num_owners(cfg, layer_type)
