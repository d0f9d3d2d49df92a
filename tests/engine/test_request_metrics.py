"""Every RequestOutput carries the request's timeline (RequestMetrics), offline too."""
from __future__ import annotations

import time

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.core.request_metrics import RequestMetrics


def test_generate_outputs_carry_an_ordered_timeline(checkpoint):
    # (no warmup: the timeline's order holds whether or not a step compiles first)
    llm = LLM(checkpoint("qwen3"), dtype="float32", max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=16, enforce_eager=True)
    start = time.time()
    # Three prompts for two seats: the third waits for one; n=2 times its two together.
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(max_tokens=4, ignore_eos=True),
                         SamplingParams(max_tokens=6, ignore_eos=True),
                         SamplingParams(max_tokens=3, ignore_eos=True, n=2, temperature=1.0,
                                        seed=1)], use_tqdm=False)
    end = time.time()
    for out in outs:
        m = out.metrics
        assert isinstance(m, RequestMetrics)
        # Comparable with time.time() (the clocks may differ by the offset's rounding).
        assert start - 1 <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time \
            <= m.last_token_time <= m.finished_time <= end + 1
        assert m.num_generation_tokens == sum(len(c.token_ids) for c in out.outputs)
        assert m.time_in_queue + m.prefill_time + m.decode_time == \
            pytest.approx(m.last_token_time - m.arrival_time)
    # The third had to wait for a seat: its queue time is the longest.
    waits = [o.metrics.time_in_queue for o in outs]
    assert waits[2] > max(waits[:2])
    assert outs[1].metrics.decode_time > 0
