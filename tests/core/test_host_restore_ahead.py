"""Host-tier restores one step ahead (core/restoring.py), without a device: a request
whose hit has a host part is taken in the step that restores its pages, with no tokens,
and computed from the next; a request over pages still being restored waits with it; an
abort, a preemption or a failed step between the two steps leaks nothing, and the next
look-up still hits."""
from __future__ import annotations

from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler, SchedulerConfig
from jaxserve.lora_request import LoRARequest
from tests.core.test_host_cache import PS, SP, settled

A = list(range(10, 23))   # 13 tokens: 3 full pages


def scheduler(num_pages: int = 5, lora: LoRARequest | None = None) -> Scheduler:
    """num_pages - 1 device pages of 4 tokens; A's pages (under the adapter `lora`)
    evicted to the host tier by a request that takes them all."""
    sched = Scheduler(SchedulerConfig(num_pages=num_pages, page_size=PS, max_num_seqs=2,
                                      max_num_batched_tokens=64, max_model_len=32,
                                      num_host_pages=16, max_loras=1 if lora else 0))
    for rid, tokens in (("a", A), ("b", range(100, 100 + (num_pages - 2) * PS + 1))):
        sched.add_request(make(rid, tokens, lora))
        sched.update_from_output(sched.schedule(), {rid: 1})
        sched.finish_requests(rid, RequestStatus.FINISHED_STOPPED)
    assert len(sched.kv.host.index) == 3
    return sched


def make(rid: str, tokens, lora: LoRARequest | None = None) -> Request:
    return Request(rid, list(tokens), SP, eos_token_id=None, arrival_time=0.0, page_size=PS,
                   lora_request=lora)


def restores(out) -> int:
    return 0 if out.host_copies is None else out.host_copies.num_restores


def test_a_host_hit_is_computed_the_step_after_its_restore():
    sched = scheduler()
    sched.add_request(make("a2", A))
    first = sched.schedule()
    copies = first.host_copies
    assert len(copies.restore_pages) == 3 and copies.restore_slots
    assert not first.new_reqs and first.num_scheduled_tokens == 0
    assert list(sched.restoring) == ["a2"] and sched.num_running == 1
    assert sched.update_from_output(first, {}) == []
    second = sched.schedule()
    assert not restores(second)   # nothing more to restore
    (new,) = second.new_reqs
    assert (new.req_id, new.num_computed_tokens, new.num_new_tokens) == ("a2", 12, 1)
    assert new.page_ids[0][:3] == copies.restore_pages
    assert sched.get_request("a2").num_cached_tokens == 12
    assert not sched.restoring


def test_a_request_over_pages_still_being_restored_waits_with_it():
    """n > 1 completions share a prompt: the second hits the first's restored pages on the
    device, in the step that restores them, so it is computed a step later too."""
    sched = scheduler(num_pages=7)   # room for both
    sched.add_request(make("0_a", A))
    sched.add_request(make("1_a", A))
    first = sched.schedule()
    assert len(first.host_copies.restore_pages) == 3   # restored once
    assert not first.new_reqs and list(sched.restoring) == ["0_a", "1_a"]
    sched.update_from_output(first, {})
    second = sched.schedule()
    assert [(r.req_id, r.num_computed_tokens) for r in second.new_reqs] == \
        [("0_a", 12), ("1_a", 12)]
    assert second.new_reqs[0].page_ids[0][:3] == second.new_reqs[1].page_ids[0][:3] == \
        first.host_copies.restore_pages


def test_an_abort_between_the_send_and_the_scatter_frees_everything():
    sched = scheduler()
    kv = sched.kv
    sched.add_request(make("a2", A))
    sched.update_from_output(sched.schedule(), {})
    sched.abort_requests("a2")
    assert not sched.restoring and not sched.requests and kv.get_num_free_pages() == 4
    assert settled(kv.host)
    # Its pages are scattered in the next step and keep their hashes: the next look-up
    # hits them on the device and is computed in the step that takes it.
    sched.update_from_output(sched.schedule(), {})
    sched.add_request(make("a3", A))
    out = sched.schedule()
    assert not restores(out)
    assert [(r.req_id, r.num_computed_tokens) for r in out.new_reqs] == [("a3", 12)]


