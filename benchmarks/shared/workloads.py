"""Offline workloads: lists of (prompt token ids, output length), seeded.

    random          fixed lengths: uniform in [L(1-r), L(1+r)] (serve.py's random dataset)
    decode-heavy    throughput.py's: prompts 16-96, outputs 8-384
    prefill-heavy   throughput.py's: prompts 32-400, outputs 16-200
    sharegpt-like   seeded log-normal lengths shaped like ShareGPT (SHAREGPT_LIKE below)
    sharegpt:FILE   a ShareGPT-format JSON file, tokenized with the model's tokenizer

Every request produces exactly its output length (eos ignored), so both systems do
the same work and only those tokens count.
"""
from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.shared.common import Item
from benchmarks.shared.common import workload as throughput_workload
from jaxserve.bench.datasets import random_ids, sharegpt_pairs

# ShareGPT's shape: short typical prompts and replies with long tails. Log-normal
# lengths with these means (before clipping) and log-space sigmas, clipped to
# [min_len, max_len] and so that prompt + output fits max_model_len.
SHAREGPT_LIKE: dict[str, float] = dict(prompt_mean=200.0, prompt_sigma=1.0,
                                       output_mean=180.0, output_sigma=0.9,
                                       min_len=4, max_len=1024)


@dataclass(frozen=True)
class Workload:
    name: str
    items: list[Item]
    params: dict[str, Any]   # what generated it, for the results file

    def stats(self) -> dict[str, float]:
        p = [len(it.prompt_token_ids) for it in self.items]
        o = [it.max_tokens for it in self.items]
        return dict(num_prompts=len(self.items), prompt_tokens=sum(p), output_tokens=sum(o),
                    prompt_len_mean=sum(p) / len(p), output_len_mean=sum(o) / len(o),
                    prompt_len_max=max(p), output_len_max=max(o))


def random_workload(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                    vocab_size: int, seed: int) -> Workload:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"lengths must be >= 1, got {input_len} and {output_len}")
    rng = random.Random(seed)

    def length(n: int) -> int:
        return max(1, rng.randint(math.floor(n * (1 - range_ratio)),
                                  math.ceil(n * (1 + range_ratio))))

    items = []
    for _ in range(num_prompts):
        n_in, n_out = length(input_len), length(output_len)
        items.append(Item(random_ids(rng, n_in, vocab_size), n_out))
    return Workload("random", items, dict(input_len=input_len, output_len=output_len,
                                          range_ratio=range_ratio, seed=seed))


def lognormal_length(rng: random.Random, mean: float, sigma: float) -> int:
    """A draw whose distribution has this mean: mu = ln(mean) - sigma^2 / 2."""
    return round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma))


def sharegpt_like_workload(num_prompts: int, vocab_size: int, seed: int,
                           max_model_len: int | None = None) -> Workload:
    s = SHAREGPT_LIKE
    lo, hi = int(s["min_len"]), int(s["max_len"])
    rng = random.Random(seed)
    items = []
    for _ in range(num_prompts):
        n_in = min(max(lognormal_length(rng, s["prompt_mean"], s["prompt_sigma"]), lo), hi)
        n_out = min(max(lognormal_length(rng, s["output_mean"], s["output_sigma"]), lo), hi)
        if max_model_len is not None and n_in + n_out > max_model_len:
            n_in = min(n_in, max_model_len - lo)       # keep room for min_len outputs
            n_out = max_model_len - n_in
        items.append(Item(random_ids(rng, n_in, vocab_size), n_out))
    return Workload("sharegpt-like", items, dict(distribution="log-normal", **s, seed=seed,
                                                 max_model_len=max_model_len))


def sharegpt_file_workload(path: str, num_prompts: int, seed: int,
                           encode: Callable[[str], list[int]],
                           max_model_len: int | None = None) -> Workload:
    """As vLLM's benchmark: prompt = first human turn, output length = the reply's token
    count; pairs with fewer than 4 tokens on either side or too long for max_model_len
    (prompt > 1024 or the sum > 2048 when it is not given) are skipped."""
    with open(path, encoding="utf-8") as f:
        pairs = sharegpt_pairs(json.load(f))
    random.Random(seed).shuffle(pairs)
    items = []
    for prompt, reply in pairs:
        ids, n_out = encode(prompt), len(encode(reply))
        if len(ids) < 4 or n_out < 4:
            continue
        if max_model_len is not None and len(ids) + n_out > max_model_len:
            continue
        if max_model_len is None and (len(ids) > 1024 or len(ids) + n_out > 2048):
            continue
        items.append(Item(ids, n_out))
        if len(items) == num_prompts:
            break
    if len(items) < num_prompts:
        raise ValueError(f"{path}: {len(items)} usable conversations, need {num_prompts}")
    return Workload(f"sharegpt:{path}", items, dict(file=path, seed=seed,
                                                    max_model_len=max_model_len))


def make_workload(spec: str, *, num_prompts: int, input_len: int, output_len: int,
                  range_ratio: float, vocab_size: int, seed: int,
                  encode: Callable[[str], list[int]] | None = None,
                  max_model_len: int | None = None) -> Workload:
    """The workload named by `spec` (see the module docstring)."""
    if spec == "random":
        return random_workload(num_prompts, input_len, output_len, range_ratio, vocab_size, seed)
    if spec in ("decode-heavy", "prefill-heavy"):
        items = throughput_workload(spec.split("-")[0], num_prompts, vocab_size, seed)
        return Workload(spec, items, dict(source="benchmarks/shared/common.py workload()", seed=seed))
    if spec == "sharegpt-like":
        return sharegpt_like_workload(num_prompts, vocab_size, seed, max_model_len)
    if spec.startswith("sharegpt:"):
        if encode is None:
            raise ValueError("a sharegpt file needs the model's tokenizer")
        return sharegpt_file_workload(spec.split(":", 1)[1], num_prompts, seed, encode,
                                      max_model_len)
    raise ValueError(f"unknown workload {spec!r}: random, decode-heavy, prefill-heavy, "
                     "sharegpt-like or sharegpt:<file>")
