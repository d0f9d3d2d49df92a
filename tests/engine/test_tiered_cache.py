"""The prefix cache's host tier (--kv-offloading-size) on a multi-turn trace whose
conversations need several times the device pool (--num-gpu-blocks-override): greedy
tokens are those of the same engine without the tier, the later turns hit pages the host
tier kept (its metrics say so), a restore's rows are sent the step before the request's
first forward and scattered in that forward's step, preemption, an abort while the step's
copies are in flight or between a send and its scatter, and a failed send or scatter leak
nothing, and nothing compiles after warmup. Llama, the Qwen3.5 hybrid (whose
state snapshots travel with their pages) and Gemma 4 (whose sliding-window pages come
back only as far as a hit's window needs); an int8 KV cache travels as stored."""
from __future__ import annotations

import random
import weakref

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.api.metrics import Metrics
from jaxserve.errors import ConfigError
from jaxserve.engine.async_engine import EngineStats
from jaxserve.engine.engine_core import prompt_page_hashes
from jaxserve.engine.llm_kwargs import engine_config
from jaxserve.runner.compile_counter import num_compilations
from jaxserve.runner.host_tier import DRAFT_KV, LOG_LENGTH
from models.layer_stack import KV
from tests.api.test_metrics_vllm import samples, value
from tests.engine.conftest import add, assert_no_leaks

PS, POOL = 16, 12        # device pool: 11 pages of 16 tokens (+ the null page)
CONVERSATIONS, TURNS = 8, 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SIZES = dict(dtype="float32", max_model_len=160, max_num_seqs=4, max_num_batched_tokens=64,
             page_size=PS, num_gpu_blocks_override=POOL, compilation_cache_dir=None)
# The engines without the tier only give the reference tokens: they skip warmup and compile
# the few programs greedy requests use (the tiered ones warm up: nothing compiles after).
PLAIN = dict(SIZES, enforce_eager=True)


def assert_tier_settled(llm: LLM) -> None:
    """No request left, every device page free, and the host tier has nothing in flight:
    no pin, every slot free or holding one entry."""
    assert_no_leaks(llm.engine)
    host = llm.engine.scheduler.kv.host
    if host is None:
        return
    assert not host.restored_in_flight
    for index in (i for i in (host.index, host.sliding, host.states) if i is not None):
        assert all(e.pins == 0 and e.ready for e in index._lru.values())
        assert index.num_free + len(index) == index.num_slots - 1
    if (pool := llm.engine.scheduler.kv.sliding_pool) is not None:
        assert pool.get_num_free_pages() == pool.num_pages - 1


@pytest.fixture(scope="module")
def llama_engines(checkpoint):
    """(engine without the tier, engine with it) for Llama, for the module."""
    path = checkpoint("llama")
    return LLM(path, **PLAIN), LLM(path, kv_offloading_size=0.02, **SIZES)


@pytest.fixture(scope="module")
def qwen3_5_engines(checkpoint):
    """The same for the Qwen3.5 hybrid."""
    path = checkpoint("qwen3_5")
    return LLM(path, **PLAIN), LLM(path, kv_offloading_size=0.02, **SIZES)


@pytest.fixture(scope="module", params=["llama", "qwen3_5", "gemma4"])
def engines(request, checkpoint):
    """(kind, engine without the tier, engine with it), for the module."""
    if request.param in ("llama", "qwen3_5"):
        return (request.param, *request.getfixturevalue(f"{request.param}_engines"))
    path = checkpoint(request.param)
    return request.param, LLM(path, **PLAIN), LLM(path, kv_offloading_size=0.02, **SIZES)


def trace(llm: LLM, conversations: int = CONVERSATIONS) -> tuple[list[list[int]], list[int]]:
    """`conversations` chats of TURNS turns, taken round-robin (every conversation's
    history is evicted from the device pool before its next turn): each turn sends the
    whole history, the answer and a new user message. -> tokens, cached tokens per turn."""
    rng = random.Random(0)
    history = [[rng.randrange(3, 250) for _ in range(30)] for _ in range(conversations)]
    tokens, cached = [], []
    for _ in range(TURNS):
        for i in range(conversations):
            out = llm.generate({"prompt_token_ids": history[i]}, GREEDY, use_tqdm=False)[0]
            tokens.append(out.outputs[0].token_ids)
            cached.append(out.num_cached_tokens)
            history[i] = history[i] + list(tokens[-1]) + [rng.randrange(3, 250)
                                                          for _ in range(20)]
    return tokens, cached


