"""Safetensors reading: the hand-written reader against ways of reading through the
`safetensors` package, in load_params.

    python -m benchmarks.loading.safetensors_read --output-dir benchmarks/results

Writes (once, reused from --checkpoint-dir, which may hold any checkpoint) a random-weight
Qwen3 in bf16 with transformers (hidden 1024, 12 layers: 0.34 GiB), then loads it with
load_params onto one device (1x1) and a 1x8 mesh of CPU devices, into each --dtypes,
with each reader in turn standing in for models.weights.SafeTensorsFile:

- "hand-written": the reader before the package was used (JSON header parsed by hand,
  numpy views into an mmap), loaded from git at HANDWRITTEN_COMMIT;
- "package header + views": models/safetensors_io.py now (the package parses and checks
  the file; tensors are views into an mmap at the offsets it implies);
- "package get_tensor": every tensor read whole by `safe_open(...).get_tensor` (a copy),
  each device's slice then cut from that copy;
- "package get_slice": each device's slice read by `get_slice(name)[...]` alone (a copy
  of just that slice), through `PackageSlices`, which maps an index in the param's
  layout (transposed, axes split) back to the file's.

Repeats are interleaved (each reader once per round, the order rotated every round)
after one untimed load of each, so the page cache is warm and drift of this shared
machine spreads over all readers. Every reader's params are checked equal to the first
reader's. Also timed: opening the file (header only), median of 20.
"""
from __future__ import annotations

import os

# 8 CPU devices for the 1x8 mesh: must be set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402
from unittest import mock  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.shared.common import make_qwen3  # noqa: E402
from benchmarks.shared.results_io import REPO, markdown_table, write_results  # noqa: E402
from models.safetensors_io import SafeTensorsFile  # noqa: E402

CONFIG: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
    num_attention_heads=16, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
    max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6)
# The last commit with the hand-written reader.
HANDWRITTEN_COMMIT = "626adecba2bdddb741732fdd0345ab611561ea14"


