"""The cache plan of a model with sliding-window layers (Gemma 4): the sliding layers get
a KV group sized for max_num_seqs windows and one step, taken from the budget first; the
global group gets the rest; the engine's layout, the planner and its printout agree."""
from __future__ import annotations

import json
from dataclasses import replace

import jax
import pytest

from jaxserve.config import EngineConfig
from jaxserve.build.layout import engine_layout, layout_cache_plan
from jaxserve.build.cache_plan import plan_caches
from jaxserve.planning.plan import WeightFigures, make_plan
from jaxserve.planning.plan_format import format_plan
from models.cache_spec import PagedKVSpec, RecurrentStateSpec, SharedKVSpec
from models.config import ModelConfig
from models.gemma4_config import gemma4_fields
from sharding import make_mesh

GLOBAL = PagedKVSpec(num_kv_heads=2, head_dim=16, dtype="float32")
SLIDING = PagedKVSpec(num_kv_heads=4, head_dim=8, dtype="float32", sliding_window=10)


def test_sliding_group_sizing_and_budget_order():
    # W = 10, ps = 4: a window spans ceil(9 / 4) + 1 = 4 pages.
    specs = [SLIDING, SLIDING, GLOBAL, SharedKVSpec(1), SharedKVSpec(2)]
    kw = dict(model_axis=2, page_size=4, max_num_seqs=3, max_model_len=400,
              max_num_batched_tokens=16)
    plan = plan_caches(specs, budget_bytes=200_000, **kw)
    per_page = 2 * 2 * 16 * 4 * 4 // 2                 # the global layer only
    per_sliding = 2 * (2 * 4 * 8 * 4) * 4 // 2         # both sliding layers; shared: none
    sliding = 3 * 4 + 16 // 4 + 3 + 1                  # windows + step + straddles + null
    assert (plan.bytes_per_page, plan.bytes_per_sliding_page) == (per_page, per_sliding)
    assert (plan.num_kv_layers, plan.num_sliding_layers, plan.sliding_window) == (1, 2, 10)
    assert plan.num_sliding_pages == sliding == 20
    assert plan.num_pages == (200_000 - sliding * per_sliding) // per_page
    assert plan.kv_bytes == plan.num_pages * per_page + sliding * per_sliding
    assert plan.total_bytes <= 200_000 < plan.total_bytes + per_page
    assert plan.sliding_pages_per_seq == 4
    # Global-group facts stay about the global group.
    assert plan.kv_tokens == (plan.num_pages - 1) * 4 and plan.fits_one_sequence()
    # Given pages are the global group's; the sliding group is sized the same way.
    given = plan_caches(specs, num_pages=50, **kw)
    assert (given.num_pages, given.num_sliding_pages) == (50, sliding)
    # Never more sliding pages than max_num_seqs full-length sequences need.
    short = plan_caches(specs, num_pages=50, **{**kw, "max_model_len": 12})
    assert short.num_sliding_pages == 3 * 3 + 1
    # Recurrent state first, then the sliding pages, then the global ones.
    state = RecurrentStateSpec(shapes=((5,),), dtypes=("float32",))
    mixed = plan_caches([state, *specs], budget_bytes=200_000, **kw)
    assert mixed.num_pages == (200_000 - 4 * 10 - sliding * per_sliding) // per_page
    # No sliding layers: no sliding group, and the plan is as before.
    plain = plan_caches([GLOBAL, SharedKVSpec(0)], budget_bytes=200_000, **kw)
    assert (plain.num_sliding_pages, plain.sliding_window, plain.kv_bytes) == \
        (0, None, plain.num_pages * per_page)
    assert plain.num_pages == 200_000 // per_page


def test_describe_shows_both_groups():
    wide = replace(GLOBAL, head_dim=32)   # 0.5 KiB a token, the sliding layer 0.25
    kw = dict(model_axis=1, page_size=4, max_num_seqs=3, max_model_len=400,
              max_num_batched_tokens=16)
    text = plan_caches([SLIDING, wide], num_pages=101, **kw).describe()
    assert text.startswith("KV cache: 100 pages x 4 tokens = 400 tokens in 1 global layers "
                           "(0.5 KiB/token, ")
    assert "sliding-window KV (window 10): 19 pages x 1 layers (0.2 KiB/token, " in text
    assert "at most 4 pages per sequence between steps" in text
    # The same KV memory, a page per token in every layer: (101 x 2 + 20 x 1) KiB in
    # pages of 3 KiB = 74, less the null page.
    assert "(a page per token there: 292 tokens in this memory)" in text
    plain = plan_caches([GLOBAL], num_pages=101, **kw).describe()
    assert "sliding" not in plain and "in 1 layers (0.00 GiB" in plain


