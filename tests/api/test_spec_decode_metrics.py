"""Speculative decoding's vLLM metrics: the spec_decode counters on /metrics (only when
speculative decoding is on, as vLLM registers them), the SpecDecoding stats line, and a
real server started with --speculative-config."""
from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import httpx
import pytest

from jaxserve.api.metrics import Metrics
from jaxserve.api.stats_logger import StatsLogger, spec_decoding_line
from jaxserve.core.scheduler import SchedulerStats
from jaxserve.engine.async_engine import EngineStats
from tests.api.conftest import API_KEY, Server
from tests.api.test_metrics_vllm import FakeEngine, samples, value

K = 3   # num_speculative_tokens
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
SPEC_NAMES = (DRAFTS, DRAFT_TOKENS, ACCEPTED, PER_POS)


def spec(drafts: int, draft_tokens: int, per_pos: tuple[int, ...], **other) -> EngineStats:
    return EngineStats(spec_num_drafts=drafts, spec_num_draft_tokens=draft_tokens,
                       spec_num_accepted_tokens=sum(per_pos), spec_accepted_per_pos=per_pos,
                       **other)


def per_pos(snap: dict) -> dict[int, float]:
    return {int(dict(ls)["position"]): v for (n, ls), v in snap.items() if n == PER_POS}


# ---- the registry ----------------------------------------------------------------------
def test_no_spec_decode_metrics_without_speculative_decoding():
    metrics = Metrics("m")
    for text in (metrics.render_idle(), metrics.render(EngineStats(num_generation_tokens=9),
                                                       admitted=0)):
        assert "spec_decode" not in text.decode()


def test_registered_at_zero_when_configured():
    snap = samples(Metrics("my-model", num_speculative_tokens=K).render_idle().decode())
    for name in (DRAFTS, DRAFT_TOKENS, ACCEPTED):
        assert snap[(name, (("model_name", "my-model"),))] == 0
    assert per_pos(snap) == {i: 0 for i in range(K)}
    for (name, labels), _ in snap.items():
        if name == PER_POS:
            assert ("model_name", "my-model") in labels


def test_counters_follow_the_engine_totals():
    # Not told at construction (the server's registry exists before the engine): the
    # counters appear with the first snapshot that has per-position counts.
    metrics = Metrics("m")

    def render(stats: EngineStats) -> dict:
        return samples(metrics.render(stats, admitted=0).decode())

    snap = render(EngineStats(spec_accepted_per_pos=(0,) * K))
    assert {n for n, _ in snap} >= set(SPEC_NAMES)
    assert value(snap, DRAFTS) == 0 and per_pos(snap) == {0: 0, 1: 0, 2: 0}
    snap = render(spec(10, 25, (8, 5, 2)))
    assert (value(snap, DRAFTS), value(snap, DRAFT_TOKENS), value(snap, ACCEPTED)) == \
        (10, 25, 15)
    assert per_pos(snap) == {0: 8, 1: 5, 2: 2}
    snap = render(spec(14, 37, (11, 7, 4)))
    assert (value(snap, DRAFTS), value(snap, DRAFT_TOKENS), value(snap, ACCEPTED)) == \
        (14, 37, 22)
    assert per_pos(snap) == {0: 11, 1: 7, 2: 4}
    # Counts restarting is a new baseline, never a drop; the counters grow from it.
    render(spec(1, 3, (1, 1, 0)))
    snap = render(spec(3, 7, (3, 2, 1)))
    assert (value(snap, DRAFTS), value(snap, DRAFT_TOKENS), value(snap, ACCEPTED)) == \
        (16, 41, 26)
    assert per_pos(snap) == {0: 13, 1: 8, 2: 5}
    # Registered once: another snapshot (or call) changes nothing of the layout.
    metrics.enable_spec_decode(5)
    assert len(per_pos(render(spec(3, 7, (3, 2, 1))))) == K


def test_configured_registry_takes_the_engine_totals():
    metrics = Metrics("m", num_speculative_tokens=K)
    snap = samples(metrics.render(spec(4, 12, (4, 3, 1)), admitted=0).decode())
    assert (value(snap, DRAFTS), value(snap, ACCEPTED), per_pos(snap)) == \
        (4, 8, {0: 4, 1: 3, 2: 1})


def test_the_documented_queries_name_exported_metrics():
    readme = (Path(__file__).parents[2] / "docs" / "grafana" / "README.md").read_text()
    queried = set(re.findall(r"vllm:spec_decode_[a-z_]+", readme))
    registry = Metrics("m", num_speculative_tokens=K).registry
    exported = {s.name for family in registry.collect() for s in family.samples}
    assert queried and queried <= exported, queried - exported


