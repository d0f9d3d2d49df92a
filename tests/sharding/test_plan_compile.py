"""python -m jaxserve.plan --compile: the engine's warmup programs compiled for a TPU by
libtpu's deviceless XLA:TPU + Mosaic compilers on this CPU host."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from jaxserve.cli.plan import main
from tests.checkpoints import make_tiny_checkpoint

pytest.importorskip("libtpu")

GIB = 2**30
V6E_HBM = int(31.25 * GIB)   # what XLA:TPU lets a program use of the chip's 32 GiB


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A tiny llama with head_dim 128 (lane-aligned on TPU, as every served model)."""
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
    """The engine's defaults: 90 % of what the weights leave goes to the KV pages."""
    return {mesh: run_json("--model", tiny, "--mesh", mesh, "--target", "tpu-v6e", "--compile")
            for mesh in ("1x1", "1x4")}


@pytest.mark.parametrize("mesh", ["1x1", "1x4"])
def test_compile_json_on_a_tiny_model(reports, mesh):
    r = reports[mesh]
    assert r["error"] is None and r["fits"] is True
    assert r["hbm_bytes"] == V6E_HBM and r["published_hbm_bytes"] == 32 * GIB
    assert r["max_model_len"] == 512 and r["mesh"] == mesh
    # A forward per token bucket (10: 16 .. 512 by powers of two, 768 .. 2048 by
    # midpoints), one prompt-logprobs program, a greedy sampler per row bucket (11), a
    # sampling one per power of two (8..256: 6) and the penalties sampler: what warmup
    # compiles (test_warmup_compiles_its_program_list).
    assert r["warmup_programs"] == 10 + 1 + 11 + 6 + 1
    got = [(p["name"], p["tokens"], p["rows"]) for p in r["programs"]]
    # ... and the greedy sampler of a one-row decode step (--decode-rows 1, the default),
    # whose bytes are accounted beside the roofline (tests/planning/test_step_bytes.py)
    assert got == [("forward", 16, None), ("forward", 2048, None),
                   ("sample[penalties]", None, 256), ("sample[greedy]", None, 8)]
    (step,) = r["decode"]
    assert step["rows"] == 1 and step["programs"] == ["forward[t=16]", "sample[greedy][r=8]"]
    assert step["step_bytes"] > 0 and step["roofline_bytes"] > 0 and step["top_ops"]
    for p in r["programs"]:
        assert p["compiled"] and p["error"] is None, p
        assert p["compile_seconds"] > 0
        assert p["peak_bytes"] == (p["argument_bytes"] + p["output_bytes"] + p["temp_bytes"]
                                   - p["alias_bytes"])
        assert p["argument_bytes"] <= p["peak_bytes"] <= p["device_peak_bytes"] <= V6E_HBM
    fwd = r["programs"][1]
    # The engine's 90 % of the chip less the reserve (5 % of it: a tiny model's
    # activations are less), and the caches donated: aliased, not copied out.
    assert 0.9 * 0.95 * V6E_HBM - 2**20 < fwd["argument_bytes"] < 0.9 * 0.95 * V6E_HBM + 2**20
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
    from jaxserve.planning.plan_compile import compile_plan
    path = make_tiny_checkpoint("qwen3_5", tmp_path, num_attention_heads=8,
                                num_key_value_heads=2, head_dim=128, linear_num_key_heads=4,
                                linear_num_value_heads=8)
    r = compile_plan(path, target="tpu-v6e", mesh="1x4", hbm_utilization=0.5,
                     select=lambda progs: progs[:1])
    (p,) = r.programs
    assert p.compiled, p.error
    assert r.state_bytes_per_device > 0
    assert r.planner_bytes_per_device == pytest.approx(p.argument_bytes, rel=0.01)