_REFERENCE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reference(plain: LLM) -> tuple[list[list[int]], list[int]]:
    """trace() on an engine without the tier, run once per engine (greedy: the same
    tokens every time; its cached tokens are its first run's)."""
    if plain not in _REFERENCE:
        _REFERENCE[plain] = trace(plain)
    return _REFERENCE[plain]


def test_the_trace_needs_several_times_the_device_pool():
    rng_len = 30 + (TURNS - 1) * 28 + 8   # a conversation's last length
    assert CONVERSATIONS * -(-rng_len // PS) >= 4 * (POOL - 1)


def test_a_trace_over_the_host_tier_gives_the_same_tokens_and_hits_it(engines):
    kind, plain, tiered = engines
    want, plain_cached = reference(plain)
    compiled = num_compilations()
    got, tier_cached = trace(tiered)
    assert got == want
    # The device pool alone keeps (almost) nothing between a conversation's turns.
    stats = tiered.engine.stats()
    assert stats.host is not None and stats.host.hits > 0
    assert stats.host.pages_offloaded > 0 and stats.host.pages_restored > 0
    host = tiered.engine.scheduler.kv.host
    runner = tiered.engine.runner   # restore or recompute by what warmup timed
    assert host.cost.latency_s == runner.host_tier.restore_call_s > 0
    assert host.cost.prefill_s_per_token == runner.prefill_s_per_token > 0
    # attention's pairs timed too (the largest forward over a long context, run again;
    # tests/runner/test_attention_timing.py times it), or nominal where noise hid them
    assert host.cost.attention_s_per_pair > 0 and runner.attention_s_per_pair >= 0
    if runner.attention_s_per_pair:
        assert host.cost.attention_s_per_pair == runner.attention_s_per_pair
    assert stats.host.bytes_restored == stats.host.pages_restored * host.page_bytes + \
        stats.host.states_restored * host.state_bytes + \
        stats.host.sliding_pages_restored * host.sliding_page_bytes
    if kind == "qwen3_5":   # hybrid: the state snapshots travel with their pages
        assert stats.host.states_offloaded > 0 and stats.host.states_restored > 0
    if kind == "gemma4":    # a hit's window of sliding pages, never more
        assert stats.host.sliding_pages_offloaded > 0 and stats.host.sliding_pages_restored > 0
        # the pages covering the W - 1 positions before a hit's end
        window = -(-(tiered.engine.scheduler.kv.sliding_window - 1) // PS)
        assert stats.host.sliding_pages_restored <= window * sum(c > 0 for c in tier_cached)
        assert stats.host.sliding_pages_restored < stats.host.pages_restored
        # ... and on /metrics, beside the tier's own
        snap = samples(Metrics("m").render(EngineStats(host=stats.host), admitted=0).decode())
        assert value(snap, "jaxserve:host_cache_sliding_restored_pages_total") == \
            stats.host.sliding_pages_restored
        assert 0 < value(snap, "jaxserve:host_cache_sliding_usage_perc") <= 1
    # Each send's transfer timed, in the stats and on /metrics as a histogram.
    tier = runner.host_tier
    assert tier.timer.wait_idle()
    timed = tiered.engine.stats().host
    sends = sum(what == "send" for _, what, _ in tier.log)
    count = sum(timed.restore_time_buckets)
    assert sends > 0 and (count == sends if len(tier.log) < LOG_LENGTH else count >= sends)
    assert count <= tier.num_dispatches and timed.restore_time_sum > 0
    snap = samples(Metrics("m").render(EngineStats(host=timed), admitted=0).decode())
    assert value(snap, "jaxserve:host_cache_restore_transfer_seconds_count") == count
    # num_cached_tokens counts hits from either tier; later turns hit the host's pages.
    assert sum(tier_cached) >= sum(plain_cached) + stats.host.hits
    assert all(c > 0 for c in tier_cached[CONVERSATIONS:])
    assert plain.engine.stats().host is None
    assert num_compilations() == compiled   # the copy programs were compiled at warmup
    assert_tier_settled(plain)
    assert_tier_settled(tiered)


def test_preemption_with_copies_in_the_same_steps(engines):
    """Four long conversations at once in 11 pages: requests preempt one another while
    pages go out to the host tier and come back."""
    _, plain, tiered = engines
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(60)]}
               for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    before = tiered.engine.stats()
    for _ in range(2):   # the second time over, hits come from the host tier
        got = [o.outputs[0].token_ids for o in tiered.generate(prompts, params,
                                                                use_tqdm=False)]
        assert got == want
    after = tiered.engine.stats()
    assert after.num_preemptions > before.num_preemptions
    assert after.host.pages_restored > before.host.pages_restored
    assert_tier_settled(tiered)


