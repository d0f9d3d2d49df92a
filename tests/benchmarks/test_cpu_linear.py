"""benchmarks/step/cpu_linear.py: its three dot forms compute the same product, and a small
run prints a row of timings per batch size and the bandwidth."""
from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np

from benchmarks.step import cpu_linear


def test_the_forms_compute_the_same_product():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((24, 32)), jnp.bfloat16)       # [out, in]
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
    got = {f: np.asarray(cpu_linear.dot_fn(f)(x, w.T if f == "in_out" else w))
           for f in cpu_linear.FORMS}
    np.testing.assert_allclose(got["out_in"], want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got["in_out"], want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got["w_lhs"].T, want, rtol=1e-5, atol=1e-4)


def test_a_small_run_prints_every_row(capsys):
    assert cpu_linear.main(["--rows", "4,16", "--shape", "64x32", "--calls", "2",
                            "--repeats", "1", "--bandwidth-mib", "1"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert [int(r[0]) for r in rows] == [4, 16]
    assert all(float(v) > 0 for r in rows for v in r[1:])
    assert float(re.search(r"bandwidth .*: ([\d.]+) GB/s", out).group(1)) > 0
