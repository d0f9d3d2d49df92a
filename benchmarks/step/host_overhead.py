"""Host overhead per engine step: Scheduler.schedule() + input preparation.

    python -m benchmarks.step.host_overhead [--num-requests 256] [--steps 200]

256 requests are decoding (prompts of 100-1000 tokens already computed); each
step schedules one token for each (a diff: running requests as counts and new pages),
applies it to the runner's persistent batch and builds the padded device batch and
the sampling tensors, then stores one sampled token per request in the batch and
feeds it back to the scheduler. No model runs: this is the Python/numpy cost the
device step has to hide. "input preparation" counts the batch's upkeep (storing the
sampled tokens) too.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from jaxserve.core.request import Request
from jaxserve.core.scheduler import Scheduler, SchedulerConfig
import numpy as np

from jaxserve.runner.buckets import pick_bucket, power_of_two_buckets, sampling_row_buckets
from jaxserve.runner.input_batch import InputBatch
from jaxserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=4096)
    args = ap.parse_args()
    n, ps, mml = args.num_requests, args.page_size, args.max_model_len
    rng = random.Random(0)
    sched = Scheduler(SchedulerConfig(
        num_pages=n * (mml // ps) + 1, page_size=ps, max_num_seqs=n,
        max_num_batched_tokens=max(2048, n), max_model_len=mml))
    # The engine gives every request a seed (its own or one drawn from the engine seed).
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=2000, ignore_eos=True,
                            seed=1)
    for i in range(n):
        prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(100, 1000))]
        sched.add_request(Request(str(i), prompt, params, page_size=ps))
    batch = InputBatch(max_num_seqs=n, max_model_len=mml, page_size=ps, vocab_size=32000,
                       token_buckets=power_of_two_buckets(16, max(2048, n)))
    eos = 2

    def feed_back(out, rows) -> None:
        """What collect and the scheduler do with the sampled tokens."""
        batch.append_sampled(rows, np.full(rows.num_reqs, 7, np.int32))
        picked = np.flatnonzero(rows.sample)
        sched.update_from_output(out, dict(zip([rows.req_ids[i] for i in picked],
                                               [7] * len(picked))))

    # Prefill everything first (not timed).
    while True:
        out = sched.schedule()
        feed_back(out, batch.update(out, eos))
        if len(out.cached_reqs.req_ids) == n and out.num_scheduled_tokens == n:
            break
    rows_buckets = sampling_row_buckets(n)
    times_sched, times_prep = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        rows = batch.update(out, eos)
        batch.build(rows)
        batch.sampling_tensors(rows, pick_bucket(rows_buckets, rows.num_reqs),
                               penalties=bool(batch.has_penalties[rows.rows].any()),
                               penalty_len=mml)
        batch.append_sampled(rows, np.full(rows.num_reqs, 7, np.int32))
        t2 = time.perf_counter()
        assert rows.num_reqs == n and rows.num_tokens == n and rows.sample.all()
        picked = np.flatnonzero(rows.sample)
        sched.update_from_output(out, dict(zip([rows.req_ids[i] for i in picked],
                                               [7] * len(picked))))
        times_sched.append(t1 - t0)
        times_prep.append(t2 - t1)
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    total = [a + b for a, b in zip(times_sched, times_prep)]
    print(f"{n} decode requests, median per step: schedule {med(times_sched):.3f} ms + "
          f"input preparation {med(times_prep):.3f} ms = {med(total):.3f} ms "
          f"(p90 {statistics.quantiles(total, n=10)[-1] * 1e3:.3f} ms)")


if __name__ == "__main__":
    main()
