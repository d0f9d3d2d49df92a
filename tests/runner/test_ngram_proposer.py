"""Speculative decoding's host-side pieces, exactly: ngram_propose (prompt lookup: the
longest recurring suffix within [n_min, n_max], its most recent earlier occurrence, the
k tokens that followed it) and num_accepted (the drafts' prefix equal to the draws)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from jaxserve.runner.spec_decode import ngram_propose, num_accepted


def propose(tokens, n_min=2, n_max=5, k=3):
    out = ngram_propose(np.asarray(tokens, np.int32), n_min, n_max, k)
    assert isinstance(out, list) and all(type(t) is int for t in out)
    return out


def reference(tokens, n_min, n_max, k):
    """Brute force: for each suffix length from the longest allowed down, the earlier
    positions where that suffix ends (they may overlap the suffix itself): the most
    recent one that k tokens follow, else the earliest."""
    n = len(tokens)
    if k < 1:
        return []
    for length in range(min(n_max, n - 1), n_min - 1, -1):
        suffix = tokens[n - length:]
        ends = [end for end in range(length - 1, n - 1)
                if tokens[end - length + 1:end + 1] == suffix]
        if ends:
            full = [end for end in ends if end + k <= n - 1]
            end = full[-1] if full else ends[0]
            return tokens[end + 1:end + 1 + k]
    return []


# ---- ngram_propose -----------------------------------------------------------------------

def test_basic_lookup():
    # Suffix [1, 2] occurred at 0..1; [3, 4, 1] followed it.
    assert propose([1, 2, 3, 4, 1, 2], k=3) == [3, 4, 1]
    assert propose([1, 2, 3, 4, 1, 2], k=1) == [3]


def test_no_match_gives_nothing():
    assert propose([1, 2, 3, 4, 5, 6]) == []
    # The last token recurs, but no suffix of n_min = 2 does.
    assert propose([1, 2, 3, 4, 5, 2], n_min=2) == []
    assert propose([1, 2, 3, 4, 5, 2], n_min=1) == [3, 4, 5]


def test_longest_match_preferred_over_more_recent_shorter_one():
    # Suffix [7, 8, 9]: [8, 9] occurs most recently at 5..6 (followed by 50), but the
    # longer [7, 8, 9] occurs at 0..2 (followed by 10): the longer one wins.
    toks = [7, 8, 9, 10, 11, 8, 9, 50, 7, 8, 9]
    assert propose(toks, n_min=2, n_max=5, k=2) == [10, 11]
    # Capped at n_max = 2 the two occurrences tie: the most recent one wins.
    assert propose(toks, n_min=2, n_max=2, k=2) == [50, 7]


def test_most_recent_occurrence_on_ties():
    # [1, 2] occurs at 0..1 (then 3) and 3..4 (then 4): the most recent.
    assert propose([1, 2, 3, 1, 2, 4, 5, 1, 2], k=2) == [4, 5]
    # Equally long matches past n_max tie too: [5, 1, 2] and [6, 1, 2] at n_max = 2.
    assert propose([5, 1, 2, 30, 6, 1, 2, 40, 7, 1, 2], n_max=2, k=1) == [40]
    # ... but with n_max = 3 no 3-gram recurs, so the 2-gram's most recent still wins.
    assert propose([5, 1, 2, 30, 6, 1, 2, 40, 7, 1, 2], n_max=3, k=1) == [40]


def test_n_max_caps_the_match_length():
    # The whole [1, 2, 3, 4] recurs at 0..3 (then 100); a most recent [3, 4] at 6..7
    # (then 200). n_max = 4 prefers the long one, n_max < 4 sees two ties of length
    # n_max and takes the most recent (its 3-gram [2, 3, 4] does not recur there).
    toks = [1, 2, 3, 4, 100, 9, 3, 4, 200, 1, 2, 3, 4]
    assert propose(toks, n_min=2, n_max=4, k=1) == [100]
    assert propose(toks, n_min=2, n_max=5, k=1) == [100]
    assert propose(toks, n_min=2, n_max=2, k=1) == [200]
    assert propose(toks, n_min=2, n_max=3, k=1) == [100]   # [2, 3, 4] recurs only at 1..3


def test_n_min_bounds_the_match_length():
    toks = [1, 2, 3, 9, 2, 3]     # [2, 3] recurs; no 3-gram does
    assert propose(toks, n_min=2, n_max=5, k=2) == [9, 2]
    assert propose(toks, n_min=3, n_max=5, k=2) == []
    assert propose(toks, n_min=1, n_max=1, k=2) == [9, 2]   # the 1-gram [3] at 2
    # n_min = n_max selects exactly that length.
    toks = [4, 1, 2, 3, 8, 0, 1, 2, 3, 9, 1, 2, 3]
    assert propose(toks, n_min=3, n_max=3, k=1) == [9]    # [1, 2, 3], most recent
    assert propose(toks, n_min=4, n_max=4, k=1) == []     # no 4-gram recurs


def test_k_truncates_and_the_sequence_end_shortens():
    toks = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose(toks, k=1) == [3]
    assert propose(toks, k=4) == [3, 4, 5, 6]
    assert propose(toks, k=16) == [3, 4, 5, 6, 1, 2]   # up to the end of the sequence
    assert propose(toks, k=0) == []


def test_overlap_with_the_suffix():
    # A run: the longest recurring suffix [1, 1, 1] occurs only overlapping itself,
    # ending one position before the end, so only the last token follows it.
    assert propose([1, 1, 1, 1], n_min=2, n_max=5, k=3) == [1]
    # A period-2 pattern: the suffix [2, 1, 2, 1] (n_max = 4) recurs at 1..4, overlapping
    # it, followed by the last two tokens.
    assert propose([1, 2, 1, 2, 1, 2, 1], n_min=2, n_max=4, k=3) == [2, 1]
    # With n_max = 2, [2, 1] occurs at 1..2 and 3..4: only the first has k = 3 tokens
    # after it, so it is taken over the more recent one.
    assert propose([1, 2, 1, 2, 1, 2, 1], n_min=2, n_max=2, k=3) == [2, 1, 2]
    # Period 3, n_max = 3: [3, 1, 2] recurs at 2..4 (then 3, 1, 2).
    assert propose([1, 2, 3, 1, 2, 3, 1, 2], n_min=2, n_max=3, k=4) == [3, 1, 2]


def test_short_sequences():
    assert propose([], n_min=1) == []
    assert propose([5], n_min=1) == []
    assert propose([5, 5], n_min=1, k=3) == [5]
    assert propose([5, 5], n_min=2) == []          # a 2-gram needs 3 tokens
    assert propose([5, 5, 5], n_min=2, k=3) == [5]
    assert propose([5, 6], n_min=1) == []


def test_against_brute_force():
    rng = random.Random(0)
    for _ in range(3000):
        n = rng.randrange(0, 40)
        vocab = rng.choice([2, 3, 5, 20])
        toks = [rng.randrange(vocab) for _ in range(n)]
        n_min = rng.randrange(1, 5)
        n_max = rng.randrange(n_min, 8)
        k = rng.randrange(0, 6)
        assert propose(toks, n_min, n_max, k) == reference(toks, n_min, n_max, k), \
            (toks, n_min, n_max, k)


def test_reads_only_the_given_tokens():
    # The runner passes a view of its row up to num_tokens: padding after it is unseen.
    row = np.array([1, 2, 3, 1, 2, 77, 77, 77], np.int32)
    assert ngram_propose(row[:5], 2, 5, 3) == [3, 1, 2]


# ---- num_accepted ------------------------------------------------------------------------

@pytest.mark.parametrize("sampled,drafts,want", [
    ([5, 6, 7, 8], [5, 6, 7], 3),      # all accepted (8: the token after them)
    ([5, 6, 7, 8], [4, 6, 7], 0),      # the first rejected: none, even if later ones match
    ([5, 6, 7, 8], [5, 9, 7], 1),
    ([5, 6, 7, 8], [5, 6, 9], 2),
    ([5], [], 0),                      # no drafts
    ([3, 3], [3], 1),
    ([3, 3], [4], 0),
])
def test_num_accepted(sampled, drafts, want):
    got = num_accepted(np.asarray(sampled, np.int32), np.asarray(drafts, np.int32))
    assert type(got) is int and got == want


def test_num_accepted_matches_definition():
    rng = np.random.default_rng(1)
    for _ in range(500):
        k = int(rng.integers(0, 6))
        drafts = rng.integers(0, 3, k)
        sampled = rng.integers(0, 3, k + 1)
        want = 0
        while want < k and drafts[want] == sampled[want]:
            want += 1
        assert num_accepted(sampled, drafts) == want
