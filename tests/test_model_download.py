"""Downloads from a Hugging Face hub (tests/fake_hub.py on localhost, never the real one):
only the files jaxserve reads, at the asked revision, into --download-dir; offline mode;
the hub's refusals; checkpoints that need their own code."""
from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import pytest

from jaxserve.checkpoints.model_names import resolve_model, resolve_tokenizer
from jaxserve.checkpoints.tiny_tokenizer import make_tiny_tokenizer
from models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from tests.checkpoints import make_tiny_checkpoint, reference_greedy
from tests.fake_hub import FakeHub

# What a repo may hold besides a checkpoint, none of which jaxserve reads.
UNREAD = {"pytorch_model.bin": b"pickled", "model.gguf": b"gguf", "README.md": b"# tiny",
          "onnx/model.onnx": b"onnx", "original/consolidated.pth": b"torch",
          "original/model.safetensors": b"not jaxserve's layout"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny Qwen3 checkpoint in four shards with their index, and a tokenizer."""
    return Path(make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("tiny"),
                                     max_shard_size="200KB"))


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A fake hub at HF_ENDPOINT, online, empty HF and jaxserve caches; connecting
    anywhere but localhost fails the test."""
    from huggingface_hub import constants
    with FakeHub() as fake:
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
        monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "jaxserve"))
        connect = socket.socket.connect

        def local_only(sock, address):
            assert address[0] in ("127.0.0.1", "localhost"), f"tried to reach {address}"
            return connect(sock, address)
        monkeypatch.setattr(socket.socket, "connect", local_only)
        yield fake


def checkpoint_files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.is_file()}


def test_download_at_a_revision_then_serve(hub, tiny, tmp_path):
    """LLM downloads the model at --revision into --download-dir (only what it reads: the
    shards the index names, not .bin, GGUF, ONNX or subfolders), and the --tokenizer repo's
    tokenizer files alone; then serves the model as transformers runs it."""
    from jaxserve import LLM, SamplingParams
    hub.add("org/tiny", {"config.json": b"{}"})                 # main: not this checkpoint
    v1 = hub.add_dir("org/tiny", tiny, branch="v1",
                     extra={**UNREAD, "consolidated.safetensors": b"not in the index"})
    tok_dir = tmp_path / "tok"
    make_tiny_tokenizer(str(tok_dir))
    hub.add_dir("org/tok", tok_dir, extra={"model.safetensors": b"weights", **UNREAD})
    dl = tmp_path / "downloads"

    llm = LLM("org/tiny", revision="v1", download_dir=str(dl), tokenizer="org/tok",
              trust_remote_code=True, dtype="float32", max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=32, enforce_eager=True)   # (no warmup)
    repo = dl / "models--org--tiny"
    assert llm.engine.info.model == str(repo / "snapshots" / v1)
    assert (repo / "refs" / "v1").read_text() == v1
    assert hub.fetched("org/tiny") == checkpoint_files(tiny)    # and nothing else
    assert checkpoint_files(repo / "snapshots" / v1) == checkpoint_files(tiny)
    tok_snap = dl / "models--org--tok" / "snapshots"
    assert hub.fetched("org/tok") == checkpoint_files(tok_dir)
    assert llm.tokenizer.name_or_path == str(next(tok_snap.iterdir()))
    assert not (tmp_path / "hf").exists()                       # the default cache untouched

    prompt = [5, 17, 42, 9]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == reference_greedy(tiny, [prompt], 4)[0]


def test_cached_model_needs_no_http_and_offline_mode(hub, tiny, tmp_path, monkeypatch):
    from huggingface_hub import constants
    hub.add_dir("org/tiny", tiny)
    dl = str(tmp_path / "dl")
    path = resolve_model("org/tiny", download_dir=dl)
    assert hub.fetched("org/tiny") == checkpoint_files(tiny)
    hub.requests.clear()
    assert resolve_model("org/tiny", download_dir=dl) == path   # online, from the cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("org/tiny", download_dir=dl) == path
    assert resolve_model("org/tiny", download_dir=dl, load_format="dummy") == path
    assert resolve_tokenizer("org/tiny", download_dir=dl) == path
    assert hub.requests == []
    with pytest.raises(ValueError) as e:
        resolve_model("org/elsewhere", download_dir=dl, revision="v2")
    for part in ("org/elsewhere at revision v2", "HF_HUB_OFFLINE is on",
                 f"not in the Hugging Face cache at {dl}", "hf download org/elsewhere"):
        assert part in str(e.value), part
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is on.*its tokenizer is not in"):
        resolve_tokenizer("org/elsewhere", download_dir=dl)
    # Offline as huggingface_hub read it at import, the variable unset since.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is on"):
        resolve_model("org/elsewhere", download_dir=dl, load_format="dummy")
    assert hub.requests == []


