"""bad_words as an Aho-Corasick automaton over token ids, built once per request.

A bad word of one token is banned everywhere (the sampler's fixed mask); one of several
tokens bans its last token wherever the output ends with its other tokens. Checking
every word against the output's end costs O(words) per row and step on the engine
thread (3 s a step for 64 rows x 10k words, benchmarks/structured/bad_words.py), so the front
door (engine/input_processor.py, in the caller's thread) builds this automaton
instead. Its state is the longest end of the output that begins some word; an accepted
token moves it along one edge, or down the suffix ("fail") links first, each of which
shortens the state, so a token costs O(1) amortised and at most a word's length. A
state bans the last tokens of the words its children complete, and those of the
shorter ends on its suffix chain, reached through links that skip states banning
nothing: filling a mask row costs O(tokens banned).

Built with numpy, column by column over the sorted words: work in proportion to their
tokens with no Python loop per token. Host only (no jax). Pickled (to the other hosts
of a multi-host run, engine/multihost.py) as its words alone, and rebuilt there.
"""
from __future__ import annotations

from itertools import chain
from typing import Callable, Iterable, Sequence

import numpy as np

ROOT = 0   # the state of an output that ends with no word's beginning (and of an empty one)


class BadWords:
    """The automaton of a request's bad words, as token-id sequences (immutable; every
    row of the request shares it and keeps its own state, an int, from ROOT)."""

    ROOT = ROOT

    def __init__(self, sequences: Iterable[Sequence[int]]):
        words = sorted(set(map(tuple, sequences)) - {()})   # lists of ints, as tokenizers give
        lens = np.fromiter(map(len, words), np.int64, len(words))
        self._build(np.fromiter(chain.from_iterable(words), np.int64, int(lens.sum())), lens)

    # ---- use ---------------------------------------------------------------------------
    @property
    def singles(self) -> np.ndarray:
        """The words of one token: banned whatever the output (the fixed mask)."""
        return self._own(ROOT)

    @property
    def has_sequences(self) -> bool:
        """Whether some word has several tokens (the mask then follows the output)."""
        return bool((self._lens > 1).any())

    def next(self, state: int, token: int) -> int:
        """The state after `state` accepts `token`."""
        token = int(token)
        while True:
            child = self._child(state, token)
            if child >= 0:
                return child
            if state == ROOT:
                return ROOT
            state = int(self._fail[state])

    def banned(self, state: int) -> np.ndarray:
        """Tokens banned next in `state` by the words of several tokens (may repeat)."""
        s = state if state != ROOT and self._start[state + 1] > self._start[state] \
            else int(self._link[state])
        parts = []
        while s >= 0:
            parts.append(self._own(s))
            s = int(self._link[s])
        return np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else \
            self._tokens[:0]

    def __reduce__(self) -> tuple[Callable[[np.ndarray, np.ndarray], BadWords],
                                  tuple[np.ndarray, np.ndarray]]:
        # sorted and distinct already: rebuilt as they are (int32: token ids fit)
        return _rebuild, (self._flat.astype(np.int32), self._lens.astype(np.int32))

    def __len__(self) -> int:
        """The number of distinct token sequences."""
        return len(self._lens)

    # ---- the automaton -----------------------------------------------------------------
    def _own(self, state: int) -> np.ndarray:
        return self._tokens[self._start[state]:self._start[state + 1]]

    def _child(self, state: int, token: int) -> int:
        key = (state << 32) | token
        i = int(np.searchsorted(self._keys, key))
        return int(self._children[i]) if i < len(self._keys) and self._keys[i] == key else -1

    def _build(self, flat: np.ndarray, lens: np.ndarray) -> None:
        """From the words, sorted and distinct: flat tokens and each word's length."""
        self._flat, self._lens = flat, lens
        parent, token, terminal, self._levels = _trie(flat, lens)
        n = len(parent)
        # Edges (parent, token) -> child, sorted by key for np.searchsorted.
        keys = (parent[1:] << 32) | token[1:]
        order = np.argsort(keys)
        self._keys, self._children = keys[order], order + 1
        self._fail = fail = self._fail_links(parent, token)
        # Each state's own banned tokens: the last token of each word its child completes.
        ends = np.flatnonzero(terminal)
        ends = ends[np.argsort(parent[ends], kind="stable")]
        self._tokens = token[ends]
        self._start = np.concatenate(([0], np.cumsum(np.bincount(parent[ends], minlength=n))))
        # link: the next state down the suffix chain, not the root, that bans a token.
        bans = np.diff(self._start) > 0
        bans[ROOT] = False
        self._link = link = np.full(n, -1, np.int64)
        for lo, hi in self._levels:
            f = fail[lo:hi]
            link[lo:hi] = np.where(bans[f], f, link[f])

    def _fail_links(self, parent: np.ndarray, token: np.ndarray) -> np.ndarray:
        """fail[s]: the longest proper end of s's tokens that is a state, level by level
        (it is shorter than s, so known before s's level)."""
        fail = np.zeros(len(parent), np.int64)
        for lo, hi in self._levels[1:]:   # a one-token state's proper end is empty
            out = np.zeros(hi - lo, np.int64)
            cand, tok = fail[parent[lo:hi]], token[lo:hi]
            todo = np.arange(hi - lo)
            while len(todo):
                child = self._children_of(cand[todo], tok[todo])
                hit = child >= 0
                out[todo[hit]] = child[hit]
                todo = todo[~hit & (cand[todo] != ROOT)]   # missed at the root: ROOT
                cand[todo] = fail[cand[todo]]
            fail[lo:hi] = out
        return fail

    def _children_of(self, states: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        keys = (states << 32) | tokens
        i = np.minimum(np.searchsorted(self._keys, keys), len(self._keys) - 1)
        return np.where(self._keys[i] == keys, self._children[i], -1)


def _rebuild(flat: np.ndarray, lens: np.ndarray) -> BadWords:
    words = BadWords.__new__(BadWords)
    words._build(flat.astype(np.int64), lens.astype(np.int64))
    return words


def _trie(flat: np.ndarray, lens: np.ndarray):
    """The trie of sorted, distinct words (flat tokens, lengths): per state (0 the
    root, then numbered level by level) its parent, its token and whether it ends a
    word; and each level's [first, end) states.

    Column c of the words holds their level-(c+1) states. Sorted, the words that share
    a state are adjacent: a word shares the state of the word before it while their
    first c+1 tokens agree. (A word's last state is never shared: the word before it
    is smaller, so does not extend it.)
    """
    offsets = np.cumsum(lens) - lens
    parent, token, terminal = [np.zeros(1, np.int64)], [np.full(1, -1, np.int64)], \
        [np.zeros(1, bool)]
    levels: list[tuple[int, int]] = []
    state = np.zeros(len(lens), np.int64)     # each word's state at the column before
    agrees = np.arange(len(lens)) > 0         # with the word before, in every column so far
    n = 1
    for c in range(int(lens.max(initial=0))):
        rows = np.flatnonzero(lens > c)
        tok = flat[offsets[rows] + c]
        prev = rows - 1
        alive = (prev >= 0) & agrees[rows]
        alive[alive] &= lens[prev[alive]] > c
        prev_tok = np.full(len(rows), -1, np.int64)
        prev_tok[alive] = flat[offsets[prev[alive]] + c]
        shared = alive & (prev_tok == tok)
        agrees[rows] = shared
        fresh = ~shared                       # rows[0] is always fresh
        k = int(fresh.sum())
        ids = np.where(fresh, n - 1 + np.cumsum(fresh), 0)
        ids = ids[np.maximum.accumulate(np.where(fresh, np.arange(len(rows)), 0))]
        parent.append(state[rows][fresh])
        token.append(tok[fresh])
        terminal.append((lens[rows] == c + 1)[fresh])
        levels.append((n, n + k))
        state[rows] = ids
        n += k
    return (np.concatenate(parent), np.concatenate(token), np.concatenate(terminal), levels)
