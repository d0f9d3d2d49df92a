"""Model names: aliases, the offline Hugging Face cache, dummy models at the real shape."""
from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import pytest

from jaxserve.checkpoints.model_configs import ALIASES
from jaxserve.checkpoints.model_names import builtin_config, resolve_model
from jaxserve.checkpoints.tiny_tokenizer import make_tiny_tokenizer
from models.config import ModelConfig

MIB = 2**20


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """An empty HF cache and jaxserve cache per test, offline mode, and no network at all."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "jaxserve"))

    def refuse(*args, **kwargs):
        raise AssertionError("model name resolution tried to use the network")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return tmp_path


def fake_snapshot(cache: Path, repo_id: str, files: dict[str, str | bytes], *,
                  commit: str = "0123abcd" * 5, ref: bool = True) -> Path:
    """The HF cache layout: models--Org--Name/snapshots/<commit>/..., refs/main -> commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, data in files.items():
        (snap / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    if ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
    return snap


def test_aliases_name_the_published_repos():
    assert ALIASES == {
        "qwen3.6-27b": "Qwen/Qwen3.6-27B", "qwen3.6-35b-a3b": "Qwen/Qwen3.6-35B-A3B",
        "qwen3-8b": "Qwen/Qwen3-8B", "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
        "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
        "gemma-4-31b": "google/gemma-4-31B-it", "gemma-4-26b-a4b": "google/gemma-4-26B-A4B-it",
        "gemma-4-e4b": "google/gemma-4-E4B-it", "gemma-4-e2b": "google/gemma-4-E2B-it"}
    for alias, repo in ALIASES.items():
        assert builtin_config(alias) == builtin_config(alias.upper()) == builtin_config(repo)
    assert builtin_config("Qwen/Qwen2-7B") is None
    first = builtin_config("qwen3.6-27b")
    first["text_config"]["rope_parameters"]["rope_theta"] = 1
    assert builtin_config("qwen3.6-27b")["text_config"]["rope_parameters"]["rope_theta"] == 1e7


def test_alias_and_repo_id_found_in_the_hf_cache(offline):
    cfg = json.dumps(builtin_config("qwen3-8b"))
    snap = fake_snapshot(offline / "hf", "Qwen/Qwen3-8B",
                         {"config.json": cfg, "model.safetensors": b"x"})
    assert resolve_model("qwen3-8b") == str(snap)
    assert resolve_model("Qwen3-8B") == str(snap)         # aliases ignore case
    assert resolve_model("Qwen/Qwen3-8B") == str(snap)


def test_hf_home_and_pinned_revisions(offline, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(offline / "home"))
    old = fake_snapshot(offline / "home" / "hub", "org/pinned", {"config.json": "{}"},
                        commit="a" * 40, ref=False)
    (old.parent / ("b" * 40)).mkdir()                        # a snapshot without config.json
    (old / "model.safetensors").write_bytes(b"x")
    assert resolve_model("org/pinned") == str(old)


def test_sharded_checkpoint_needs_every_shard(offline):
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}
    snap = fake_snapshot(offline / "hf", "org/sharded", {
        "config.json": "{}", "model.safetensors.index.json": json.dumps(index),
        "model-00001-of-00002.safetensors": b"x"})
    with pytest.raises(ValueError, match="no \\(complete\\) safetensors weights"):
        resolve_model("org/sharded")
    (snap / "model-00002-of-00002.safetensors").write_bytes(b"x")
    assert resolve_model("org/sharded") == str(snap)


def test_missing_weights_say_how_to_get_them(offline):
    """Offline (tests/conftest.py sets HF_HUB_OFFLINE=1; test_model_download.py downloads)."""
    with pytest.raises(ValueError) as e:
        resolve_model("qwen3.6-27b")
    msg = str(e.value)
    for part in ("'qwen3.6-27b' (Qwen/Qwen3.6-27B)", "HF_HUB_OFFLINE is on", str(offline / "hf"),
                 "hf download Qwen/Qwen3.6-27B", "local checkpoint directory",
                 "--load-format dummy"):
        assert part in msg, part
    # Config and tokenizer cached, weights not: still an error unless dummy.
    fake_snapshot(offline / "hf", "org/config-only", {"config.json": "{}"})
    with pytest.raises(ValueError, match="has no \\(complete\\) safetensors weights.*"
                                         "hf download org/config-only"):
        resolve_model("org/config-only", load_format="safetensors")


