"""Weight loading: the old serial loader against the parallel, sliced one.

    python -m benchmarks.loading.load_weights --output-dir benchmarks/results

Writes (once, reused from --checkpoint-dir) a random-weight Qwen3 checkpoint in bf16
with transformers (hidden 2048, 16 layers: ~1.8 GB), then loads it onto one device
(a 1x1 mesh) and onto a 1x8 mesh of CPU devices, into each --dtypes, three ways:

- "old serial": what load_params did before, rebuilt here from the same tasks: per
  param the whole tensor on the host (layout, cast, plain numpy copy), one device_put;
- "sliced, 1 thread": load_params(workers=1), each device's slice read and cast alone;
- "sliced, N threads": load_params with the default thread count.

Each timing is the median of --repeats loads after one untimed load, so the page cache
is warm (the file is read from memory, not disk): this measures the host work
(layout, casts, copies, transfers), not the disk.
"""
from __future__ import annotations

import os

# 8 CPU devices for the 1x8 mesh: must be set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402
from unittest import mock  # noqa: E402

from benchmarks.shared.common import make_qwen3  # noqa: E402
from benchmarks.shared.results_io import markdown_table, write_results  # noqa: E402

CONFIG: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=4096, num_hidden_layers=16,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6)


def write_checkpoint(path: Path) -> Path:
    """A random bf16 Qwen3 (CONFIG) at `path`, unless one is already there."""
    return Path(make_qwen3(str(path), CONFIG, dtype="bfloat16"))


def old_serial(path: Path, mc: Any, model: Any, dtype: str, *, shardings: Any,
               kv_head_repeat: int) -> dict:
    """The previous algorithm: whole host tensor per param, one device_put each, in order,
    with its plain numpy copy (not the unsigned-integer view copy of bfloat16)."""
    import jax
    import numpy as np
    from models.param_placement import full_index
    from models.weights import checkpoint_tasks
    plain = lambda x, dt: np.ascontiguousarray(x, dtype=dt)
    with mock.patch("models.weights._contiguous", plain):
        out = {t.path: jax.device_put(t.open()(full_index(t.shape)), t.sharding)
               for t in checkpoint_tasks(path, mc, model, dtype, shardings=shardings,
                                         kv_head_repeat=kv_head_repeat)}
        return jax.block_until_ready(out)


def median_seconds(load: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
    load()   # untimed: warms the page cache
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        params = load()
        times.append(time.perf_counter() - t0)
        del params
    return statistics.median(times), times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--checkpoint-dir", default=os.path.join(tempfile.gettempdir(),
                                                             "jaxserve_load_weights_qwen3"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--meshes", default="1x1,1x8")
    args = ap.parse_args(argv)

    import jax
    from models.config import ModelConfig
    from models.param_placement import default_workers
    from models.registry import build_model
    from models.weights import load_params, param_logical_axes
    from sharding import kv_head_layout, make_mesh, mesh_rules, param_shardings

    path = write_checkpoint(Path(args.checkpoint_dir))
    file_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    mc = ModelConfig.from_pretrained(str(path))
    workers = default_workers()
    rows = []
    for mesh_spec in args.meshes.split(","):
        m = int(mesh_spec.split("x")[1])
        stored = kv_head_layout(mc.num_heads, mc.num_kv_heads, m)
        for dtype in args.dtypes.split(","):
            model = build_model(replace(mc, num_kv_heads=stored), dtype)
            shardings = param_shardings(param_logical_axes(model), make_mesh(mesh_spec),
                                        mesh_rules(mc, m))
            kw = dict(shardings=shardings, kv_head_repeat=stored // mc.num_kv_heads)
            loaders = {
                "old serial": lambda: old_serial(path, mc, model, dtype, **kw),
                "sliced, 1 thread": lambda: load_params(path, mc, model, dtype, workers=1, **kw),
                f"sliced, {workers} threads": lambda: load_params(path, mc, model, dtype,
                                                                   workers=workers, **kw),
            }
            old = None
            for name, load in loaders.items():
                median, times = median_seconds(load, args.repeats)
                old = old or median
                rows.append({"mesh": mesh_spec, "dtype": dtype, "loader": name,
                             "median_s": median, "runs_s": times,
                             "gib_per_s": file_bytes / 2**30 / median, "speedup": old / median})
                print(rows[-1], flush=True)
    table = markdown_table(
        ["mesh", "dtype", "loader", "median s", "file GiB/s", "vs old"],
        [[r["mesh"], r["dtype"], r["loader"], r["median_s"], r["gib_per_s"],
          f"{r['speedup']:.2f}x"] for r in rows])
    write_results(args.output_dir, "load_weights", benchmark="load_weights",
                  argv=sys.argv[1:] if argv is None else argv,
                  config={"checkpoint": CONFIG, "file_bytes": file_bytes, "repeats": args.repeats,
                          "workers": workers, "devices": jax.device_count(),
                          "platform": jax.devices()[0].platform},
                  results={"loads": rows}, table=table,
                  notes=[f"checkpoint: random Qwen3 in bf16, {file_bytes / 2**30:.2f} GiB on disk",
                         "median of the timed loads after one untimed load: page cache warm",
                         f"{workers} threads = min(os.cpu_count(), 8) on this machine"])


if __name__ == "__main__":
    main()
