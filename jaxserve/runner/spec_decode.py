"""Speculative decoding on the runner's side: proposing drafts, and accepting them.

Verification. A row with drafts d1..dk computes its last known token and the k drafts in
one forward; the sampler draws a token t_j at each of the k + 1 positions (j = 0..k),
from the target's distribution given the prefix before it, with the key of the token
index it would have without drafts (sampler.py: fold_in(seed, step), step = outputs so
far + j). Drafts are accepted while d_{j+1} == t_j; the row's new tokens are the
accepted drafts and then t_a, the first draw that differs (or the draw after the last
draft).

Why that is exact. The proposers here draft deterministically (a point mass q on d).
Rejection sampling accepts d with probability min(1, p(d) / q(d)) = p(d) and otherwise
draws from the residual (p - q)+, normalised: p without d. Drawing t ~ p and accepting
iff t == d gives d with probability p(d) and any other token y with probability p(y):
the same rule. So every token is drawn from the target's distribution given the tokens
before it; for greedy rows t_j is the argmax, so the output is the greedy output. And
because t_j uses the key of its token index, a seeded request draws the very tokens it
draws without speculation (up to the float noise of computing k + 1 positions at once).
"""
from __future__ import annotations

import numpy as np


def ngram_propose(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Prompt lookup: the longest suffix of `tokens` (at most n_max, at least n_min long)
    that also occurs earlier -> up to k tokens that followed it there ([] when no suffix
    of n_min tokens recurs). Among its earlier occurrences the most recent one that k
    tokens follow, else the earliest (the most follow it: in a run or a repeated
    pattern the most recent one overlaps the suffix itself)."""
    n = len(tokens)
    if n < n_min + 1 or k < 1:
        return []
    last = n - 1
    # Earlier positions holding the last token: where a recurring suffix would end.
    ends = np.flatnonzero(tokens[:last] == tokens[last])
    if not ends.size:
        return []
    length = np.ones(len(ends), np.int32)
    alive = np.ones(len(ends), np.bool_)
    for m in range(1, min(n_max, last + 1)):
        alive &= ends >= m
        if not alive.any():
            break
        idx = np.flatnonzero(alive)
        alive[idx] = tokens[ends[idx] - m] == tokens[last - m]
        length += alive
    best = min(int(length.max()), n_max)
    if best < n_min:
        return []
    found = ends[length >= best]
    full = found[found + k <= last]
    end = int(full[-1] if full.size else found[0])
    return tokens[end + 1:end + 1 + k].tolist()


def num_accepted(sampled: np.ndarray, drafts: np.ndarray) -> int:
    """Drafts accepted: the length of the prefix where each draft equals the token drawn
    at the position before it (sampled [k + 1], drafts [k])."""
    mismatch = np.flatnonzero(sampled[:len(drafts)] != drafts)
    return int(mismatch[0]) if mismatch.size else len(drafts)