def test_unknown_names_list_the_aliases(offline):
    for name in ("gpt-17", str(offline / "no" / "such" / "dir"), "a/b/c"):
        with pytest.raises(ValueError, match="does not exist") as e:
            resolve_model(name)
        assert all(alias in str(e.value) for alias in ALIASES)
    local = offline / "ckpt"
    local.mkdir()
    assert resolve_model(str(local)) == str(local)         # directories pass through


def test_dummy_alias_materialises_the_real_shape(offline, caplog):
    caplog.set_level(logging.WARNING, logger="jaxserve")
    path = resolve_model("Qwen3.6-27B", load_format="dummy")
    assert path == str(offline / "jaxserve" / "dummy" / "qwen3.6-27b")
    with open(Path(path) / "config.json") as f:
        assert json.load(f) == builtin_config("qwen3.6-27b")
    mc = ModelConfig.from_pretrained(path)
    assert mc.architecture == "Qwen3_5ForConditionalGeneration" and mc.is_hybrid
    assert (mc.num_layers, mc.hidden_size, mc.intermediate_size, mc.vocab_size) == \
        (64, 5120, 17408, 248320)
    assert mc.full_attention_layers == tuple(range(3, 64, 4))
    assert (mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.rotary_dim) == (24, 4, 256, 64)
    assert (mc.rope_theta, mc.max_position_embeddings, mc.rms_norm_eps) == (1e7, 262144, 1e-6)
    assert mc.linear_conv_dim == 10240 and not mc.tie_word_embeddings
    state = mc.state_bytes_per_seq(2)           # bf16 conv state
    assert state == 48 * (3 * 10240 * 2 + 48 * 128 * 128 * 4)
    assert 146 * MIB < state < 148 * MIB
    assert mc.eos_token_ids == (248044,) and mc.dtype == "bfloat16"

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == mc.vocab_size                       # every sampled id decodes
    assert tok.decode([mc.vocab_size - 1]) == f"<x{mc.vocab_size - 1}>"
    lines = [r.getMessage() for r in caplog.records if "meaningless" in r.getMessage()]
    assert len(lines) == 1 and "qwen3.6-27b" in lines[0]
    assert resolve_model("qwen3.6-27b", load_format="dummy") == path   # idempotent


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_dummy_tokenizer_covers_the_vocabulary(alias):
    """transformers picks the tokenizer class by model type (Qwen3.5 forces its own):
    whichever it picks, the stand-in has exactly the model's ids."""
    from transformers import AutoTokenizer
    path = resolve_model(alias, load_format="dummy")
    mc = ModelConfig.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == mc.vocab_size
    assert tok.decode(tok("Hello, my name is").input_ids, skip_special_tokens=True) == \
        "Hello, my name is"


def test_dummy_takes_the_real_tokenizer_from_the_cache(offline, caplog):
    tok_dir = offline / "tok"
    make_tiny_tokenizer(str(tok_dir))                      # stands in for Qwen's tokenizer
    files = {p.name: p.read_bytes() for p in tok_dir.iterdir()}
    snap = fake_snapshot(offline / "hf", "Qwen/Qwen3-8B", files)
    path = Path(resolve_model("qwen3-8b", load_format="dummy"))
    assert (path / "tokenizer.json").read_bytes() == (snap / "tokenizer.json").read_bytes()
    assert not (path / ".jaxserve-tiny-tokenizer").exists()
    assert not any("meaningless" in r.getMessage() for r in caplog.records)
    mc = ModelConfig.from_pretrained(path)
    assert (mc.architecture, mc.num_layers, mc.num_kv_heads) == ("Qwen3ForCausalLM", 36, 8)
    # With config.json and tokenizer cached, dummy uses the snapshot itself.
    (snap / "config.json").write_text(json.dumps(builtin_config("qwen3-8b")))
    assert resolve_model("qwen3-8b", load_format="dummy") == str(snap)


