"""The scheduler's LoRA slots, exactly (host only): a waiting request whose adapter finds
every slot pinned waits in its place while the next is tried; slots are loaded once,
released on finish and preemption, reused by LRU; the adapter salts the page hashes; an
adapter in use cannot be removed."""
from __future__ import annotations

import pytest

from jaxserve.core.request import Request
from jaxserve.lora_request import LoRARequest
from tests.core.test_scheduler import EOS, PS, sched, sp

A = {i: LoRARequest(f"a{i}", i, f"/adapters/{i}") for i in (1, 2, 3)}


def lreq(rid: str, adapter: int | None, n: int = 6, **kw) -> Request:
    base = 100 * (ord(rid[0]) - ord("a") + 1)
    return Request(rid, list(range(base, base + n)), sp(**kw), eos_token_id=EOS,
                   page_size=PS, lora_request=A.get(adapter))


def run_step(s, out):
    """Every row that reached its last token samples one (never EOS)."""
    s.update_from_output(out, {rid: 7 for rid in out.req_ids
                               if s.get_request(rid) is not None
                               and s.get_request(rid).num_computed_tokens
                               >= s.get_request(rid).num_tokens})


def test_a_request_waits_for_a_slot_and_the_next_is_tried():
    s = sched(max_loras=2)
    for r in (lreq("a", 1), lreq("b", 2), lreq("c", 3), lreq("d", None), lreq("e", 1)):
        s.add_request(r)
    out = s.schedule()
    assert [r.req_id for r in out.new_reqs] == ["a", "b", "d", "e"]   # c waits
    assert [r.lora_slot for r in out.new_reqs] == [1, 2, 0, 1]
    assert out.lora_loads == [(1, A[1]), (2, A[2])]          # a1 loaded once for a and e
    assert [r.request_id for r in s.waiting] == ["c"]
    assert s.lora.refs(1) == 2 and s.lora.refs(2) == 1
    s.finish_requests(["b"], s.get_request("b").status.FINISHED_ABORTED)
    run_step(s, out)
    out = s.schedule()
    # b's slot is free of users: c's adapter takes it (LRU), loaded before the step.
    assert [r.req_id for r in out.new_reqs] == ["c"] and out.new_reqs[0].lora_slot == 2
    assert out.lora_loads == [(2, A[3])]
    assert s.stats().running_lora_adapters == ("a1", "a3") and s.stats().max_lora == 2


def test_preemption_releases_the_slot_and_resuming_takes_it_again():
    s = sched(num_pages=5, max_loras=1, budget=16)   # 4 usable pages of 4 tokens
    s.add_request(lreq("a", 1, n=7, max_tokens=8))
    s.add_request(lreq("b", 1, n=7, max_tokens=8))
    out = s.schedule()
    assert s.lora.refs(1) == 2
    preempted = 0
    while s.has_unfinished_requests() and preempted == 0:
        run_step(s, out)
        out = s.schedule()
        preempted = len(out.preempted_req_ids)
    assert preempted == 1 and s.lora.refs(1) == 1            # the victim let go
    while s.has_unfinished_requests():
        run_step(s, out)
        out = s.schedule()
        assert all(r.lora_slot == 1 for r in out.new_reqs)
    assert s.lora.refs(1) == 0 and s.lora.resident == [1]


def test_the_adapter_salts_the_page_hashes_and_removal_waits_for_its_users():
    # The same two pages under the base model, adapter 1 and adapter 2: no hash shared.
    hashes = [Request("x", list(range(100, 108)), sp(), page_size=PS,
                      lora_request=A.get(a)).page_hashes for a in (None, 1, 2)]
    assert len({h[0] for h in hashes}) == 3 and len({h[1] for h in hashes}) == 3
    s = sched(max_loras=2)
    s.add_request(lreq("d", 1))
    with pytest.raises(ValueError, match="'a1' is in use by 1 unfinished request"):
        s.remove_lora(1)
    s.abort_requests(["d"])
    s.remove_lora(1)
    assert s.lora.resident == []


def test_lora_off_refuses_a_request_with_an_adapter():
    s = sched()
    s.add_request(lreq("a", 1))
    with pytest.raises(ValueError, match="LoRA is off"):
        s.schedule()
