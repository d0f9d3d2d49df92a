"""OpenAI's logprobs shapes, from the engine's per-position dicts (token id -> Logprob,
the sampled token first): completions' (tokens, token_logprobs, top_logprobs,
text_offset) and chat's (content: token, logprob, bytes, top_logprobs)."""
from __future__ import annotations

from typing import Any

from jaxserve.core.outputs import Logprob


def _ranked(entry: dict, k: int) -> list[tuple[int, Any]]:
    """The top-k alternatives of one position, most likely first."""
    alts = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k]
    return sorted(alts, key=lambda a: a[1].rank)[:k]


def _token_str(tokenizer: Any, tid: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([tid]) if tokenizer is not None else f"token_id:{tid}"


def completion_logprobs(entries: list[dict], k: int, tokenizer: Any,
                        prompt_ids: list[int] | None = None,
                        prompt_entries: list | None = None, *, offset: int = 0) -> dict:
    """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs, text_offset
    (each token's, from `offset`: where a streamed chunk starts in the whole answer).

    With echo, the prompt's tokens come first (the first has no logprob)."""
    rows: list[tuple[int, dict | None]] = []
    if prompt_ids is not None:
        rows += [(tid, prompt_entries[pos] if prompt_entries else None)
                 for pos, tid in enumerate(prompt_ids)]
    rows += [(next(iter(entry)), entry) for entry in entries]   # the sampled token is first
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in rows:
        lp = entry[tid] if entry is not None else None
        s = _token_str(tokenizer, tid, lp)
        tokens.append(s)
        token_lps.append(lp.logprob if lp is not None else None)
        tops.append({_token_str(tokenizer, t, v): v.logprob for t, v in _ranked(entry, k)}
                    if entry is not None else None)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def end_offset(logprobs: dict, start: int) -> int:
    """The text_offset after the last token of `logprobs` (start when it has none)."""
    if not logprobs["tokens"]:
        return start
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


def chat_logprobs(entries: list[dict], k: int) -> dict:
    content = []
    for entry in entries:
        chosen = next(iter(entry))
        lp = entry[chosen]
        token = lp.decoded_token or ""
        content.append({
            "token": token, "logprob": lp.logprob, "bytes": list(token.encode()),
            "top_logprobs": [{"token": v.decoded_token or "", "logprob": v.logprob,
                              "bytes": list((v.decoded_token or "").encode())}
                             for _, v in _ranked(entry, k)]})
    return {"content": content}
