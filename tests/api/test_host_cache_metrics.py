"""The host tier's metrics (--kv-offloading-size): vLLM's external_prefix_cache counters
and jaxserve's bytes, restore time, transfer-time histogram and usage on /metrics only when
there is a tier, the stats line's external hit rate, and data-parallel replicas' tiers
summed."""
from __future__ import annotations

from jaxserve.api.metrics import Metrics
from jaxserve.api.stats_logger import stats_line
from jaxserve.core.host_cache import RESTORE_TIME_BUCKETS, HostCacheStats
from jaxserve.core.scheduler_stats import SchedulerStats
from jaxserve.engine.async_engine import EngineStats
from tests.api.test_metrics_vllm import samples, value

HOST = HostCacheStats(queries=400, hits=96, pages_offloaded=10, pages_restored=6,
                      states_offloaded=2, states_restored=1, bytes_offloaded=5000,
                      bytes_restored=3000, num_pages=10, capacity=40, restore_seconds=0.25,
                      restore_time_buckets=(0, 2, 1) + (0,) * (len(RESTORE_TIME_BUCKETS) - 3)
                      + (1,), restore_time_sum=7.5)


def test_no_host_metrics_without_a_host_tier():
    text = Metrics("m").render(EngineStats(prefix_cache_queries=9), admitted=0).decode()
    assert "external_prefix_cache" not in text and "host_cache" not in text
    assert "External" not in stats_line(SchedulerStats(), 0.0, 0.0)


def test_host_metrics_follow_the_engine_totals():
    metrics = Metrics("m")
    snap = samples(metrics.render(EngineStats(host=HOST), admitted=0).decode())
    assert value(snap, "vllm:external_prefix_cache_queries_total") == 400
    assert value(snap, "vllm:external_prefix_cache_hits_total") == 96
    assert value(snap, "jaxserve:host_cache_offloaded_bytes_total") == 5000
    assert value(snap, "jaxserve:host_cache_restored_bytes_total") == 3000
    assert value(snap, "jaxserve:host_cache_restore_seconds_total") == 0.25
    assert value(snap, "jaxserve:host_cache_usage_perc") == 0.25
    later = HostCacheStats(queries=500, hits=196, bytes_offloaded=5000, bytes_restored=4000,
                           num_pages=20, capacity=40, restore_seconds=0.5)
    snap = samples(metrics.render(EngineStats(host=later), admitted=0).decode())
    assert value(snap, "vllm:external_prefix_cache_hits_total") == 196
    assert value(snap, "jaxserve:host_cache_restored_bytes_total") == 4000
    assert value(snap, "jaxserve:host_cache_usage_perc") == 0.5


def test_restore_transfer_times_are_a_histogram():
    """The engine's bucket counts as a Prometheus histogram: cumulative buckets, count and
    sum as they stand; absent without a tier."""
    name = "jaxserve:host_cache_restore_transfer_seconds"
    assert name not in Metrics("m").render(EngineStats(), admitted=0).decode()
    metrics = Metrics("m")
    snap = samples(metrics.render(EngineStats(host=HOST), admitted=0).decode())
    le = {b: value(snap, name + "_bucket", le=str(b)) for b in RESTORE_TIME_BUCKETS}
    assert le[RESTORE_TIME_BUCKETS[0]] == 0 and le[RESTORE_TIME_BUCKETS[1]] == 2
    assert le[RESTORE_TIME_BUCKETS[2]] == 3 and le[RESTORE_TIME_BUCKETS[-1]] == 3
    assert value(snap, name + "_bucket", le="+Inf") == 4 == value(snap, name + "_count")
    assert value(snap, name + "_sum") == 7.5
    # a snapshot from before any restore was timed leaves the histogram as it was
    snap = samples(metrics.render(EngineStats(host=HostCacheStats(capacity=40)),
                                  admitted=0).decode())
    assert value(snap, name + "_count") == 4


def test_a_sliding_window_index_has_its_own_page_counts_and_usage():
    """Gemma 4's sliding pages (HostCache.sliding): their counters and usage beside the
    tier's, only when the tier has such an index."""
    assert "sliding" not in Metrics("m").render(EngineStats(host=HOST), admitted=0).decode()
    metrics = Metrics("m")
    host = HostCacheStats(sliding_pages_offloaded=7, sliding_pages_restored=3,
                          sliding_num_pages=5, sliding_capacity=20, capacity=40)
    snap = samples(metrics.render(EngineStats(host=host), admitted=0).decode())
    assert value(snap, "jaxserve:host_cache_sliding_offloaded_pages_total") == 7
    assert value(snap, "jaxserve:host_cache_sliding_restored_pages_total") == 3
    assert value(snap, "jaxserve:host_cache_sliding_usage_perc") == 0.25
    later = HostCacheStats(sliding_pages_offloaded=9, sliding_pages_restored=3,
                           sliding_num_pages=10, sliding_capacity=20, capacity=40)
    snap = samples(metrics.render(EngineStats(host=later), admitted=0).decode())
    assert value(snap, "jaxserve:host_cache_sliding_offloaded_pages_total") == 9
    assert value(snap, "jaxserve:host_cache_sliding_usage_perc") == 0.5


def test_a_hybrids_state_index_has_its_usage():
    """A hybrid's host state slots (HostCache.states): their usage beside the pages', only
    when the tier has them; replicas' slots are summed."""
    assert "state_usage" not in Metrics("m").render(EngineStats(host=HOST),
                                                    admitted=0).decode()
    host = HostCacheStats(states_offloaded=4, state_num_slots=3, state_capacity=12,
                          capacity=40)
    snap = samples(Metrics("m").render(EngineStats(host=host), admitted=0).decode())
    assert value(snap, "jaxserve:host_cache_state_usage_perc") == 0.25
    merged = SchedulerStats.merge([SchedulerStats(host=host), SchedulerStats(host=host)])
    assert (merged.host.state_num_slots, merged.host.state_capacity) == (6, 24)


def test_the_stats_line_shows_the_external_hit_rate():
    line = stats_line(SchedulerStats(prefix_cache_queries=400, prefix_cache_hits=100,
                                     host=HOST), 1.0, 2.0)
    assert line.endswith("Prefix cache hit rate: 25.0%, External prefix cache hit rate: 24.0%")


def test_replicas_tiers_are_summed():
    merged = SchedulerStats.merge([SchedulerStats(host=HOST), SchedulerStats(host=HOST),
                                   SchedulerStats()])
    assert merged.host.hits == 192 and merged.host.capacity == 80
    assert merged.host.restore_seconds == 0.5
    assert merged.host.restore_time_buckets == tuple(2 * n for n in HOST.restore_time_buckets)
    assert merged.host.restore_time_sum == 15.0
    assert SchedulerStats.merge([SchedulerStats(), SchedulerStats()]).host is None
