"""spec_decode's prompt lookup replayed over a request's final tokens: the drafts the
engine proposed and accepted, and whether each match was in the prompt or the output
(drafts depend only on the tokens so far, so the replay is exact)."""
from __future__ import annotations

from typing import Any

import numpy as np


def match_ends(tokens: np.ndarray, drafts: list[int], n_min: int, n_max: int) -> list[int]:
    """Where a lookup that proposed `drafts` may have matched: the earlier ends of the
    longest suffix (n_max down to n_min tokens) that recurs followed by the drafts ([]
    when none). Which of them ngram_propose picks is its own rule; this needs only
    that it proposes what followed an occurrence of the longest recurring suffix."""
    n, last = len(tokens), len(tokens) - 1
    d = np.asarray(drafts, tokens.dtype)
    for m in range(min(n_max, last), n_min - 1, -1):
        suffix = tokens[n - m:]
        ends = np.flatnonzero(tokens[m - 1:last] == tokens[last]) + (m - 1)
        hits = [int(e) for e in ends if np.array_equal(tokens[e - m + 1:e + 1], suffix)]
        if hits:
            return [e for e in hits if np.array_equal(tokens[e + 1:e + 1 + len(d)], d)]
    return []


def simulate(prompt: list[int], output: list[int], n_min: int, n_max: int, k: int,
             max_tokens: int) -> dict[str, Any]:
    """The engine's drafts replayed over a request's final tokens: after the prefill's
    token, each step proposes from the tokens so far (ngram_propose, cut as the
    scheduler cuts them at max_tokens), accepts the drafts that equal the next tokens
    and appends one more. -> the counters, and how many drafts / accepted drafts came
    from a match in the prompt (every occurrence they could come from ends there).""" 
    from jaxserve.runner.spec_decode import ngram_propose
    toks = np.asarray(list(prompt) + list(output), np.int64)
    pos, p = len(prompt) + 1, len(prompt)
    res = dict(steps=1, drafts=0, draft_tokens=0, accepted=0, per_pos=[0] * k,
               prompt_drafts=0, prompt_accepted=0)
    while pos < len(toks):
        d = ngram_propose(toks[:pos], n_min, n_max, k)[:max(0, max_tokens - (pos - p) - 1)]
        a = 0
        while a < len(d) and pos + a < len(toks) and toks[pos + a] == d[a]:
            a += 1
        if d:
            res["drafts"] += 1
            res["draft_tokens"] += len(d)
            res["accepted"] += a
            for j in range(a):
                res["per_pos"][j] += 1
            ends = match_ends(toks[:pos], d, n_min, n_max)
            if ends and max(ends) < p:
                res["prompt_drafts"] += 1
                res["prompt_accepted"] += a
        pos += a + 1
        res["steps"] += 1
    return res


def add_sims(sims: list[dict[str, Any]]) -> dict[str, Any]:
    out = {k: sum(s[k] for s in sims) for k in sims[0] if k != "per_pos"}
    out["per_pos"] = [sum(x) for x in zip(*(s["per_pos"] for s in sims))]
    return out

