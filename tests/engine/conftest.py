"""Engine fixtures: tiny checkpoints (written once per session) and a leak check."""
from __future__ import annotations

import random

import pytest

from tests.checkpoints import make_tiny_checkpoint

KINDS = ("llama", "qwen3", "qwen3_moe")   # the hybrids have their own test file


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(kind) -> path of a tiny float32 checkpoint with a tokenizer."""
    made: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in made:
            made[kind] = make_tiny_checkpoint(kind, tmp_path_factory.mktemp(kind))
        return made[kind]
    return get


def assert_no_leaks(engine) -> None:
    """Every page is free (or free-and-cached) and no request is left behind."""
    sched = engine.scheduler
    assert not sched.has_unfinished_requests(), sched.requests
    assert sched.kv.get_num_free_pages() == engine.info.num_pages - 1
    assert sched.kv_cache_usage == 0.0
    # Hybrid models: every recurrent-state slot is back.
    slots = sched.kv.state_slots
    if slots is not None:
        assert sorted(slots.free_slots) == list(range(1, slots.num_slots))
    # Hybrid prefix caching: every snapshot slot is free or a cached snapshot.
    snaps = sched.kv.snapshots
    if snaps is not None:
        assert snaps.num_free + snaps.num_cached == snaps.num_slots


def add(engine, request_id: str, prompt, params, **kwargs) -> None:
    """Adds a request as LLM and the server do: through the engine's front door."""
    engine.add_request(engine.inputs.process(request_id, prompt, params, **kwargs))


def run_staggered(engine, prompts, params, every: int) -> dict[str, list[int]]:
    """Adds prompt i (request id str(i)) every `every` steps and steps until all finish;
    -> each request's output token ids."""
    pending = list(enumerate(prompts))
    results: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            i, p = pending.pop(0)
            add(engine, str(i), p, params)
        for o in engine.step():
            if o.finished:
                results[o.request_id] = o.outputs[0].token_ids
        step += 1
    return results


def prompt_workload(seed: int, num: int, params_of, prefix_len: int, max_tail: int
                    ) -> list[tuple[list[int], object]]:
    """num random prompts, every other one behind a shared prefix of prefix_len tokens
    (a prefix-cache hit once it is cached), the i-th with params_of(i)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 256) for _ in range(prefix_len)]
    items = []
    for i in range(num):
        tail = [rng.randrange(3, 256) for _ in range(rng.randrange(5, max_tail))]
        items.append((prefix + tail if i % 2 else tail, params_of(i)))
    return items