def test_lora_stacks_are_held_before_the_kv_cache_is_sized(tiny):
    """--enable-lora: the engine allocates the adapters' stacks before it sizes the KV
    cache from what is left, so --compile sizes it as the planner does (fewer pages than
    LoRA off) and the forward takes weights + stacks + KV."""
    from jaxserve.checkpoints.model_names import load_model_config
    from jaxserve.planning.plan import make_plan
    from jaxserve.planning.compile_format import format_report
    from jaxserve.planning.plan_compile import compile_plan
    lora = dict(enable_lora=True, max_loras=4, max_lora_rank=16)
    r = compile_plan(tiny, target="tpu-v6e", select=lambda progs: progs[:1], **lora)
    kw = dict(model=tiny, mesh="1x1", platform="tpu", hbm_bytes=V6E_HBM)
    plan = make_plan(load_model_config(tiny), **kw, **lora)
    base = make_plan(load_model_config(tiny), **kw)
    assert r.num_pages == plan.cache.num_pages < base.cache.num_pages
    assert r.lora_bytes_per_device == plan.lora_bytes_per_device > 0
    (p,) = r.programs
    assert p.compiled, p.error
    assert r.weight_bytes_per_device + r.lora_bytes_per_device + r.kv_bytes_per_device \
        == pytest.approx(p.argument_bytes, rel=0.001)
    assert r.planner_bytes_per_device == pytest.approx(p.argument_bytes, rel=0.01)
    assert "LoRA slots" in format_report(r)


def test_the_host_tiers_copies_compile_as_the_engine_runs_them(tmp_path):
    """--kv-offloading-size: a hybrid's (KV pages, conv and recurrent state slots) copy
    programs as its HostTier builds them, on the engine's caches split over 1x4: the
    restore writes one call's pages and slots into the donated caches in place (every
    cache aliased), the offload reads only the rows it names, neither with a temporary
    near a layer's share of the KV cache; both in the report's programs and its text."""
    from jaxserve.planning.compile_format import format_report
    from jaxserve.planning.plan_compile import compile_plan
    path = make_tiny_checkpoint("qwen3_5", tmp_path, num_attention_heads=8,
                                num_key_value_heads=2, head_dim=128, linear_num_key_heads=4,
                                linear_num_value_heads=8)
    kw = dict(target="tpu-v6e", mesh="1x4", max_model_len=256, max_num_seqs=4,
              kv_cache_memory_bytes=256 << 20, select=lambda progs: progs[:1])
    r = compile_plan(path, **kw, kv_offloading_size=1)
    assert [p.name for p in r.programs] == ["forward", "host_offload", "host_restore"]
    assert r.fits, format_report(r)
    forward, offload, restore = r.programs
    held = r.kv_bytes_per_device + r.state_bytes_per_device
    assert restore.alias_bytes >= held > 0
    layer_share = r.kv_bytes_per_device // 2   # the tiny Qwen3.5's 2 full-attention layers
    assert restore.temp_bytes < layer_share and offload.temp_bytes < layer_share
    assert offload.alias_bytes == 0 and offload.argument_bytes >= held
    assert "host_restore" in format_report(r)
    # Without the flag, no copy programs.
    assert [p.name for p in compile_plan(path, **kw).programs] == ["forward"]


