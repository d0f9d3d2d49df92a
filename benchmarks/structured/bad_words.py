"""bad_words' host cost per engine step: every word checked against each row's output
(the rule as it ran before, d8e1891) vs the automaton (jaxserve/engine/bad_words.py).

    python -m benchmarks.structured.bad_words [--output-dir benchmarks/results] [--rows 64] \
        [--words 10000] [--steps 20] [--old-steps 3]

Host only, no model: what InputBatch does for rows with bad words of several tokens
before and after each step that samples. Each of --rows rows has the same --words words,
each word two token sequences of 1-4 random ids in a 32000 vocabulary (the front door
tokenizes a word at the start of a text and after a space), and an output of 128 random
tokens. A step: every row fills its mask row (uint32[1000]) and accepts one more random
token. Scenarios: `random` (words of random ids: the banned sets are mostly empty, as in
most steps) and `shared` (every word begins with the same id, which ends every output:
each fill bans one token per word). Reported: median ms per step, old and new; the
front door's build (BadWords of the sequences) and a pickled copy's size and rebuild
(what a multi-host step carries to the other processes).
"""
from __future__ import annotations

import argparse
import pickle
import random
import statistics
import sys
import time

import numpy as np

from benchmarks.shared.results_io import markdown_table, write_results
from jaxserve.engine.bad_words import BadWords
from jaxserve.runner.token_constraints import ALL_ALLOWED, DynamicConstraints, set_tokens
from jaxserve.sampling_params import SamplingParams

VOCAB, OUTPUT_LEN = 32000, 128


def old_fill(sequences: list[tuple[int, ...]], mask_row: np.ndarray,
             output: np.ndarray) -> None:
    """DynamicConstraints.fill's bad-words part before the automaton."""
    banned = [w[-1] for w in sequences
              if len(output) >= len(w) - 1
              and tuple(output[len(output) - len(w) + 1:]) == w[:-1]]
    if banned:
        set_tokens(mask_row, banned, False)


def words(rng: random.Random, n: int, shared: bool) -> list[tuple[int, ...]]:
    seqs = []
    for _ in range(n):
        for _ in range(2):   # two spellings
            w = tuple(rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 4)))
            seqs.append((0,) + w if shared else w)
    return seqs


def median_ms(step, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run(rows: int, num_words: int, steps: int, old_steps: int, shared: bool) -> dict:
    rng = random.Random(0)
    seqs = words(rng, num_words, shared)
    start = time.perf_counter()
    automaton = BadWords(seqs)
    build_ms = (time.perf_counter() - start) * 1e3
    blob = pickle.dumps(automaton, protocol=pickle.HIGHEST_PROTOCOL)
    start = time.perf_counter()
    pickle.loads(blob)
    rebuild_ms = (time.perf_counter() - start) * 1e3
    outputs = [[rng.randrange(1, VOCAB) for _ in range(OUTPUT_LEN - 1)] + [0]
               for _ in range(rows)]
    masks = np.full((rows, VOCAB // 32), ALL_ALLOWED, np.uint32)
    params = SamplingParams(bad_words=["w"], bad_words_automaton=automaton)
    dyn = [DynamicConstraints(params, out) for out in outputs]
    multi = [s for s in seqs if len(s) > 1]
    arrays = [np.array(o, np.int32) for o in outputs]

    def old_step():
        for i in range(rows):
            old_fill(multi, masks[i], arrays[i])
        # (accepting a token cost nothing: the rule reads the output itself)

    def new_step():
        for i in range(rows):
            dyn[i].fill(masks[i])
        for d in dyn:
            d.accept(0 if shared else rng.randrange(1, VOCAB))   # shared: stay after id 0

    return {"scenario": "shared" if shared else "random", "rows": rows, "words": num_words,
            "sequences": len(automaton), "old_ms": median_ms(old_step, old_steps),
            "new_ms": median_ms(new_step, steps), "build_ms": build_ms,
            "pickle_kib": len(blob) / 1024, "rebuild_ms": rebuild_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output-dir", default="benchmarks/results")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--words", type=int, default=10000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--old-steps", type=int, default=3)
    args = ap.parse_args()
    results = [run(args.rows, args.words, args.steps, args.old_steps, shared)
               for shared in (False, True)]
    table = markdown_table(
        ["scenario", "rows x words (sequences)", "old ms/step", "new ms/step", "speed-up",
         "build ms", "pickle KiB", "rebuild ms"],
        [[r["scenario"], f"{r['rows']} x {r['words']} ({r['sequences']})",
          f"{r['old_ms']:.0f}", f"{r['new_ms']:.2f}", f"{r['old_ms'] / r['new_ms']:.0f}x",
          f"{r['build_ms']:.0f}", f"{r['pickle_kib']:.0f}", f"{r['rebuild_ms']:.0f}"]
         for r in results])
    write_results(args.output_dir, "bad_words", benchmark="bad_words", argv=sys.argv[1:],
                  config=vars(args), results={"runs": results}, table=table)


if __name__ == "__main__":
    main()
