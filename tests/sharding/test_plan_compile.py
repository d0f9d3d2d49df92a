"""python -m jaxserve.plan --compile: the engine's warmup programs compiled for a TPU by
libtpu's deviceless XLA:TPU + Mosaic compilers on this CPU host."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from jaxserve.plan import main
from tests.checkpoints import make_tiny_checkpoint

pytest.importorskip("libtpu")

GIB = 2**30
V6E_HBM = 32 * GIB
# Half the free HBM for the KV pages: today's write_kv makes XLA:TPU copy a layer's
# whole cache at some token buckets, which would not fit next to a 90 % cache.
UTIL = "0.5"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A tiny llama with head_dim 128 (lane-aligned on TPU, as every served model):
    at head_dim 16 XLA:TPU lays the cache out differently for the kernel and the
    scatter and copies it whole."""
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("plan_compile"),
                                num_attention_heads=8, num_key_value_heads=4,
                                intermediate_size=256, head_dim=128)


def run_json(*argv: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main([*argv, "--json"])
    return json.loads(out.getvalue())   # exactly one JSON object, nothing else


@pytest.fixture(scope="module")
def reports(tiny) -> dict[str, dict]:
    return {mesh: run_json("--model", tiny, "--mesh", mesh, "--target", "tpu-v6e", "--compile",
                           "--hbm-utilization", UTIL)
            for mesh in ("1x1", "1x4")}


@pytest.mark.parametrize("mesh", ["1x1", "1x4"])
def test_compile_json_on_a_tiny_model(reports, mesh):
    r = reports[mesh]
    assert r["error"] is None and r["fits"] is True
    assert r["hbm_bytes"] == V6E_HBM and r["max_model_len"] == 512 and r["mesh"] == mesh
    # 15 token buckets (16 .. 2048) x (forward, prompt logprobs) + 11 row buckets x 8
    # sampler variants: what warmup compiles (test_warmup_compiles_its_program_list).
    assert r["warmup_programs"] == 2 * 15 + 11 * 8
    got = [(p["name"], p["tokens"], p["rows"]) for p in r["programs"]]
    assert got == [("forward", 16, None), ("forward", 2048, None),
                   ("sample[random+penalties+logprobs]", None, 256)]
    for p in r["programs"]:
        assert p["compiled"] and p["error"] is None, p
        assert p["compile_seconds"] > 0
        assert p["peak_bytes"] == (p["argument_bytes"] + p["output_bytes"] + p["temp_bytes"]
                                   - p["alias_bytes"])
        assert p["argument_bytes"] <= p["peak_bytes"] <= p["device_peak_bytes"] <= V6E_HBM
    fwd = r["programs"][1]
    # Half of what the weights leave, and the caches donated: aliased, not copied out.
    assert 0.45 * V6E_HBM < fwd["argument_bytes"] < 0.55 * V6E_HBM
    assert fwd["alias_bytes"] >= r["kv_bytes_per_device"]
    sampler = r["programs"][2]
    assert sampler["argument_bytes"] < 64 * 2**20   # weights and the batch, no KV cache
    # ...but the cache stays in HBM while it runs: the device peak counts it.
    resident = r["weight_bytes_per_device"] + r["kv_bytes_per_device"]
    assert sampler["device_peak_bytes"] == pytest.approx(
        resident + sampler["peak_bytes"] - sampler["argument_bytes"], abs=2**20)


@pytest.mark.parametrize("mesh", ["1x1", "1x4"])
def test_planner_agrees_with_the_compiler(reports, mesh):
    """jaxserve.plan's weights + KV per device (no compiler involved) within 1 % of
    what the compiler says the forward step takes as arguments."""
    r = reports[mesh]
    for p in r["programs"][:2]:
        assert r["planner_bytes_per_device"] == pytest.approx(p["argument_bytes"], rel=0.01)
    assert r["weight_bytes_per_device"] + r["kv_bytes_per_device"] == pytest.approx(
        r["programs"][0]["argument_bytes"], rel=0.001)


def test_planner_agrees_on_a_hybrid_with_replicated_kv_heads(tmp_path):
    """Qwen3.5 (recurrent-state slots besides the pages) on 1x4: 2 KV heads replicated
    to 4, the state split by head."""
    from jaxserve.plan_compile import compile_plan
    path = make_tiny_checkpoint("qwen3_5", tmp_path, num_attention_heads=8,
                                num_key_value_heads=2, head_dim=128, linear_num_key_heads=4,
                                linear_num_value_heads=8)
    r = compile_plan(path, target="tpu-v6e", mesh="1x4", hbm_utilization=0.5,
                     select=lambda progs: progs[:1])
    (p,) = r.programs
    assert p.compiled, p.error
    assert r.state_bytes_per_device > 0
    assert r.planner_bytes_per_device == pytest.approx(p.argument_bytes, rel=0.01)


def test_an_engine_that_cannot_start_is_reported():
    """Qwen3-8B on one 16 GiB v5e: ~15.3 GiB of weights leave no room for one
    40,960-token sequence; the engine would refuse to start."""
    r = run_json("--model", "qwen3-8b", "--mesh", "1x1", "--target", "tpu-v5e", "--compile")
    assert r["fits"] is False and r["programs"] == [] and r["hbm_bytes"] == 16 * GIB
    assert "fewer than one sequence of max_model_len=40960" in r["error"]


def test_a_program_that_does_not_compile_is_reported(tiny, capsys):
    """`--compile all` with the whole HBM for the cache: no room for the forward's
    temporaries, XLA:TPU refuses it (RESOURCE_EXHAUSTED), reported per program, not
    raised; the programs that take no cache (prompt logprobs, 8 sampler variants)
    compile."""
    main(["--model", tiny, "--target", "tpu-v6e", "--compile", "all", "--hbm-utilization",
          "1.0", "--max-num-batched-tokens", "16", "--max-num-seqs", "8"])
    out = capsys.readouterr().out
    assert "warmup compiles 10 programs; compiled here 10" in out
    assert "forward                                t=16" in out
    assert "FAILED: JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory" in out
    assert out.count("FAILED") == 1 and "prompt_logprobs" in out and "sample[greedy]" in out
    assert "fits: no: 1 of 10 programs did not compile" in out


def test_compile_needs_a_target(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model", "qwen3-8b", "--compile"])
    assert e.value.code == 2 and "--compile needs --target" in capsys.readouterr().err


def test_warmup_compiles_its_program_list(tiny):
    """The list the planner compiles is what a live engine's warmup compiles, one
    compilation per program and nothing else."""
    from jaxserve import LLM
    llm = LLM(tiny, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
              compilation_cache_dir=None)
    runner = llm.engine.runner
    programs = runner.warmup_programs()
    assert len(programs) == 3 + 3 + 8   # tokens 16, 24, 32; rows 8; 8 sampler variants
    assert runner.warmup_compilations == len(programs)
