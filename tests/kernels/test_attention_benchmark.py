"""benchmarks/gpu/attention_gpu.py imports on CPU and its accounting is right (the timed
part needs a GPU; `--dry-run` runs it in interpret mode)."""
from __future__ import annotations

import importlib.util
import os

import jax.numpy as jnp
import numpy as np

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu",
                     "attention_gpu.py")


def _load():
    spec = importlib.util.spec_from_file_location("attention_gpu", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_accounting_and_table():
    bench = _load()
    # Qwen3-8B decode, batch 8 at 1k: K and V of 8 kv heads x 128 dims x 2 bytes per token.
    assert bench.decode_bytes(8, 1024, 32, 8, 128, 2) == 8 * 1024 * 8 * 2 * 128 * 2 + 2 * 8 * 32 * 128 * 2
    # A sliding-window decode moves only the window's KV (Gemma 4's 1024 of an 8k context).
    assert bench.decode_bytes(2, 8192, 32, 16, 256, 2, window=1024) == \
        2 * 1024 * 16 * 2 * 256 * 2 + 2 * 2 * 32 * 256 * 2
    # causal prefill of one 4-token sequence: 4 * N * H * (1 + 2 + 3 + 4)
    assert bench.prefill_flops(1, 4, 2, 8) == 4 * 2 * 8 * 10
    q, cache, kv_lens, table, qsl, num_seqs = bench.paged_batch(
        [1, 3], [5, 20], 4, 2, 64, 16, jnp.bfloat16)
    assert q.shape == (4, 4, 64) and cache.shape[1:] == (4, 16, 64)
    assert sorted(np.asarray(table).ravel()) == list(range(1, cache.shape[0]))
    assert np.asarray(qsl).tolist() == [0, 1, 4] and int(num_seqs[0]) == 2
    result = dict(command="x", device="H100", jax="0", page_size=16, dtype="bfloat16",
                  copy_gb_per_s=3000.0,
                  rows=[dict(kind="decode", model="m", batch=1, context=1024, us=10.0,
                             gb_per_s=2000.0, frac_of_copy=0.66),
                        dict(kind="prefill", model="m", batch=1, context=4096, us=900.0,
                             tflops=400.0, baseline="cudnn", baseline_tflops=500.0)])
    table = bench.markdown(result)
    assert "| m | 1 | 1024 | 10.0 | 2000 | 66% |" in table
    assert "| m | 1 x 4096 | 900.0 | 400.0 | cudnn | 500.0 |" in table