def test_an_abort_while_its_restore_is_in_flight_leaks_nothing(engines):
    """A request aborted between the dispatch of the step that restores its pages and
    that step's results: its pages and the host entries' pins all come back, and the
    next request over the same prefix still gets the right tokens."""
    _, plain, tiered = engines
    rng = random.Random(9)
    prompt = [rng.randrange(3, 250) for _ in range(70)]
    others = [[rng.randrange(3, 250) for _ in range(70)] for _ in range(3)]
    want = plain.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    # From empty caches (the device's snapshot slots keep the earlier tests' snapshots,
    # which may outweigh this prompt's before its pages leave the device).
    tiered.reset_prefix_cache()
    tiered.generate([{"prompt_token_ids": p} for p in [prompt, *others]], GREEDY,
                    use_tqdm=False)   # the prompt's pages are evicted to host by the others
    engine = tiered.engine
    add(engine, "x", prompt, GREEDY)
    step = engine.begin_step()
    copies = step.sched_out.host_copies
    assert copies is not None and copies.restore_slots   # its pages come from the host
    engine.abort_request("x")
    engine.finish_step(step)
    assert_tier_settled(tiered)
    again = tiered.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want.outputs[0].token_ids
    assert again.num_cached_tokens > 0
    assert_tier_settled(tiered)


def evicted_prompt(tiered: LLM, seed: int) -> list[int]:
    """A prompt whose pages the host tier holds and the device pool does not."""
    rng = random.Random(seed)
    prompt, *others = [[rng.randrange(3, 250) for _ in range(70)] for _ in range(4)]
    tiered.reset_prefix_cache()
    tiered.generate([{"prompt_token_ids": p} for p in [prompt, *others]], GREEDY,
                    use_tqdm=False)   # the prompt's pages are evicted to host by the others
    return prompt


def finish_outputs(engine) -> dict[str, object]:
    """Steps until every request is done -> each request's final output."""
    out = {}
    while engine.scheduler.has_unfinished_requests():
        out.update({o.request_id: o for o in engine.step() if o.finished})
    return out


def finish(engine) -> dict[str, list[int]]:
    """Steps until every request is done -> each finished request's tokens."""
    return {rid: o.outputs[0].token_ids for rid, o in finish_outputs(engine).items()}


def test_a_restore_is_sent_the_step_before_the_request_is_computed(engines):
    """The step that restores a request's pages sends their rows and computes nothing of
    it; the next scatters them into the pages before its forward, which computes the
    request's first chunk after the hit (the runner's record of its restores)."""
    _, plain, tiered = engines
    prompt = evicted_prompt(tiered, 11)
    want = plain.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    engine, tier = tiered.engine, tiered.engine.runner.host_tier
    compiled = num_compilations()
    add(engine, "x", prompt, GREEDY)
    first = engine.begin_step()
    pages = tuple(first.sched_out.host_copies.restore_pages)
    assert pages and not first.sched_out.new_reqs
    engine.finish_step(first)
    assert tier.log[-1] == (tier.num_dispatches, "send", pages)
    second = engine.begin_step()
    (new,) = second.sched_out.new_reqs
    assert new.req_id == "x" and new.num_computed_tokens >= len(pages) * PS
    assert tier.log[-1] == (tier.num_dispatches, "scatter", pages)
    assert set(pages) <= set(new.page_ids[0])
    outs = engine.finish_step(second)
    got = finish(engine) | {o.request_id: o.outputs[0].token_ids for o in outs if o.finished}
    assert got["x"] == want.outputs[0].token_ids
    assert num_compilations() == compiled
    assert_tier_settled(tiered)


