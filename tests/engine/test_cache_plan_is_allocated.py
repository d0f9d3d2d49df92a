"""One cache plan: the capacity the start-up log and `python -m jaxserve.plan` print is
what the engine allocates on device and what its scheduler hands out -- for dense, MoE
and hybrid models, on one device and on four."""
from __future__ import annotations

import logging

import pytest

from jaxserve import LLM
from jaxserve.build.cache_plan import plan_caches
from jaxserve.checkpoints.model_names import load_model_config
from jaxserve.planning.plan import make_plan, plan_for_engine
from models.cache_spec import PagedKVSpec, RecurrentStateSpec, SharedKVSpec
from sharding import bytes_per_device
from tests.checkpoints import make_tiny_checkpoint

# Enough for a few hundred pages of the tiny models, so the budget (not a cap) decides.
BUDGET = 3 << 20
# The hybrid's DeltaNet key heads must divide by the model axis (4).
OVERRIDES = {"qwen3_5": dict(linear_num_key_heads=4, linear_num_value_heads=8)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in made:
            made[kind] = make_tiny_checkpoint(kind, tmp_path_factory.mktemp(kind),
                                              **OVERRIDES.get(kind, {}))
        return made[kind]
    return get


ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32)
# No warmup: the plan and the arrays are the same with or without it (warmup only delays
# allocating the described caches: ModelRunner.allocate_caches), and nothing here runs.


@pytest.mark.parametrize("mesh", ["1x1", "1x4"])
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "qwen3_5"])
def test_the_printed_plan_is_what_the_engine_allocates(checkpoint, kind, mesh, caplog):
    path = checkpoint(kind)
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        core = LLM(path, mesh=mesh, kv_cache_memory_bytes=BUDGET, enforce_eager=True,
                   **ENGINE).engine
    plan = core.info.cache_plan
    assert plan.describe() in caplog.messages
    # The device arrays: every KV layer's pages, every recurrent layer's slots.
    caches = core.runner.kv_caches
    assert caches["kv"].shape[0] == plan.num_kv_layers * plan.num_pages
    assert bytes_per_device(caches["kv"]) == plan.kv_bytes
    hybrid = kind == "qwen3_5"
    assert plan.has_state == hybrid == ("recurrent" in caches)
    if hybrid:
        for kind_ in ("conv", "recurrent"):
            # The prefix cache's snapshot slots follow the running requests' slots.
            assert caches[kind_].shape[0] == plan.num_state_layers * (
                plan.num_state_slots + plan.num_snapshot_slots)
        assert bytes_per_device([caches["conv"], caches["recurrent"]]) == plan.state_bytes
        assert plan.num_state_slots == ENGINE["max_num_seqs"] + 1
    assert plan.total_bytes <= BUDGET < plan.total_bytes + plan.bytes_per_page
    # The scheduler hands out exactly these pages and slots.
    kv = core.scheduler.kv
    assert kv.num_pages == plan.num_pages and kv.get_num_free_pages() == plan.num_pages - 1
    assert (kv.state_slots.num_slots if kv.state_slots else 0) == plan.num_state_slots
    assert (kv.snapshots.num_slots if kv.snapshots else 0) == plan.num_snapshot_slots
    assert core.scheduler.max_len == min(64, plan.kv_tokens)
    # The printed plan shows that capacity ...
    text = plan_for_engine(core.info)
    assert f"KV pages per replica       {plan.num_pages - 1:,} x 16 tokens" in text
    assert f"KV capacity per replica    {plan.kv_tokens:,} tokens" in text
    # ... and the planner, given the same budget, makes the same plan.
    mc = load_model_config(path)
    assert make_plan(mc, model=path, mesh=mesh, kv_cache_memory_bytes=BUDGET,
                     **ENGINE).cache == plan


def test_cache_specs_per_layer_kind():
    """A layer that shares another's KV costs nothing; recurrent state comes first."""
    kv = PagedKVSpec(num_kv_heads=4, head_dim=8, dtype="float32")
    state = RecurrentStateSpec(shapes=((3, 8), (2, 4, 4)), dtypes=("float32", "float32"))
    plan = plan_caches([kv, SharedKVSpec(0), state, kv], model_axis=2, page_size=16,
                       max_num_seqs=3, max_model_len=64, max_num_batched_tokens=32,
                       budget_bytes=100_000)
    per_page = 2 * (2 * 4 * 8 * 4) * 16 // 2
    per_slot = (3 * 8 + 2 * 4 * 4) * 4 // 2
    assert (plan.bytes_per_page, plan.bytes_per_state_slot) == (per_page, per_slot)
    assert plan.num_state_slots == 4 and plan.max_running == 3
    assert plan.num_pages == (100_000 - 4 * per_slot) // per_page
    capped = plan_caches([kv], model_axis=1, page_size=16, max_num_seqs=3, max_model_len=64,
                         max_num_batched_tokens=32, budget_bytes=10**9, cap_at_demand=True)
    assert capped.num_pages == 3 * 4 + 1 and not capped.has_state


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory) -> str:
    """A tiny Qwen3.5 with an MTP layer."""
    from tests.checkpoints import add_mtp_layer
    return add_mtp_layer(make_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("mtp"),
                                              **OVERRIDES["qwen3_5"]))


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 2},
                                  {"method": "mtp", "num_speculative_tokens": 2}])
def test_the_planner_plans_speculation_on_a_hybrid_as_the_engine(mtp_checkpoint, spec,
                                                                 capsys):
    """`jaxserve plan` with the server's flags, --speculative-config included, makes the
    engine's cache plan: a hybrid's backup state slots (two per sequence) and an MTP
    drafter's KV on every page."""
    import dataclasses
    import json

    from jaxserve.cli.plan import main
    path = mtp_checkpoint
    core = LLM(path, kv_cache_memory_bytes=BUDGET, speculative_config=spec,
               enforce_eager=True, **ENGINE).engine
    plan = core.info.cache_plan
    assert plan.state_slots_per_seq == 2
    flags = ["--model", path, "--kv-cache-memory-bytes", str(BUDGET), "--speculative-config",
             json.dumps(spec), "--dtype", "float32", "--max-model-len", "64",
             "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--json"]
    main(flags)
    planned = json.loads(capsys.readouterr().out)
    assert planned["cache"] == dataclasses.asdict(plan)
    assert planned["state_slots"] == 2 * ENGINE["max_num_seqs"] + 1
    without = make_plan(load_model_config(path), model=path, mesh="1x1",
                        kv_cache_memory_bytes=BUDGET, **ENGINE).cache
    if spec["method"] == "mtp":   # the drafter's KV makes every page larger
        assert plan.bytes_per_page > without.bytes_per_page
        assert planned["drafter_weight_bytes_per_device"] > 0
    else:
        assert plan.bytes_per_page == without.bytes_per_page
