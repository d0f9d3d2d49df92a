"""benchmarks.cache.hybrid_prefix_cache at toy size (the tests' tiny Qwen3.5, two conversations
of two turns, four questions on a 100-token system prompt, one run of each engine): the
results' structure, greedy outputs identical with and without the cache, hits in the
cached run only; and the align rule's simulation and block sizes by hand."""
from __future__ import annotations

import json

import pytest

import benchmarks.cache.hybrid_prefix_cache as hpc
from benchmarks.cache.hybrid_prefix_cache_align import align_blocks, simulate_align
from tests.checkpoints import make_tiny_checkpoint

WORKLOADS = ["chat", "system", "system-burst2"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen3_5"),
                                max_position_embeddings=512)


def test_simulate_align():
    a = list(range(3, 40))            # 37 tokens
    b = a[:20] + [200] * 10           # shares 20 tokens with a
    rounds = [[(a, [1, 2, 3])], [(b, [4]), (a + [5, 6, 7, 8], [9])]]
    sim = simulate_align(rounds, 8)
    # b: longest cached 8-multiple of its first 29 tokens is 16; a + ...: 40 of 40 tokens
    # (a's 37 + 2 of its output: the last output token has no KV) rounds down to 32.
    assert sim["hits_each"] == [0, 16, 32]
    assert sim["cached_tokens"] == 48
    assert sim["hit_rate"] == pytest.approx(48 / (37 + 30 + 41))
    # A hit always leaves a token to compute: the same prompt again hits 36 of 37.
    assert simulate_align([[(a, [1])], [(a, [1])]], 1)["hits_each"] == [0, 36]
    # Requests of one round see each other (the rule's best case).
    assert simulate_align([[(a, [1]), (a, [1])]], 8)["hits_each"] == [0, 32]


def test_align_blocks_of_qwen36_27b():
    # python -m jaxserve.plan --model qwen3.6-27b --mesh 1x8 --hbm 96GiB --json: 16 KiB
    # of KV per token (16 layers), 18.35 MiB of state (48 layers) per device.
    cache = {"bytes_per_page": 262144, "bytes_per_state_slot": 19243008,
             "num_kv_layers": 16, "num_state_layers": 48}
    b = align_blocks(cache, 16)
    assert b["kv_bytes_per_token"] == 16384
    assert b["tokens_per_state_per_layer"] == pytest.approx(391.5)
    assert b["tokens_per_state_all_layers"] == pytest.approx(1174.5)
    assert (b["block_per_layer"], b["block_all_layers"]) == (400, 1184)


def test_main_writes_results(tiny, tmp_path):
    res = hpc.main(["--model", tiny, "--output-dir", str(tmp_path), "--no-27b",
                    "--conversations", "2", "--turns", "2", "--first-len", "40",
                    "--user-len", "8,16", "--chat-output", "8", "--system-len", "100",
                    "--questions", "4", "--question-len", "4,8", "--answer-len", "4",
                    "--burst", "2", "--max-num-seqs", "2", "--max-num-batched-tokens", "64",
                    "--max-model-len", "256", "--repeats", "1"])
    doc = json.loads((tmp_path / "hybrid_prefix_cache.json").read_text())
    assert doc["benchmark"] == "hybrid_prefix_cache"
    assert doc["command"].startswith("python -m benchmarks.cache.hybrid_prefix_cache --model")
    r = doc["results"]
    assert r["qwen3_6_27b"] is None and r["page_size"] == 16
    plans = r["cache_plan"]
    assert plans["cached"]["num_snapshot_slots"] > 0 == plans["uncached"]["num_snapshot_slots"]
    assert plans["cached"]["snapshot_bytes"] == (plans["cached"]["num_snapshot_slots"]
                                                 * plans["cached"]["bytes_per_state_slot"])
    blocks = r["align_blocks"]
    assert blocks["block_per_layer"] % 16 == 0 and blocks["block_all_layers"] % 16 == 0
    assert blocks["block_all_layers"] >= blocks["block_per_layer"] >= 16
    assert [w["workload"] for w in r["workloads"]] == WORKLOADS
    for w in r["workloads"]:
        assert w["agreement"]["identical"] and w["agreement"]["all_runs_identical"], w
        c, u = w["runs"]["cached"], w["runs"]["uncached"]
        assert c["requests"] == u["requests"] == w["requests"] == len(w["prompt_lens"])
        assert c["prompt_tokens"] == u["prompt_tokens"] == sum(w["prompt_lens"])
        assert c["hit_rate"] > 0 == u["hit_rate"] == u["cached_tokens"]
        assert c["computed_prompt_tokens"] == c["prompt_tokens"] - c["cached_tokens"]
        assert c["snapshots"]["num_slots"] == plans["cached"]["num_snapshot_slots"]
        assert c["snapshots"]["restored_tokens"] == c["cached_tokens"]
        assert u["snapshots"] is None
        for run in (c, u):
            assert run["compilations"] == 0
            assert run["wall_s"] > 0 and run["tok_s"] > run["out_tok_s"] > 0
            assert run["ttft_mean_ms"] > 0 and run["ttft_median_ms"] > 0
            assert len(run["repeats"]) == 1 and len(run["repeats"][0]["ttft_ms_each"]) == \
                w["requests"]
        # The page-granular best case bounds the measured hits; coarser blocks hit less.
        page = w["align"]["page"]
        assert page["block"] == 16 and page["hit_rate"] >= c["hit_rate"]
        assert page["hit_rate"] >= w["align"]["this_per_layer"]["hit_rate"] >= \
            w["align"]["this_all_layers"]["hit_rate"]
        assert w["ttft_mean_speedup"] > 0 and w["throughput_ratio"] > 0
    # The shared system prompt (its whole pages end at 96): the first request computes
    # it, the later ones hit within it from the third on at the latest.
    system = r["workloads"][1]["runs"]["cached"]["cached_each"]
    assert system[0] == 0 and all(h % 16 == 0 and h <= 96 for h in system), system
    assert all(h >= 80 for h in system[2:]), system
    chat = r["workloads"][0]["runs"]["cached"]["cached_each"]
    assert chat[:2] == [0, 0] and all(h >= 32 for h in chat[2:]), chat   # turn 2 hits turn 1
    md = (tmp_path / "hybrid_prefix_cache.md").read_text()
    assert "page-granular best case" in md and "identical token for token" in md
    assert res["workloads"][0]["workload"] == "chat"
