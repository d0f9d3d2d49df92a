"""benchmarks/step/cpu_linear.py: its dot forms compute the same product, and a small run
prints a row of timings per batch size and the bandwidth; --stack a row per batch size."""
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
    np.testing.assert_allclose(got["w_lhs_t"], want, rtol=1e-5, atol=1e-4)


def test_a_small_run_prints_every_row(capsys):
    assert cpu_linear.main(["--rows", "4,16", "--shape", "64x32", "--calls", "2",
                            "--repeats", "1", "--bandwidth-mib", "1"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\s*(\d+)" + r"\s+([\d.]+)" * (len(cpu_linear.FORMS) + 1) + "$", out, re.M)
    assert [int(r[0]) for r in rows] == [4, 16]
    assert all(float(v) > 0 for r in rows for v in r[1:])
    assert float(re.search(r"bandwidth .*: ([\d.]+) GB/s", out).group(1)) > 0


def test_a_stack_run_prints_every_row(capsys):
    """One layer of the llama's projections in the three forms, same numbers, a row a size."""
    import jax
    rng = np.random.default_rng(0)
    weights = [jnp.asarray(0.03 * rng.standard_normal(s), jnp.bfloat16)
               for s in cpu_linear.LLAMA_LAYER]
    x = jnp.asarray(rng.standard_normal((3, 1024)), jnp.bfloat16)
    a, b, c = (np.asarray(jax.jit(cpu_linear.stack_fn(f))(
        x, [w.T for w in weights] if f == "in_out" else weights), np.float32)
        for f in cpu_linear.STACK_FORMS)
    np.testing.assert_allclose(a, b, rtol=0.02, atol=0.02)
    np.testing.assert_allclose(c, b, rtol=0.02, atol=0.02)
    for dtype in ("bfloat16", "float32"):
        assert cpu_linear.main(["--stack", "1", "--rows", "2", "--calls", "1", "--repeats", "1",
                                "--dtype", dtype]) == 0
        out = capsys.readouterr().out
        rows = re.findall(r"^\s*(\d+)" + r"\s+([\d.]+)" * 4 + "$", out, re.M)
        assert dtype in out and [int(r[0]) for r in rows] == [2]
        assert all(float(v) > 0 for v in rows[0][1:])
