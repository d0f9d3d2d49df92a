"""Time of one engine decode step on this machine, and the attention's share of it.

    python -m benchmarks.step.decode_step [--num-requests 64] [--prefill 3] [--no-attention]

64 requests decode one token each, contexts drawn from 20-480 tokens, on the small
Qwen3 of throughput.py. Prints the runner's execute time (forward + sampling) and
the forward alone; --no-attention replaces the attention by the identity (wrong
numbers, right cost of everything else) to show what attention costs. --prefill N
makes the first N requests compute a 128-token prefill chunk instead (a mixed,
prefill-heavy step: attention then runs with 16-token query blocks).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import numpy as np

from benchmarks.shared.common import make_small_qwen3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--no-attention", action="store_true")
    args = ap.parse_args()
    if args.no_attention:
        import pallas_kernels.ragged_paged_attention.paged_loop as paged_loop
        paged_loop.ragged_paged_attention = lambda q, *a, **k: q
    from jaxserve.config import EngineConfig
    from jaxserve.core.scheduler import CachedRequestData, NewRequestData, SchedulerOutput
    from jaxserve.engine.engine_core import EngineCore
    from jaxserve.sampling_params import SamplingParams

    path = make_small_qwen3(os.path.join(tempfile.gettempdir(), "jaxserve-bench-qwen3-small"))
    n = args.num_requests
    core = EngineCore(EngineConfig(model=path, dtype="float32", max_model_len=1024,
                                   max_num_seqs=n, max_num_batched_tokens=512))
    runner = core.runner
    params = SamplingParams(temperature=0.0, max_tokens=100, seed=1)
    rng = np.random.default_rng(0)
    news, lens = [], []
    for i in range(n):
        ctx = int(rng.integers(20, 480))
        new = 128 if i < args.prefill else 1
        ctx = max(ctx, new)
        # Room for the tokens each timed step adds (every execute samples one per row).
        pages = list(range(1 + i * 32, 1 + i * 32 + -(-(ctx + 32) // 16)))
        # The context as if prefix-cached: only the last `new` tokens are computed.
        news.append(NewRequestData(str(i), [5] * ctx, [], params, (pages,), ctx - new, new))
        lens.append(new)
    num_tokens = sum(lens)
    if num_tokens > 512:
        raise SystemExit(f"{num_tokens} tokens: more than max_num_batched_tokens=512")
    runner.execute(SchedulerOutput(news, CachedRequestData.empty(), num_tokens, [], []))
    batch = runner.batch

    def step_out() -> SchedulerOutput:
        """The same rows again, each computing its last `new` tokens (so each samples)."""
        ids = [r.req_id for r in news]
        starts = [int(batch.num_tokens[batch.row_of[rid]]) - k for rid, k in zip(ids, lens)]
        return SchedulerOutput([], CachedRequestData(ids, starts, lens, [([],) for _ in ids]),
                               num_tokens, [], [])

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            fn()
        return (time.perf_counter() - t0) / args.iters * 1e3

    execute_ms = timed(lambda: runner.execute(step_out()))
    hb = batch.build(batch.update(step_out(), None))
    inputs, idx = jax.device_put((hb.inputs, hb.logits_indices))

    def forward():
        hidden, _, runner.kv_caches = runner._forward(runner.params, runner.kv_caches, inputs, idx,
                                                      runner._no_prev_ids, hb.token_src)
        hidden.block_until_ready()

    forward_ms = timed(forward)
    label = "attention replaced by identity" if args.no_attention else "attention on"
    what = f"{n} decodes" if not args.prefill else \
        f"{n - args.prefill} decodes + {args.prefill} prefill chunks ({num_tokens} tokens)"
    print(f"{what} ({label}): execute {execute_ms:.1f} ms, forward {forward_ms:.1f} ms")


if __name__ == "__main__":
    main()
