"""Converted checkpoints (`python -m jaxserve.convert`): served from DIR they give the
greedy tokens of the safetensors they came from, their params restore bit for bit into
the engine's shardings (also on another model axis that stores the same KV heads),
and an engine that would build another tree is refused with the flag to change."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoints.converted import MANIFEST, PARAMS_DIR, read_manifest, resolve_converted
from jaxserve.config import EngineConfig
from jaxserve.cli.convert import convert
from jaxserve.build.layout import engine_layout, layout_param_shardings
from jaxserve.build.loader import load_model, load_weights
from jaxserve.checkpoints.model_names import load_model_config
from models.config import ModelConfig
from models.layers import KERNEL_OUT_IN
from sharding import make_mesh
from tests.engine.conftest import assert_no_leaks

REPO = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _prompts() -> list[dict]:
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(3, 256) for _ in range(n)]} for n in (5, 33, 70)]


def _greedy(path: str, **kw) -> list[list[int]]:
    """The greedy tokens of _prompts (numerics only: no warmup, each program compiled
    when first used)."""
    llm = LLM(path, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
              enforce_eager=True, **kw)
    outs = [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]
    assert_no_leaks(llm.engine)
    return outs


def _convert(src: str, out: Path, **kw) -> Path:
    convert(EngineConfig(model=src, **kw), out)
    return out


def _load(path: str, mesh: str = "1x1", tied: bool = False, **kw):
    """(params, the shardings the engine places them in) as an engine on `mesh` loads
    `path`; tied: before the CPU-only lm_head untie."""
    config = resolve_converted(EngineConfig(model=path, mesh=mesh, **kw)).for_platform("cpu")
    m = make_mesh(mesh)
    layout = engine_layout(config, ModelConfig.from_pretrained(path), m)
    if tied:
        model, params = load_weights(config, layout, m)
    else:
        loaded = load_model(config, layout, m)
        model, params = loaded.model, loaded.params
    return params, layout_param_shardings(model, m, layout)


def _assert_same(got, want) -> None:
    got, want = flatten_dict(got), flatten_dict(want)
    assert got.keys() == want.keys()
    for path in want:
        assert got[path].dtype == want[path].dtype, path
        assert np.array_equal(np.asarray(got[path]), np.asarray(want[path])), path


def _assert_placed(params, shardings) -> None:
    # A kernel the CPU stores [out, in] (on a model axis of 1 only: replicated, as the
    # kernel was; models/weights.store_kernels_out_in) is placed as its kernel.
    placed = {(*p[:-1], "kernel") if p[-1] == KERNEL_OUT_IN else p: x
              for p, x in flatten_dict(params).items()}
    assert placed.keys() == flatten_dict(shardings).keys()
    for path, sharding in flatten_dict(shardings).items():
        assert placed[path].sharding.is_equivalent_to(sharding, 2), path


# ---- serving from DIR ------------------------------------------------------------

# Serving costs the compilations: a dense model on one device and a hybrid on
# two (the tiny qwen3 repeats one token, too weak a check); the leaf-by-leaf tests
# below cover the other models and meshes cheaply.
@pytest.mark.parametrize("kind,mesh", [("llama", "1x1"), ("qwen3_5", "1x2")])
def test_converted_serves_the_safetensors_greedy_tokens(kind, mesh, checkpoint, tmp_path):
    src = checkpoint(kind)
    out = _convert(src, tmp_path / "c", dtype="float32", mesh=mesh)
    want = _greedy(src, dtype="float32", mesh=mesh)
    assert len({t for row in want for t in row}) > 5   # tokens that can disagree
    assert _greedy(str(out), mesh=mesh) == want
    # What the directory says and holds.
    manifest = read_manifest(out)
    assert (manifest.dtype, manifest.model_axis, manifest.scan_layers) == (
        "float32", int(mesh[-1]), False)
    assert manifest.source == src and manifest.quantization is None
    assert manifest.settings == {"kv_cache_dtype": "auto", "calculate_kv_scales": False}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", MANIFEST,
            PARAMS_DIR} <= set(os.listdir(out))
    assert load_model_config(str(out)).dtype == "float32"   # the planner reads it too


# ---- the params, leaf by leaf (no compilation) ----------------------------------------

@pytest.mark.parametrize("kind,convert_on,load_on", [
    ("qwen3", "1x2", "1x1"),      # another model axis, same tree: resharded
    ("llama", "1x1", "1x2"),
    ("llama", "1x4", "1x4"),      # 2 KV heads, each stored twice
    ("qwen3_5", "1x2", "1x2"),    # DeltaNet channels regrouped, sharded
])
def test_params_restore_bit_for_bit_into_the_engines_shardings(kind, convert_on, load_on,
                                                                checkpoint, tmp_path):
    src = checkpoint(kind)
    out = _convert(src, tmp_path / "c", mesh=convert_on)
    got, shardings = _load(str(out), load_on)
    want, _ = _load(src, load_on)
    _assert_same(got, want)
    _assert_placed(got, shardings)


def test_the_tree_is_saved_before_the_cpu_untie(checkpoint, tmp_path):
    # The tied embedding's transposed copy is a CPU choice: an accelerator must not get it.
    out = _convert(checkpoint("qwen3"), tmp_path / "c")
    assert not any(leaf.path[0] == "lm_head" for leaf in read_manifest(out).leaves)
    tied, _ = _load(str(out), tied=True)
    assert "lm_head" not in tied
    untied, _ = _load(str(out))
    # On CPU the untied copy is the embedding transposed, which the CPU then stores
    # [out, in]: the embedding's values, as a leaf of its own.
    np.testing.assert_array_equal(np.asarray(untied["lm_head"][KERNEL_OUT_IN]),
                                  np.asarray(tied["embed_tokens"]["embedding"]))


def test_scanned_layers_and_other_dtypes_convert_too(checkpoint, tmp_path):
    src = checkpoint("qwen3_5")
    out = _convert(src, tmp_path / "c", dtype="bfloat16", scan_layers=True)
    manifest = read_manifest(out)
    assert manifest.scan_layers and manifest.dtype == "bfloat16"
    assert {leaf.dtype for leaf in manifest.leaves} == {"bfloat16"}
    assert ModelConfig.from_pretrained(str(out)).dtype == "bfloat16"   # "auto" = stored
    got, _ = _load(str(out), scan_layers=True)
    want, _ = _load(src, dtype="bfloat16", scan_layers=True)
    _assert_same(got, want)


def test_dummy_weights_convert_too(checkpoint, tmp_path):
    src = checkpoint("llama")
    out = _convert(src, tmp_path / "c", load_format="dummy", seed=3)
    assert read_manifest(out).load_format == "dummy"
    got, _ = _load(str(out))
    want, _ = _load(src, load_format="dummy", seed=3)
    _assert_same(got, want)


# ---- refusals ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def converted_1x2(checkpoint, tmp_path_factory) -> str:
    """tiny llama (4 heads, 2 KV heads) in float32, converted on 1x2."""
    return str(_convert(checkpoint("llama"), tmp_path_factory.mktemp("conv") / "c",
                        dtype="float32", mesh="1x2"))


@pytest.mark.parametrize("kwargs,message", [
    (dict(mesh="1x4"), r"converted for model axis 2, which stores 2 KV heads .* model axis 4 "
                       r"stores 4: serve it with --mesh Dx2, or convert again with --mesh 1x4"),
    (dict(scan_layers=True), r"holds its layers one by one .* convert again with --scan-layers"),
    (dict(dtype="bfloat16"), r"--dtype bfloat16: .* was converted to float32; pass --dtype "
                             r"float32 \(or auto\), or convert again with --dtype bfloat16"),
    (dict(load_format="dummy"), r"--load-format dummy .* is a converted checkpoint"),
    (dict(load_format="safetensors"), r"--load-format safetensors"),
])
def test_an_engine_that_builds_another_tree_is_refused(converted_1x2, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(converted_1x2, max_model_len=64, max_num_seqs=2, **kwargs)


def test_auto_dtype_is_the_converted_one(converted_1x2):
    config = resolve_converted(EngineConfig(model=converted_1x2))
    assert config.dtype == "float32"
    assert resolve_converted(EngineConfig(model=converted_1x2, dtype="float32")) == config


def test_a_changed_or_unfinished_directory_is_refused(checkpoint, tmp_path):
    out = _convert(checkpoint("llama"), tmp_path / "c", dtype="float32")
    manifest = json.loads((out / MANIFEST).read_text())

    def with_manifest(**changes) -> None:
        (out / MANIFEST).write_text(json.dumps({**manifest, **changes}))

    leaves = [dict(x, shape=[7]) if x["path"] == "norm/scale" else x for x in manifest["leaves"]]
    with_manifest(leaves=leaves)
    with pytest.raises(ValueError, match=r"params do not fit .* norm/scale: stored \(7,\), "
                                         r"engine \(64,\)\)\. convert it again"):
        _load(str(out))
    # A setting that may shape the tree (a quantized KV cache's scales) is named.
    with_manifest(leaves=leaves, settings={"kv_cache_dtype": "bfloat16"})
    with pytest.raises(ValueError, match=r"This engine has --kv-cache-dtype auto \(converted "
                                         r"with bfloat16\): pass the converted value, or "
                                         r"convert it again"):
        _load(str(out))
    with_manifest(format_version=99)
    with pytest.raises(ValueError, match=r"format_version 99, this jaxserve reads version 1"):
        _load(str(out))
    (out / MANIFEST).write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot be read .* convert the model again"):
        _load(str(out))
    (out / MANIFEST).unlink()   # params/ without a manifest: the conversion stopped
    with pytest.raises(ValueError, match=r"no jaxserve_checkpoint.json: an interrupted"):
        LLM(str(out), max_model_len=64)


def test_convert_refuses_a_used_output_and_a_converted_model(checkpoint, tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    with pytest.raises(ValueError, match=r"--output .* exists and is not an empty directory"):
        _convert(checkpoint("llama"), tmp_path / "used")
    out = _convert(checkpoint("llama"), tmp_path / "c")
    with pytest.raises(ValueError, match=r"already a converted checkpoint"):
        _convert(str(out), tmp_path / "again")


# ---- the command line ------------------------------------------------------------------

def test_cli_converts_and_the_engine_serves_it(checkpoint, tmp_path):
    src, out = checkpoint("qwen3"), tmp_path / "c"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "jaxserve.convert", "--model", src, "--output", str(out),
           "--mesh", "1x2", "--dtype", "float32"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "converted" in done.stderr and "GiB" in done.stderr
    assert read_manifest(out).model_axis == 2
    got, _ = _load(str(out), "1x2")
    want, _ = _load(src, "1x2", dtype="float32")
    _assert_same(got, want)
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "exists and is not an empty directory" in again.stderr


# ---- quantization (EngineConfig.quantization: on main, from the lead) -----------------

@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_round_trip(quantization, checkpoint, tmp_path):
    src = checkpoint("qwen3")
    out = _convert(src, tmp_path / "c", dtype="float32", quantization=quantization)
    manifest = read_manifest(out)
    assert manifest.quantization == quantization
    assert len({leaf.dtype for leaf in manifest.leaves}) > 1   # quantized kernels + scales
    got, _ = _load(str(out))                                   # None: the converted one
    want, _ = _load(src, dtype="float32", quantization=quantization)
    _assert_same(got, want)
    assert _greedy(str(out)) == _greedy(src, dtype="float32", quantization=quantization)
    other = "fp8" if quantization == "int8" else "int8"
    with pytest.raises(ValueError, match=rf"--quantization {other}: .* was converted with "
                                         rf"quantization {quantization}"):
        LLM(str(out), max_model_len=64, quantization=other)


def test_kv_scales_are_served_as_they_were_made(checkpoint, tmp_path):
    """A converted quantized KV cache's scales are values of the tree: served with the
    settings that made them (the same measured scales as from the safetensors), and
    refused with settings that would make others (the same tree shapes)."""
    src = checkpoint("llama")
    made = dict(dtype="float32", kv_cache_dtype="fp8", calculate_kv_scales=True)
    out = str(_convert(src, tmp_path / "c", **made))
    got, _ = _load(out, kv_cache_dtype="fp8", calculate_kv_scales=True)
    want, _ = _load(src, **made)
    _assert_same(got, want)
    assert not (np.asarray(got["kv_scales"]) == 1).all()
    for kv in ("fp8", "int8"):   # scales of 1; int8's own
        with pytest.raises(ValueError, match=rf"--kv-cache-dtype {kv}: .* stores the KV scales "
                                             rf"of a float8_e4m3fn cache, measured; serve it "
                                             rf"with the settings it was converted with "
                                             rf"\(--kv-cache-dtype fp8, --calculate-kv-scales "
                                             rf"True\)"):
            _load(out, kv_cache_dtype=kv)


def test_quantization_asked_of_an_unquantized_conversion_is_refused(converted_1x2):
    with pytest.raises(ValueError, match=r"--quantization int8: .* converted with "
                                         r"quantization none"):
        LLM(converted_1x2, max_model_len=64, quantization="int8")


def test_restore_reads_no_leaf_through_the_host_as_float(checkpoint, tmp_path, monkeypatch):
    # The restore asks orbax for each leaf in its stored dtype, placed: never a cast.
    import models.orbax_io as orbax_io
    out = _convert(checkpoint("llama"), tmp_path / "c", dtype="bfloat16")
    seen = {}
    real = orbax_io.restore_params

    def spy(path, target, **kw):
        seen.update({p: (x.dtype, x.sharding) for p, x in flatten_dict(target).items()})
        return real(path, target, **kw)
    monkeypatch.setattr("jaxserve.build.loader.restore_params", spy)
    _load(str(out), "1x2")
    assert seen and {str(d) for d, _ in seen.values()} == {"bfloat16"}
    assert all(isinstance(s, jax.sharding.NamedSharding) for _, s in seen.values())
