"""Model names -> a local checkpoint directory, offline.

`--model` may be a directory, a Hugging Face repo id (`Org/Name`) already in the local
Hugging Face cache, or a short alias (`qwen3.6-27b` -> `Qwen/Qwen3.6-27B`). Nothing is
ever downloaded. With `load_format="dummy"` an alias needs no download at all: its
built-in config.json (jaxserve/model_configs.py) is written under the jaxserve cache
with a tokenizer, so the model runs with random weights at its real shape.
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

from jaxserve.checkpoints.default_model import cache_root
from jaxserve.checkpoints.model_configs import ALIASES, BUILTIN_CONFIGS

logger = logging.getLogger("jaxserve")

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What a checkpoint's tokenizer may consist of (generation_config.json rides along: its
# sampling defaults belong with the tokenizer's chat template).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                    "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
                    "chat_template.jinja", "chat_template.json", "generation_config.json")
_TINY_MARK = ".jaxserve-tiny-tokenizer"   # the dummy directory holds the tiny tokenizer


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


def cached_snapshot(repo_id: str, cache: Path | None = None) -> Path | None:
    """The snapshot directory of `repo_id` in the HF cache (refs/main first), or None."""
    from huggingface_hub import try_to_load_from_cache
    cache = cache or hf_hub_cache()
    hit = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache)
    if isinstance(hit, str):
        return Path(hit).parent
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


def resolve_model(name: str, *, load_format: str = "auto") -> str:
    """A local directory holding config.json (and the tokenizer when there is one) for
    `name`: a directory, a Hugging Face repo id in the local HF cache, or an alias.

    Raises ValueError when the weights are not on this machine (unless load_format is
    "dummy"), saying how to get them, and for a name that is none of the above.
    """
    if os.path.isdir(name):
        return name
    if os.path.isdir(os.path.expanduser(name)):
        return os.path.expanduser(name)
    repo_id = ALIASES.get(name.lower()) or (name if _REPO_ID.fullmatch(name) else None)
    if repo_id is None:
        raise ValueError(f"model {name!r} does not exist: it is not a local directory, a "
                         f"Hugging Face repo id (Org/Name) or a known alias ({_aliases()})")
    cache = hf_hub_cache()
    try:
        snap = cached_snapshot(repo_id, cache)
    except ValueError as e:   # huggingface_hub rejects the id (e.g. "a/b..c")
        raise ValueError(f"model {name!r} does not exist: not a local directory nor a valid "
                         f"Hugging Face repo id ({e}); known aliases: {_aliases()}") from None
    has_config = snap is not None and (snap / "config.json").is_file()
    if load_format != "dummy":
        if has_config and has_weights(snap):
            return str(snap)
        raise ValueError(_missing_weights(name, repo_id, cache, snap, has_config))
    if has_config and _has_tokenizer(snap):
        return str(snap)
    config = builtin_config(repo_id)
    if config is not None:
        return _materialise_dummy(_alias_of(repo_id), repo_id, config,
                                  snap if _has_tokenizer(snap) else None)
    if has_config:
        return str(snap)
    raise ValueError(f"{name!r}: --load-format dummy needs the model's config.json, and "
                     f"{repo_id} is neither in the Hugging Face cache at {cache} nor a "
                     f"built-in ({_aliases()})")


def _missing_weights(name: str, repo_id: str, cache: Path, snap: Path | None,
                     has_config: bool) -> str:
    label = repo_id if name == repo_id else f"{name!r} ({repo_id})"
    if snap is None:
        where = f"{repo_id} is not in the Hugging Face cache at {cache}"
    elif not has_config:
        where = f"the cached snapshot {snap} has no config.json"
    else:
        where = f"the cached snapshot {snap} has no (complete) safetensors weights"
    return (f"{label}: the weights are not on this machine ({where}; HF_HUB_CACHE or HF_HOME "
            f"choose the cache) and jaxserve never downloads. Get them on a machine with "
            f"network with `huggingface-cli download {repo_id}` and copy that cache here, "
            f"pass a local checkpoint directory as the model, or use --load-format dummy "
            f"for random weights at the real shape")


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
