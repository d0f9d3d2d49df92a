"""Engine weight load: a converted (orbax) checkpoint against the safetensors it came from.

    python -m benchmarks.loading.convert_load --output-dir benchmarks/results

Writes (once, reused from --checkpoint-dir) a random-weight Qwen3 in bf16 with
transformers (hidden 2048, 8 layers, vocab 32000, untied: ~0.9 GB), converts it with
`python -m jaxserve.convert`'s code for each --meshes replica, then times the engine's
whole weight step (`load_model`: build the model, read, place, CPU untie) once per way:

- "safetensors": each device's slice read, laid out and cast from the file's mmap;
- "converted (orbax)": each device's slice restored as stored (the layout work done
  by the conversion);
- for each EngineConfig.quantization choice: the
  safetensors loaded and quantized, and its converted (already quantized) tree.

Each timing is the median of --repeats loads (the ways interleaved) after one untimed
load of each, in one process: the page cache is warm, so this is host work, not disk
reads. The JSON keeps every run and the untimed first one.
"""
from __future__ import annotations

import os

# Devices for the --meshes: must be set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.shared.common import make_qwen3  # noqa: E402
from benchmarks.shared.results_io import markdown_table, write_results  # noqa: E402

CONFIG: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
    max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6)


def write_checkpoint(path: Path) -> Path:
    """A random bf16 Qwen3 (CONFIG) at `path`, unless one is already there."""
    return Path(make_qwen3(str(path), CONFIG, dtype="bfloat16"))


def quantizations() -> tuple[str, ...]:
    """EngineConfig.quantization's choices (fp8, int8)."""
    from models.config import WEIGHT_QUANT_DTYPES
    return tuple(WEIGHT_QUANT_DTYPES)


def timed_load(model: str, mesh_spec: str, **engine_args: Any) -> tuple[float, int]:
    """Seconds of one load_model as EngineCore runs it, and the bytes it placed."""
    import jax

    from jaxserve.checkpoints.converted import resolve_converted
    from jaxserve.config import EngineConfig
    from jaxserve.build.layout import engine_layout
    from jaxserve.build.loader import load_model
    from models.config import ModelConfig
    from sharding import make_mesh

    mesh = make_mesh(mesh_spec)
    config = resolve_converted(EngineConfig(model=model, mesh=mesh_spec, **engine_args))
    config = config.for_platform(mesh.devices.flat[0].platform)
    layout = engine_layout(config, ModelConfig.from_pretrained(model), mesh)
    t0 = time.perf_counter()
    loaded = load_model(config, layout, mesh)
    jax.block_until_ready(loaded.params)
    seconds = time.perf_counter() - t0
    nbytes = loaded.weight_bytes
    # Its arrays go with their last reference (no gc.collect(): a walk of the whole heap,
    # seconds a call inside a long test worker).
    del loaded
    return seconds, nbytes


def convert_and_load(src: Path, out: Path, mesh_spec: str, q: str | None, dtype: str,
                     repeats: int) -> list[dict[str, Any]]:
    """Converts `src` for one mesh (and quantization) into `out`, then loads it both ways
    (the safetensors and the converted checkpoint) -> a row per way."""
    from jaxserve.cli.convert import convert
    from jaxserve.config import EngineConfig

    extra = {} if q is None else {"quantization": q}
    t0 = time.perf_counter()
    manifest = convert(EngineConfig(model=str(src), dtype=dtype, mesh=mesh_spec, **extra), out)
    convert_s = time.perf_counter() - t0
    disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    how = "" if q is None else f" + quantize {q}"
    ways = {f"safetensors{how}": lambda: timed_load(str(src), mesh_spec, dtype=dtype, **extra),
            f"converted (orbax){' ' + q if q else ''}": lambda: timed_load(str(out), mesh_spec)}
    # One untimed load each (the first in the process pays one-time costs and warms the
    # page cache), then the repeats interleaved: a busy machine's noise falls on both
    # ways alike.
    first = {name: load() for name, load in ways.items()}
    runs: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, load in ways.items():
            seconds, nbytes = load()
            assert nbytes == first[name][1]
            runs[name].append(seconds)
    assert len({b for _, b in first.values()}) == 1   # the same tree in memory
    base = statistics.median(next(iter(runs.values())))
    rows = []
    for name, times in runs.items():
        median, nbytes = statistics.median(times), first[name][1]
        rows.append({"mesh": mesh_spec, "quantization": q, "loader": name,
                     "median_s": median, "runs_s": times, "first_s": first[name][0],
                     "param_gib": nbytes / 2**30,
                     "gib_per_s": nbytes / 2**30 / median,
                     "speedup_vs_safetensors": base / median,
                     "convert_seconds": convert_s, "converted_disk_bytes": disk,
                     "converted_param_bytes": manifest.param_bytes})
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--model", default=None,
                    help="a safetensors checkpoint directory (default: the random Qwen3 "
                         "written to --checkpoint-dir)")
    ap.add_argument("--checkpoint-dir", default=os.path.join(tempfile.gettempdir(),
                                                             "jaxserve_convert_load_qwen3"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--meshes", default="1x1,1x8")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    import jax

    src = Path(args.model) if args.model else write_checkpoint(Path(args.checkpoint_dir))
    file_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    work = Path(tempfile.mkdtemp(prefix="jaxserve_convert_load_"))
    rows = []
    try:
        for mesh_spec in args.meshes.split(","):
            for q in (None, *quantizations()):
                out = work / f"{mesh_spec}-{q or 'none'}"
                rows += convert_and_load(src, out, mesh_spec, q, args.dtype, args.repeats)
                shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = markdown_table(
        ["mesh", "loader", "median load s", "first load s", "param GiB/s", "vs safetensors",
         "convert s (once)"],
        [[r["mesh"], r["loader"], r["median_s"], r["first_s"], r["gib_per_s"],
          f"{r['speedup_vs_safetensors']:.2f}x", r["convert_seconds"]] for r in rows])
    write_results(args.output_dir, "convert_load", benchmark="convert_load",
                  argv=sys.argv[1:] if argv is None else argv,
                  config={"checkpoint": None if args.model else CONFIG, "model": str(src),
                          "file_bytes": file_bytes, "dtype": args.dtype,
                          "repeats": args.repeats,
                          "devices": jax.device_count(),
                          "platform": jax.devices()[0].platform,
                          "quantizations": list(quantizations())},
                  results={"loads": rows}, table=table,
                  notes=[f"checkpoint: {src.name}, {file_bytes / 2**30:.2f} GiB of safetensors",
                         f"median of {args.repeats} loads of each way (interleaved) after one "
                         "untimed first load each, all in one process; page cache warm: host "
                         "work, not disk reads. first load s: that untimed load (the way "
                         "that goes first in a mesh also pays the process's one-time costs)",
                         "load s: load_model whole (model build, read, placement, CPU untie)",
                         "convert s: python -m jaxserve.convert's work, paid once per "
                         "checkpoint and mesh"])


if __name__ == "__main__":
    main()