def test_dummy_upgrades_a_tiny_tokenizer_once_the_real_one_is_cached(offline):
    tiny = Path(resolve_model("llama-3.1-8b", load_format="dummy"))
    assert (tiny / ".jaxserve-tiny-tokenizer").exists()
    tok_dir = offline / "tok"
    make_tiny_tokenizer(str(tok_dir), vocab_size=300)
    fake_snapshot(offline / "hf", "meta-llama/Llama-3.1-8B-Instruct",
                  {"tokenizer.json": (tok_dir / "tokenizer.json").read_bytes(),
                   "tokenizer_config.json": (tok_dir / "tokenizer_config.json").read_bytes()})
    assert resolve_model("llama-3.1-8b", load_format="dummy") == str(tiny)
    assert not (tiny / ".jaxserve-tiny-tokenizer").exists()
    assert not (tiny / "chat_template.jinja").exists()     # no stale tiny-tokenizer files
    from transformers import AutoTokenizer
    assert len(AutoTokenizer.from_pretrained(str(tiny))) == 300


def test_dummy_needs_a_config(offline):
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is on.*dummy needs its config.json"):
        resolve_model("org/unknown", load_format="dummy")


def test_every_builtin_config_parses():
    figures = {   # alias: (layers, full-attention layers, experts, vocab)
        "qwen3.6-27b": (64, 16, 0, 248320), "qwen3.6-35b-a3b": (40, 10, 256, 248320),
        "qwen3-8b": (36, 36, 0, 151936), "qwen3-30b-a3b": (48, 48, 128, 151936),
        "llama-3.1-8b": (32, 32, 0, 128256)}
    for alias, want in figures.items():
        mc = ModelConfig.from_hf_dict(builtin_config(alias))
        assert (mc.num_layers, len(mc.full_attention_layers), mc.num_experts,
                mc.vocab_size) == want, alias
    moe = ModelConfig.from_hf_dict(builtin_config("qwen3.6-35b-a3b"))
    assert (moe.num_experts_per_tok, moe.moe_intermediate_size,
            moe.shared_expert_intermediate_size, moe.linear_num_value_heads) == (8, 512, 512, 32)
    llama = ModelConfig.from_hf_dict(builtin_config("llama-3.1-8b"))
    assert llama.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}
    assert llama.eos_token_ids == (128001, 128008, 128009) and llama.rms_norm_eps == 1e-5
    q30 = ModelConfig.from_hf_dict(builtin_config("qwen3-30b-a3b"))
    assert (q30.moe_intermediate_size, q30.norm_topk_prob, q30.max_position_embeddings) == \
        (768, True, 40960)


def test_help_texts_mention_aliases_and_repo_ids(capsys):
    from jaxserve.cli.serve import parser
    from jaxserve.cli.generate import main as generate_main
    helps = [a.help for a in parser()._actions if a.dest == "model"]
    with pytest.raises(SystemExit):
        generate_main(["--help"])
    helps.append(capsys.readouterr().out)
    for text in helps:
        assert "qwen3.6-27b" in text and "Org/Name" in text


def test_engine_serves_a_repo_id_from_the_cache(offline):
    """EngineCore resolves the name first: a tiny checkpoint stored as a cached repo."""
    from jaxserve import LLM, SamplingParams
    from tests.checkpoints import make_tiny_checkpoint
    snap = offline / "hf" / "models--tiny--qwen3" / "snapshots" / ("c" * 40)
    make_tiny_checkpoint("qwen3", snap)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("c" * 40)
    llm = LLM("tiny/qwen3", dtype="float32", max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=32, enforce_eager=True)   # (no warmup)
    assert llm.engine.info.model == str(snap)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_qwen36_27b_parameter_count():
    """The flax model of the published config has the published 26.9B text parameters.
    Needs the Qwen3.5 model class in models/registry.py."""
    import math

    from flax.traverse_util import flatten_dict

    from models.registry import build_model
    from models.weights import abstract_params
    mc = ModelConfig.from_hf_dict(builtin_config("qwen3.6-27b"))
    shapes = flatten_dict(abstract_params(build_model(mc, "bfloat16", "reference")))
    count = sum(math.prod(s.shape) for s in shapes.values())
    assert count == pytest.approx(26.9e9, rel=0.005)
