"""The model of one engine replica, built and loaded onto its 1xM mesh.

`load_model` is the only bring-up step that touches weights: it builds the flax model
for the layout's choices (engine/layout.py), reads the checkpoint (or draws dummy
weights) straight into the parameter shardings, and unties a tied lm_head on CPU.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.config import EngineConfig
from jaxserve.engine.layout import EngineLayout, build_layout_model, layout_param_shardings
from models.kv_scales import kv_scales
from models.weights import load_params, param_bytes, untie_lm_head
from sharding import MODEL, bytes_per_device

logger = logging.getLogger("jaxserve")


@dataclass(frozen=True)
class LoadedModel:
    model: Any                    # the flax module, as it runs on the mesh
    params: Any                   # its parameters, placed in their shardings
    weight_bytes: int             # all devices
    weight_bytes_per_device: int


def load_model(config: EngineConfig, layout: EngineLayout, mesh: Mesh, *,
               on_progress: Callable[[int, int], None] | None = None) -> LoadedModel:
    """on_progress(bytes done, bytes total) while the weights load."""
    mc = layout.model_config
    m = mesh.shape[MODEL]
    if layout.kv_heads != mc.num_kv_heads:
        logger.warning("num_kv_heads=%d does not divide by the model axis %d: each KV head "
                       "is replicated on %d devices (%d KV heads stored, %d per device)",
                       mc.num_kv_heads, m, layout.kv_heads // mc.num_kv_heads, layout.kv_heads,
                       layout.kv_heads // m)
    model = build_layout_model(layout)
    shardings_of = lambda module: layout_param_shardings(module, mesh, layout)
    params = load_params(config.model, mc, model, layout.dtype,
                         load_format=config.load_format, seed=config.seed,
                         shardings=shardings_of(model),
                         kv_head_repeat=layout.kv_heads // mc.num_kv_heads,
                         progress=on_progress)
    if model.config.kv_cache_quantized:
        with jax.set_mesh(mesh):
            params = {**params, "kv_scales": kv_scales(model, params, layout.kv_dtype,
                                                       seed=config.seed)}
        logger.info("KV cache in %s: K and V scales per layer and KV head %s",
                    jnp.dtype(layout.kv_dtype).name,
                    "calibrated on a prefill" if jnp.dtype(layout.kv_dtype) == jnp.int8 else "1 (fp8)")
    if mc.tie_word_embeddings and mesh.devices.flat[0].platform == "cpu":
        model, params = untie_lm_head(model, params, shardings_of)
        logger.info("CPU: the lm_head reads a transposed copy of the tied embedding "
                    "(faster decode matmul, +%.1f MiB)", param_bytes(params["lm_head"]) / 2**20)
    loaded = LoadedModel(model, params, param_bytes(params), bytes_per_device(params))
    # The load's time and rate are models.weights' line; this one is what is in memory.
    logger.info("model %s (%s, %s): %.2f GiB of weights, %.2f GiB per device "
                "(model axis %d)", config.model, mc.architecture, jnp.dtype(layout.dtype).name,
                loaded.weight_bytes / 2**30, loaded.weight_bytes_per_device / 2**30, m)
    return loaded
