"""Model and tokenizer names -> a local directory, downloading what is missing.

`--model` may be a directory, a Hugging Face repo id (`Org/Name`) or a short alias
(`qwen3.6-27b` -> `Qwen/Qwen3.6-27B`). A repo id is looked up first in the Hugging Face
cache (`download_dir`, else HF_HUB_CACHE / HF_HOME/hub) at `revision`; what is not there is
downloaded into that cache with huggingface_hub (hub_download.py: HF_TOKEN, HF_ENDPOINT,
HF_HUB_OFFLINE=1 forbids it). Only the files jaxserve reads are fetched: config.json,
generation_config.json, the tokenizer and chat template (TOKENIZER_FILES) and the
safetensors weights with their index; never .bin, .pt, GGUF or ONNX files, and a repo
with no safetensors is refused. The config is fetched and checked first, so a model
jaxserve cannot run is refused before its weights are downloaded.

With `load_format="dummy"` an alias needs no download at all: its built-in config.json
(jaxserve/model_configs.py) is written under the jaxserve cache with a tokenizer, so the
model runs with random weights at its real shape. Any other repo id fetches its config
and tokenizer only. `--tokenizer` resolves the same way, fetching tokenizer files only.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from jaxserve.checkpoints import hub_download
from jaxserve.checkpoints.default_model import cache_root
from jaxserve.checkpoints.model_configs import ALIASES, BUILTIN_CONFIGS
from models.config import ModelConfig

logger = logging.getLogger("jaxserve")

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What a checkpoint's tokenizer may consist of (generation_config.json rides along: its
# sampling defaults belong with the tokenizer's chat template).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                    "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
                    "chat_template.jinja", "chat_template.json", "generation_config.json")
_TINY_MARK = ".jaxserve-tiny-tokenizer"   # the dummy directory holds the tiny tokenizer
_WEIGHT_INDEX = "model.safetensors.index.json"
# Fetched before the weights: the config (checked first), tokenizer, chat template and
# the index naming the shards (a repo may also hold consolidated.safetensors: not fetched).
_META_FILES = ["config.json", *TOKENIZER_FILES, _WEIGHT_INDEX]
# A dummy model's and a --tokenizer's files (AutoTokenizer may read config.json to pick
# the tokenizer's class).
_CONFIG_AND_TOKENIZER = ["config.json", *TOKENIZER_FILES]
_COMMIT = re.compile(r"[0-9a-f]{40}")


def _alias_of(name: str) -> str | None:
    """The alias for an alias or a repo id (both case-insensitive), else None."""
    key = name.lower()
    if key in ALIASES:
        return key
    return next((a for a, repo in ALIASES.items() if repo.lower() == key), None)


def builtin_config(name: str) -> dict | None:
    """A copy of the published config.json of an alias or its repo id; None if unknown."""
    alias = _alias_of(name)
    return copy.deepcopy(BUILTIN_CONFIGS[alias]) if alias else None


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache, read from the environment now (huggingface_hub reads
    it once, at import)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def cached_snapshot(repo_id: str, cache: Path | None = None,
                    revision: str | None = None) -> Path | None:
    """The snapshot directory of `repo_id` in the HF cache, or None: that of `revision`
    (a branch or tag through refs/, or a commit), else refs/main's, else the newest."""
    from huggingface_hub import try_to_load_from_cache   # (heavy: only for a repo id)
    cache = cache or hf_hub_cache()
    hit = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache, revision=revision)
    if isinstance(hit, str):
        return Path(hit).parent
    if revision is not None:   # that snapshot even without config.json (tokenizer only)
        repo = cache / ("models--" + repo_id.replace("/", "--"))
        ref = repo / "refs" / revision
        commit = ref.read_text().strip() if ref.is_file() else revision
        snap = repo / "snapshots" / commit
        return snap if _COMMIT.fullmatch(commit) and snap.is_dir() else None
    # No refs/main (fetched at a pinned revision) or no config.json there: the newest
    # snapshot, preferring one with a config.json.
    snapshots = cache / ("models--" + repo_id.replace("/", "--")) / "snapshots"
    found = [p for p in snapshots.glob("*") if p.is_dir()]
    if not found:
        return None
    return max(found, key=lambda p: ((p / "config.json").is_file(), p.stat().st_mtime))


