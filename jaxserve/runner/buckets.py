"""The bucket ladders: the fixed sizes a step is padded to, so that warmup compiles
every program serving will run (a size off the ladder would compile mid-serving).

Each ladder is a tuple of increasing sizes; a step takes the smallest that fits
(`pick_bucket`). Powers of two pad at most half a step, with their midpoints at most
a third, at the cost of more programs.
"""
from __future__ import annotations

# Below about this many tokens a step on an accelerator is bound by reading the weights
# (v6e: 918 TFLOP/s over 1.6 TB/s, ~570 tokens for bf16 weights), so padding a step to
# the next power of two costs little there; above, compute grows with the padding too.
_COMPUTE_BOUND_TOKENS = 512
# A CPU's is a few dozen (2 AVX2 cores: ~100 GFLOP/s over ~10 GB/s, ~20 tokens for
# float32 weights), so there the decode sizes also get the midpoints from here up: a
# decode step of 33-48 rows runs a 48-token program, not the 64 (the benchmark llama's
# float32 decode step at 48 rows 322.5 / 303.3 -> 270.4 / 274.7 ms on an AVX2 EPYC:
# benchmarks/README.md, "Token buckets on CPU"). Not the prefill sizes: they are mostly
# full chunks, and each midpoint is a warmup program.
_CPU_MIDPOINTS_FROM = 48


def pick_bucket(buckets: tuple[int, ...], n: int) -> int:
    """The smallest bucket that holds n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def power_of_two_at_least(n: int, smallest: int = 1) -> int:
    """The smallest power of two >= max(n, 1), and at least `smallest`."""
    return max(smallest, 1 << max(n - 1, 0).bit_length())


def power_of_two_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """Powers of two from `smallest` until one covers `largest`."""
    out, b = [], smallest
    while True:
        out.append(b)
        if b >= largest:
            return tuple(out)
        b *= 2


def capped(ladder: tuple[int, ...], largest: int) -> tuple[int, ...]:
    """The ladder's sizes below `largest`, then exactly `largest`."""
    return tuple(b for b in ladder if b < largest) + (largest,)


def capped_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """Powers of two from `smallest`, then exactly `largest`."""
    return capped(power_of_two_buckets(smallest, largest), largest)


def midpoint_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """Powers of two from `smallest` and the midpoints between them (16, 24, 32, 48, 64,
    96, ...) until one covers `largest`: a step pads at most a third of its work
    instead of half."""
    out: list[int] = []
    for b in power_of_two_buckets(smallest, largest):
        if out:
            out.append(b * 3 // 4)
        out.append(b)
    return tuple(out)


def token_buckets(largest: int, cpu_decode_tokens: int = 0) -> tuple[int, ...]:
    """Tokens of the forward: powers of two from 16 (a step pads at most half) up to
    _COMPUTE_BOUND_TOKENS, then the midpoints too (768, 1024, 1536, ...: at most a
    third) until one covers `largest`. cpu_decode_tokens: on CPU, the most tokens a
    decode step has (max_num_seqs, times 1 + the speculative tokens): the midpoints
    from _CPU_MIDPOINTS_FROM up to there as well."""
    return tuple(b for b in midpoint_buckets(16, largest)
                 if b >= _COMPUTE_BOUND_TOKENS or b & (b - 1) == 0
                 or _CPU_MIDPOINTS_FROM <= b <= cpu_decode_tokens)


def row_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Rows the greedy sampler's lm_head computes (8, 12, 16, 24, ...), capped at
    max_num_seqs: a decode step pads at most a third of its rows."""
    return capped(midpoint_buckets(8, max_num_seqs), max_num_seqs)


def sampling_row_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Rows of the sampler that samples (8, 16, 32, ...): coarser, as it costs a program
    per bucket (its lm_head pads at most half, ~free where it reads the weights)."""
    return capped_buckets(8, max_num_seqs)


def page_buckets(pages_per_request: int) -> tuple[int, ...]:
    """Page-table widths (4, 8, 16, ... pages, then exactly pages_per_request)."""
    return capped_buckets(4, pages_per_request)