def test_a_preemption_in_the_next_step_sends_it_back_to_the_queue():
    sched = scheduler()
    kv = sched.kv
    sched.add_request(make("r", [200, 201, 202]))   # one page, running
    sched.update_from_output(sched.schedule(), {"r": 203})
    sched.add_request(make("a2", A))
    first = sched.schedule()   # r's fourth token; a2 takes the other 3 pages
    assert first.host_copies.restore_pages and list(sched.restoring) == ["a2"]
    sched.update_from_output(first, {"r": 204})
    second = sched.schedule()   # r needs a second page: preempted, a2 goes back
    assert second.preempted_req_ids == ["r"] and not second.new_reqs
    assert not sched.restoring and [r.request_id for r in sched.waiting] == ["a2", "r"]
    assert kv.get_num_free_pages() == 4 and settled(kv.host)
    assert sched.get_request("a2").status == RequestStatus.WAITING
    sched.update_from_output(second, {})
    third = sched.schedule()   # a2's pages were restored: a device hit now
    assert not restores(third)
    assert [(r.req_id, r.num_computed_tokens) for r in third.new_reqs] == [("a2", 12)]


def test_a_failed_step_after_the_send_forgets_the_restored_pages():
    """The step that scatters the rows fails: the pages they fill forget their hashes
    (the scatter may not have run), the host entries stay and are hit again."""
    sched = scheduler()
    kv = sched.kv
    sched.add_request(make("a2", A))
    first = sched.schedule()
    sched.update_from_output(first, {})
    second = sched.schedule()
    assert second.new_reqs[0].req_id == "a2"
    sched.fail_step(second, ["a2"])
    assert not any(h in kv.pool.cached_pages for h in make("x", A).page_hashes)
    assert kv.get_num_free_pages() == 4 and settled(kv.host) and not sched.requests
    sched.add_request(make("a3", A))
    assert sched.schedule().host_copies.restore_slots == first.host_copies.restore_slots


def test_an_adapters_request_holds_its_slot_while_its_pages_are_restored():
    """The adapter salts the hashes (the same tokens without it miss); the request holds
    its LoRA slot from the step that restores its pages, gives it back when aborted, and
    the next request under the adapter hits the restored pages on the device."""
    adapter = LoRARequest("a1", 1, "/adapters/1")
    sched = scheduler(lora=adapter)
    assert sched.kv.get_computed_pages(make("p", A))[1] == 0   # no adapter: another prefix
    sched.add_request(make("a2", A, adapter))
    first = sched.schedule()
    assert first.host_copies.restore_pages and list(sched.restoring) == ["a2"]
    assert sched.lora.refs(1) == 1
    sched.update_from_output(first, {})
    sched.abort_requests("a2")
    assert sched.lora.refs(1) == 0 and sched.kv.get_num_free_pages() == 4
    sched.update_from_output(sched.schedule(), {})
    sched.add_request(make("a3", A, adapter))
    out = sched.schedule()
    assert not restores(out)
    assert [(r.req_id, r.num_computed_tokens, r.lora_slot) for r in out.new_reqs] == \
        [("a3", 12, 1)]


def hybrid_scheduler() -> Scheduler:
    """A hybrid's (state snapshots) with host pages but no host state slots: A's pages go
    to host, the device snapshot at their end stays."""
    sched = Scheduler(SchedulerConfig(num_pages=5, page_size=PS, max_num_seqs=2,
                                      max_num_batched_tokens=64, max_model_len=32,
                                      num_state_slots=3, num_snapshot_slots=4,
                                      num_host_pages=16))
    for rid, tokens in (("a", A), ("b", range(100, 113))):
        sched.add_request(make(rid, tokens))
        while not sched.get_request(rid).output_token_ids:   # chunks cut at a snapshot
            sched.update_from_output(sched.schedule(), {rid: 1})
        sched.finish_requests(rid, RequestStatus.FINISHED_STOPPED)
    assert len(sched.kv.host.index) == 3 and sched.kv.host.states is None
    return sched


def test_a_hybrids_device_snapshot_is_copied_in_the_step_that_computes_it():
    """Host pages ending on a device snapshot: the state copy goes with the request's
    first forward (step k+1), not with the step that restores its pages."""
    sched = hybrid_scheduler()
    sched.add_request(make("a2", A))
    first = sched.schedule()
    assert first.host_copies.restore_pages and not first.state_restores
    sched.update_from_output(first, {})
    second = sched.schedule()
    (new,) = second.new_reqs
    snap = sched.kv.snapshots.lookup(make("x", A).page_hashes[2], 12)
    assert new.num_computed_tokens == 12 and second.state_restores == [(snap.slot,
                                                                        new.state_slot)]


def test_a_hybrid_whose_snapshot_went_meanwhile_looks_up_again():
    sched = hybrid_scheduler()
    sched.add_request(make("a2", A))
    sched.update_from_output(sched.schedule(), {})
    sched.reset_prefix_cache()   # the snapshot (and the restored pages' hashes) go
    second = sched.schedule()
    assert not second.state_restores and [r.num_computed_tokens for r in second.new_reqs] == [0]
    assert not sched.restoring
