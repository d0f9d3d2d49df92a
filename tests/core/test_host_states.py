"""A hybrid's state snapshots in the host tier on their own (core/host_hits.py): the device
gives up a snapshot whose page it keeps (its snapshot slots ran out), the host tier takes
the snapshot alone, and a later hit over the device's pages restores just the state from
host instead of recomputing back to an earlier snapshot -- one step ahead, as page
restores are. Without a device: the scheduler's copies are checked."""
from __future__ import annotations

from jaxserve.core.request import RequestStatus
from jaxserve.core.scheduler import Scheduler, SchedulerConfig
from tests.core.test_host_cache import PS
from tests.core.test_host_restore_ahead import A, make, restores

B = list(range(100, 113))   # another 13-token prompt


def run_prompt(sched: Scheduler, rid: str, tokens) -> list:
    """The request computed up to its first output token, then finished; -> its steps."""
    sched.add_request(make(rid, tokens))
    steps = []
    while not sched.get_request(rid).output_token_ids:   # chunks cut at a snapshot
        steps.append(sched.schedule())
        sched.update_from_output(steps[-1], {rid: 1})
    sched.finish_requests(rid, RequestStatus.FINISHED_STOPPED)
    return steps


def scheduler(num_host_state_slots: int = 4) -> Scheduler:
    """A device pool that keeps every page, one device snapshot slot: B's snapshot at the
    end of its last full page takes A's."""
    sched = Scheduler(SchedulerConfig(num_pages=16, page_size=PS, max_num_seqs=2,
                                      max_num_batched_tokens=64, max_model_len=32,
                                      num_state_slots=3, num_snapshot_slots=1,
                                      num_host_pages=16,
                                      num_host_state_slots=num_host_state_slots))
    run_prompt(sched, "a", A)
    return sched


def test_a_snapshot_the_device_gives_up_goes_to_host_alone():
    sched = scheduler()
    snap = sched.kv.snapshots.lookup(make("x", A).page_hashes[2], 12)
    steps = run_prompt(sched, "b", B)
    offloads = [s.host_copies for s in steps if s.host_copies is not None]
    assert len(offloads) == 1   # the state alone: every page stays on device
    (c,) = offloads
    assert c.offload_state_ids == [snap.slot] and len(c.offload_state_slots) == 1
    assert not c.offload_pages and not c.restore_slots
    assert sched.kv.snapshots.lookup(make("x", A).page_hashes[2], 12) is None
    assert sched.kv.host.state_entry(make("x", A).page_hashes[2]).slot == \
        c.offload_state_slots[0]
    stats = sched.kv.host.stats()
    assert stats.states_offloaded == 1
    assert (stats.state_num_slots, stats.state_capacity) == (1, 3)


def test_a_hit_over_device_pages_restores_the_state_from_host():
    sched = scheduler()
    run_prompt(sched, "b", B)
    host_slot = sched.kv.host.state_entry(make("x", A).page_hashes[2]).slot
    sched.add_request(make("a2", A))
    first = sched.schedule()   # the state's restore is sent; a2 is taken with no token
    c = first.host_copies
    assert restores(first) == 1 and c.restore_state_slots == [host_slot]
    assert c.restore_state_ids == [sched.kv.get_state_slot("a2")] and not c.restore_pages
    assert not first.new_reqs and list(sched.restoring) == ["a2"]
    assert sched.kv.host.states._lru[make("x", A).page_hashes[2]].pins == 1
    sched.update_from_output(first, {})
    second = sched.schedule()   # computed from the hit's end: no device snapshot copy
    (new,) = second.new_reqs
    assert (new.req_id, new.num_computed_tokens, new.num_new_tokens) == ("a2", 12, 1)
    assert not second.state_restores and not restores(second)
    assert sched.kv.host.states._lru[make("x", A).page_hashes[2]].pins == 0
    stats = sched.kv.host.stats()
    assert stats.states_restored == 1 and stats.pages_restored == 0


def test_without_host_state_slots_the_hit_goes_back_to_no_snapshot():
    sched = scheduler(num_host_state_slots=0)
    run_prompt(sched, "b", B)
    assert sched.kv.host.states is None
    sched.add_request(make("a2", A))
    out = sched.schedule()
    assert restores(out) == 0 and [r.num_computed_tokens for r in out.new_reqs] == [0]


def test_a_failed_step_drops_the_state_offload():
    sched = scheduler()
    sched.add_request(make("b", B))
    out = sched.schedule()
    for _ in range(8):   # to the step that offloads A's snapshot
        if out.host_copies is not None and out.host_copies.offload_state_slots:
            break
        sched.update_from_output(out, {"b": 1})
        out = sched.schedule()
    assert out.host_copies is not None and out.host_copies.offload_state_slots
    sched.kv.fail_host_copies()
    assert sched.kv.host.state_entry(make("x", A).page_hashes[2]) is None
    assert sched.kv.host.states.num_free == 3 and len(sched.kv.host.states) == 0
