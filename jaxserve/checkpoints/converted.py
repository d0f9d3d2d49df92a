"""Converted checkpoints (`python -m jaxserve.convert`): the manifest that says what
tree DIR/params holds, and the checks that refuse an engine it does not fit.

A converted directory holds the param tree exactly as an engine runs it on a 1xM
mesh: scanned or not, DeltaNet channels regrouped, KV heads repeated for M,
quantized or not, in one dtype. Its shapes depend on the engine's choices, so an
engine loads it only when it would build the same tree; otherwise the error names
the flag to change or says to convert again. A different model axis that stores the
same KV heads builds the same tree: the restore reshards it.

No jax here: the planner and the CLIs read manifests too.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (numpy then knows bfloat16, float8_e4m3fn)
import numpy as np

from pallas_kernels.kv_cache_dtypes import KV_QUANT_DTYPE_NAMES

MANIFEST = "jaxserve_checkpoint.json"
PARAMS_DIR = "params"
FORMAT_VERSION = 1

Path_ = tuple[str, ...]
# EngineConfig fields, besides dtype, quantization, scan_layers and the mesh (checked on
# their own), that may shape the param tree (a quantized KV cache has per-head scale
# params) or make its values (the scales: check_settings): recorded at conversion, named
# when the trees differ.
TREE_SETTINGS = ("kv_cache_dtype", "calculate_kv_scales")


def tree_settings(config: Any) -> dict[str, Any]:
    return {f: getattr(config, f) for f in TREE_SETTINGS if hasattr(config, f)}


@dataclass(frozen=True)
class Leaf:
    path: Path_                  # e.g. ("layers_0", "self_attn", "q_proj", "kernel")
    shape: tuple[int, ...]
    dtype: str                   # numpy name: "bfloat16", "int8", "float8_e4m3fn", ...

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Manifest:
    """DIR/jaxserve_checkpoint.json."""
    format_version: int
    architecture: str
    dtype: str                   # the serving dtype the tree was made for
    quantization: str | None     # EngineConfig.quantization it was converted with
    model_axis: int              # M of the 1xM replica it was converted on
    kv_heads: int                # KV heads as stored (sharding.kv_head_layout for M)
    num_kv_heads: int            # the model's own
    scan_layers: bool            # layers stacked for jax.lax.scan
    leaves: tuple[Leaf, ...]
    settings: dict[str, Any]     # tree_settings of the converting engine
    source: str                  # the model converted (a record for people)
    load_format: str             # "dummy": random weights
    jaxserve_version: str

    @property
    def param_bytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["leaves"] = [{"path": "/".join(x.path), "shape": list(x.shape), "dtype": x.dtype}
                       for x in self.leaves]
        d["param_bytes"] = self.param_bytes
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str) -> Manifest:
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"{where}: format_version {version!r}, this jaxserve reads "
                             f"version {FORMAT_VERSION}: convert the model again with "
                             f"`python -m jaxserve.convert`")
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in d]
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)}: convert the model again")
        try:
            leaves = tuple(Leaf(tuple(x["path"].split("/")), tuple(int(s) for s in x["shape"]),
                                str(x["dtype"])) for x in d["leaves"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{where}: a malformed leaf entry ({type(e).__name__}: {e}): "
                             f"convert the model again") from None
        return cls(**{**{n: d[n] for n in names}, "leaves": leaves})


def is_converted(model_dir: str | Path) -> bool:
    """Whether `model_dir` is a converted checkpoint. ValueError for a conversion that
    did not finish (its params written, no manifest: the manifest is written last)."""
    path = Path(model_dir)
    if (path / MANIFEST).is_file():
        return True
    if (path / PARAMS_DIR).is_dir() and not any(path.glob("*.safetensors")):
        raise ValueError(f"{str(path)!r} holds an orbax {PARAMS_DIR}/ but no {MANIFEST}: an "
                         f"interrupted `python -m jaxserve.convert`? Convert again")
    return False


def read_manifest(model_dir: str | Path) -> Manifest:
    where = str(Path(model_dir) / MANIFEST)
    try:
        with open(where, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{str(model_dir)!r} is not a converted checkpoint (no {MANIFEST})") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{where} cannot be read ({e}): convert the model again") from None
    if not isinstance(d, dict):
        raise ValueError(f"{where} is not a JSON object: convert the model again")
    return Manifest.from_json(d, where)


def write_manifest(model_dir: str | Path, manifest: Manifest) -> None:
    """Atomically: a reader sees the whole manifest or none. One leaf a line."""
    d = manifest.to_json()
    leaves = ",\n".join("  " + json.dumps(leaf) for leaf in d.pop("leaves"))
    text = json.dumps(d, indent=1)[:-2] + ',\n "leaves": [\n' + leaves + "\n ]\n}\n"
    path = Path(model_dir) / MANIFEST
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# ---- the checks ------------------------------------------------------------------

def check_settings(manifest: Manifest, config: Any, model_dir: str) -> None:
    """Refuses EngineConfig settings a converted checkpoint cannot serve: a load format
    other than auto, a dtype or a quantization other than the converted one ("auto" /
    None take the converted one: resolve_converted)."""
    name = repr(model_dir)
    if config.load_format != "auto":
        raise ValueError(f"--load-format {config.load_format} (load_format="
                         f"{config.load_format!r}): {name} is a converted checkpoint, loaded "
                         f"as converted; drop --load-format (or serve the original model "
                         f"{manifest.source!r} for other weights)")
    if config.dtype not in ("auto", manifest.dtype):
        raise ValueError(f"--dtype {config.dtype}: {name} was converted to {manifest.dtype}; "
                         f"pass --dtype {manifest.dtype} (or auto), or convert again with "
                         f"--dtype {config.dtype}")
    made, wanted = _kv_scales_made(manifest.settings), _kv_scales_made(tree_settings(config))
    if wanted and made and made != wanted:
        raise ValueError(
            f"--kv-cache-dtype {config.kv_cache_dtype}"
            f"{' --calculate-kv-scales' if config.calculate_kv_scales else ''}: {name} stores "
            f"the KV scales of a {made[0]} cache, {'measured' if made[1] else 'all 1'}; serve "
            f"it with the settings it was converted with ({_describe_settings(manifest)}), "
            f"or convert again with these")
    q = config.quantization
    if q is not None and q != manifest.quantization:
        was = manifest.quantization or "none (unquantized)"
        raise ValueError(f"--quantization {q}: {name} was converted with quantization {was}; "
                         f"drop --quantization, or convert again with --quantization {q}")


def _kv_scales_made(settings: dict[str, Any]) -> tuple[str, bool] | None:
    """How a quantized KV cache's scales are made under these tree settings: (stored
    dtype, measured rather than 1: models/kv_scales.py); None for a float cache."""
    stored = KV_QUANT_DTYPE_NAMES.get(settings.get("kv_cache_dtype", "auto"))
    if stored is None:
        return None
    return stored, stored == "int8" or bool(settings.get("calculate_kv_scales", False))


def _describe_settings(manifest: Manifest) -> str:
    return ", ".join(f"--{f.replace('_', '-')} {v}" for f, v in manifest.settings.items())


def resolve_converted(config: Any) -> Any:
    """`config` (an EngineConfig whose model is a local directory) with dtype "auto" and
    an unset quantization taken from the converted checkpoint it names, after
    check_settings; `config` itself when the model is not a converted checkpoint."""
    if not os.path.isdir(config.model) or not is_converted(config.model):
        return config
    manifest = read_manifest(config.model)
    check_settings(manifest, config, config.model)
    changes: dict[str, Any] = {"dtype": manifest.dtype}
    if manifest.quantization is not None:
        changes["quantization"] = manifest.quantization
    return dataclasses.replace(config, **changes)


def check_tree(manifest: Manifest, model_dir: str, *, dtype: str, quantization: str | None,
               model_axis: int, kv_heads: int, scan_layers: bool, platform: str,
               settings: dict[str, Any], shapes: dict[Path_, tuple[int, ...]]) -> None:
    """Refuses an engine that would build another tree than the stored one. The
    arguments are the engine's: its layout's dtype name, quantization, model axis, KV
    heads as stored, scan_layers, its platform, its tree_settings and its params'
    paths -> shapes."""
    name = repr(model_dir)
    if dtype != manifest.dtype:
        raise ValueError(f"dtype {dtype}: {name} was converted to {manifest.dtype}; pass "
                         f"--dtype {manifest.dtype} (or auto), or convert again with --dtype {dtype}")
    if quantization != manifest.quantization:
        fix = (f"pass --quantization {manifest.quantization}" if manifest.quantization
               else "drop --quantization")
        raise ValueError(f"quantization {quantization or 'none'}: {name} was converted "
                         f"with quantization {manifest.quantization or 'none'}; {fix}, or "
                         f"convert again")
    if kv_heads != manifest.kv_heads:
        raise ValueError(
            f"{name} was converted for model axis {manifest.model_axis}, which stores "
            f"{manifest.kv_heads} KV heads (the model has {manifest.num_kv_heads}); this "
            f"engine's model axis {model_axis} stores {kv_heads}: serve it with --mesh "
            f"Dx{manifest.model_axis}, or convert again with --mesh 1x{model_axis}")
    if scan_layers != manifest.scan_layers:
        how = lambda s: ("stacked for jax.lax.scan" if s else "one by one (a layer loop)")
        flag = "--scan-layers" if scan_layers else "--no-scan-layers"
        raise ValueError(
            f"{name} holds its layers {how(manifest.scan_layers)} (scan_layers="
            f"{manifest.scan_layers}), this engine on {platform} runs them {how(scan_layers)}: "
            f"convert again with {flag}, or run the engine with LLM(..., "
            f"scan_layers={manifest.scan_layers})")
    stored = {leaf.path: leaf.shape for leaf in manifest.leaves}
    differ = sorted(set(stored) ^ set(shapes)) + sorted(
        p for p in set(stored) & set(shapes) if stored[p] != shapes[p])
    if differ:
        shown = "; ".join(f"{'/'.join(p)}: stored {stored.get(p, 'none')}, engine "
                          f"{shapes.get(p, 'none')}" for p in differ[:3])
        changed = [f"--{f.replace('_', '-')} {settings[f]} (converted with {was})"
                   for f, was in manifest.settings.items() if f in settings and settings[f] != was]
        why = f" This engine has {', '.join(changed)}: pass the converted value, or" if changed else ""
        raise ValueError(f"{name}'s params do not fit the model this engine builds "
                         f"({len(differ)} leaves differ: {shown}).{why} convert it again "
                         f"with this jaxserve and these settings")
