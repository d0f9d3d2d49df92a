"""`jaxserve bench throughput` and `jaxserve bench latency` on one shared tiny engine:
vLLM's printed lines and JSON keys, token counts that are exact (eos is ignored, so
every completion has its max_tokens), and no compilation during the timed runs."""
from __future__ import annotations

import json

import pytest

from jaxserve.bench import latency, offline, throughput
from jaxserve.config.engine_args import engine_kwargs
from tests.checkpoints import make_tiny_checkpoint

ENGINE = ["--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", "4",
          "--max-num-batched-tokens", "32"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("bench") / "qwen3")


@pytest.fixture(scope="module")
def llm(model):
    """The engine the flags ENGINE describe, built once (as `main` would build it)."""
    return offline.make_llm(throughput.parse(["--model", model, *ENGINE]))


def test_flags_build_the_engine_they_name(model):
    args = latency.parse(["--model", model, *ENGINE, "--seed", "3"])
    kw = engine_kwargs(args)
    assert (kw["dtype"], kw["max_model_len"], kw["max_num_seqs"], kw["seed"]) == \
        ("float32", 64, 4, 3)
    assert kw["max_num_batched_tokens"] == 32


def test_throughput_random(llm, model, tmp_path, capsys):
    out = tmp_path / "t.json"
    res = throughput.main(["--model", model, *ENGINE, "--num-prompts", "6", "--input-len", "8",
                           "--output-len", "5", "--n", "2", "--disable-tqdm",
                           "--output-json", str(out)], llm=llm)
    text = capsys.readouterr().out
    assert text.startswith("Throughput: ") and "requests/s" in text
    assert "Total num prompt tokens:  48" in text and "Total num output tokens:  60" in text
    doc = json.loads(out.read_text())
    assert doc == res
    assert (doc["num_requests"], doc["total_num_tokens"]) == (6, 48 + 6 * 5 * 2)
    assert doc["requests_per_second"] == pytest.approx(6 / doc["elapsed_time"])
    assert doc["compilations_during_run"] == 0


def test_throughput_sharegpt_counts_with_the_models_tokenizer(llm, model, tmp_path):
    tok = llm.get_tokenizer()
    convs = [{"conversations": [{"from": "human", "value": f"hello there number {i}"},
                                {"from": "gpt", "value": "fine " * (2 + i)}]} for i in range(3)]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    res = throughput.main(["--model", model, "--dataset-name", "sharegpt", "--dataset-path",
                           str(path), "--num-prompts", "3", "--disable-tqdm"], llm=llm)
    want_out = sum(len(tok.encode("fine " * (2 + i), add_special_tokens=False))
                   for i in range(3))
    want_in = sum(len(tok.encode(f"hello there number {i}", add_special_tokens=False))
                  for i in range(3))
    assert (res["total_num_output_tokens"], res["total_num_prompt_tokens"]) == (want_out, want_in)


def test_latency(llm, model, tmp_path, capsys):
    out = tmp_path / "l.json"
    res = latency.main(["--model", model, *ENGINE, "--input-len", "8", "--output-len", "4",
                        "--batch-size", "3", "--num-iters-warmup", "1", "--num-iters", "3",
                        "--output-json", str(out)], llm=llm)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Avg latency: ") and lines[0].endswith(" seconds")
    assert [ln.split("%")[0] for ln in lines[1:7]] == ["10", "25", "50", "75", "90", "99"]
    doc = json.loads(out.read_text())
    assert len(doc["latencies"]) == 3 and all(t > 0 for t in doc["latencies"])
    assert doc["avg_latency"] == pytest.approx(sum(doc["latencies"]) / 3)
    assert min(doc["latencies"]) <= doc["percentiles"]["50"] <= max(doc["latencies"])
    assert doc == res and doc["compilations_during_run"] == 0


@pytest.mark.parametrize("module, flags, message", [
    (throughput, ["--n", "0"], "--n"),
    (throughput, ["--dataset-name", "sharegpt"], "--dataset-path"),
    (throughput, ["--dataset-path", "x.json"], "--dataset-path"),
    (latency, ["--num-iters", "0"], "--num-iters"),
    (latency, ["--batch-size", "0"], "--batch-size"),
])
def test_bad_flags_are_refused_by_name(module, flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        module.main(flags)
    assert e.value.code == 2 and message in capsys.readouterr().err
