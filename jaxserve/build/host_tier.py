"""The prefix cache's host tier at build time (--kv-offloading-size; docs/TIERED_CACHE.md):
what it is refused with, its arrays on the runner, and the scheduler's share of it (slot
counts, slot bytes, the restore-or-recompute cost model).

The cost model, measured at start-up where warmup runs: a restore's cost from one timed
restore call (HostTier.warmup; every call moves pages_per_call pages, padding included,
so a restore costs a whole call, and a call more per pages_per_call pages), a prefill's
per token from the largest token bucket's forward (timed as warmup runs it anyway), and
attention's quadratic part per (query, key) pair from that forward run again over a
long context (RunnerWarmup._time_attention). Without warmup (enforce_eager), or where the
attention timing came out at noise level, they are nominal, per platform (NOMINAL: a
host->device bandwidth and a copy's fixed latency; 2 FLOPs per parameter per token, and
4 * layers * heads * head_dim per pair, over a nominal throughput). The model only
decides which short prefixes are recomputed rather than restored.
"""
from __future__ import annotations

from typing import Any

import jax

from jaxserve.build.cache_plan import CachePlan
from jaxserve.build.kv_budget import available_host_bytes
from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError
from jaxserve.core.restore_cost import RestoreCost
from jaxserve.runner.host_tier import HostTier
from jaxserve.runner.model_runner import ModelRunner
from sharding.mesh import parse_mesh

FLAG = "--kv-offloading-size"
GIB = 2**30
# platform -> (host->device bytes/s, fixed seconds per restore, model FLOP/s)
NOMINAL = {"cpu": (10e9, 50e-6, 2e11), "gpu": (25e9, 50e-6, 4e14), "tpu": (16e9, 50e-6, 4e14)}


def check_host_tier(config: EngineConfig, plan: CachePlan) -> None:
    """ConfigError naming the flag where this engine cannot keep a host tier."""
    why = None
    replicas = parse_mesh(config.mesh or "1x1")[0]   # each holds a tier of this size
    if not config.enable_prefix_caching:
        why = "the host tier is a second tier of the prefix cache: --enable-prefix-caching"
    elif replicas * config.kv_offloading_bytes > available_host_bytes():
        # (numpy's zeroed pools take their memory as they fill: counted up front here)
        why = (f"{replicas} replica(s) x {config.kv_offloading_size} GiB is more than the "
               f"host's available memory ({available_host_bytes() / GIB:.1f} GiB)")
    if why is not None:
        raise ConfigError("kv_offloading_size", f"{FLAG} {config.kv_offloading_size}: {why}")


def attach_host_tier(config: EngineConfig, runner: ModelRunner) -> HostTier:
    try:
        return runner.attach_host_tier(config.kv_offloading_bytes)
    except ValueError as e:
        raise ConfigError("kv_offloading_size", f"{FLAG} {config.kv_offloading_size}: "
                          f"{e}") from None


def restore_cost(tier: HostTier, plan: CachePlan, params: Any, mc: Any, platform: str,
                 prefill_s_per_token: float = 0.0, attention_s_per_pair: float = 0.0,
                 drafter_params: Any = None) -> RestoreCost:
    """Restore or recompute (see the module docstring); prefill_s_per_token and
    attention_s_per_pair: measured (the runner's warmup), 0: nominal. drafter_params: a
    model drafter's, whose KV a restore brings back too (the page bytes count it) and a
    recompute computes again: a prefill costs its share of the parameters more."""
    bandwidth, latency, flops = NOMINAL.get(platform, NOMINAL["gpu"])
    count = lambda tree: sum(x.size for x in jax.tree_util.tree_leaves(tree))
    num_params = count(params)
    prefill = (prefill_s_per_token or 2 * num_params / flops) * \
        (1 + count(drafter_params) / num_params)
    layout = tier.layout
    pair_flops = 4 * len(mc.full_attention_layers) * mc.num_heads * mc.head_dim
    # A restore's fixed part: a hybrid's state, or a sliding group's window of pages.
    fixed = layout.state_bytes + plan.sliding_pages_per_seq * layout.sliding_page_bytes
    if tier.restore_call_s > 0:   # measured: they ride in its first call
        fixed, latency = 0, tier.restore_call_s
        bandwidth = tier.copier.pages_per_call * layout.page_bytes / tier.restore_call_s
    return RestoreCost(bytes_per_token=layout.page_bytes / plan.page_size,
                       bandwidth_bytes_per_s=bandwidth, prefill_s_per_token=prefill,
                       attention_s_per_pair=attention_s_per_pair or pair_flops / flops,
                       latency_s=latency,
                       state_bytes=fixed)


def describe_cost(tier: HostTier, cost: RestoreCost, plan: CachePlan,
                  attention_measured: bool = False) -> str:
    """The start-up log's line on the cost model."""
    where = "nominal" if not tier.restore_call_s else (
        f"measured: a call of {tier.copier.pages_per_call} pages "
        f"({tier.copier.pages_per_call * tier.layout.page_bytes / 2**20:.2f} MiB) in "
        f"{tier.restore_call_s * 1e3:.2f} ms")
    even = cost.break_even_tokens(plan.max_model_len)
    return (f"host tier restores: {cost.bandwidth_bytes_per_s / 1e9:.2f} GB/s, "
            f"{cost.latency_s * 1e3:.3f} ms per restore ({where}); prefill "
            f"{cost.prefill_s_per_token * 1e6:.2f} us per token, attention "
            f"{cost.attention_s_per_pair * 1e9:.3f} ns per pair of tokens "
            f"({'measured' if attention_measured else 'nominal'}); "
            + ("host hits are always recomputed" if even is None else
               "every host hit is restored" if even <= 1 else
               f"host hits under {even} tokens are recomputed"))


def host_tier_slice(tier: HostTier, plan: CachePlan, cost: RestoreCost) -> dict[str, Any]:
    """SchedulerConfig's host-tier fields."""
    layout = tier.layout
    return dict(num_host_pages=tier.arrays.num_slots,
                num_host_state_slots=tier.arrays.num_state_slots,
                num_host_sliding_pages=tier.arrays.num_sliding_slots,
                host_page_bytes=layout.page_bytes, host_state_bytes=layout.state_bytes,
                host_sliding_page_bytes=layout.sliding_page_bytes, restore_cost=cost)


def describe(tier: HostTier, plan: CachePlan) -> str:
    """The start-up log's line (and the planner's)."""
    pages = tier.arrays.num_slots - 1
    states = tier.arrays.num_state_slots - 1 if tier.arrays.num_state_slots else 0
    total = sum(a.nbytes for a in tier.arrays.arrays.values())
    snaps = f", {states} state snapshots" if states > 0 else ""
    if tier.arrays.num_sliding_slots:
        snaps += f", {tier.arrays.num_sliding_slots - 1} sliding-window pages"
    return (f"host tier: {total / GIB:.2f} GiB, {pages} pages "
            f"({pages * plan.page_size} tokens){snaps}")
