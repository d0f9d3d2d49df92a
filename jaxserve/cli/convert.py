"""`python -m jaxserve.convert`: a checkpoint as the engine runs it, saved with orbax.

    python -m jaxserve.convert --model M --output DIR [--mesh DxM] [--dtype bfloat16] \\
        [--load-format dummy] [--scan-layers]

Loads M as an engine replica on a 1xM mesh would (the layers scanned or not, DeltaNet
channels regrouped, KV heads repeated for M, in --dtype; quantized when the engine
quantizes) and writes

    DIR/params/                 the param tree (orbax), before any CPU-only change
    DIR/config.json             the model's HF config, its dtype the converted one
    DIR/jaxserve_checkpoint.json  what the tree is (checkpoints/converted.py), last
    DIR/tokenizer*, chat template, generation_config.json   copied as they are

Converting for 1xM needs M devices: a CPU host is split into M XLA devices for it, so
run it with JAX_PLATFORMS=cpu where fewer accelerators than M are attached (the tree
is the same on any platform; --scan-layers for an engine on GPU/TPU).

`--model DIR` then restores the tree straight into the engine's shardings. An engine
that would build another tree (a model axis storing other KV heads, another dtype,
scan_layers or quantization) is refused with the flag to change.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import jaxserve
from jaxserve.checkpoints.converted import (FORMAT_VERSION, PARAMS_DIR, Leaf, Manifest,
                                            is_converted, tree_settings, write_manifest)
from jaxserve.checkpoints.model_configs import ALIASES
from jaxserve.checkpoints.model_names import TOKENIZER_FILES, resolve_model
from jaxserve.config import EngineConfig
from jaxserve.config.engine_args import add_engine_args, config_error, engine_kwargs
from jaxserve.errors import ConfigError

logger = logging.getLogger("jaxserve")

# The engine flags that change the converted tree (kv_cache_dtype: a quantized cache
# adds its scales) or its weights.
CONVERT_ENGINE_FLAGS = ("mesh", "dtype", "quantization", "kv_cache_dtype",
                        "calculate_kv_scales", "load_format", "seed", "revision", "download_dir")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxserve.convert", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True,
                    help="checkpoint directory, Hugging Face repo id (from the local HF cache) "
                         "or alias (" + ", ".join(ALIASES) + ")")
    ap.add_argument("--output", required=True,
                    help="directory to write (must not exist, or be empty)")
    ap.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                    help="stack the layers for jax.lax.scan, as the engine runs them on "
                         "GPU/TPU (default: as an engine on this machine's platform runs "
                         "them: a layer loop on CPU)")
    add_engine_args(ap, CONVERT_ENGINE_FLAGS)
    return ap


def convert(config: EngineConfig, output: str | Path) -> Manifest:
    """Writes `config.model` converted for the replica of `config.mesh` (1xM) to
    `output`; returns its manifest. ValueError for an existing non-empty output or a
    model that is already converted."""
    # (jax and the model code load once the flags are read: --help stays fast, and
    # _cpu_devices sets XLA's device count before jax starts)
    import jax
    from flax.traverse_util import flatten_dict

    from jaxserve.build.layout import engine_layout
    from jaxserve.build.loader import load_weights
    from models.config import ModelConfig
    from models.orbax_io import save_params
    from sharding import make_mesh
    from sharding.mesh import parse_mesh

    t0 = time.perf_counter()
    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--output {str(out)!r} exists and is not an empty directory")
    src = resolve_model(config.model, load_format=config.load_format, revision=config.revision,
                        download_dir=config.download_dir)
    if is_converted(src):
        raise ValueError(f"{src!r} is already a converted checkpoint: convert the original "
                         f"model")
    d, m = parse_mesh(config.mesh) if config.mesh else (1, 1)
    if d > 1:
        logger.info("mesh %dx%d: converting for one replica (1x%d); each of the %d loads it",
                    d, m, m, d)
    mesh = make_mesh((1, m))
    source = config.model
    config = replace(config, model=src, mesh=f"1x{m}").for_platform(mesh.devices.flat[0].platform)
    mc = ModelConfig.from_pretrained(src)
    layout = engine_layout(config, mc, mesh)
    _, params = load_weights(config, layout, mesh)

    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        save_params(out / PARAMS_DIR, params, what=f"the params of {Path(src).name}")
        dtype = jax.numpy.dtype(layout.dtype).name
        _write_config(Path(src), out, dtype)
        copied = _copy_tokenizer(Path(src), out)
    except BaseException:
        _remove_partial(out, created)
        raise
    manifest = Manifest(
        format_version=FORMAT_VERSION, architecture=mc.architecture, dtype=dtype,
        # The tree's: --quantization, or a quantized checkpoint's own.
        quantization=layout.weight_quant.method if layout.weight_quant else None, model_axis=m,
        kv_heads=layout.kv_heads, num_kv_heads=mc.num_kv_heads,
        scan_layers=bool(layout.scan_layers), settings=tree_settings(config),
        leaves=tuple(Leaf(path, tuple(x.shape), jax.numpy.dtype(x.dtype).name)
                     for path, x in sorted(flatten_dict(params).items())),
        source=source,
        load_format=config.load_format, jaxserve_version=_version())
    write_manifest(out, manifest)   # last: its presence says the directory is complete
    logger.info("converted %s -> %s in %.1f s: %d arrays, %.2f GiB (%s, model axis %d, %d KV "
                "heads stored, scan_layers=%s); tokenizer files: %s", src, out,
                time.perf_counter() - t0, len(manifest.leaves), manifest.param_bytes / 2**30,
                dtype, m, layout.kv_heads, layout.scan_layers, ", ".join(copied) or "none")
    return manifest


def _remove_partial(out: Path, created: bool) -> None:
    """A failed conversion leaves nothing behind (`out` was new or empty)."""
    if created:
        shutil.rmtree(out, ignore_errors=True)
        return
    for p in out.iterdir():
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def _version() -> str:
    return jaxserve.__version__


def _write_config(src: Path, out: Path, dtype: str) -> None:
    """config.json with the converted dtype where ModelConfig reads the checkpoint's
    dtype, so that "auto" (engine, planner) means the stored one."""
    with open(src / "config.json", encoding="utf-8") as f:
        hf: dict[str, Any] = json.load(f)
    for d in (hf, hf.get("text_config")):
        if isinstance(d, dict):
            d["dtype"] = dtype
            if "torch_dtype" in d:
                d["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(hf, indent=2), encoding="utf-8")


def _copy_tokenizer(src: Path, out: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)   # follows the HF cache's symlinks
            copied.append(name)
    return copied


def _cpu_devices_for(mesh: str | None) -> None:
    """A CPU host converting for 1xM needs M devices: split the CPU into M XLA devices
    (only the CPU backend's count; before jax starts its backends). An XLA_FLAGS device
    count that is set already is kept."""
    from sharding.mesh import parse_mesh   # (before jax is imported: see convert)
    m = parse_mesh(mesh)[1] if mesh else 1
    if m > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        import jax   # (jax is imported here first, its backends not yet started)
        jax.config.update("jax_num_cpu_devices", m)


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        config = EngineConfig(model=args.model, scan_layers=args.scan_layers,
                              **engine_kwargs(args))
    except ConfigError as e:
        config_error(ap, e)
    _cpu_devices_for(config.mesh)
    try:
        convert(config, args.output)
    except ValueError as e:
        ap.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    main()
