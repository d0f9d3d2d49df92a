"""bad_words: the automaton (jaxserve/engine/bad_words.py) bans exactly what checking every
word against the output's end bans, over random word sets, after every token, also
rebuilt from its pickle; a row's constraints follow it through speculative windows and
a resume after preemption; and the front door bounds the words and their tokens."""
from __future__ import annotations

import pickle
import random

import numpy as np
import pytest

from jaxserve.engine.bad_words import BadWords
from jaxserve.errors import InputError
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.runner.token_constraints import ALL_ALLOWED, DynamicConstraints, static_mask
from jaxserve.sampling_params import (MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_BAD_WORDS_CHARS,
                                      SamplingParams)

V = 70


def brute_banned(words, output) -> set[int]:
    """The rule itself: a word's last token is banned where the output ends with the rest."""
    return {w[-1] for w in words if len(w) > 1 and len(output) >= len(w) - 1
            and tuple(output[len(output) - len(w) + 1:]) == tuple(w[:-1])}


def random_words(rng: random.Random, alphabet: int) -> list[list[int]]:
    """Few symbols and repeats: words that share prefixes, end inside one another and
    are prefixes of one another, so the suffix links are exercised."""
    return [[rng.randrange(alphabet) for _ in range(rng.randint(1, 6))]
            for _ in range(rng.randint(0, 40))]


@pytest.mark.parametrize("seed", range(6))
def test_the_automaton_bans_what_the_rule_bans(seed):
    rng = random.Random(seed)
    for _ in range(40):
        alphabet = rng.choice([2, 3, 6, V])
        words = random_words(rng, alphabet)
        automata = [BadWords(words)]
        automata.append(pickle.loads(pickle.dumps(automata[0])))   # as another host gets it
        assert sorted(automata[1].singles.tolist()) == sorted({w[0] for w in words
                                                               if len(w) == 1})
        assert automata[0].has_sequences == any(len(w) > 1 for w in words)
        states = [BadWords.ROOT] * 2
        output: list[int] = []
        for _ in range(50):
            want = brute_banned(words, output)
            for a, s in zip(automata, states):
                assert set(a.banned(s).tolist()) == want, (words, output)
            t = rng.randrange(alphabet)
            output.append(t)
            states = [a.next(s, t) for a, s in zip(automata, states)]


def test_the_pickle_carries_the_words_not_the_automaton():
    words = [[i, i + 1, i + 2] for i in range(0, 3000, 3)]
    size = len(pickle.dumps(BadWords(words)))
    assert size < 3000 * 4 + 1000 * 4 + 1000   # int32 tokens and lengths, and little else


def _banned_in(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:V]
    return set(np.flatnonzero(bits == 0).tolist())


@pytest.mark.parametrize("seed", range(3))
def test_rows_follow_the_output_through_drafts_and_resumes(seed):
    """fill after each accepted token; fill_window masks position j by the outputs up to
    draft j, stops after a banned draft and leaves the state where it was; a row built
    from outputs (a resume after preemption) starts where the first one is."""
    rng = random.Random(seed)
    words = random_words(rng, 3) + [[0, 1]]
    params = SamplingParams(bad_words=["w"], bad_words_automaton=BadWords(words))
    assert DynamicConstraints.wanted(params)
    row = DynamicConstraints(params, [])
    output: list[int] = []
    for _ in range(40):
        mask = np.full((1, 3), ALL_ALLOWED, np.uint32)
        row.fill(mask[0])
        assert _banned_in(mask[0]) == brute_banned(words, output)
        drafts = [rng.randrange(3) for _ in range(rng.randint(0, 4))]
        masks = np.full((len(drafts) + 1, 3), ALL_ALLOWED, np.uint32)
        row.fill_window(masks, np.array(output + drafts, np.int32), len(drafts))
        banned_at = [i for i, d in enumerate(drafts)
                     if d in brute_banned(words, output + drafts[:i])]
        stop = banned_at[0] if banned_at else len(drafts)   # no draft after it is filled
        for j in range(len(drafts) + 1):
            if j <= stop:
                assert _banned_in(masks[j]) == brute_banned(words, output + drafts[:j])
            else:
                assert (masks[j] == ALL_ALLOWED).all()
        t = rng.choice(sorted(set(range(3)) - brute_banned(words, output)) or [0])
        output.append(t)
        row.accept(t)
        resumed = DynamicConstraints(params, output)
        for r in (row, resumed):
            mask = np.full(3, ALL_ALLOWED, np.uint32)
            r.fill(mask)
            assert _banned_in(mask) == brute_banned(words, output)


def test_one_token_words_are_the_fixed_mask():
    params = SamplingParams(bad_words=["w"], bad_words_automaton=BadWords([[4], [5, 6]]))
    row = np.full(3, ALL_ALLOWED, np.uint32)
    assert static_mask(params, row) and _banned_in(row) == {4}
    only_single = SamplingParams(bad_words=["w"], bad_words_automaton=BadWords([[4]]))
    assert not DynamicConstraints.wanted(only_single)


class _Chars:
    """A tokenizer of one token per character (code point mod V)."""

    def get_vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(V)}

    def __call__(self, text, add_special_tokens=True):
        ids = ([[ord(c) % V for c in t] for t in text] if isinstance(text, list)
               else [ord(c) % V for c in text])
        return type("Encoding", (), {"input_ids": ids})()


@pytest.fixture
def inputs() -> InputProcessor:
    return InputProcessor(tokenizer=_Chars(), vocab_size=V, max_model_len=32)


def test_the_front_door_bans_both_spellings(inputs):
    req = inputs.process("r", [1], SamplingParams(bad_words=[" ab", "c"]))
    automaton = req.sampling_params.bad_words_automaton
    assert sorted(automaton.singles.tolist()) == [ord("c") % V]
    a, b, c, space = (ord(x) % V for x in "abc ")
    words = [[a, b], [space, a, b], [space, c]]
    state = BadWords.ROOT
    output = [space, a, space, space, a]
    for t in output:
        state = automaton.next(state, t)
    assert set(automaton.banned(state).tolist()) == brute_banned(words, output) == {b}


def test_the_front_door_bounds_bad_words(inputs, monkeypatch):
    with pytest.raises(InputError, match=f"at most {MAX_BAD_WORDS} words") as e:
        SamplingParams(bad_words=["x"] * (MAX_BAD_WORDS + 1))
    assert e.value.param == "bad_words"
    with pytest.raises(InputError, match=f"{MAX_BAD_WORDS_CHARS} characters") as e:
        SamplingParams(bad_words=["x" * (MAX_BAD_WORDS_CHARS + 1)])
    assert e.value.param == "bad_words" and len(str(e.value)) < 200
    long = "y" * MAX_BAD_WORD_TOKENS   # after a space: one token too many
    with pytest.raises(InputError, match=r"bad_words\[1\] is 65 tokens") as e:
        inputs.process("r", [1], SamplingParams(bad_words=["ok", long]))
    assert e.value.param == "bad_words"
    monkeypatch.setattr("jaxserve.engine.input_processor.MAX_BAD_WORDS_TOKENS", 10)
    with pytest.raises(InputError, match="bad_words are 12 tokens.*at most 10"):
        inputs.process("r", [1], SamplingParams(bad_words=["abcd", "e"]))
    assert inputs.process("r", [1], SamplingParams(bad_words=["abc"])) is not None
