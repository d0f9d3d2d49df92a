"""benchmarks.shared.workloads: seeded, the stated lengths, ShareGPT's shape, ShareGPT files."""
from __future__ import annotations

import json
import statistics

import pytest

from benchmarks.shared.common import make_word_tokenizer
from benchmarks.shared.workloads import SHAREGPT_LIKE, make_workload


def wl(spec: str, **kw):
    args = {"num_prompts": 50, "input_len": 100, "output_len": 20, "range_ratio": 0.5,
            "vocab_size": 300, "seed": 1}
    return make_workload(spec, **{**args, **kw})


def test_random_is_seeded_and_in_range():
    a = wl("random")
    assert a.items == wl("random").items and a.items != wl("random", seed=2).items
    assert all(50 <= len(it.prompt_token_ids) <= 150 and 10 <= it.max_tokens <= 30
               for it in a.items)
    assert all(3 <= t < 300 for it in a.items for t in it.prompt_token_ids)
    fixed = wl("random", range_ratio=0.0)
    assert {len(it.prompt_token_ids) for it in fixed.items} == {100}
    assert {it.max_tokens for it in fixed.items} == {20}
    with pytest.raises(ValueError, match="range-ratio"):
        wl("random", range_ratio=1.0)


def test_throughput_workloads():
    d = wl("decode-heavy", num_prompts=64)
    assert all(16 <= len(it.prompt_token_ids) <= 96 and 8 <= it.max_tokens <= 384
               for it in d.items)
    p = wl("prefill-heavy")
    assert all(32 <= len(it.prompt_token_ids) <= 400 for it in p.items)


def test_sharegpt_like_shape():
    big = wl("sharegpt-like", num_prompts=4000, vocab_size=50)
    p = [len(it.prompt_token_ids) for it in big.items]
    o = [it.max_tokens for it in big.items]
    # the stated means, a little lower after clipping the tail at 1024
    pm, om = SHAREGPT_LIKE["prompt_mean"], SHAREGPT_LIKE["output_mean"]
    assert 0.85 * pm < statistics.mean(p) < pm
    assert 0.85 * om < statistics.mean(o) < 1.05 * om
    assert statistics.median(p) < 0.75 * statistics.mean(p)   # a long right tail
    assert min(p + o) >= 4 and max(p + o) <= 1024 and max(p) > 800
    assert big.params["distribution"] == "log-normal" and big.params["seed"] == 1
    short = wl("sharegpt-like", num_prompts=500, max_model_len=64)
    assert all(len(it.prompt_token_ids) + it.max_tokens <= 64 and it.max_tokens >= 4
               for it in short.items)


def test_sharegpt_file(tmp_path):
    make_word_tokenizer(str(tmp_path), 64)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tmp_path))

    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False).input_ids

    def words(*ids: int) -> str:
        return " ".join(f"w{i}" for i in ids)

    data = [
        {"conversations": [{"from": "human", "value": words(5, 6, 7, 8, 9)},
                           {"from": "gpt", "value": words(10, 11, 12, 13, 14, 15)}]},
        {"conversations": [{"from": "system", "value": "be brief"},
                           {"from": "human", "value": words(20, 21, 22, 23)},
                           {"from": "gpt", "value": words(30, 31, 32, 33)},
                           {"from": "human", "value": "a later turn"}]},
        {"conversations": [{"from": "human", "value": words(5, 6)},          # prompt < 4
                           {"from": "gpt", "value": words(7, 8, 9, 10)}]},
        {"conversations": [{"from": "gpt", "value": "no human turn"}]},
        {"conversations": [{"from": "human", "value": words(5, 6, 7, 8)}]},  # no reply
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    got = make_workload(f"sharegpt:{path}", num_prompts=2, input_len=0, output_len=0,
                        range_ratio=0.0, vocab_size=64, seed=0, encode=encode)
    assert sorted((it.prompt_token_ids, it.max_tokens) for it in got.items) == [
        ([5, 6, 7, 8, 9], 6), ([20, 21, 22, 23], 4)]
    with pytest.raises(ValueError, match="2 usable conversations, need 3"):
        make_workload(f"sharegpt:{path}", num_prompts=3, input_len=0, output_len=0,
                      range_ratio=0.0, vocab_size=64, seed=0, encode=encode)
    with pytest.raises(ValueError, match="unknown workload"):
        wl("sharegpt")
