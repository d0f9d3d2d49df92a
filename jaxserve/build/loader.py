"""The model of one engine replica, built and loaded onto its 1xM mesh.

`load_model` is the only bring-up step that touches weights: it builds the flax model
for the layout's choices (build/layout.py), reads the checkpoint (or draws dummy
weights, or restores a converted checkpoint: jaxserve/cli/convert.py) straight into the
parameter shardings, and unties a tied lm_head on CPU.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import Mesh

from jaxserve.build.blas_threads import limit_openblas_threads
from jaxserve.build.cpu_malloc import keep_freed_memory
from jaxserve.checkpoints.converted import (PARAMS_DIR, check_settings, check_tree,
                                            is_converted, read_manifest, tree_settings)
from jaxserve.config import EngineConfig
from jaxserve.build.layout import EngineLayout, build_layout_model, layout_param_shardings
from models.kv_scales import calculates_scales, kv_scales
from models.layers import WEIGHT_LEFT_MAX_ROWS
from models.orbax_io import restore_params
from models.weights import (abstract_params, load_params, param_bytes, store_kernels_out_in,
                            untie_lm_head, widen_params)
from sharding import MODEL, bytes_per_device, kv_head_repeats

logger = logging.getLogger("jaxserve")


@dataclass(frozen=True)
class LoadedModel:
    model: Any                    # the flax module, as it runs on the mesh
    params: Any                   # its parameters, placed in their shardings
    weight_bytes: int             # all devices
    weight_bytes_per_device: int


def load_weights(config: EngineConfig, layout: EngineLayout, mesh: Mesh, *,
                 on_progress: Callable[[int, int], None] | None = None) -> tuple[Any, Any]:
    """The flax model and its params as the layout runs them, placed in their
    shardings, with nothing platform-specific yet (a tied lm_head is still tied): read
    from the safetensors, drawn at random (load_format dummy) or restored from a
    converted checkpoint. What `python -m jaxserve.convert` writes."""
    mc = layout.model_config
    model = build_layout_model(layout)
    shardings = layout_param_shardings(model, mesh, layout)
    if os.path.isdir(config.model) and is_converted(config.model):
        return model, _restore_converted(config, layout, mesh, model, shardings, on_progress)
    params = load_params(config.model, mc, model, layout.dtype,
                         load_format=config.load_format, seed=config.seed,
                         shardings=shardings,
                         kv_head_repeat=kv_head_repeats(mc, layout.model_axis),
                         progress=on_progress)
    if model.config.kv_cache_quantized:   # (a converted checkpoint stores its scales)
        calculate = config.calculate_kv_scales
        with jax.set_mesh(mesh):
            params = {**params, **kv_scales(model, params, layout.kv_dtype, calculate=calculate,
                                            seed=config.seed)}
        logger.info("KV cache in %s: K and V scales per layer and KV head %s",
                    jnp.dtype(layout.kv_dtype).name,
                    "calibrated on a prefill (models/kv_scales.py)"
                    if calculates_scales(layout.kv_dtype, calculate)
                    else "1 (fp8; --calculate-kv-scales measures them)")
    return model, params


def _restore_converted(config: EngineConfig, layout: EngineLayout, mesh: Mesh, model: Any,
                       shardings: Any, on_progress: Callable[[int, int], None] | None) -> Any:
    """The converted tree, each leaf read in its stored dtype straight into its
    sharding, after refusing an engine that would build another tree."""
    manifest = read_manifest(config.model)
    check_settings(manifest, config, config.model)
    check_tree(manifest, config.model, dtype=jnp.dtype(layout.dtype).name,
               quantization=layout.weight_quant.method if layout.weight_quant else None,
               model_axis=layout.model_axis, kv_heads=layout.kv_heads,
               scan_layers=layout.scan_layers, platform=mesh.devices.flat[0].platform,
               settings=tree_settings(config),
               shapes={p: x.shape for p, x in flatten_dict(abstract_params(model)).items()})
    placed = flatten_dict(shardings)
    target = unflatten_dict({leaf.path: jax.ShapeDtypeStruct(leaf.shape, jnp.dtype(leaf.dtype),
                                                             sharding=placed[leaf.path])
                             for leaf in manifest.leaves})
    total = manifest.param_bytes
    if on_progress:
        on_progress(0, total)
    params = restore_params(os.path.join(config.model, PARAMS_DIR), target,
                            what=f"the converted {os.path.basename(config.model.rstrip('/'))}")
    if on_progress:
        on_progress(total, total)
    return params


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
    model, params = load_weights(config, layout, mesh, on_progress=on_progress)
    if mesh.devices.flat[0].platform == "cpu":
        for note in (limit_openblas_threads(), keep_freed_memory()):
            if note:
                logger.info(note)
    if mc.tie_word_embeddings and mesh.devices.flat[0].platform == "cpu":
        shardings_of = lambda module: layout_param_shardings(module, mesh, layout)
        model, params = untie_lm_head(model, params, shardings_of)
        logger.info("CPU: the lm_head reads a transposed copy of the tied embedding "
                    "(faster decode matmul, +%.1f MiB)", param_bytes(params["lm_head"]) / 2**20)
    if layout.compute_dtype != layout.dtype:
        narrow = param_bytes(params)
        keep = jnp.dtype(layout.matmul_dtype) == jnp.dtype(layout.dtype)
        model, params = widen_params(model, params, layout.compute_dtype, keep_projections=keep)
        logger.warning("CPU: the %s model computes in %s on its weights upcast%s "
                       "(%.2f -> %.2f GiB): XLA:CPU has no %s arithmetic and would convert "
                       "every op and weight to float32 and back, about 3x slower; the KV "
                       "cache stays %s", jnp.dtype(layout.dtype).name,
                       jnp.dtype(layout.compute_dtype).name,
                       (", but for the linear layers, whose dots stay %s (this CPU has native "
                        "%s dots, ~2x float32)" % ((jnp.dtype(layout.dtype).name,) * 2)
                        if keep else " (exact)"),
                       narrow / 2**30, param_bytes(params) / 2**30,
                       jnp.dtype(layout.dtype).name, jnp.dtype(layout.kv_dtype).name)
    # Not where the model axis splits the kernels: there a row-parallel weight-left dot
    # would all-reduce its transposed [E, T] result, and a CPU mesh stands in for an
    # accelerator's plan (tests/sharding checks its collectives).
    if mesh.devices.flat[0].platform == "cpu" and m == 1:
        params = store_kernels_out_in(model, params)
        logger.info("CPU: the projection kernels are stored [out, in]: up to %d rows the "
                    "dot takes the weight as its left operand (XLA:CPU packs a dot's right "
                    "operand on every call)", WEIGHT_LEFT_MAX_ROWS)
    loaded = LoadedModel(model, params, param_bytes(params), bytes_per_device(params))
    # The load's time and rate are models.weights' line; this one is what is in memory.
    logger.info("model %s (%s, %s): %.2f GiB of weights, %.2f GiB per device "
                "(model axis %d)", config.model, mc.architecture, jnp.dtype(layout.dtype).name,
                loaded.weight_bytes / 2**30, loaded.weight_bytes_per_device / 2**30, m)
    return loaded
