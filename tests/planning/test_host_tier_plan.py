"""The planner's line for the prefix cache's host tier (--kv-offloading-size): the pages
and snapshots its memory holds (whole pages: every KV head), as core/host_pages sizes
them, and a sliding-window model's sliding pages in slots of their own."""
from __future__ import annotations

from jaxserve.core.host_pages import size_host_tier, size_sliding_host_tier, sliding_per_page
from jaxserve.checkpoints.model_names import load_model_config
from jaxserve.planning.plan import make_plan
from jaxserve.planning.plan_format import format_plan


def plan(alias: str, **engine):
    mc = load_model_config(alias)
    return make_plan(mc, model=alias, mesh="1x2", hbm_bytes=80 * 2**30, **engine)


def test_no_host_tier_line_without_the_flag():
    assert "host tier" not in format_plan(plan("qwen3-8b"))


def test_the_host_tier_line_counts_whole_pages_and_snapshots():
    for alias in ("qwen3-8b", "qwen3.6-27b"):
        p = plan(alias, kv_offloading_size=64)
        assert p.host_tier_bytes == 64 * 2**30
        page_bytes = p.kv_bytes_per_token_per_device * 2 * p.cache.page_size
        state = p.state_bytes_per_seq if p.has_state else 0
        pages, states = size_host_tier(64 * 2**30, page_bytes, state)
        line = next(ln for ln in format_plan(p).splitlines() if "host tier" in ln)
        assert f"{pages - 1:,} pages ({(pages - 1) * 16:,} tokens)" in line, line
        assert (f"{states - 1:,} state snapshots" in line) == p.has_state, line


def test_sliding_window_models_count_their_sliding_pages_apart():
    p = plan("gemma-4-31b", kv_offloading_size=8)
    c = p.cache
    per = sliding_per_page(c.bytes_per_page, c.bytes_per_sliding_page)
    pages, _, sliding = size_sliding_host_tier(8 * 2**30, c.bytes_per_page * 2,
                                               c.bytes_per_sliding_page * 2, per)
    assert 2 <= sliding < pages   # a sliding page weighs more than a global one
    assert sliding * c.bytes_per_sliding_page <= pages * c.bytes_per_page
    line = next(ln for ln in format_plan(p).splitlines() if "host tier" in ln)
    assert f"{pages - 1:,} pages" in line and f"{sliding - 1:,} sliding-window pages" in line, \
        line


def test_a_model_drafters_kv_goes_with_the_pages():
    """An MTP layer's KV is on the target's pages (the cache plan counts it in each page):
    the host tier holds fewer pages of the heavier size."""
    mtp = {"method": "mtp", "num_speculative_tokens": 3}
    alone = plan("qwen3.6-27b", kv_offloading_size=64)
    drafting = plan("qwen3.6-27b", kv_offloading_size=64, speculative_config=mtp)
    assert drafting.cache.bytes_per_page > alone.cache.bytes_per_page
    pages, _ = size_host_tier(64 * 2**30, drafting.cache.bytes_per_page * 2,
                              drafting.state_bytes_per_seq)
    line = next(ln for ln in format_plan(drafting).splitlines() if "host tier" in ln)
    assert f" {pages - 1:,} pages" in line and f" {pages - 1:,} pages" not in \
        next(ln for ln in format_plan(alone).splitlines() if "host tier" in ln), line
