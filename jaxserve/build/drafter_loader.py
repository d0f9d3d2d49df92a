"""The model drafter of speculative methods mtp and draft_model: its model, weights and
cache specs, before the cache plan (which counts its KV in every page) is made.

mtp: the target checkpoint's `mtp.*` tensors as models.mtp.MTPHead, on the target's
mesh and rules. draft_model: a second checkpoint loaded as an engine would load it (its
own layout), with the target's vocabulary, full attention only (its KV rides on the
target's page ids; a recurrent state or a sliding-window group would need slots and
pages of their own).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import flax.linen as nn
from jax.sharding import Mesh

from jaxserve.checkpoints.model_names import resolve_model
from jaxserve.checkpoints.model_names import load_model_config
from jaxserve.config import EngineConfig
from jaxserve.build.layout import (EngineLayout, build_layout_model, layout_for,
                                   layout_param_shardings)
from jaxserve.build.loader import load_model
from jaxserve.build.cache_plan import CachePlan
from jaxserve.runner.drafter import ModelDrafter
from jaxserve.runner.runner_config import DrafterConfig
from jaxserve.config.speculative import DRAFT_MODEL, MTP, NGRAM
from models.cache_spec import CacheSpec, layer_cache_specs
from models.config import ModelConfig
from models.mtp import MTP_PREFIX, MTPHead, mtp_config
from models.registry import get_model_class
from models.weights import load_params, param_bytes, placed_abstract_params
from pallas_kernels.ragged_paged_attention import is_quantized
from sharding import kv_head_repeats

logger = logging.getLogger("jaxserve")


@dataclass(frozen=True)
class DrafterParts:
    method: str
    model: Any
    params: Any
    cache_config: ModelConfig         # what its caches follow (KV heads as stored)
    cache_specs: tuple[CacheSpec, ...]  # its KV per page, for the cache plan
    kv_dtype: Any

    def build(self, plan: CachePlan, config: EngineConfig, layout: EngineLayout, *,
              target_model: nn.Module, mesh: Mesh, abstract: bool = False) -> ModelDrafter:
        dconfig = DrafterConfig(
            method=self.method, num_pages=plan.num_pages, page_size=plan.page_size,
            kv_dtype=self.kv_dtype, max_num_seqs=config.max_num_seqs,
            pages_per_req=-(-layout.max_model_len // plan.page_size),
            num_speculative_tokens=config.speculative_config.num_speculative_tokens)
        return ModelDrafter(dconfig, model=self.model, params=self.params,
                            target_model=target_model, cache_config=self.cache_config, mesh=mesh,
                            abstract=abstract)


@dataclass(frozen=True)
class DrafterModel:
    """A model drafter before any weight: its flax module, what its caches follow, and
    the layout its parameters are placed by (the target's for mtp, its own for
    draft_model). The engine loads it; the planner counts its bytes and KV."""
    method: str
    model: Any
    cache_config: ModelConfig
    cache_specs: tuple[CacheSpec, ...]
    kv_dtype: Any
    layout: EngineLayout
    source: str                       # the checkpoint its weights come from


def drafter_model(config: EngineConfig, layout: EngineLayout, platform: str, *,
                  check_kernels: bool = True) -> DrafterModel | None:
    """The drafter of config's speculative method, or None (no speculation, or ngram).
    ValueError for a drafter that cannot serve this target, naming why."""
    spec = config.speculative_config
    if spec is None or spec.method == NGRAM:
        return None
    if spec.draft_tensor_parallel_size not in (None, layout.model_axis):
        raise ValueError(f"speculative_config draft_tensor_parallel_size="
                         f"{spec.draft_tensor_parallel_size}: the drafter runs on the target's "
                         f"mesh, tensor parallel over {layout.model_axis} (leave it out)")
    return _mtp(config, layout) if spec.method == MTP \
        else _draft_model(config, layout, platform, check_kernels)


def load_drafter(config: EngineConfig, layout: EngineLayout, mesh: Mesh,
                 *, abstract: bool = False) -> DrafterParts | None:
    """The drafter's parts with its weights placed on `mesh`, or None. abstract: its
    params as placed ShapeDtypeStructs (nothing read; `python -m jaxserve.plan
    --compile`)."""
    d = drafter_model(config, layout, mesh.devices.flat[0].platform)
    if d is None:
        return None
    shardings = layout_param_shardings(d.model, mesh, d.layout)
    if abstract:
        params = placed_abstract_params(d.model, d.layout.dtype, shardings)
    elif d.method == MTP:
        mc = layout.model_config
        params = load_params(config.model, mtp_config(mc), d.model, layout.compute_dtype,
                             load_format=config.load_format, seed=config.seed + 1,
                             shardings=shardings,
                             kv_head_repeat=kv_head_repeats(mc, layout.model_axis),
                             prefix=MTP_PREFIX)
        logger.info("speculative decoding: the MTP layer, %.1f MiB of weights",
                    param_bytes(params) / 2**20)
    else:
        dconfig = _draft_config(config, d.source, layout)
        loaded = load_model(dconfig, d.layout, mesh)
        params = loaded.params
        logger.info("speculative decoding: draft model %s, %.2f GiB of weights", d.source,
                    loaded.weight_bytes / 2**30)
        # (its model as loaded: on CPU a bf16 draft computes in float32, loader.py)
        return DrafterParts(d.method, loaded.model, params, d.cache_config, d.cache_specs,
                            d.kv_dtype)
    return DrafterParts(d.method, d.model, params, d.cache_config, d.cache_specs, d.kv_dtype)


def _mtp(config: EngineConfig, layout: EngineLayout) -> DrafterModel:
    mc = layout.model_config
    spec = config.speculative_config
    if spec.model not in (None, config.model):
        raise ValueError(f"speculative_config model={spec.model!r}: method 'mtp' uses the "
                         f"target checkpoint's own MTP layer (leave model out)")
    try:
        mtp_config(mc)
    except ValueError as e:
        raise ValueError(f"speculative_config method 'mtp': {e}") from None
    # Its KV in the model dtype: a quantized cache's scales are the target's, per layer.
    kv_dtype = layout.dtype if is_quantized(layout.kv_dtype) else layout.kv_dtype
    run = replace(mtp_config(layout.run_config), kv_cache_quantized=False)
    dtype = layout.compute_dtype   # as the target computes (float32 on CPU for bf16)
    model = MTPHead(run, get_model_class(mc.architecture), dtype, layout.attention_backend)
    return DrafterModel(MTP, model, run,
                        layer_cache_specs(run, kv_dtype=kv_dtype, conv_state_dtype=dtype),
                        kv_dtype, layout, config.model)


def _draft_config(config: EngineConfig, path: str, layout: EngineLayout) -> EngineConfig:
    # Expert parallel for the target: the draft's experts too; a dense draft has none.
    is_moe = load_model_config(path).num_experts > 0
    return replace(config, model=path, tokenizer=None, speculative_config=None,
                   max_model_len=layout.max_model_len,
                   enable_expert_parallel=config.enable_expert_parallel and is_moe)


def _draft_model(config: EngineConfig, layout: EngineLayout, platform: str,
                 check_kernels: bool) -> DrafterModel:
    spec = config.speculative_config
    path = resolve_model(spec.model, load_format=config.load_format,
                         download_dir=config.download_dir)
    draft = load_model_config(path)
    target = layout.model_config
    what = f"speculative_config model={spec.model!r}"
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"{what}: its vocabulary has {draft.vocab_size} tokens, the target's "
                         f"{target.vocab_size}; a draft model must share the target's tokenizer")
    if draft.linear_attention_layers or draft.has_sliding_layers or draft.num_kv_shared_layers:
        raise ValueError(f"{what} ({draft.architecture}): a draft model must have full "
                         f"attention in every layer (no recurrent state, sliding window or "
                         f"shared KV); its KV rides on the target's pages")
    if draft.max_position_embeddings < layout.max_model_len:
        raise ValueError(f"{what}: max_position_embeddings={draft.max_position_embeddings} is "
                         f"shorter than max_model_len={layout.max_model_len}; lower "
                         f"--max-model-len")
    dlayout = layout_for(_draft_config(config, path, layout), draft, platform,
                         layout.model_axis, check_kernels=check_kernels)
    return DrafterModel(DRAFT_MODEL, build_layout_model(dlayout), dlayout.run_config,
                        dlayout.cache_specs, dlayout.kv_dtype, dlayout, path)