# ---- the stats line --------------------------------------------------------------------
def test_spec_decoding_line_over_the_interval():
    last = spec(10, 30, (9, 6, 3))
    now = spec(35, 105, (27, 17, 9))   # +25 drafts, +75 draft tokens, +35 accepted
    assert spec_decoding_line(last, now, 10.0) == (
        "SpecDecoding metrics: Mean acceptance length: 2.40, Accepted throughput: 3.50 "
        "tokens/s, Drafted throughput: 7.50 tokens/s, Accepted: 35 tokens, Drafted: 75 "
        "tokens, Per-position acceptance rate: 0.720, 0.440, 0.240, Avg Draft acceptance "
        "rate: 46.7%")
    # From the start (no per-position counts before).
    assert spec_decoding_line(SchedulerStats(), spec(2, 4, (2, 1, 0)), 2.0).startswith(
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 1.50 "
        "tokens/s, Drafted throughput: 2.00 tokens/s, Accepted: 3 tokens, Drafted: 4 tokens, "
        "Per-position acceptance rate: 1.000, 0.500, 0.000, Avg Draft acceptance rate: 75.0%")
    # No speculative decoding, or no drafts in the interval: no line.
    assert spec_decoding_line(SchedulerStats(), SchedulerStats(num_generation_tokens=5),
                              1.0) is None
    assert spec_decoding_line(now, now, 10.0) is None


def test_stats_logger_logs_the_spec_line_under_the_stats_line(caplog):
    caplog.set_level(logging.INFO, logger="jaxserve")
    engine = FakeEngine()
    stats_logger = StatsLogger(engine, interval=10.0)
    stats_logger.tick(now=1000.0)
    engine.stats = spec(4, 12, (4, 2, 0), num_running=1, num_generation_tokens=40)
    text = stats_logger.tick(now=1010.0)
    main, spec_line = text.split("\n")
    assert main.startswith("Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation "
                           "throughput: 4.0 tokens/s")
    assert spec_line == (
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 0.60 "
        "tokens/s, Drafted throughput: 1.20 tokens/s, Accepted: 6 tokens, Drafted: 12 tokens, "
        "Per-position acceptance rate: 1.000, 0.500, 0.000, Avg Draft acceptance rate: 50.0%")
    assert [r.getMessage() for r in caplog.records[-2:]] == [main, spec_line]
    # Busy, but no drafts verified in this interval: the stats line alone.
    engine.stats = spec(4, 12, (4, 2, 0), num_running=1, num_generation_tokens=50)
    assert "\n" not in stats_logger.tick(now=1020.0)
    # Without speculative decoding: the stats line alone, as before.
    plain = FakeEngine()
    plain_logger = StatsLogger(plain, interval=10.0)
    plain.stats = EngineStats(num_running=1, num_generation_tokens=10)
    assert "SpecDecoding" not in plain_logger.tick(now=5.0)


# ---- a real server ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def spec_server(api_checkpoint):
    srv = Server(api_checkpoint, "--speculative-config",
                 json.dumps({"method": "ngram", "num_speculative_tokens": K}))
    yield srv
    srv.stop()


def _scrape(server) -> dict:
    return samples(httpx.get(server.url + "/metrics").text)


def test_spec_decode_counters_move_on_a_real_server(spec_server, api_checkpoint):
    before = _scrape(spec_server)
    # Repetitive prompts: the n-gram proposer finds their suffixes earlier on, and a tiny
    # random model's greedy text soon repeats itself too.
    for prompt in ([10, 11, 12, 13] * 6, [40, 41, 42] * 8, list(range(20, 30)) * 3):
        r = httpx.post(spec_server.url + "/v1/completions", timeout=120,
                       headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": api_checkpoint, "prompt": prompt, "max_tokens": 32,
                             "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 32
    after = _scrape(spec_server)

    def grew(name: str) -> float:
        return value(after, name) - value(before, name)

    drafts, draft_tokens, accepted = grew(DRAFTS), grew(DRAFT_TOKENS), grew(ACCEPTED)
    assert drafts > 0
    assert drafts <= draft_tokens <= K * drafts
    assert 0 <= accepted <= draft_tokens
    # At most one token per draft position per draft, and generated tokens bound them.
    assert accepted <= grew("vllm:generation_tokens_total")
    positions = per_pos(after)
    assert sorted(positions) == list(range(K))
    assert sum(positions.values()) == value(after, ACCEPTED)
    # A draft's token at position i+1 is accepted only after the one at i.
    assert all(positions[i] >= positions[i + 1] for i in range(K - 1))
    assert positions[0] <= value(after, DRAFTS)
    for (name, labels), _ in after.items():
        if name in SPEC_NAMES:
            assert ("model_name", api_checkpoint) in labels, name


def test_the_server_logs_the_spec_decoding_line(spec_server, api_checkpoint):
    # (after the requests above; the stats thread writes a line every 10 s of work)
    httpx.post(spec_server.url + "/v1/completions", timeout=120,
               headers={"Authorization": f"Bearer {API_KEY}"},
               json={"model": api_checkpoint, "prompt": [7, 8, 9] * 8, "max_tokens": 16,
                     "temperature": 0, "ignore_eos": True}).raise_for_status()
    pattern = re.compile(
        r"SpecDecoding metrics: Mean acceptance length: [\d.]+, Accepted throughput: [\d.]+ "
        r"tokens/s, Drafted throughput: [\d.]+ tokens/s, Accepted: \d+ tokens, Drafted: \d+ "
        r"tokens, Per-position acceptance rate: [\d.]+, [\d.]+, [\d.]+, Avg Draft acceptance "
        r"rate: [\d.]+%")
    deadline = time.monotonic() + 30
    while not pattern.search(spec_server.output()):
        assert time.monotonic() < deadline, "no SpecDecoding line in the server's log"
        time.sleep(0.5)
