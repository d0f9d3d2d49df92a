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

from jax.sharding import Mesh

from jaxserve.checkpoints.model_names import resolve_model
from jaxserve.planning.plan import load_model_config
from jaxserve.config import EngineConfig
from jaxserve.engine.layout import (EngineLayout, build_layout_model, engine_layout,
                                    layout_param_shardings)
from jaxserve.engine.loader import load_model
from jaxserve.planning.cache_plan import CachePlan
from jaxserve.runner.drafter import ModelDrafter
from jaxserve.speculative import DRAFT_MODEL, MTP, NGRAM
from models.cache_spec import CacheSpec, layer_cache_specs
from models.mtp import MTP_PREFIX, MTPHead, mtp_config
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
              target_model, mesh: Mesh, abstract: bool = False) -> ModelDrafter:
        return ModelDrafter(
            method=self.method, model=self.model, params=self.params, target_model=target_model,
            cache_config=self.cache_config, mesh=mesh, num_pages=plan.num_pages,
            page_size=plan.page_size, kv_dtype=self.kv_dtype, max_num_seqs=config.max_num_seqs,
            pages_per_req=-(-layout.max_model_len // plan.page_size),
            num_speculative_tokens=config.speculative_config.num_speculative_tokens,
            abstract=abstract)


def load_drafter(config: EngineConfig, layout: EngineLayout, mesh: Mesh,
                 target_model, *, abstract: bool = False) -> DrafterParts | None:
    """The drafter's parts, or None (no speculation, or ngram). ValueError for a drafter
    that cannot serve this target, naming why. abstract: its params as placed
    ShapeDtypeStructs (nothing read; `python -m jaxserve.plan --compile`)."""
    spec = config.speculative_config
    if spec is None or spec.method == NGRAM:
        return None
    if spec.draft_tensor_parallel_size not in (None, layout.model_axis):
        raise ValueError(f"speculative_config draft_tensor_parallel_size="
                         f"{spec.draft_tensor_parallel_size}: the drafter runs on the target's "
                         f"mesh, tensor parallel over {layout.model_axis} (leave it out)")
    return _load_mtp(config, layout, mesh, target_model, abstract) if spec.method == MTP \
        else _load_draft_model(config, layout, mesh, abstract)


def _load_mtp(config: EngineConfig, layout: EngineLayout, mesh: Mesh, target_model,
              abstract: bool) -> DrafterParts:
    mc = layout.model_config
    spec = config.speculative_config
    if spec.model not in (None, config.model):
        raise ValueError(f"speculative_config model={spec.model!r}: method 'mtp' uses the "
                         f"target checkpoint's own MTP layer (leave model out)")
    try:
        published = mtp_config(mc)
    except ValueError as e:
        raise ValueError(f"speculative_config method 'mtp': {e}") from None
    # Its KV in the model dtype: a quantized cache's scales are the target's, per layer.
    kv_dtype = layout.dtype if is_quantized(layout.kv_dtype) else layout.kv_dtype
    run = replace(mtp_config(layout.run_config), kv_cache_quantized=False)
    dtype = layout.compute_dtype   # as the target computes (float32 on CPU for bf16)
    model = MTPHead(run, type(target_model), dtype, layout.attention_backend)
    shardings = layout_param_shardings(model, mesh, layout)
    params = placed_abstract_params(model, dtype, shardings) if abstract else \
        load_params(config.model, published, model, dtype,
                    load_format=config.load_format, seed=config.seed + 1, shardings=shardings,
                    kv_head_repeat=kv_head_repeats(mc, layout.model_axis), prefix=MTP_PREFIX)
    if not abstract:
        logger.info("speculative decoding: the MTP layer, %.1f MiB of weights",
                    param_bytes(params) / 2**20)
    return DrafterParts(MTP, model, params, run,
                        layer_cache_specs(run, kv_dtype=kv_dtype, conv_state_dtype=dtype),
                        kv_dtype)


def _load_draft_model(config: EngineConfig, layout: EngineLayout, mesh: Mesh,
                      abstract: bool) -> DrafterParts:
    spec = config.speculative_config
    path = resolve_model(spec.model, load_format=config.load_format,
                         download_dir=config.download_dir)
    draft = load_model_config(path)
    target = layout.model_config
    what = f"speculative_config model={spec.model!r}"
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"{what}: its vocabulary has {draft.vocab_size} tokens, the target's "
                         f"{target.vocab_size}; a draft model must share the target's tokenizer")
    if draft.is_hybrid or draft.has_sliding_layers or draft.num_kv_shared_layers:
        raise ValueError(f"{what} ({draft.architecture}): a draft model must have full "
                         f"attention in every layer (no recurrent state, sliding window or "
                         f"shared KV); its KV rides on the target's pages")
    if draft.max_position_embeddings < layout.max_model_len:
        raise ValueError(f"{what}: max_position_embeddings={draft.max_position_embeddings} is "
                         f"shorter than max_model_len={layout.max_model_len}; lower "
                         f"--max-model-len")
    dconfig = replace(config, model=path, tokenizer=None, speculative_config=None,
                      max_model_len=layout.max_model_len)
    dlayout = engine_layout(dconfig, draft, mesh)
    if abstract:
        model = build_layout_model(dlayout)
        params = placed_abstract_params(model, dlayout.dtype,
                                        layout_param_shardings(model, mesh, dlayout))
    else:
        loaded = load_model(dconfig, dlayout, mesh)
        model, params = loaded.model, loaded.params
        logger.info("speculative decoding: draft model %s, %.2f GiB of weights", path,
                    loaded.weight_bytes / 2**30)
    return DrafterParts(DRAFT_MODEL, model, params, dlayout.run_config,
                        dlayout.cache_specs, dlayout.kv_dtype)

