"""benchmarks.spec_decode.spec_decode at toy size (the tests' tiny llama, two code prompts of one
function, two random prompts, 24 output tokens, one run of each engine): the results'
structure, greedy outputs identical with and without speculation, the engine's
speculative counters equal to the lookup replayed over the final tokens; and the
replay itself by hand."""
from __future__ import annotations

import json

import numpy as np
import pytest

import benchmarks.spec_decode.spec_decode as sd
from benchmarks.spec_decode.spec_decode_replay import match_ends, simulate
from benchmarks.spec_decode.spec_decode_workload import code_prompts
from jaxserve.runner.spec_decode import ngram_propose
from tests.checkpoints import make_tiny_checkpoint

WORKLOADS = ["code-edit", "code-edit-bs1", "random", "random-t1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"),
                                max_position_embeddings=512)


def test_match_ends_find_where_ngram_propose_matched():
    rng = np.random.default_rng(0)
    for _ in range(300):
        toks = rng.integers(3, 7, size=int(rng.integers(1, 40)))
        drafts = ngram_propose(toks, 2, 5, 3)
        ends = match_ends(toks, drafts, 2, 5)
        assert bool(ends) == bool(drafts), (toks, drafts)
        for e in ends:
            assert toks[e + 1:e + 1 + len(drafts)].tolist() == drafts
            assert toks[e - 1:e + 1].tolist() == toks[-2:].tolist()   # n_min = 2 recurs


def test_simulate_by_hand():
    # After the prefill's token (3) the suffix 1 2 3 recurs in the prompt (ending at 2):
    # drafts 1 2 3, the next tokens 1 2 9 accept two; 9 is the step's own token.
    sim = simulate([1, 2, 3, 1, 2], [3, 1, 2, 9], 2, 5, 3, max_tokens=100)
    assert (sim["drafts"], sim["draft_tokens"], sim["accepted"]) == (1, 3, 2)
    assert sim["per_pos"] == [1, 1, 0] and sim["steps"] == 2
    assert (sim["prompt_drafts"], sim["prompt_accepted"]) == (1, 2)
    # max_tokens 4: one output so far, so at most 4 - 1 - 1 = 2 drafts are verified.
    sim = simulate([1, 2, 3, 1, 2], [3, 1, 2, 9], 2, 5, 3, max_tokens=4)
    assert (sim["draft_tokens"], sim["accepted"]) == (2, 2)
    # A loop of the output's own: matched in the output, not the prompt.
    sim = simulate([9, 8], [5, 5, 5, 5, 5], 2, 5, 3, max_tokens=100)
    assert sim["accepted"] > 0 and sim["prompt_drafts"] == 0


def test_code_prompts_are_seeded(tiny):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny)
    a, b = code_prompts(tok, 2, 4, 0), code_prompts(tok, 2, 4, 0)
    assert a == b and a[0] != a[1]
    text = tok.decode(a[0])
    assert text.startswith("```python\ndef ") and "renamed to" in text


def test_main_writes_results(tiny, tmp_path):
    res = sd.main(["--model", tiny, "--output-dir", str(tmp_path), "--code-requests", "2",
                   "--code-lines", "1", "--code-output", "24", "--bs1-requests", "1",
                   "--random-requests", "2", "--random-input", "24", "--random-output", "24",
                   "--max-num-seqs", "2", "--max-num-batched-tokens", "64",
                   "--max-model-len", "512", "--repeats", "1"])
    doc = json.loads((tmp_path / "spec_decode.json").read_text())
    assert doc["benchmark"] == "spec_decode"
    assert doc["command"].startswith("python -m benchmarks.spec_decode.spec_decode --model")
    r = doc["results"]
    assert r["speculative_config"]["num_speculative_tokens"] == 3
    assert [w["workload"] for w in r["workloads"]] == WORKLOADS
    for w in r["workloads"]:
        a = w["agreement"]
        if w["sampling"] == "greedy":
            assert a["identical"] and a["all_runs_identical"], w
        base, spec = w["runs"]["base"], w["runs"]["spec"]
        assert base["requests"] == spec["requests"] == w["requests"] == len(w["prompt_lens"])
        assert base["output_tokens"] == spec["output_tokens"] == 24 * w["requests"]
        # The engine's counters are the lookup replayed over the final tokens.
        sim = w["simulated"]
        assert sim["matches_engine"], w
        assert sim["per_pos"] == [round(x * spec["num_drafts"])
                                  for x in spec["acceptance_per_pos"] or [0, 0, 0]]
        assert base["num_drafts"] == base["num_accepted_tokens"] == 0
        assert base["acceptance_rate"] is None and base["mean_acceptance_length"] is None
        if spec["num_drafts"]:
            assert 0 <= spec["acceptance_rate"] <= 1
            assert spec["mean_acceptance_length"] == pytest.approx(
                1 + spec["num_accepted_tokens"] / spec["num_drafts"])
            pp = spec["acceptance_per_pos"]
            assert len(pp) == 3 and all(x >= y for x, y in zip(pp, pp[1:]))
        # Each step moves every running request by one token or more.
        assert spec["steps"] <= base["steps"]
        assert w["steps_ratio"] == pytest.approx(spec["steps"] / base["steps"])
        for run in (base, spec):
            assert run["compilations"] == 0
            assert run["out_tok_s"] > 0 and run["tpot_mean_ms"] > 0 and run["ttft_mean_ms"] > 0
            assert len(run["repeats"]) == 1
            host = run["host_ms_per_step"]
            assert {"schedule", "dispatch", "collect", "update", "outputs"} <= set(host)
        assert "propose" in spec["host_ms_per_step"]
        # Every step is counted under one kind; a llama never recomputes (no state).
        for run in (base, spec):
            kinds = run["step_kinds"]
            assert sum(v["steps"] for v in kinds.values()) == run["steps"], kinds
            assert set(kinds) <= {"prefill", "decode", "verify", "recompute"}
        assert "verify" not in base["step_kinds"] and "recompute" not in spec["step_kinds"]
        assert ("verify" in spec["step_kinds"]) == (spec["num_drafts"] > 0)
        assert w["throughput_ratio"] > 0
    # The tiny model's greedy output loops: the lookup has drafts to verify.
    assert sum(w["runs"]["spec"]["num_accepted_tokens"] for w in r["workloads"]) > 0
    assert r["workloads"][1]["batch"] == 1
    md = (tmp_path / "spec_decode.md").read_text()
    assert "acc. per position" in md and "identical token for token" in md
    assert res["workloads"][0]["workload"] == "code-edit"
