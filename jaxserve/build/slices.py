"""The typed slices of the engine's settings each part takes, derived once from
EngineConfig, the layout and the CachePlan (one place unpacks the config for the doors)."""
from __future__ import annotations

from jaxserve.build.cache_plan import CachePlan
from jaxserve.build.layout import EngineLayout
from jaxserve.config import EngineConfig
from jaxserve.core.scheduler_config import SchedulerConfig
from jaxserve.runner.image_encoder import VisionParts
from jaxserve.runner.runner_config import RunnerConfig
from jaxserve.sampling_params import logprobs_limit
from jaxserve.config.speculative import MTP


def scheduler_config(config: EngineConfig, layout: EngineLayout, plan: CachePlan,
                     vision: VisionParts | None = None) -> SchedulerConfig:
    spec = config.speculative_config
    return SchedulerConfig(
        num_pages=plan.num_pages, page_size=plan.page_size, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.num_batched_tokens, max_model_len=layout.max_model_len,
        enable_prefix_caching=config.enable_prefix_caching, policy=config.scheduling_policy,
        num_state_slots=plan.num_state_slots, num_snapshot_slots=plan.num_snapshot_slots,
        num_sliding_pages=plan.num_sliding_pages, sliding_window=plan.sliding_window,
        num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
        num_lookahead_tokens=spec.num_lookahead_tokens if spec else 0,
        drop_last_hit_page=spec is not None and spec.method == MTP,
        max_loras=config.max_loras if config.enable_lora else 0,
        encoder_cache_rows=vision.num_rows if vision else 0,
        encoder_budget=vision.budget if vision else 0,
        whole_images=bool(vision) and layout.model_config.image_attention_both_ways)


def runner_config(config: EngineConfig, layout: EngineLayout, plan: CachePlan) -> RunnerConfig:
    vocab_size = layout.model_config.vocab_size
    return RunnerConfig(
        vocab_size=vocab_size,
        # The snapshot slots follow the running requests' in the same state arrays.
        num_state_slots=plan.num_state_slots + plan.num_snapshot_slots,
        num_pages=plan.num_pages, num_sliding_pages=plan.num_sliding_pages,
        page_size=plan.page_size, max_num_seqs=config.max_num_seqs,
        max_model_len=layout.max_model_len, max_num_batched_tokens=config.num_batched_tokens,
        kv_dtype=layout.kv_dtype,
        # Only the reference reads whole page-table rows; the others stop at kv_len.
        context_buckets=layout.attention_backend == "reference",
        vocab_axis=layout.rules["vocab"],
        max_logprobs=logprobs_limit(config.max_logprobs, vocab_size),
        speculative_config=config.speculative_config)