def test_a_vision_model_compiles_its_encoder_programs(tmp_path):
    """A checkpoint that serves images (Qwen3.5's tower, 16 tokens an image: encoder
    buckets of 16, 32 and 64 patches): --compile builds the vision side as the engine
    does. The default selection compiles the smallest and largest encoder bucket; with the
    KV cache's bytes fixed, the report exceeds the text-only one (--language-model-only)
    by the tower and the encoder cache, which the forward takes as an argument; with the
    engine's memory rule the KV pages are the planner's, which leaves out the tower, the
    encoder cache and the largest encoder call's reserve."""
    from jaxserve.checkpoints.model_names import load_model_config
    from jaxserve.planning.plan import make_plan
    from jaxserve.planning.compile_format import format_report
    from jaxserve.planning.plan_compile import compile_plan, default_selection
    from tests.checkpoints import make_tiny_vision_serving_checkpoint
    path = make_tiny_vision_serving_checkpoint(
        "qwen3_5", tmp_path, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        linear_num_key_heads=4, linear_num_value_heads=8)
    kw = dict(target="tpu-v6e", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32)
    kv = dict(kv_cache_memory_bytes=64 << 20)
    first = lambda progs: progs[:1]   # the forward at 16 tokens
    r = compile_plan(path, **kw, **kv, select=lambda progs: first(progs) + [
        p for p in default_selection(progs) if p.kind == "encode"])
    text = compile_plan(path, **kw, **kv, language_model_only=True, select=first)
    assert r.fits, format_report(r)
    assert r.warmup_programs == text.warmup_programs + 3
    forward, *encode = r.programs
    assert [(p.name, p.tokens) for p in encode] == [("encode", 16), ("encode", 64)]
    v = make_plan(load_model_config(path), model=path, mesh="1x1", platform="tpu",
                  hbm_bytes=V6E_HBM, **{k: w for k, w in kw.items() if k != "target"}).vision
    assert (r.vision_weight_bytes_per_device, r.encoder_cache_bytes_per_device,
            r.encoder_activation_bytes) == (v.weight_bytes, v.cache_bytes, v.activation_bytes)
    assert text.vision_weight_bytes_per_device == text.encoder_cache_bytes_per_device == 0
    assert r.num_pages == text.num_pages
    assert r.planner_bytes_per_device - text.planner_bytes_per_device \
        == v.weight_bytes + v.cache_bytes > 0
    # The compiler's figures: the forward reads the encoder cache (its 64-wide rows laid
    # out 128 lanes wide on TPU) and per-token image rows and 3-axis positions; an encoder
    # call takes the tower and the cache, and its device peak counts the KV cache held
    # beside it.
    (text_forward,) = text.programs
    extra = forward.argument_bytes - text_forward.argument_bytes
    assert v.cache_bytes < extra <= 2 * v.cache_bytes + 8192
    big = encode[-1]
    assert big.argument_bytes > v.weight_bytes + v.cache_bytes
    assert big.temp_bytes <= v.activation_bytes and not r.encoders_over_reserve
    assert big.device_peak_bytes >= r.kv_bytes_per_device + big.peak_bytes
    assert "vision tower" in format_report(r)
    # The engine's memory rule: the planner's pages, fewer than text-only's.
    r = compile_plan(path, **kw, select=lambda progs: [p for p in progs if p.kind == "encode"][:1])
    mk = lambda **x: make_plan(load_model_config(path), model=path, mesh="1x1", platform="tpu",
                               hbm_bytes=V6E_HBM, max_model_len=256, max_num_seqs=4,
                               max_num_batched_tokens=32, **x)
    assert r.num_pages == mk().cache.num_pages < mk(language_model_only=True).cache.num_pages


def test_an_engine_that_cannot_start_is_reported():
    """Qwen3-8B on one 16 GiB v5e: ~15.3 GiB of weights leave no room for one
    40,960-token sequence; the engine would refuse to start."""
    r = run_json("--model", "qwen3-8b", "--mesh", "1x1", "--target", "tpu-v5e", "--compile")
    assert r["fits"] is False and r["programs"] == [] and r["hbm_bytes"] == int(15.75 * GIB)
    assert r["published_hbm_bytes"] == 16 * GIB
    assert "fewer than one sequence of max_model_len=40960" in r["error"]


def test_a_program_that_does_not_compile_is_reported(tiny, capsys):
    """`--compile all` with the whole HBM for the cache: no room for the forward's
    temporaries, XLA:TPU refuses it (RESOURCE_EXHAUSTED), reported per program, not
    raised; the programs that take no cache (prompt logprobs, the three samplers)
    compile."""
    main(["--model", tiny, "--target", "tpu-v6e", "--compile", "all",
          "--kv-cache-memory-bytes", str(V6E_HBM), "--max-num-batched-tokens", "16",
          "--max-num-seqs", "8"])
    out = capsys.readouterr().out
    assert "warmup compiles 5 programs; compiled here 5" in out
    assert "forward                                t=16" in out
    assert "FAILED: JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory" in out
    assert out.count("FAILED") == 1 and "prompt_logprobs" in out and "sample[penalties]" in out
    assert "fits: no: 1 of 5 programs did not compile" in out


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
    # forward at tokens 16 and 32, one prompt-logprobs program; rows 8: the greedy, the
    # sampling and the penalties sampler
    assert len(programs) == 2 + 1 + 3
    assert runner.warmup_compilations == len(programs)


