from __future__ import annotations

import random

import pytest

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.checkpoints.tiny_tokenizer import make_tiny_tokenizer

TEXTS = [
    "Hello, my name is Alice and I like to write code.",
    "héllo wörld 日本 ça va? naïve café",
    "The capital of Japan is Tokyo 東京. 日本日本日本!",
    "def main():\n\treturn 42  # the answer",
    " leading space and trailing space ",
]


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def feed(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int]):
    """Feed ids in chunks; returns (stop string or None, output_text after each update)."""
    snapshots, i, k = [], 0, 0
    while i < len(ids):
        n = chunk_sizes[k % len(chunk_sizes)]
        stop = detok.update(ids[i : i + n])
        snapshots.append(detok.output_text)
        i, k = i + n, k + 1
        if stop is not None:
            return stop, snapshots
    return None, snapshots


def test_tiny_tokenizer_splits_multibyte_chars(tok):
    # The test below is only meaningful if some token ends mid-character.
    pieces = [tok.decode([t]) for t in encode(tok, "日本 東京")]
    assert any("\ufffd" in p for p in pieces)
    assert len(tok) == 256 and (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunks", [[1], [2, 1, 3], [100]])
def test_incremental_text_equals_full_decode(tok, text, chunks):
    prompt = tok.encode("The prompt: 日本")
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    stop, snapshots = feed(detok, ids, chunks)
    assert stop is None
    # Text is never emitted mid-character, so every prefix is valid text.
    assert all("\ufffd" not in s for s in snapshots)
    assert all(text.startswith(s) for s in snapshots)
    assert detok.finalize() == tok.decode(ids, skip_special_tokens=True) == text
    assert detok.token_ids == ids


def test_random_ids_match_full_decode(tok):
    rng = random.Random(0)
    for trial in range(20):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            detok = IncrementalDetokenizer(tok, [1, 50, 60], skip_special_tokens=skip)
            for t in ids:
                detok.update([t])
            assert detok.finalize() == tok.decode(ids, skip_special_tokens=skip), (trial, ids)


def test_special_tokens_kept_or_skipped(tok):
    ids = encode(tok, "Hello") + [tok.eos_token_id] + encode(tok, " world")
    kept = IncrementalDetokenizer(tok, None, skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tok, None, skip_special_tokens=True)
    for t in ids:
        kept.update([t])
        skipped.update([t])
    assert kept.finalize() == "Hello</s> world"
    assert skipped.finalize() == "Hello world"


def test_lazy_mode_decodes_only_at_finalize(tok):
    ids = encode(tok, TEXTS[1])
    detok = IncrementalDetokenizer(tok, tok.encode("x"), incremental=False)
    for t in ids:
        assert detok.update([t]) is None
    assert detok.output_text == ""  # nothing decoded yet
    assert detok.finalize() == TEXTS[1]
    # Stop strings need incremental detection, so they switch lazy mode off.
    assert IncrementalDetokenizer(tok, None, stop=["x"], incremental=False).incremental


def run_stop(tok, text, stop, include=False, chunks=(1,), min_tokens=0):
    detok = IncrementalDetokenizer(
        tok, tok.encode("Q:"), stop=stop, include_stop_str_in_output=include, min_tokens=min_tokens
    )
    found, _ = feed(detok, encode(tok, text), list(chunks))
    return found, detok


def test_stop_string_spanning_token_boundaries(tok):
    text = "The quick brown fox jumps over the lazy dog."
    ids = encode(tok, text)
    # Pick a stop string that starts inside one token and ends inside a later one.
    pieces = [tok.decode([t]) for t in ids]
    assert any(len(p) > 1 for p in pieces)
    stop = "ick bro"
    assert not any(stop in p for p in pieces)
    found, detok = run_stop(tok, text, [stop])
    assert found == stop and detok.stop_reason == stop
    assert detok.output_text == "The qu"
    # Tokens up to the one that completed the stop string were consumed, no more.
    consumed = tok.decode(detok.token_ids)
    assert stop in consumed and stop not in tok.decode(detok.token_ids[:-1])


@pytest.mark.parametrize("chunks", [(1,), (3,), (1000,)])
def test_include_stop_str_in_output(tok, chunks):
    found, detok = run_stop(tok, "Once upon a time, there was", ["time,", "zzz"], True, chunks)
    assert found == "time," and detok.output_text == "Once upon a time,"
    found, detok = run_stop(tok, "Once upon a time, there was", ["time,"], False, chunks)
    assert found == "time," and detok.output_text == "Once upon a "


def test_earliest_stop_wins_and_multibyte_stop(tok):
    found, detok = run_stop(tok, "abc 日本 xyz", ["xyz", "本"], chunks=(1000,))
    assert found == "本" and detok.output_text == "abc 日"
    found, detok = run_stop(tok, "no stop here", ["zzz"])
    assert found is None and detok.finalize() == "no stop here"


def test_updates_after_stop_add_no_text(tok):
    found, detok = run_stop(tok, "one two three", [" two"])
    assert found == " two" and detok.output_text == "one"
    assert detok.update(encode(tok, " more text")) is None
    assert detok.output_text == "one" and detok.finalize() == "one"


def test_min_tokens_defers_stop_checks(tok):
    text = "stop here, and stop again"
    n_first = len(encode(tok, "stop"))
    found, detok = run_stop(tok, text, ["stop"], min_tokens=n_first + 2)
    # The first "stop" lies within min_tokens and is never re-scanned later.
    assert found == "stop" and detok.output_text == "stop here, and "


def test_streaming_holds_back_possible_stop_prefix(tok):
    detok = IncrementalDetokenizer(tok, None, stop=["END"])
    streamed = []
    for t in encode(tok, "abcEN"):
        detok.update([t])
        streamed.append(detok.get_next_output_text(finished=False, delta=True))
    # "EN" might become "END", so it is not streamed yet.
    assert "".join(streamed) == "abc"
    assert detok.get_next_output_text(finished=True, delta=True) == "EN"
    assert detok.get_next_output_text(finished=True, delta=False) == "abcEN"


def test_decode_token(tok):
    ids = encode(tok, "Hello")
    detok = IncrementalDetokenizer(tok, None)
    assert "".join(detok.decode_token(t) for t in ids) == "Hello"
    assert detok.decode_token(tok.eos_token_id) == "</s>"


def test_saved_tokenizer_round_trips(tmp_path):
    from transformers import AutoTokenizer

    make_tiny_tokenizer(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded.encode(TEXTS[1]) == make_tiny_tokenizer().encode(TEXTS[1])
    prompt = loaded.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<s>user: hi\nassistant:"
