"""Host overhead per engine step: Scheduler.schedule() + input preparation.

    python benchmarks/host_overhead.py [--num-requests 256] [--steps 200]

256 requests are decoding (prompts of 100-1000 tokens already computed); each
step schedules one token for each, builds the padded device batch and the
sampling tensors, then feeds back one sampled token per request. No model runs:
this is the Python/numpy cost the device step has to hide.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from jaxserve.core.request import Request
from jaxserve.core.scheduler import Scheduler
from jaxserve.runner.buckets import pick_bucket, power_of_two_buckets, row_buckets
from jaxserve.runner.input_batch import InputBatchBuilder
from jaxserve.runner.sampler import SamplingRow, make_sampling_tensors, needs_penalties
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
    sched = Scheduler(num_pages=n * (mml // ps) + 1, page_size=ps, max_num_seqs=n,
                      max_num_batched_tokens=max(2048, n), max_model_len=mml)
    # The engine gives every request a seed (its own or one drawn from the engine seed).
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=2000, ignore_eos=True,
                            seed=1)
    for i in range(n):
        prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(100, 1000))]
        sched.add_request(Request(str(i), prompt, params, page_size=ps))
    builder = InputBatchBuilder(max_num_seqs=n, max_model_len=mml, page_size=ps,
                                token_buckets=power_of_two_buckets(16, max(2048, n)))
    # Prefill everything first (not timed).
    while True:
        out = sched.schedule()
        sched.update_from_output(out, {r.req_id: 7 for r in out.requests if r.sample})
        if len(out.requests) == n and out.num_scheduled_tokens == n:
            break
    rows_buckets = row_buckets(n)
    times_sched, times_prep = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        reqs = out.requests
        builder.build(reqs)
        rows = [SamplingRow(r.sampling_params, r.num_output_tokens) for r in reqs]
        make_sampling_tensors(rows, pick_bucket(rows_buckets, len(reqs)), 32000,
                              penalties=needs_penalties([r.sampling_params for r in reqs]),
                              penalty_len=mml)
        t2 = time.perf_counter()
        assert len(reqs) == n and all(len(r.token_ids) == 1 for r in reqs)
        sched.update_from_output(out, {r.req_id: 7 for r in reqs})
        times_sched.append(t1 - t0)
        times_prep.append(t2 - t1)
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    total = [a + b for a, b in zip(times_sched, times_prep)]
    print(f"{n} decode requests, median per step: schedule {med(times_sched):.3f} ms + "
          f"input preparation {med(times_prep):.3f} ms = {med(total):.3f} ms "
          f"(p90 {statistics.quantiles(total, n=10)[-1] * 1e3:.3f} ms)")


if __name__ == "__main__":
    main()
