"""benchmarks.step.detokenizer on the tiny tokenizer, and the decoders it measures on a small
SentencePiece-style tokenizer (byte fallback, leading-space strip): every one's text
equals a full decode after the prompt's context (so the first output token keeps its
leading space), special tokens skipped or kept."""
from __future__ import annotations

import json

import pytest

from benchmarks.step.detokenizer import (StreamDetokenizer, main, make_sp_tokenizer, run_updates,
                                         text_after, token_stream)
from benchmarks.structured.grammar_tokenizer import corpus
from jaxserve.engine.detokenizer import IncrementalDetokenizer


def test_detokenizer_bench(tmp_path):
    main(["--tokenizers", "tiny", "--num-tokens", "600", "--repeats", "2",
          "--output-dir", str(tmp_path)])
    doc = json.loads((tmp_path / "detokenizer.json").read_text())
    rows = doc["results"]["rows"]
    assert {(r["mode"], r["decoder"]) for r in rows} == {
        ("streaming", "hand-written"), ("streaming", "DecodeStream"),
        ("streaming", "DecodeStream-backed"), ("lazy", "hand-written"),
        ("lazy", "DecodeStream-backed")}
    assert all(r["us_per_token"] > 0 and len(r["runs_s"]) == 2 for r in rows)
    checks = doc["results"]["text_equals_full_decode"]
    assert len(checks) == 4 and all(ok is True for v in checks.values() for ok in v.values())


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory):
    return make_sp_tokenizer(str(tmp_path_factory.mktemp("sp")), 700, corpus(0, 60_000))


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("lazy", [False, True])
def test_decoders_match_full_decode_on_sentencepiece_style(sp_tok, skip, lazy):
    ids = token_stream(sp_tok, 900)
    assert sp_tok.eos_token_id in ids
    # multi-byte text falls back to <0xNN> byte tokens in this small vocabulary
    assert any(sp_tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids)
    context = sp_tok.encode("The answer:", add_special_tokens=False)[-5:]
    want = text_after(sp_tok, context, ids, skip)
    assert want.startswith(" ") and not sp_tok.decode(ids).startswith(" ")
    for cls in (IncrementalDetokenizer, StreamDetokenizer):
        got = run_updates(lambda: cls(sp_tok, context, skip_special_tokens=skip,
                                      incremental=not lazy), ids)
        assert got == want, cls.__name__


def test_stream_detokenizer_flushes_an_incomplete_tail(sp_tok):
    ids = sp_tok.encode("ok 日本", add_special_tokens=False)
    cut = ids[:-1]   # the last character's final byte token is missing
    texts = []
    for cls in (IncrementalDetokenizer, StreamDetokenizer):
        detok = cls(sp_tok, None)
        for t in cut:
            detok.update([t])
        texts.append(detok.finalize())
    # "日" was emitted before the broken tail, which finalize adds as U+FFFDs.
    assert texts[0] == texts[1] and texts[1].startswith("ok 日") and texts[1].endswith("\ufffd")
