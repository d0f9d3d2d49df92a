"""The data-parallel front door's routing, with stand-in replicas (no model)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxserve.engine.data_parallel import DataParallelEngine
from jaxserve.engine.engine_core import prompt_page_hashes
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import add


class FakeReplica:
    """cached: {pages: n} -- the replica holds the first n pages of any prompt."""
    def __init__(self, load: int = 0, cached_pages: int = 0):
        self.load, self.cached_pages, self.added, self.aborted = load, cached_pages, [], []

    def num_unfinished(self) -> int:
        return self.load

    def cached_prefix_pages(self, page_hashes) -> int:
        return min(self.cached_pages, len(page_hashes))

    def add_request(self, request):   # no validate: the front door did that
        self.added.append(request.request_id)
        self.load += 1

    def abort_request(self, rid):
        self.aborted.append(rid)
        self.load -= 1

    def reset_prefix_cache(self):
        self.cached_pages = 0


def front(*replicas, slack: int = 2) -> DataParallelEngine:
    dp = DataParallelEngine.__new__(DataParallelEngine)   # skip building real engines
    dp.replicas, dp.balance_slack, dp._replica_of = list(replicas), slack, {}
    dp.info = SimpleNamespace(page_size=16)   # routing reads only the page size
    dp.inputs = InputProcessor(tokenizer=None, vocab_size=100, max_model_len=64)
    return dp


P = SamplingParams(max_tokens=1)


def test_least_loaded_wins_and_ties_go_to_the_first():
    a, b, c = FakeReplica(3), FakeReplica(1), FakeReplica(1)
    dp = front(a, b, c, slack=0)
    for i in range(4):
        add(dp, f"r{i}", [5, 6], P)
    assert (a.added, b.added, c.added) == ([], ["r0", "r2"], ["r1", "r3"])


def test_prefix_hit_wins_within_the_slack_only():
    prompt = [7] * 40
    hot = FakeReplica(2, cached_pages=2)
    cold = FakeReplica(0)
    dp = front(cold, hot, slack=2)
    add(dp, "x", prompt, P)
    assert hot.added == ["x"]                  # load 2 <= 0 + slack: the prefix hit wins
    add(dp, "y", prompt, P)             # load 3 > 0 + slack: balance wins
    assert cold.added == ["y"]


def test_reset_prefix_cache_reaches_every_replica():
    a, b = FakeReplica(cached_pages=3), FakeReplica(cached_pages=2)
    front(a, b).reset_prefix_cache()
    assert a.cached_pages == b.cached_pages == 0


def test_ids_are_unique_across_replicas_and_aborts_route_back():
    a, b = FakeReplica(), FakeReplica()
    dp = front(a, b, slack=0)
    add(dp, "r", [3], P)
    with pytest.raises(ValueError, match="already in use"):
        add(dp, "r", [3], P)
    with pytest.raises(ValueError, match="empty"):
        add(dp, "bad", [], P)
    assert a.added == ["r"] and b.added == []
    dp.abort_request("r")
    assert a.aborted == ["r"] and dp.abort_request("r") is None


def test_prompt_hashes_match_the_prefix_cache():
    """The front door's hashes are the ones the replicas' prefix caches store."""
    from jaxserve.core.request import Request
    prompt = list(range(3, 40))
    req = Request("r", prompt, SamplingParams(), page_size=16)
    assert prompt_page_hashes(prompt, 16) == req.page_hashes and len(req.page_hashes) == 2


class HashReplica(FakeReplica):
    """Holds the pages whose chained hashes are in `held` (its prefix cache)."""
    def __init__(self, held: list[int]):
        super().__init__()
        self.held = set(held)

    def cached_prefix_pages(self, page_hashes) -> int:
        return next((i for i, h in enumerate(page_hashes) if h not in self.held),
                    len(page_hashes))


def test_routing_hashes_the_images_content():
    """Two images behind the same placeholder ids are two prefixes: an image prompt goes
    to the replica holding its own image's pages, not to the first of two that hold the
    same ids (before, the router hashed the ids alone, so neither matched past the
    image's first page and the tie went to replica 0)."""
    from jaxserve.multimodal.front import ImageInput, MultiModalInputs
    prompt = [7] * 8 + [99] * 32 + [5] * 8          # an image's 32 tokens at 8: pages 0-2

    def images(digest: str) -> MultiModalInputs:
        return MultiModalInputs((ImageInput(None, offset=8, length=32, content_hash=digest),))

    held_a = prompt_page_hashes(prompt, 16, multi_modal=images("a" * 64))
    held_b = prompt_page_hashes(prompt, 16, multi_modal=images("b" * 64))
    assert len(held_a) == 3 and not set(held_a) & set(held_b)
    dp = front(HashReplica(held_a), HashReplica(held_b))
    assert dp.choose_replica(prompt, multi_modal=images("b" * 64)) == 1
    assert dp.choose_replica(prompt, multi_modal=images("a" * 64)) == 0
    assert dp.choose_replica(prompt) == 0      # text alone: no hit anywhere, the tie


def test_prompt_hashes_with_images_match_the_prefix_cache():
    from jaxserve.core.request import Request
    from jaxserve.multimodal.front import ImageInput, MultiModalInputs
    prompt = list(range(3, 40))
    mm = MultiModalInputs((ImageInput(None, offset=4, length=20, content_hash="c" * 64),))
    req = Request("r", prompt, SamplingParams(), page_size=16, multi_modal=mm)
    assert prompt_page_hashes(prompt, 16, multi_modal=mm) == req.page_hashes
    assert req.page_hashes != prompt_page_hashes(prompt, 16)
