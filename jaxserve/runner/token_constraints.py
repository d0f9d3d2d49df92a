"""Host side of the sampler's token constraints: the per-row bitmask (sampler.token_mask)
and logit-bias arrays, built from a request's SamplingParams.

Static constraints (allowed_token_ids, one-token bad words) are fixed for a request and
written once, when its row is added. Dynamic ones are recomputed before each step that
samples: bad words of several tokens (banned only where the output ends with the
word's other tokens: an automaton, jaxserve/engine/bad_words.py) and a structured-output
grammar (jaxserve/engine/grammar.py); both advance by every sampled token.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

ALL_ALLOWED = np.uint32(0xFFFFFFFF)


def set_tokens(mask_row: np.ndarray, token_ids: Sequence[int], allowed: bool) -> None:
    """Sets (allowed) or clears the bits of token_ids in a uint32 mask row."""
    ids = np.asarray(token_ids, np.int64)
    bits = np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32))
    if allowed:
        np.bitwise_or.at(mask_row, ids // 32, bits)
    else:
        np.bitwise_and.at(mask_row, ids // 32, ~bits)


def static_mask(params: Any, mask_row: np.ndarray) -> bool:
    """Writes the request's fixed constraints into mask_row; whether it has any."""
    mask_row[:] = ALL_ALLOWED
    if params.allowed_token_ids:
        mask_row[:] = 0
        set_tokens(mask_row, params.allowed_token_ids, True)
    bad = params.bad_words_automaton     # jaxserve/engine/bad_words.py BadWords
    singles = bad.singles if bad is not None else ()
    if len(singles):
        set_tokens(mask_row, singles, False)
    return bool(params.allowed_token_ids or len(singles))


def bias_row(params: Any, vocab_size: int, ids_row: np.ndarray, values_row: np.ndarray) -> bool:
    """Writes logit_bias into a row of the sampler's bias arrays (unused entries point at
    vocab_size, which the sampler drops); whether it has any."""
    ids_row[:] = vocab_size
    values_row[:] = 0.0
    bias = params.logit_bias or {}     # at most MAX_LOGIT_BIAS entries (SamplingParams)
    ids_row[:len(bias)] = list(bias)
    values_row[:len(bias)] = list(bias.values())
    return bool(bias)


class DynamicConstraints:
    """The constraints of one sequence that change as it generates."""

    def __init__(self, params: Any, output_token_ids: Sequence[int]):
        # bad words of several tokens: the automaton and this sequence's state in it
        bad = params.bad_words_automaton
        self.bad_words = bad if bad is not None and bad.has_sequences else None
        self._bad_state = bad.ROOT if self.bad_words is not None else 0
        self.grammar = params.grammar.matcher() if params.grammar is not None else None
        # Reasoning first: the grammar waits until the output ends with these tokens.
        self._after = tuple(params.grammar_after_ids or ())
        self._recent: tuple[int, ...] = ()
        for t in output_token_ids:          # a request resumed after preemption
            self.accept(t)

    @staticmethod
    def wanted(params: Any) -> bool:
        bad = params.bad_words_automaton
        return params.grammar is not None or (bad is not None and bad.has_sequences)

    def fill(self, mask_row: np.ndarray) -> None:
        """mask_row &= what may come next after the tokens accepted so far."""
        if self.bad_words is not None:
            banned = self.bad_words.banned(self._bad_state)
            if len(banned):
                set_tokens(mask_row, banned, False)
        if self.grammar is not None and not self._after:
            self.grammar.fill(mask_row)

    def fill_window(self, masks: np.ndarray, output_token_ids: np.ndarray,
                    num_drafts: int) -> None:
        """Speculative decoding: masks[j] &= what may come next after the outputs up to
        the j-th draft (the last num_drafts outputs are drafts, j = 0..num_drafts). Past a
        draft its mask forbids, the masks are left as they are: no draft after it can be
        accepted. The constraints end where they began."""
        base = len(output_token_ids) - num_drafts
        saved, consumed = (self._after, self._recent, self._bad_state), 0
        for j in range(num_drafts + 1):
            self.fill(masks[j])
            if j == num_drafts:
                break
            d = int(output_token_ids[base + j])
            if not (int(masks[j][d >> 5]) >> (d & 31)) & 1:
                break
            consumed += self.grammar is not None and not self._after
            self.accept(d)
        if consumed:
            self.grammar.rollback(consumed)
        self._after, self._recent, self._bad_state = saved

    def accept(self, token_id: int) -> bool:
        """Advances by a sampled token; False: the grammar failed (grammar.error says
        why), and the request is to end with finish_reason "error"."""
        if self.bad_words is not None:
            self._bad_state = self.bad_words.next(self._bad_state, token_id)
        if self._after:       # still reasoning: watch for its end
            self._recent = (self._recent + (int(token_id),))[-len(self._after):]
            if self._recent == self._after:
                self._after = ()
        elif self.grammar is not None:
            return self.grammar.accept(token_id)
        return True