def has_weights(model_dir: Path) -> bool:
    """safetensors weights present, every shard of the index included (an interrupted
    download leaves some out; HF cache entries are symlinks that must resolve)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            shards = set(json.load(f).get("weight_map", {}).values())
        return bool(shards) and all((model_dir / s).is_file() for s in shards)
    return any(p.is_file() for p in model_dir.glob("*.safetensors"))


def _has_tokenizer(model_dir: Path | None) -> bool:
    return model_dir is not None and any(
        (model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                            "tokenizer.model"))


def _aliases() -> str:
    return ", ".join(ALIASES)


def load_model_config(model: str) -> ModelConfig:
    """An alias or its repo id (built-in config), a config.json path, a checkpoint
    directory or a repo id in the local Hugging Face cache (config only, no weights)."""
    config = builtin_config(model)
    if config is not None:
        return ModelConfig.from_hf_dict(config)
    if Path(model).is_file():
        with open(model) as f:
            return ModelConfig.from_hf_dict(json.load(f))
    return ModelConfig.from_pretrained(resolve_model(model, load_format="dummy"))


def resolve_model(name: str, *, load_format: str = "auto", revision: str | None = None,
                  download_dir: str | None = None) -> str:
    """A local directory holding config.json (and the tokenizer when there is one) for
    `name`: a directory, a Hugging Face repo id or an alias.

    A repo id not complete in the HF cache (`download_dir`, else the default one) at
    `revision` (None: main, or any cached snapshot) is downloaded there: its config and
    tokenizer, then, unless load_format is "dummy", its safetensors weights. Raises
    ValueError for a name that is none of the above, a model jaxserve cannot run, a repo
    without safetensors, the hub's refusals and offline mode (HF_HUB_OFFLINE) when
    something is missing, each saying what to do.
    """
    local = _local_dir(name)
    if local is not None:
        return local
    repo_id = _repo_id(name, "model")
    cache = _cache(download_dir)
    snap = _cached(name, repo_id, cache, revision)
    has_config = snap is not None and (snap / "config.json").is_file()
    if load_format != "dummy":
        if has_config and has_weights(snap):
            return str(snap)
        if hub_download.offline():
            raise ValueError(_offline(name, repo_id, revision, cache,
                                      _missing_weights(cache, snap, has_config)))
        return str(_download_checkpoint(repo_id, revision, cache))
    if has_config and _has_tokenizer(snap):
        return str(snap)
    config = builtin_config(repo_id)
    if config is not None:   # the built-in config: nothing to download
        return _materialise_dummy(_alias_of(repo_id), repo_id, config,
                                  snap if _has_tokenizer(snap) else None)
    if hub_download.offline():
        if has_config:
            return str(snap)
        raise ValueError(_offline(name, repo_id, revision, cache,
                                  f"--load-format dummy needs its config.json, which is not "
                                  f"in the Hugging Face cache at {cache}, and it is not a "
                                  f"built-in ({_aliases()})", suggest_dummy=False))
    meta = hub_download.download(repo_id, _CONFIG_AND_TOKENIZER, revision=revision,
                                 cache=cache, what="config and tokenizer")
    _check_runnable(repo_id, meta)
    return str(meta)


def resolve_tokenizer(name: str, *, revision: str | None = None,
                      download_dir: str | None = None) -> str:
    """A local directory holding the tokenizer `name` names (a directory, a repo id or an
    alias), its tokenizer files downloaded into the HF cache when not cached there."""
    local = _local_dir(name)
    if local is not None:
        return local
    repo_id = _repo_id(name, "tokenizer")
    cache = _cache(download_dir)
    snap = _cached(name, repo_id, cache, revision)
    if _has_tokenizer(snap):
        return str(snap)
    if hub_download.offline():
        raise ValueError(_offline(name, repo_id, revision, cache,
                                  f"its tokenizer is not in the Hugging Face cache at {cache}",
                                  suggest_dummy=False))
    snap = hub_download.download(repo_id, _CONFIG_AND_TOKENIZER, revision=revision, cache=cache,
                                 what="tokenizer")
    if not _has_tokenizer(snap):
        raise ValueError(f"{repo_id} (revision {revision or 'main'}) has no tokenizer files "
                         f"(tokenizer.json, tokenizer_config.json or tokenizer.model)")
    return str(snap)


def _local_dir(name: str) -> str | None:
    if os.path.isdir(name):
        return name
    expanded = os.path.expanduser(name)
    return expanded if os.path.isdir(expanded) else None


def _repo_id(name: str, what: str) -> str:
    repo_id = ALIASES.get(name.lower()) or (name if _REPO_ID.fullmatch(name) else None)
    if repo_id is None:
        raise ValueError(f"{what} {name!r} does not exist: it is not a local directory, a "
                         f"Hugging Face repo id (Org/Name) or a known alias ({_aliases()})")
    return repo_id


def _cache(download_dir: str | None) -> Path:
    return Path(download_dir).expanduser() if download_dir else hf_hub_cache()


def _cached(name: str, repo_id: str, cache: Path, revision: str | None) -> Path | None:
    try:
        return cached_snapshot(repo_id, cache, revision)
    except ValueError as e:   # huggingface_hub rejects the id (e.g. "a/b..c")
        raise ValueError(f"{name!r} does not exist: not a local directory nor a valid "
                         f"Hugging Face repo id ({e}); known aliases: {_aliases()}") from None


def _download_checkpoint(repo_id: str, revision: str | None, cache: Path) -> Path:
    """Config and tokenizer first (refusing a model jaxserve cannot run before its
    weights come), then the safetensors the index names, else every top-level one."""
    meta = hub_download.download(repo_id, _META_FILES, revision=revision, cache=cache,
                                 what="config and tokenizer")
    _check_runnable(repo_id, meta)
    index = meta / _WEIGHT_INDEX
    if index.is_file():
        with open(index) as f:
            weights = sorted(set(json.load(f).get("weight_map", {}).values()))
    else:
        weights = ["*.safetensors"]
    # The snapshot's commit pins the weights to the config's revision.
    snap = hub_download.download(repo_id, weights, revision=meta.name, cache=cache,
                                 what="safetensors weights")
    if not has_weights(snap):
        raise ValueError(f"{repo_id} (revision {revision or 'main'}) has no safetensors "
                         f"weights, and jaxserve reads only safetensors (not PyTorch .bin or "
                         f".pt, GGUF or ONNX files): pick a repo that publishes "
                         f"*.safetensors, or convert the weights and pass the directory")
    return snap


def _check_runnable(repo_id: str, snap: Path) -> None:
    """Refuses a config.json jaxserve has no implementation for (ModelConfig's reasons)."""
    if not (snap / "config.json").is_file():
        raise ValueError(f"{repo_id} has no config.json on the Hugging Face hub: it is not "
                         f"a transformers checkpoint jaxserve can run")
    try:
        ModelConfig.from_pretrained(snap)
    except ValueError as e:
        raise ValueError(f"{repo_id}: {e}") from None


def _missing_weights(cache: Path, snap: Path | None, has_config: bool) -> str:
    if snap is None:
        return f"it is not in the Hugging Face cache at {cache}"
    if not has_config:
        return f"the cached snapshot {snap} has no config.json"
    return f"the cached snapshot {snap} has no (complete) safetensors weights"


def _offline(name: str, repo_id: str, revision: str | None, cache: Path, missing: str,
             *, suggest_dummy: bool = True) -> str:
    """Offline mode forbids the download `missing` calls for: the ways out."""
    label = repo_id if name == repo_id else f"{name!r} ({repo_id})"
    rev = f" at revision {revision}" if revision else ""
    local = ("pass a local checkpoint directory, or use --load-format dummy for random "
             "weights at the real shape") if suggest_dummy else "or pass a local directory"
    return (f"{label}{rev}: HF_HUB_OFFLINE is on (offline mode), so jaxserve does not "
            f"download, and {missing}. Unset HF_HUB_OFFLINE to download it, fetch it on a "
            f"machine with network (`hf download {repo_id}`) and copy that cache here "
            f"(--download-dir, HF_HUB_CACHE or HF_HOME choose the cache), {local}")


def _materialise_dummy(alias: str, repo_id: str, config: dict, tokenizer_src: Path | None
                       ) -> str:
    """<jaxserve cache>/dummy/<alias>/: the built-in config.json and a tokenizer, the real
    one from the HF cache when there, else the tiny test tokenizer padded to the vocab."""
    out = Path(cache_root()) / "dummy" / alias
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / "config.json", json.dumps(config, indent=2))
    if tokenizer_src is not None and (not _has_tokenizer(out) or (out / _TINY_MARK).exists()):
        for f in TOKENIZER_FILES + (_TINY_MARK,):
            (out / f).unlink(missing_ok=True)
        for f in TOKENIZER_FILES:
            if (tokenizer_src / f).is_file():
                shutil.copyfile(tokenizer_src / f, out / f)   # follows the cache's symlinks
    elif tokenizer_src is None and not _has_tokenizer(out):
        _write_tiny_tokenizer(out, (config.get("text_config") or config)["vocab_size"])
    if (out / _TINY_MARK).exists():
        logger.warning("%s: random weights and no tokenizer for %s in the Hugging Face cache, "
                       "so jaxserve's tiny test tokenizer stands in: the text will be "
                       "meaningless", alias, repo_id)
    return str(out)


def _write_tiny_tokenizer(out: Path, vocab_size: int) -> None:
    # (tokenizers and transformers load only to write one)
    from jaxserve.checkpoints.tiny_tokenizer import make_tiny_tokenizer
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        make_tiny_tokenizer(str(tmp), vocab_size=vocab_size)
        # transformers loads some model types (qwen3_5) with their own tokenizer class,
        # whose default unk token would add an id past the vocabulary: name one.
        tok_cfg = tmp / "tokenizer_config.json"
        with open(tok_cfg) as f:
            settings = json.load(f)
        settings.setdefault("unk_token", settings["eos_token"])
        tok_cfg.write_text(json.dumps(settings, indent=2))
        (out / _TINY_MARK).touch()   # before the files: a reader that sees them sees it
        for f in tmp.iterdir():
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _atomic_write(path: Path, text: str) -> None:
    """Write via a temporary file, so a concurrent start never reads half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
