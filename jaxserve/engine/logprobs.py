"""Logprobs as vLLM returns them: {token_id: Logprob}, from the sampler's arrays read
back to the host (the chosen token, its rank, the most likely tokens)."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxserve.core.outputs import Logprob


def make_logprob_dict(
    token_id: int,
    logprob: float,
    rank: int,
    top_ids: Sequence[int],
    top_logprobs: Sequence[float],
    num_logprobs: int,
    decode: Callable[[int], str] | None = None,
) -> dict[int, Logprob]:
    """The chosen token first, then the `num_logprobs` most likely (ranks 1..k).

    Entries with id < 0 (vocabulary smaller than asked) are skipped.
    """
    def entry(tid: int, lp: float, r: int) -> Logprob:
        return Logprob(logprob=float(lp), rank=int(r), decoded_token=decode(tid) if decode else None)

    out = {int(token_id): entry(int(token_id), logprob, rank)}
    for i in range(min(num_logprobs, len(top_ids))):
        tid = int(top_ids[i])
        if tid >= 0 and tid not in out:
            out[tid] = entry(tid, top_logprobs[i], i + 1)
    return out
