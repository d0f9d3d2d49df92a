"""How many programs warmup compiles: each costs minutes for the flagship on a TPU host
and seconds for the tiny default model here (DESIGN.md section 4's budget: at most 48
for the flagship, at most 24 for the tiny model)."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from jaxserve.cli.serve import engine_config, parser
from jaxserve.runner.programs import FORWARD, PROMPT_LOGPROBS, SAMPLE

FLAGSHIP_BUDGET, TINY_BUDGET = 48, 24


def kinds(programs) -> Counter:
    return Counter(p.name for p in programs)


def test_flagship_on_tpu_within_budget():
    """Qwen3.6-27B as the engine builds it for a v6e 1x8 at its defaults (262,144 tokens,
    256 rows): counted on the abstract engine, nothing compiled."""
    from jaxserve.config import EngineConfig, default_max_num_seqs
    from jaxserve.checkpoints.model_names import load_model_config
    from jaxserve.planning.plan_compile import build_abstract_engine
    from sharding import replica_meshes
    from sharding.tpu_targets import abstract_tpu_mesh, tpu_target
    # Built on this CPU host, the default rows would be CPU's: ask for the TPU's.
    config = EngineConfig(model="qwen3.6-27b", mesh="1x8", load_format="dummy",
                          compilation_cache_dir=None, max_num_seqs=default_max_num_seqs("tpu"))
    mesh = replica_meshes(abstract_tpu_mesh("tpu-v6e", "1x8"))[0]
    eng = build_abstract_engine(config, load_model_config("qwen3.6-27b"), mesh,
                                tpu_target("tpu-v6e").usable_hbm_bytes)
    counts = kinds(eng.programs)
    print(f"flagship warmup programs: {len(eng.programs)} {dict(counts)}")
    assert len(eng.programs) <= FLAGSHIP_BUDGET
    # A greedy sampler per row bucket, a sampling one per power-of-two row bucket, one
    # penalties sampler, one prompt-logprobs program.
    assert counts[f"{SAMPLE}[greedy]"] == len(eng.runner.row_buckets)
    assert counts[SAMPLE] == len(eng.runner.sampling_row_buckets)
    assert counts[f"{SAMPLE}[penalties]"] == counts[PROMPT_LOGPROBS] == 1
    assert counts[FORWARD] == len(eng.runner.token_buckets)


@pytest.mark.parametrize("kind", ["default", "qwen3_5"])
def test_tiny_server_within_budget(kind, checkpoint, tmp_path, monkeypatch):
    """The server's defaults (`python -m jaxserve.api`, no flags): the built-in tiny model,
    or a tiny Qwen3.5 hybrid, list at most the budget (listed only: no compilation). The
    hybrid then warms up, on a small step (the defaults' list holds the same kinds of
    program over more buckets, and its full warmup cost ~40 s here): every listed program
    compiles once, nothing else. (tests/sharding/test_plan_compile.py checks the same of
    a dense model.)"""
    from jaxserve.engine.engine_core import EngineCore
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))   # where the default model is written
    argv = [] if kind == "default" else ["--model", checkpoint(kind)]

    def runner(argv: list[str], warm: bool):
        config = replace(engine_config(parser().parse_args(argv)), compilation_cache_dir=None,
                         enforce_eager=not warm)
        return EngineCore(config).runner

    listed = runner(argv, warm=False)
    defaults = listed.warmup_programs()
    print(f"{kind}: {len(defaults)} warmup programs {dict(kinds(defaults))}")
    assert len(defaults) <= TINY_BUDGET
    assert kinds(defaults)[FORWARD] == len(listed.token_buckets)
    if kind != "default":
        warm = runner(argv + ["--max-model-len", "128", "--max-num-seqs", "4",
                              "--max-num-batched-tokens", "32"], warm=True)
        programs = warm.warmup_programs()
        print(f"{kind} (small step): {len(programs)} programs {dict(kinds(programs))}, "
              f"{warm.warmup_compilations} compilations in {warm.warmup_seconds:.1f} s")
        assert set(kinds(programs)) == set(kinds(defaults))
        assert kinds(programs)[FORWARD] == len(warm.token_buckets)
        assert warm.warmup_compilations == len(programs)