def gemma_config(**over) -> ModelConfig:
    d = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "global_head_dim": 32, "sliding_window": 64,
         "max_position_embeddings": 4096, "num_kv_shared_layers": 2, **over}
    return ModelConfig(**gemma4_fields("Gemma4ForCausalLM", d, d))


def test_the_planner_and_the_engine_make_the_same_sliding_plan():
    mc = gemma_config()
    engine = dict(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=64)
    config = EngineConfig(model="unused", dtype="float32", kv_cache_memory_bytes=4 << 20,
                          page_size=16, **engine)
    layout = engine_layout(config, mc, make_mesh("1x1", jax.devices()[:1]))
    plan = layout_cache_plan(config, layout, None)
    # Layers 0-4 and 6 are sliding (5 and 7 global), 6 and 7 share 4's and 5's KV.
    assert (plan.num_kv_layers, plan.num_sliding_layers) == (1, 5)
    assert plan.num_sliding_pages == 4 * (-(-63 // 16) + 1) + 64 // 16 + 4 + 1
    weights = WeightFigures(10**6, 4 * 10**6, 4 * 10**6, 0)
    p = make_plan(mc, model="g", mesh="1x1", dtype="float32", weights=weights,
                  kv_cache_memory_bytes=4 << 20, **engine)
    assert p.cache == plan
    assert (p.full_attention_layers, p.sliding_attention_layers, p.kv_shared_layers) == (1, 5, 2)
    assert p.kv_bytes_per_token_per_device == 2 * 2 * 32 * 4        # the global layer
    assert p.sliding_kv_bytes_per_token_per_device == 5 * 2 * 2 * 16 * 4
    text = format_plan(p)
    assert "8: 1 global attention (KV of every token), 5 sliding-window attention (KV of " \
           "the last 64 tokens), 2 reading an earlier layer's KV" in text
    assert (f"  sliding-window KV pages    {plan.num_sliding_pages - 1:,} x 16 tokens (+ the "
            f"null page) x 5 layers") in text
    assert "at most 5 pages kept per sequence" in text
    assert f"would hold {plan.full_history_kv_tokens:,} tokens, not {plan.kv_tokens:,}" in text
    assert f"  KV pages per replica       {plan.num_pages - 1:,} x 16 tokens" in text
    js = json.loads(json.dumps(p.to_json()))
    assert js["cache"]["num_sliding_pages"] == plan.num_sliding_pages
    assert js["sliding_pages_per_seq"] == 5 and js["sliding_window"] == 64
    assert js["full_history_kv_tokens"] == plan.full_history_kv_tokens < plan.kv_tokens


@pytest.mark.parametrize("window", [1, 16, 17])
def test_sliding_pages_cover_a_lone_request(window):
    """The planned group always holds one request's window and a full step, so the
    scheduler accepts it (it refuses a pool that could loop on preemption)."""
    from jaxserve.core.scheduler import Scheduler, SchedulerConfig
    spec = replace(SLIDING, sliding_window=window)
    plan = plan_caches([spec, GLOBAL], num_pages=200, model_axis=1, page_size=16,
                       max_num_seqs=1, max_model_len=2048, max_num_batched_tokens=64)
    Scheduler(SchedulerConfig(
        num_pages=plan.num_pages, page_size=16, max_num_seqs=1, max_num_batched_tokens=64,
        max_model_len=2048, num_sliding_pages=plan.num_sliding_pages,
        sliding_window=plan.sliding_window))
    with pytest.raises(ValueError, match="num_sliding_pages"):
        Scheduler(SchedulerConfig(
            num_pages=plan.num_pages, page_size=16, max_num_seqs=1, max_num_batched_tokens=64,
            max_model_len=2048, num_sliding_pages=plan.num_sliding_pages - 2,
            sliding_window=plan.sliding_window))