def test_a_step_past_a_compiler_limit_is_refused(tmp_path, capsys):
    """16 query heads per KV head and a 262,144-token step: the TPU attention kernel's
    work items would not fit in SMEM. The planner (with or without --compile) and the
    engine's layout refuse it, saying what to lower."""
    import jax

    from jaxserve.config import EngineConfig
    from jaxserve.build.layout import engine_layout
    from jaxserve.checkpoints.model_names import load_model_config
    from sharding.tpu_targets import abstract_tpu_mesh

    path = make_tiny_checkpoint("llama", tmp_path, num_attention_heads=16,
                                num_key_value_heads=1, head_dim=128, intermediate_size=256,
                                max_position_embeddings=262_144)
    argv = ["--model", path, "--target", "tpu-v6e", "--max-model-len", "1024",
            "--max-num-batched-tokens", "262144"]
    main(argv)
    out = capsys.readouterr().out
    assert "does NOT compile for TPU: 262144 tokens over 256 rows need" in out
    assert "lower max_num_batched_tokens to" in out
    r = run_json(*argv, "--compile")
    assert r["fits"] is False and r["programs"] == []
    assert "bytes of TPU SMEM" in r["error"]
    config = EngineConfig(model=path, max_model_len=1024, max_num_batched_tokens=262_144,
                          load_format="dummy")
    with pytest.raises(ValueError, match="lower max_num_batched_tokens to"):
        engine_layout(config, load_model_config(path), abstract_tpu_mesh("tpu-v6e"))
    # The same step on CPU (the reference attention) has no such limit.
    engine_layout(config, load_model_config(path), jax.make_mesh((1, 1), ("data", "model")))
    # ...and the largest bucket the message names is accepted.
    main([*argv[:-1], out.split("lower max_num_batched_tokens to ")[1].split()[0]])
    assert "does NOT compile" not in capsys.readouterr().out


def test_too_many_rows_for_the_gated_delta_kernel_are_refused():
    """The hybrid's decode kernel keeps 12 bytes per row in SMEM (its budget: 256 KiB)."""
    from jaxserve.checkpoints.model_names import load_model_config
    from jaxserve.planning.plan import make_plan
    mc = load_model_config("qwen3.6-27b")
    kw = dict(model="qwen3.6-27b", mesh="1x8", max_model_len=4096, platform="tpu")
    p = make_plan(mc, max_num_seqs=22_000, max_num_batched_tokens=22_000, **kw)
    assert not p.fits and "gated-delta" in p.compiler_limit
    assert "lower max_num_seqs to 21845" in p.compiler_limit
    assert make_plan(mc, max_num_seqs=21_845, max_num_batched_tokens=21_845,
                     **kw).compiler_limit is None


def test_an_encoder_call_over_its_reserve_does_not_fit():
    """Each encode program's own temporaries are checked against the reserve the engine
    keeps for the largest encoder call (encoder_activation_bytes), not only the device's
    peak: a larger one is named and the report does not fit."""
    from dataclasses import replace

    from jaxserve.planning.compile_format import format_report
    from jaxserve.planning.plan_compile import CompileReport, ProgramResult
    done = dict(compiled=True, compile_seconds=1.0, argument_bytes=GIB, output_bytes=GIB,
                alias_bytes=0, peak_bytes=3 * GIB, device_peak_bytes=20 * GIB)
    programs = (ProgramResult("forward", 16, None, temp_bytes=GIB, **done),
                ProgramResult("encode", 16, None, temp_bytes=GIB // 2, **done),
                ProgramResult("encode", 4096, None, temp_bytes=GIB, **done))
    r = CompileReport(model="m", target="tpu-v6e", mesh="1x1", hbm_bytes=V6E_HBM,
                      published_hbm_bytes=32 * GIB, max_model_len=256, max_num_seqs=4,
                      num_pages=9, weight_bytes_per_device=GIB, kv_bytes_per_device=GIB,
                      state_bytes_per_device=0, planner_bytes_per_device=3 * GIB,
                      warmup_programs=3, programs=programs, vision_weight_bytes_per_device=GIB,
                      encoder_cache_bytes_per_device=GIB, encoder_activation_bytes=GIB)
    assert r.fits and not r.encoders_over_reserve        # at the reserve: fits
    over = replace(r, encoder_activation_bytes=GIB - 1)  # the forward's temp is no encoder's
    assert [p.tokens for p in over.encoders_over_reserve] == [4096]
    assert not over.fits and over.to_json()["encoders_over_reserve"] == [4096]
    assert "encoder temporaries over the reserve" in format_report(over)
    assert "t=4096" in format_report(over).splitlines()[-1]
