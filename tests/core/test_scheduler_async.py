"""The scheduler under async scheduling: step N+1 is scheduled before step N's tokens are
appended. A fake runner keeps what the scheduler's diffs tell it (plus the tokens it
sampled itself, in flight) and samples a fixed token sequence per request, so every
request must end with exactly the tokens it ends with when steps run in order: through
random arrivals, aborts, stops on EOS, max_tokens, the model length and preemption with a
token in flight (a tight pool)."""
from __future__ import annotations

import random

import pytest

from jaxserve.core.request import Request, RequestStatus
from tests.core.test_scheduler import EOS, PS, sched, sp


def _token(rid: str, k: int, stop_at: dict[str, int]) -> int:
    """The k-th output of request rid: EOS at its stop index, else a distinct token."""
    return EOS if k == stop_at.get(rid) else 1000 + k


class FakeRunner:
    """Holds each request's token count as a runner does: the prompt and outputs sent
    with it, then one more per token it sampled (appended or still in flight)."""

    def __init__(self, stop_at: dict[str, int], max_len: int):
        self.count: dict[str, int] = {}
        self.prompt: dict[str, int] = {}
        self.stop_at, self.max_len = stop_at, max_len
        self.num_overlapped = 0   # rows whose input token was still in flight

    def run(self, out, requests: dict[str, Request]) -> dict[str, int]:
        for rid in out.finished_req_ids + out.preempted_req_ids:
            self.count.pop(rid, None)
        for r in out.new_reqs:
            assert r.req_id not in self.count
            self.prompt[r.req_id] = len(r.prompt_token_ids)
            self.count[r.req_id] = len(r.prompt_token_ids) + len(r.output_token_ids)
        sampled = {}
        for rid, start, n in out.scheduled():
            have = self.count[rid]
            assert start + n <= have, f"{rid}: asked for a token nobody sampled"
            assert start + n <= self.max_len
            self.num_overlapped += start >= requests[rid].num_tokens
            if start + n == have:
                k = have - self.prompt[rid]
                max_tokens = requests[rid].sampling_params.max_tokens
                assert k < max_tokens, f"{rid}: a step past max_tokens"
                sampled[rid] = _token(rid, k, self.stop_at)
                self.count[rid] = have + 1
        return sampled


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_async_order_gives_the_tokens_of_steps_in_order(policy):
    rng = random.Random(7)
    max_len = 40
    s = sched(num_pages=11, budget=12, max_num_seqs=4, max_model_len=max_len, policy=policy)
    stop_at: dict[str, int] = {}
    runner = FakeRunner(stop_at, max_len)
    reqs: dict[str, Request] = {}
    aborted: set[str] = set()
    in_flight = None   # (scheduler output, its sampled tokens) not yet appended
    preempted_in_flight = 0
    for t in range(600):
        if len(reqs) < 40 and rng.random() < 0.3:
            rid = f"r{len(reqs)}"
            prompt = [rng.randrange(3, 50) for _ in range(rng.randrange(1, 20))]
            if rng.random() < 0.3:
                stop_at[rid] = rng.randrange(0, 8)
            r = Request(rid, prompt, sp(max_tokens=rng.randrange(1, 30)), eos_token_id=EOS,
                        arrival_time=float(t), priority=rng.randrange(3), page_size=PS)
            s.add_request(r)
            reqs[rid] = r
        if rng.random() < 0.03 and s.running:
            victim = rng.choice(s.running).request_id
            s.abort_requests(victim)
            aborted.add(victim)
        out = s.schedule()
        preempted_in_flight += sum(reqs[r].num_in_flight > 0 for r in out.preempted_req_ids)
        sampled = runner.run(out, reqs)
        if in_flight is not None:   # step N's tokens, after step N+1 was scheduled
            s.update_from_output(*in_flight)
        in_flight = (out, sampled)
        if t > 400 and not s.has_unfinished_requests():
            break
    s.update_from_output(*in_flight)
    assert not s.has_unfinished_requests()
    assert s.kv.get_num_free_pages() == 10
    assert s.num_preemptions > 0 and preempted_in_flight > 0
    assert runner.num_overlapped > 100
    for rid, r in reqs.items():
        if rid in aborted:
            continue
        max_tokens = r.sampling_params.max_tokens
        stop = stop_at.get(rid)
        n = min(max_tokens, max_len - r.num_prompt_tokens,
                max_tokens if stop is None else stop + 1)
        assert r.output_token_ids == [_token(rid, k, stop_at) for k in range(n)], rid
        want = (RequestStatus.FINISHED_STOPPED if stop is not None and stop < n
                or r.output_token_ids[-1] == EOS else RequestStatus.FINISHED_LENGTH_CAPPED)
        assert r.status == want, rid