def test_an_abort_between_the_send_and_the_scatter_leaks_nothing(engines):
    """Aborted after the step that sent its rows, before the one that scatters them: its
    pages and slots come back at once, the scatter still fills its pages, and the next
    request over the prefix hits them with the right tokens."""
    _, plain, tiered = engines
    prompt = evicted_prompt(tiered, 13)
    want = plain.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    engine = tiered.engine
    add(engine, "x", prompt, GREEDY)
    first = engine.begin_step()
    assert first.sched_out.host_copies.restore_pages and not first.sched_out.new_reqs
    engine.finish_step(first)
    engine.abort_request("x")
    assert not engine.scheduler.restoring
    assert_tier_settled(tiered)
    again = tiered.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want.outputs[0].token_ids
    assert again.num_cached_tokens > 0
    assert_tier_settled(tiered)


@pytest.mark.parametrize("half", ["send", "scatter"])
def test_a_failed_send_or_scatter_fails_the_request_and_leaks_nothing(engines, half,
                                                                       monkeypatch):
    """The step that sends a request's restore, or the next one that scatters it, raises:
    the request fails with the step (an output with the error), its pages forget their
    hashes, nothing leaks, and the next request over the prefix restores it again."""
    _, plain, tiered = engines
    prompt = evicted_prompt(tiered, 17)
    want = plain.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    engine, copier = tiered.engine, tiered.engine.runner.host_tier.copier
    real = getattr(copier, half)

    def fails_once(*args, **kwargs):
        monkeypatch.setattr(copier, half, real)
        raise RuntimeError(f"injected: the {half} failed")

    monkeypatch.setattr(copier, half, fails_once)
    add(engine, "x", prompt, GREEDY)
    outs = finish_outputs(engine)
    assert outs["x"].error and f"the {half} failed" in outs["x"].error
    assert_tier_settled(tiered)
    again = tiered.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want.outputs[0].token_ids
    assert again.num_cached_tokens > 0
    assert_tier_settled(tiered)


def test_a_hybrid_keeps_on_host_the_snapshots_its_device_gives_up(qwen3_5_engines,
                                                                  checkpoint):
    """A device pool that keeps every conversation's pages, and too few snapshot slots for
    their states (8 for 8 conversations of a snapshot per prompt and one rolling): the host
    tier takes each snapshot the device gives up alone, and a later turn restores just
    the state. Same tokens; every later turn hits (with the device pool alone 6 of the 16
    did, 96 tokens in all against 768 with the tier, when this was written)."""
    plain, _ = qwen3_5_engines
    want, _ = reference(plain)
    tiered = LLM(checkpoint("qwen3_5"), kv_offloading_size=0.02,
                 **dict(PLAIN, num_gpu_blocks_override=64))
    got, cached = trace(tiered)
    assert got == want
    stats = tiered.engine.stats().host
    assert stats.pages_offloaded == stats.pages_restored == stats.hits == 0
    assert stats.states_offloaded > 0 and stats.states_restored > 0
    assert all(c > 0 for c in cached[CONVERSATIONS:])
    assert_tier_settled(tiered)


def test_reset_prefix_cache_empties_both_tiers(engines):
    _, _, tiered = engines
    tiered.generate({"prompt_token_ids": list(range(3, 60))}, GREEDY, use_tqdm=False)
    assert tiered.reset_prefix_cache()
    host = tiered.engine.scheduler.kv.host
    assert len(host.index) == 0 and (host.states is None or len(host.states) == 0)
    assert not tiered.engine.scheduler.kv.pool.cached_pages


