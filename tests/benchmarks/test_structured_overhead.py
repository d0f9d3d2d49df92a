"""benchmarks.structured.structured_overhead at toy size (a tiny Qwen3 with its byte tokenizer, 2
rows, a few steps, two scenarios): the structure of the results, every timing positive,
steps really counted, and the grammar rows' outputs valid JSON prefixes."""
from __future__ import annotations

import json
import numbers

import jsonschema
import pytest

pytest.importorskip("llguidance")

import benchmarks.structured.structured_overhead as so  # noqa: E402
from jaxserve.api.tool_parsers.json_call import JsonScanner  # noqa: E402
from tests.checkpoints import make_tiny_checkpoint  # noqa: E402

ROWS, STEPS = 2, 4


def json_prefix(text: str) -> bool:
    """Whether `text` is the start of a JSON document (or one whole, then whitespace):
    the tool parsers' strict incremental validator, for which the end of the text is no
    error."""
    scanner = JsonScanner()
    body = text.lstrip(" \t\n\r")
    used = scanner.feed(body)
    return not scanner.error and not body[used:].strip(" \t\n\r")


def test_the_prefix_check_can_fail():
    for good in ('', ' {', '{"a": [1, -2.5e', '{"a":"x\\u00', '{"k": tr', '[]  ', '{"a":1}'):
        assert json_prefix(good), good
    for bad in ('x', '{a', '{"a" 1', '{"a":1,}', '[1 2', '{"a":1}}', '{"a":"\n'):
        assert not json_prefix(bad), bad


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def llm(tiny):
    from jaxserve import LLM
    return LLM(tiny, dtype="float32", max_model_len=256, max_num_seqs=ROWS,
               max_num_batched_tokens=64)


def _timings(x, path=""):
    """(path, value) of every number under a key ending _ms or _s, and every sample."""
    if isinstance(x, dict):
        for k, v in x.items():
            if isinstance(v, numbers.Real) and not isinstance(v, bool) and \
                    k.endswith(("_ms", "_s")) and k != "host_extra_ms":   # a difference
                yield f"{path}/{k}", v
            else:
                yield from _timings(v, f"{path}/{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            if isinstance(v, numbers.Real) and not isinstance(v, bool):
                if path.endswith(("_ms_each", "samples_ms/cold", "_mask", "cached")):
                    yield f"{path}[{i}]", v
            else:
                yield from _timings(v, f"{path}[{i}]")


@pytest.mark.parametrize("scenario", ["json_schema", "json_object"])
def test_grammar_rows_write_json(llm, scenario):
    run = so.run_scenario(llm, ROWS, scenario, 40, seed=1, max_tokens=200)
    assert run["step_s"] and all(t > 0 for t in run["step_s"])
    assert len(run["step_s"]) == 40 or "stop" in run["ends"]   # stopped at the first end
    assert all(len(v) == len(run["step_s"]) and all(t > 0 for t in v)
               for v in run["host_s"].values())
    assert len(run["texts"]) == ROWS and run["compilations"] == 0
    for text, end in zip(run["texts"], run["ends"]):
        assert text.lstrip().startswith("{") and json_prefix(text), text
        if end == "stop":
            doc = json.loads(text)
            if scenario == "json_schema":
                jsonschema.validate(doc, so.MEDIUM_SCHEMA)
            assert isinstance(doc, dict)
        else:
            assert end == "aborted", end
    assert "stop" in run["ends"] or min(map(len, run["texts"])) > 20, run["texts"]
    free = so.run_scenario(llm, ROWS, "none", STEPS, seed=1, max_tokens=200)
    assert not all(json_prefix(t) for t in free["texts"])   # unconstrained: rarely JSON


def test_structure_and_timings(llm):
    steps = so.run_steps(llm, [ROWS], ["none", "json_schema"], STEPS, 1, max_tokens=200)
    assert [(s["rows"], s["scenario"]) for s in steps] == [(ROWS, "none"),
                                                           (ROWS, "json_schema")]
    for s in steps:
        assert s["steps_counted"] > 0 and s["steps_counted"] == sum(s["steps_per_run"])
        assert s["p90_step_ms"] >= s["median_step_ms"] > 0 and s["vs_none"] > 0
        assert s["host_mask_ms"] > 0 and s["host_accept_ms"] > 0
        assert s["compilations"] == 0
    assert steps[0]["vs_none"] == steps[0]["vs_none_paired"] == 1.0
    assert steps[0]["host_extra_ms"] == 0.0 < steps[1]["host_extra_ms"]   # the grammar's
    comp = so.compile_times(llm, 2)
    figures = dict(_timings({"steps": steps, "compile": comp}))
    assert len(figures) > 20 and all(v > 0 for v in figures.values()), figures
    assert comp["cached_median_ms"] < comp["cold_median_ms"]
    text = so.tables(steps, comp)
    assert "json_schema" in text and "compile, cold" in text


def test_main_writes_results(tiny, tmp_path):
    so.main(["--model", tiny, "--output-dir", str(tmp_path), "--rows", str(ROWS),
             "--steps", "3", "--repeats", "1", "--compile-repeats", "2",
             "--scenarios", "none,allowed_token_ids", "--max-model-len", "128",
             "--max-num-batched-tokens", "64"])
    doc = json.loads((tmp_path / "structured_overhead.json").read_text())
    assert doc["benchmark"] == "structured_overhead"
    assert doc["command"].startswith("python -m benchmarks.structured.structured_overhead --model")
    assert [s["scenario"] for s in doc["results"]["steps"]] == ["none", "allowed_token_ids"]
    assert all(s["steps_counted"] >= 3 for s in doc["results"]["steps"])
    assert doc["results"]["compile"]["cold_median_ms"] > 0
    assert "host mask ms/step" in (tmp_path / "structured_overhead.md").read_text()
