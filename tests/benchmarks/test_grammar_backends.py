"""benchmarks.structured.grammar_backends at toy size, llguidance only (xgrammar is never needed):
the trained tokenizer, the structure of the results, every figure positive, and every
mask of the drive allowing the instance's next token."""
from __future__ import annotations

import json
import numbers

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("tokenizers")

import benchmarks.structured.grammar_backends as gb  # noqa: E402

VOCAB = 2000


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return gb.make_bpe_tokenizer(str(tmp_path_factory.mktemp("bpe")), VOCAB)


def _figures(x, path=""):
    """Every timing in a result: (path, value) for keys ending _s / _ms / _us and the
    compile samples."""
    if isinstance(x, dict):
        for k, v in x.items():
            if isinstance(v, numbers.Real) and not isinstance(v, bool) and \
                    k.endswith(("_s", "_ms", "_us")):
                yield f"{path}/{k}", v
            elif k == "samples":
                for name, vals in v.items():
                    for i, s in enumerate(vals):
                        yield f"{path}/samples/{name}[{i}]", s
            else:
                yield from _figures(v, f"{path}/{k}")


def test_tokenizer_is_a_trained_byte_level_bpe(hf, tmp_path):
    assert len(hf) == VOCAB
    assert hf.eos_token == gb.EOS and hf.eos_token_id is not None
    text = json.dumps(gb.MEDIUM_INSTANCE, separators=(",", ":"))
    ids = hf.encode(text, add_special_tokens=False)
    assert hf.decode(ids) == text
    assert len(ids) < len(text) / 2          # real merges: well under a token per byte
    assert hf.encode("é ☃", add_special_tokens=False)   # any bytes encode
    toks = gb.instance_tokens(hf)
    assert toks[:-1] == ids and toks[-1] == hf.eos_token_id


def test_the_medium_instance_fits_the_medium_schema():
    schema, inst = gb.MEDIUM_SCHEMA, gb.MEDIUM_INSTANCE
    assert list(inst) == [p for p in schema["properties"] if p in inst]   # schema order
    assert set(schema["required"]) <= set(inst)
    assert len(schema["properties"]) >= 10


def test_a_mask_refuses_what_the_grammar_does_not_allow(hf):
    """The check the drive makes can fail: at the start of the medium schema only `{`
    (or whitespace) may come, not the instance's second token nor EOS."""
    b = gb.LLGuidance(hf, threads=1)
    m, _ = b.compile_cold(gb.grammar_kinds()["json_schema (medium)"])
    bitmask = b.new_bitmask(1)
    b.fill(m, bitmask, 0)
    bits = b.bits(bitmask)
    toks = gb.instance_tokens(hf)
    assert gb.token_allowed(bits, 0, toks[0])
    assert not gb.token_allowed(bits, 0, toks[1])
    assert not gb.token_allowed(bits, 0, hf.eos_token_id)
    # a drive through something that is not an instance is caught
    bad = hf.encode('{"id":"x"}', add_special_tokens=False) + [hf.eos_token_id]
    _, kept = b.compile_cold(gb.grammar_kinds()["json_schema (medium)"])
    r = gb.drive_one(b, kept, bad, passes=1)
    assert r["disallowed"] and r["rejected"]
    failed = {"rows_1": {"disallowed_steps": 0, "rejected_tokens": 0},
              "batched": {"threads_1": {"rows_8": {"disallowed_steps": 3,
                                                   "rejected_tokens": 1}}}}
    assert gb.mask_failures(failed) == {"rows_8_threads_1": (3, 1)}


@pytest.fixture(scope="module")
def run(hf, tmp_path_factory) -> tuple[dict, object]:
    """One main() at toy size with xgrammar reported missing: the llguidance figures and
    the files it writes (one run: the backend's drive is most of a test's time)."""
    tmp = tmp_path_factory.mktemp("grammar_run")
    hf.save_pretrained(tmp / "tok")
    real = gb.installed
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gb, "installed", lambda name: None if name == "xgrammar" else real(name))
        # --threads 2 without --batch-threads: the batched drive runs on 1 and 2 threads
        results = gb.main(["--output-dir", str(tmp / "out"), "--vocab-size", str(VOCAB),
                           "--tokenizer-dir", str(tmp / "tok"), "--repeats", "2",
                           "--passes", "2", "--batch-rows", "4", "--batch-steps", "12",
                           "--threads", "2"])
    return results, tmp / "out"


def test_llguidance_run_at_toy_size(run, hf):
    r = run[0]["backends"]["llguidance"]
    assert r["installed"] and r["vocab_size"] == VOCAB
    assert set(r["compile"]) == set(gb.grammar_kinds())
    for label, c in r["compile"].items():
        assert "error" not in c, (label, c)
        assert all(len(v) == 2 for v in c["samples"].values())
    assert set(r["compile_medium_schema_parts_s"]) == set(gb.MEDIUM_SCHEMA["properties"])
    mask = r["mask"]
    assert mask["tokens_per_pass"] == len(gb.instance_tokens(hf))
    assert set(mask) == {"tokens_per_pass", "rows_1", "batched"}
    assert set(mask["batched"]) == {"threads_1", "threads_2"}
    assert mask["rows_1"]["step"]["steps"] == mask["tokens_per_pass"]   # passes after the 1st
    drives = [mask["rows_1"]]
    for by_rows in mask["batched"].values():
        assert set(by_rows) == {"rows_4"} and by_rows["rows_4"]["step"]["steps"] == 12
        drives.append(by_rows["rows_4"])
    for d in drives:   # every mask allowed the instance's next token
        assert d["disallowed_steps"] == 0 and d["rejected_tokens"] == 0
    assert gb.mask_failures(mask) == {}
    assert len(mask["rows_1"]["slowest_steps"]) == 5
    figures = list(_figures(r))
    assert len(figures) > 50
    bad = [(p, v) for p, v in figures if not v > 0]
    assert not bad, bad
    s = mask["rows_1"]["step"]
    assert s["p50_us"] <= s["p99_us"] <= s["max_us"]
    probes = r["features"]["probes"]
    for f in ("pattern", "format: email", "minItems / maxItems", "anyOf",
              "$ref / $defs (recursive)", "regex", "choice", "Lark grammar",
              "GBNF / EBNF grammar", "structural tag (tool call in text)",
              "rollback (speculative decoding)"):
        assert probes[f] == "yes", (f, probes[f])
    errors = r["features"]["invalid_input_errors"]
    assert set(errors) == {what for what, _ in gb.INVALID_INPUTS}
    assert all(e and e != "ACCEPTED (no error)" for e in errors.values()), errors


def test_main_writes_results_and_reports_a_missing_backend(run):
    results, out = run
    assert results["config"]["batch_threads"] == [1, 2]
    assert results["backends"]["xgrammar"] == {"installed": False}
    assert "xgrammar" not in results["packages"]
    doc = json.loads((out / "grammar_backends.json").read_text())
    assert doc["benchmark"] == "grammar_backends" and doc["machine"]["cpu_count"]
    assert doc["results"]["backends"]["llguidance"]["installed"]
    assert doc["config"]["vocab_size"] == VOCAB
    md = (out / "grammar_backends.md").read_text()
    assert "| xgrammar | not installed |" in md
    for heading in ("## Compile", "## Mask + consume", "## Batched", "## Slowest steps",
                    "## Cold compile of each", "## Features", "## Error text", "## Packages"):
        assert heading in md
    assert not any(n.startswith("WARNING: llguidance") for n in doc["notes"])