def handwritten_reader() -> type | None:
    """SafeTensorsFile as it was at HANDWRITTEN_COMMIT, or None without git history."""
    try:
        src = subprocess.run(["git", "-C", REPO, "show",
                              f"{HANDWRITTEN_COMMIT}:models/safetensors_io.py"],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    module = types.ModuleType("handwritten_safetensors_io")
    exec(compile(src, "handwritten_safetensors_io.py", "exec"), module.__dict__)
    return module.SafeTensorsFile


class PackageTensors(SafeTensorsFile):
    """`get` reads the whole tensor through the package (a copy each call)."""

    def __init__(self, path: str | Path):
        super().__init__(path)
        from safetensors import safe_open
        self._handle = safe_open(str(path), framework="numpy")

    def get(self, name: str) -> np.ndarray:
        return self._handle.get_tensor(name)


class PackageSlices(PackageTensors):
    """`get` is a LazySlice: indexing it reads only the slice through `get_slice`."""

    def get(self, name: str) -> Any:
        return LazySlice(self._handle.get_slice(name), self.shape(name), self.dtype(name))


class LazySlice:
    """A tensor in the file, seen through a permutation of its axes (`.T`) and each axis
    split into consecutive ones (`.reshape`): all models/weights.py does to a plain
    kernel. Indexing reads through the package the file rows covering the outermost
    axis of each split group (the others are cut after the read); anything else turns
    it into the whole array (__array__)."""

    def __init__(self, handle: Any, file_shape: tuple[int, ...], dtype: np.dtype,
                 perm: tuple[int, ...] | None = None,
                 groups: tuple[tuple[int, ...], ...] | None = None):
        self._handle, self._file_shape, self.dtype = handle, file_shape, dtype
        self._perm = perm if perm is not None else tuple(range(len(file_shape)))
        # groups[i]: the sizes permuted axis i (file axis perm[i]) is split into
        self._groups = groups if groups is not None else tuple((file_shape[a],) for a in self._perm)
        self.shape = tuple(n for g in self._groups for n in g)
        self.ndim = len(self.shape)

    @property
    def T(self) -> Any:
        if any(len(g) != 1 for g in self._groups):
            return np.asarray(self).T
        return LazySlice(self._handle, self._file_shape, self.dtype, self._perm[::-1])

    def reshape(self, shape: tuple[int, ...]) -> Any:
        shape, groups, j = tuple(shape), [], 0
        if any(len(g) != 1 for g in self._groups):
            return np.asarray(self).reshape(shape)
        for (n,) in self._groups:
            group = [shape[j]] if j < len(shape) else []
            j += 1
            while j < len(shape) and math.prod(group) < n:
                group.append(shape[j])
                j += 1
            if math.prod(group) != n or n == 0:
                return np.asarray(self).reshape(shape)
            groups.append(tuple(group))
        if j != len(shape):
            return np.asarray(self).reshape(shape)
        return LazySlice(self._handle, self._file_shape, self.dtype, self._perm, tuple(groups))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[tuple(slice(None) for _ in self.shape)]
        return whole if dtype is None else whole.astype(dtype)

    def __getitem__(self, index: Any) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > self.ndim or not all(isinstance(s, slice) for s in index):
            return np.asarray(self)[index]
        index += (slice(None),) * (self.ndim - len(index))
        file_index: list[slice] = [slice(None)] * len(self._file_shape)
        sizes, rest, k = [], [], 0
        for axis, group in zip(self._perm, self._groups):
            sls = index[k:k + len(group)]
            k += len(group)
            start, stop, step = sls[0].indices(group[0])
            inner = math.prod(group[1:])
            if step == 1 and stop > start:
                file_index[axis] = slice(start * inner, stop * inner)
                sizes += [stop - start, *group[1:]]
                rest += [slice(None), *sls[1:]]
            else:   # read the whole axis, cut afterwards
                sizes += list(group)
                rest += list(sls)
        raw = self._handle[tuple(file_index)]
        return raw.transpose(self._perm).reshape(sizes)[tuple(rest)]


def write_checkpoint(path: Path) -> Path:
    return Path(make_qwen3(str(path), CONFIG, dtype="bfloat16"))


def open_seconds(reader: type, files: list[Path], repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for f in files:
            reader(f)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check_equal(ref: dict, got: dict, what: str) -> None:
    import jax
    flat_ref, flat_got = jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got)
    assert len(flat_ref) == len(flat_got), what
    for a, b in zip(flat_ref, flat_got):
        if not np.array_equal(np.asarray(a), np.asarray(b)):
            raise AssertionError(f"{what}: params differ from the first reader's")


def time_loads(path: Path, mc: Any, readers: dict[str, type], mesh_spec: str, dtype: str,
               repeats: int, file_bytes: int) -> list[dict[str, Any]]:
    """Every reader loading the checkpoint onto one mesh in one dtype: one untimed load
    each (warms the page cache, checks they agree), then `repeats` interleaved timed
    rounds -> a row per reader."""
    import jax
    from models.registry import build_model
    from models.weights import load_params, param_logical_axes
    from sharding import kv_head_layout, make_mesh, mesh_rules, param_shardings

    m = int(mesh_spec.split("x")[1])
    stored = kv_head_layout(mc.num_heads, mc.num_kv_heads, m)
    model = build_model(replace(mc, num_kv_heads=stored), dtype)
    shardings = param_shardings(param_logical_axes(model), make_mesh(mesh_spec),
                                mesh_rules(mc, m))
    kw = dict(shardings=shardings, kv_head_repeat=stored // mc.num_kv_heads)

    def load(reader: type) -> dict:
        with mock.patch("models.weights.SafeTensorsFile", reader):
            return jax.block_until_ready(load_params(path, mc, model, dtype, **kw))

    first = None
    for name, reader in readers.items():   # untimed: warms the page cache, checks
        params = load(reader)
        if first is None:
            first = params
        else:
            check_equal(first, params, name)
        del params
    del first
    times: dict[str, list[float]] = {name: [] for name in readers}
    names = list(readers)
    for i in range(repeats):   # each round in a rotated order: no reader always
        for name in names[i % len(names):] + names[:i % len(names)]:   # runs first
            reader = readers[name]
            t0 = time.perf_counter()
            params = load(reader)
            times[name].append(time.perf_counter() - t0)
            del params
    base = statistics.median(next(iter(times.values())))
    rows = []
    for name, ts in times.items():
        median = statistics.median(ts)
        rows.append({"mesh": mesh_spec, "dtype": dtype, "reader": name,
                     "median_s": median, "min_s": min(ts), "runs_s": ts,
                     "gib_per_s": file_bytes / 2**30 / median,
                     "vs_first": base / median})
        print(rows[-1], flush=True)
    return rows


def tables(rows: list[dict[str, Any]], opens: dict[str, float], first_name: str) -> str:
    table = markdown_table(
        ["mesh", "dtype", "reader", "median s", "best s", "file GiB/s (median)",
         f"median speed vs {first_name}"],
        [[r["mesh"], r["dtype"], r["reader"], r["median_s"], r["min_s"], r["gib_per_s"],
          f"{r['vs_first']:.2f}x"] for r in rows])
    return table + "\n\n" + markdown_table(["reader", "open (header) ms"],
                                            [[n, s * 1e3] for n, s in opens.items()])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--checkpoint-dir", default=os.path.join(tempfile.gettempdir(),
                                                             "jaxserve_safetensors_read_qwen3"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--meshes", default="1x1,1x8")
    args = ap.parse_args(argv)

    import jax
    from models.config import ModelConfig
    from models.param_placement import default_workers

    path = write_checkpoint(Path(args.checkpoint_dir))
    files = sorted(path.glob("*.safetensors"))
    file_bytes = sum(f.stat().st_size for f in files)
    mc = ModelConfig.from_pretrained(str(path))
    readers: dict[str, type] = {}
    old = handwritten_reader()
    if old is not None:
        readers["hand-written"] = old
    readers.update({"package header + views": SafeTensorsFile,
                    "package get_tensor": PackageTensors, "package get_slice": PackageSlices})
    opens = {name: open_seconds(r, files) for name, r in readers.items()}
    rows = [row for mesh_spec in args.meshes.split(",") for dtype in args.dtypes.split(",")
            for row in time_loads(path, mc, readers, mesh_spec, dtype, args.repeats,
                                  file_bytes)]
    write_results(args.output_dir, "safetensors_read", benchmark="safetensors_read",
                  argv=sys.argv[1:] if argv is None else argv,
                  config={"checkpoint": json.loads((path / "config.json").read_text()),
                          "file_bytes": file_bytes,
                          "repeats": args.repeats, "workers": default_workers(),
                          "devices": jax.device_count(), "handwritten_commit": HANDWRITTEN_COMMIT,
                          "platform": jax.devices()[0].platform},
                  results={"loads": rows, "open_s": opens},
                  table=tables(rows, opens, next(iter(readers))),
                  notes=[f"checkpoint: {file_bytes / 2**30:.2f} GiB on disk",
                         "median (and best) of interleaved timed loads after one untimed load "
                         "of each reader: page cache warm",
                         "every reader's params equal the first reader's"])


if __name__ == "__main__":
    main()