def test_missing_weights_are_completed(hub, tiny, tmp_path):
    """A cached snapshot with the config but not every shard: the rest is downloaded."""
    hub.add_dir("org/tiny", tiny)
    dl = str(tmp_path / "dl")
    dummy = Path(resolve_model("org/tiny", download_dir=dl, load_format="dummy"))
    assert hub.fetched("org/tiny") == checkpoint_files(tiny) - {
        "model.safetensors.index.json", *(p.name for p in tiny.glob("*.safetensors"))}
    assert ModelConfig.from_pretrained(dummy).architecture == "Qwen3ForCausalLM"
    assert resolve_model("org/tiny", download_dir=dl) == str(dummy)
    assert checkpoint_files(dummy) == checkpoint_files(tiny)


def test_builtin_alias_with_dummy_downloads_nothing(hub):
    path = resolve_model("qwen3-8b", load_format="dummy")
    assert Path(path, "config.json").is_file() and hub.requests == []


def test_hub_refusals_say_what_to_do(hub, tiny, tmp_path, monkeypatch):
    tokenizer = {name: (tiny / name).read_bytes() for name in ("config.json", "tokenizer.json")}
    hub.add("org/gated", tokenizer, gated=True, token="hf_test")
    hub.add_dir("org/tiny", tiny)
    dl = str(tmp_path / "dl")
    with pytest.raises(ValueError) as e:
        resolve_model("org/gated", download_dir=dl)
    assert "org/gated is a gated repo" in str(e.value) and "HF_TOKEN" in str(e.value)
    assert f"{hub.url}/org/gated" in str(e.value)
    monkeypatch.setenv("HF_TOKEN", "hf_test")       # huggingface_hub sends it
    assert Path(resolve_tokenizer("org/gated", download_dir=dl), "tokenizer.json").is_file()
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(ValueError, match=f"org/missing was not found on the Hugging Face hub "
                                         f"\\({hub.url}\\).*HF_TOKEN"):
        resolve_model("org/missing", download_dir=dl)
    with pytest.raises(ValueError, match="org/tiny has no revision 'v9'.*--revision"):
        resolve_model("org/tiny", download_dir=dl, revision="v9")
    with pytest.raises(ValueError, match="org/missing was not found"):
        resolve_tokenizer("org/missing", download_dir=dl)
    assert any(p == "/api/models/org/missing/revision/main" for _, p in hub.requests)


def test_unreachable_hub(hub, tmp_path, monkeypatch):
    with socket.socket() as s:          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(ValueError) as e:
        resolve_model("org/tiny", download_dir=str(tmp_path / "dl"))
    assert f"the Hugging Face hub at http://127.0.0.1:{port} cannot be reached" in str(e.value)
    assert "hf download org/tiny" in str(e.value)


def test_repo_without_safetensors_is_refused(hub, tiny, tmp_path):
    files = {name: (tiny / name).read_bytes() for name in
             ("config.json", "tokenizer.json", "tokenizer_config.json")}
    hub.add("org/bin-only", {**files, **UNREAD})
    with pytest.raises(ValueError) as e:
        resolve_model("org/bin-only", download_dir=str(tmp_path / "dl"))
    assert "org/bin-only (revision main) has no safetensors weights" in str(e.value)
    assert "reads only safetensors" in str(e.value)
    assert hub.fetched("org/bin-only") == set(files)


def test_custom_code_is_refused_before_the_weights(hub, tmp_path):
    config = {"architectures": ["CustomForCausalLM"], "model_type": "custom",
              "auto_map": {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}}
    hub.add("org/custom", {"config.json": json.dumps(config).encode(),
                           "modeling_custom.py": b"class CustomForCausalLM: ...",
                           "model.safetensors": b"weights"})
    with pytest.raises(ValueError) as e:
        resolve_model("org/custom", download_dir=str(tmp_path / "dl"))
    msg = str(e.value)
    assert "org/custom: architecture 'CustomForCausalLM' needs the checkpoint's own " \
           "Python code (config.json auto_map)" in msg
    assert "--trust-remote-code does not change that" in msg
    assert all(arch in msg for arch in SUPPORTED_ARCHITECTURES)
    assert hub.fetched("org/custom") == {"config.json"}
    # Without auto_map, the usual message; no architectures but auto_map: custom code.
    del config["auto_map"]
    with pytest.raises(ValueError, match="Architecture 'CustomForCausalLM' is not supported"):
        ModelConfig.from_hf_dict(config)
    with pytest.raises(ValueError, match="'custom' needs the checkpoint's own Python code"):
        ModelConfig.from_hf_dict({"model_type": "custom", "auto_map": {"AutoConfig": "c.C"}})


def test_auto_map_on_a_known_architecture_runs_jaxserve_code(tiny, tmp_path, caplog):
    """As vLLM: the architecture's name picks jaxserve's implementation; the repo's code
    named by auto_map is not run, and the log says so."""
    config = json.loads((tiny / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_qwen.Qwen3ForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    caplog.set_level(logging.WARNING, logger="jaxserve")
    assert ModelConfig.from_pretrained(tmp_path).architecture == "Qwen3ForCausalLM"
    assert any("auto_map" in r.getMessage() and "jaxserve ignores it" in r.getMessage()
               for r in caplog.records)