def test_an_int8_cache_travels_as_stored_and_gives_the_same_tokens(checkpoint):
    """kv_cache_dtype int8 (its scales per layer and head, calibrated at load, the same for
    every page): pages go to host and back as int8 bits, and the trace's tokens are those
    of the same int8 engine without the tier."""
    path, sizes = checkpoint("llama"), dict(SIZES, kv_cache_dtype="int8")
    plain = LLM(path, **dict(PLAIN, kv_cache_dtype="int8"))
    tiered = LLM(path, kv_offloading_size=0.02, **sizes)
    want, _ = trace(plain)
    compiled = num_compilations()
    got, cached = trace(tiered)
    assert got == want
    runner = tiered.engine.runner
    assert runner.kv_caches[KV].dtype == runner.host_tier.arrays.arrays[KV].dtype == np.int8
    assert tiered.engine.stats().host.pages_restored > 0
    assert all(c > 0 for c in cached[CONVERSATIONS:])
    assert num_compilations() == compiled
    assert_tier_settled(tiered)
    # Other KV scales (the params replaced, as a weight update does): pages stored under
    # the old ones are neither restored nor shared; both tiers start over.
    rng = random.Random(9)
    prompt, *others = [[rng.randrange(3, 250) for _ in range(70)] for _ in range(4)]
    tiered.generate([{"prompt_token_ids": p} for p in [prompt, *others]], GREEDY,
                    use_tqdm=False)   # the prompt's pages are evicted to host by the others
    host = tiered.engine.scheduler.kv.host
    assert host.index.ready(prompt_page_hashes(prompt, PS)[0])
    runner.params = {**runner.params, "kv_scales": runner.params["kv_scales"] * 2}
    out = tiered.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert np.array_equal(runner.host_tier.arrays.kv_scales["kv_scales"],
                          np.asarray(runner.params["kv_scales"]))
    assert_tier_settled(tiered)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_offloading_size=0.02, enable_prefix_caching=False), "--enable-prefix-caching"),
    (dict(kv_offloading_size=1e-7), "holds no page"),
])
def test_a_host_tier_the_engine_cannot_keep_is_refused_naming_the_flag(checkpoint, kwargs,
                                                                      message):
    with pytest.raises(ConfigError, match=f"--kv-offloading-size.*{message}") as e:
        LLM(checkpoint("llama"), **{**SIZES, **kwargs})
    assert e.value.field == "kv_offloading_size"


def test_the_flags_reach_the_config():
    config = engine_config("m", dict(kv_offloading_size=2.5, kv_offloading_backend="native",
                                     num_gpu_blocks_override=64))
    assert (config.kv_offloading_size, config.kv_offloading_backend, config.num_pages) == \
        (2.5, "native", 64)


def test_data_parallel_replicas_each_keep_their_own_tier(checkpoint, llama_engines):
    """mesh 2x1: each replica's evictions go to its own host tier, of the full size; the
    trace's tokens are the single engine's, with hits from the tiers. (Llama only: the
    replicas' bookkeeping is the same for every model; no warmup: the single engine's
    test checks that nothing compiles after it.)"""
    plain, _ = llama_engines
    dp = LLM(checkpoint("llama"), kv_offloading_size=0.02, mesh="2x1", **PLAIN)
    want, _ = reference(plain)
    got, _ = trace(dp)
    assert got == want
    tiers = [r.scheduler.kv.host for r in dp.engine.replicas]
    assert tiers[0] is not tiers[1]
    assert all(t.index.num_slots == tiers[0].index.num_slots for t in tiers)
    # (one request at a time: the router may keep every conversation on one replica)
    assert sum(r.stats().host.pages_restored for r in dp.engine.replicas) > 0
    assert dp.engine.stats().host.hits == sum(r.stats().host.hits for r in dp.engine.replicas)
    for replica in dp.engine.replicas:
        assert not replica.scheduler.requests


def test_a_model_drafters_kv_comes_back_with_the_targets_pages(checkpoint, llama_engines):
    """A draft model keeps its KV on the target's page ids: the tier copies it with the
    target's (runner DRAFT_KV). The target drafting for itself has every greedy draft
    accepted only if the drafter's KV at a restored prefix is what it computed there."""
    plain, _ = llama_engines
    path = checkpoint("llama")
    spec = LLM(path, kv_offloading_size=0.02, **PLAIN, speculative_config={
        "method": "draft_model", "model": path, "num_speculative_tokens": 3})
    got, cached = trace(spec)
    assert got == reference(plain)[0]
    s = spec.engine.scheduler.stats()
    assert s.spec_num_accepted_tokens == s.spec_num_draft_tokens > 0, s
    assert spec.engine.stats().host.pages_restored > 0 and sum(cached[CONVERSATIONS:]) > 0
    layout = spec.engine.runner.host_tier.layout
    assert layout.rows[DRAFT_KV] == layout.rows[KV]   # the target's shapes, its own pool
    assert layout.page_bytes == 2 * spec.engine.runner.host_tier.arrays.arrays[KV][0].nbytes
    assert_tier_settled(spec)
