"""Benchmark prompts and arrival times, seeded: the datasets of `jaxserve bench`.

    random             lengths uniform in [L(1-r), L(1+r)] after an optional shared prefix;
                       token ids in [3, vocab) (completions) or common words (chat)
    sharegpt           a ShareGPT-format JSON file: the first human turn of a conversation
                       is the prompt, the reply after it sets the output length
    prefix_repetition  a few shared prefixes, each prompt one of them plus its own suffix:
                       what a prefix cache (and a prefix-aware router) is for

Lengths are in tokens: exact for token-id prompts; for text, one token per word, or
the tokenizer's count where one is given (ShareGPT), else characters / 4.
"""
from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

FIRST_ID = 3   # token ids start here: 0-2 are pad/bos/eos in the tokenizers used here
WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work number night point home water room mother area money story fact "
         "month lot right study book eye job word business issue side kind head house").split()

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class Prompt:
    prompt: str | list[int]   # text, or token ids (completions endpoint only)
    prompt_len: int           # tokens (estimated for text), used when the server sends no usage
    output_len: int           # sent as max_tokens


def random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab_size) for _ in range(n)]


def _random_piece(rng: random.Random, n: int, vocab_size: int, text: bool) -> list:
    return [rng.choice(WORDS) for _ in range(n)] if text else random_ids(rng, n, vocab_size)


def _join(pieces: list, text: bool) -> str | list[int]:
    return " ".join(pieces) if text else list(pieces)


def random_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                   seed: int, vocab_size: int = 256, text: bool = False,
                   prefix_len: int = 0) -> list[Prompt]:
    """Lengths uniform in [len*(1-r), len*(1+r)], after `prefix_len` tokens every prompt
    shares; token ids in [3, vocab) or words (text: the chat endpoint takes text)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random range ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1 or prefix_len < 0:
        raise ValueError(f"random lengths must be >= 1 (prefix >= 0), got input {input_len}, "
                         f"output {output_len}, prefix {prefix_len}")
    rng, r = random.Random(seed), range_ratio

    def length(n: int) -> int:
        return max(1, rng.randint(math.floor(n * (1 - r)), math.ceil(n * (1 + r))))

    prefix = _random_piece(rng, prefix_len, vocab_size, text)
    out = []
    for _ in range(num_prompts):
        n_in, n_out = length(input_len), length(output_len)
        body = prefix + _random_piece(rng, n_in, vocab_size, text)
        out.append(Prompt(_join(body, text), prefix_len + n_in, n_out))
    return out


def prefix_repetition_dataset(num_prompts: int, prefix_len: int, suffix_len: int,
                              num_prefixes: int, output_len: int, seed: int,
                              vocab_size: int = 256, text: bool = False) -> list[Prompt]:
    """`num_prefixes` random prefixes, each used by num_prompts / num_prefixes prompts
    (round robin, then shuffled), each prompt with its own random suffix."""
    if prefix_len < 1 or suffix_len < 0 or num_prefixes < 1 or output_len < 1:
        raise ValueError(f"prefix repetition needs prefix len >= 1, suffix len >= 0, "
                         f"num prefixes >= 1, output len >= 1; got {prefix_len}, {suffix_len}, "
                         f"{num_prefixes}, {output_len}")
    rng = random.Random(seed)
    prefixes = [_random_piece(rng, prefix_len, vocab_size, text) for _ in range(num_prefixes)]
    out = [Prompt(_join(prefixes[i % num_prefixes] + _random_piece(rng, suffix_len, vocab_size,
                                                                   text), text),
                  prefix_len + suffix_len, output_len) for i in range(num_prompts)]
    rng.shuffle(out)
    return out


def approx_tokens(text: str) -> int:
    """Token estimate without a tokenizer: characters / 4, rounded up, at least 1."""
    return max(1, (len(text) + 3) // 4)


def sharegpt_pairs(data: Any) -> list[tuple[str, str]]:
    """(first human turn, the gpt turn after it) of each conversation that has both."""
    pairs = []
    for conv in data if isinstance(data, list) else []:
        turns = conv.get("conversations", []) if isinstance(conv, dict) else []
        human = next((i for i, t in enumerate(turns) if t.get("from") in ("human", "user")), None)
        if human is None:
            continue
        reply = next((t for t in turns[human + 1:] if t.get("from") in ("gpt", "assistant")), None)
        if reply and turns[human].get("value") and reply.get("value"):
            pairs.append((turns[human]["value"], reply["value"]))
    return pairs


def sharegpt_dataset(path: str, num_prompts: int, seed: int, output_len: int | None = None,
                     encode: Encode | None = None) -> list[Prompt]:
    """Text prompts from a ShareGPT-format file, shuffled with `seed`; the reply's length
    (tokens with `encode`, else characters / 4) is max_tokens unless `output_len`."""
    with open(path, encoding="utf-8") as f:
        pairs = sharegpt_pairs(json.load(f))
    count = (lambda s: len(encode(s))) if encode else approx_tokens
    if len(pairs) < num_prompts:
        raise ValueError(f"{path} has {len(pairs)} usable conversations, need {num_prompts}")
    random.Random(seed).shuffle(pairs)
    return [Prompt(text, count(text), output_len or count(reply))
            for text, reply in pairs[:num_prompts]]


def arrival_times(n: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Offsets (s) of n arrivals at `rate` req/s, the first at 0; inf -> all at 0. Gaps are
    gamma-distributed with shape `burstiness` and mean 1/rate: 1 is a Poisson process,
    below 1 burstier, above 1 more even."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 or inf, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()
