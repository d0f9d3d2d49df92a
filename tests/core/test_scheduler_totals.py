"""The scheduler's running totals of prompt and generated tokens (what /metrics'
vllm:prompt_tokens_total and vllm:generation_tokens_total count)."""
from __future__ import annotations

from types import SimpleNamespace

from jaxserve.core.request import Request
from jaxserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerStats

PS = 4


def _request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    params = SimpleNamespace(max_tokens=max_tokens, min_tokens=0, ignore_eos=True,
                             stop_token_ids=None)
    return Request(rid, prompt, params, eos_token_id=2, page_size=PS)


def _run(s: Scheduler) -> None:
    """Steps until every request finished; every scheduled request 'samples' token 9."""
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, {rid: 9 for rid in out.req_ids})


def test_totals_count_each_prompt_once_and_every_token():
    # 4 usable pages of 4 tokens: the two requests cannot both grow, one is preempted
    # after its first token (its prompt is not counted again when it resumes); the
    # 20-token prompt is prefilled in chunks of 8 and counted once, when done.
    s = Scheduler(SchedulerConfig(
        num_pages=5, page_size=PS, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=16))
    prompts = {"a": list(range(10, 17)), "b": list(range(30, 37))}
    for rid, p in prompts.items():
        s.add_request(_request(rid, p, max_tokens=4))
    _run(s)
    assert s.stats().num_preemptions >= 1
    big = Scheduler(SchedulerConfig(
        num_pages=17, page_size=PS, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=32))
    big.add_request(_request("c", list(range(40, 60)), max_tokens=3))
    _run(big)
    for sched, prompt_tokens, generated in ((s, 14, 8), (big, 20, 3)):
        stats = sched.stats()
        assert (stats.num_prompt_tokens, stats.num_generation_tokens) == \
            (prompt_tokens, generated)
    merged = SchedulerStats.merge([s.stats(), big.stats()])
    assert (merged.num_prompt_tokens, merged.num_generation_tokens) == (34, 11)
