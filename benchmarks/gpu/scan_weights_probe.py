"""Does the scanned layer loop copy each layer's weights before its matmuls? (issue 39)

The first H100 profiles of llama-3.1-8b decode at batch 1 spent 53 % of the device's
time in `memcpy128` kernels, about 7 a layer of 8-32 MiB: the sizes of the layer's
weight matrices, sliced out of the stacked weights by jax.lax.scan and copied before
the gemm reads them (read + write of every weight, on top of the gemm's read).

This probe steps a stack of Llama-3.1-8B-shaped layers (bf16 q/k/v/o/gate/up/down
matrices; the attention is a stand-in) at a few rows, as jax.lax.scan over stacked
weights and as a Python loop over per-layer ones, each variant in its own process under
its own XLA_FLAGS, and reports ms a step, the weight bytes a step reads at that speed,
compile seconds and the copies in the compiled HLO. Usage (GPU):

    python -m benchmarks.gpu.scan_weights_probe --output probe.json [--best-flags FILE]

--best-flags writes the XLA flags of the fastest scanned variant (a later step's
XLA_FLAGS). --tiny: small shapes, for CPU tests.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

# (name, loop, XLA flags)
VARIANTS = (
    ("scan", "scan", ""),
    ("scan+dsfusion", "scan", "--xla_gpu_enable_dynamic_slice_fusion=true"),
    ("scan+cublas", "scan", "--xla_gpu_enable_triton_gemm=false"),
    ("scan+cublas+dsfusion", "scan",
     "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_dynamic_slice_fusion=true"),
    ("loop", "loop", ""),
)
FULL = dict(layers=32, hidden=4096, q=4096, kv=1024, ffn=14336)
TINY = dict(layers=4, hidden=64, q=64, kv=16, ffn=128)


def run_variant(loop: str, rows: int, shape: dict, iters: int) -> dict:
    """In this process (XLA_FLAGS already set): ms a step for one loop form."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    L, H, Q, KV, F = (shape[k] for k in ("layers", "hidden", "q", "kv", "ffn"))
    shapes = {"wq": (H, Q), "wk": (H, KV), "wv": (H, KV), "wo": (Q, H),
              "wg": (H, F), "wu": (H, F), "wd": (F, H)}
    key = jax.random.key(0)
    stacked = {n: (jax.random.normal(jax.random.fold_in(key, i), (L, *s), jnp.bfloat16) * 0.02)
               for i, (n, s) in enumerate(shapes.items())}
    weight_bytes = sum(int(np.prod(w.shape)) * 2 for w in stacked.values())

    def layer(h, w):
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        a = q + jnp.tile(k * v, Q // KV)
        h = h + a @ w["wo"]
        return h + (jax.nn.silu(h @ w["wg"]) * (h @ w["wu"])) @ w["wd"]

    if loop == "scan":
        def step(ws, h):
            return jax.lax.scan(lambda h, w: (layer(h, w), None), h, ws)[0]
        weights = stacked
    else:
        def step(ws, h):
            for w in ws:
                h = layer(h, w)
            return h
        weights = [{n: w[i] for n, w in stacked.items()} for i in range(L)]
        del stacked
    h = jnp.ones((rows, H), jnp.bfloat16)
    t0 = time.perf_counter()
    compiled = jax.jit(step).lower(weights, h).compile()
    compile_s = time.perf_counter() - t0
    hlo = compiled.as_text()
    out = compiled(weights, h)
    out.block_until_ready()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        compiled(weights, h).block_until_ready()
        times.append(time.perf_counter() - t0)
    ms = sorted(times)[len(times) // 2] * 1e3
    return {"rows": rows, "ms_per_step": round(ms, 4),
            "weight_GBps": round(weight_bytes / (ms / 1e3) / 1e9, 1),
            "weight_bytes": weight_bytes, "compile_s": round(compile_s, 2),
            "hlo_copies": len(re.findall(r"= \S+ copy\(", hlo)),
            "hlo_dynamic_slice_fusions": len(re.findall(r"dynamic.slice.fusion|dynamic_slice_fusion",
                                                        hlo)),
            "hlo_while_loops": len(re.findall(r" while\(", hlo)),
            "device": str(jax.devices()[0].device_kind), "jax": jax.__version__}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", required=True)
    p.add_argument("--best-flags", help="write the fastest scanned variant's XLA flags here")
    p.add_argument("--rows", default="1,64")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--variants", default=",".join(v[0] for v in VARIANTS))
    p.add_argument("--timeout", type=float, default=60, help="seconds for each variant")
    p.add_argument("--one", help=argparse.SUPPRESS)   # internal: run one (loop) in-process
    a = p.parse_args()
    shape = TINY if a.tiny else FULL
    rows = [int(r) for r in a.rows.split(",") if r]
    if a.one:
        print(json.dumps([run_variant(a.one, r, shape, a.iters) for r in rows]))
        return
    results = []
    for name, loop, flags in VARIANTS:
        if name not in a.variants.split(","):
            continue
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
        cmd = [sys.executable, "-m", "benchmarks.gpu.scan_weights_probe", "--output", "-",
               "--rows", a.rows, "--iters", str(a.iters), "--one", loop] + \
            (["--tiny"] if a.tiny else [])
        row = {"variant": name, "loop": loop, "xla_flags": flags}
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=a.timeout)
            if done.returncode == 0:
                row["runs"] = json.loads(done.stdout.strip().splitlines()[-1])
            else:
                row["error"] = done.stderr.strip()[-600:]
        except subprocess.TimeoutExpired:
            row["error"] = f"timed out after {a.timeout} s"
        print(json.dumps(row), flush=True)
        results.append(row)
    with open(a.output, "w") as f:
        json.dump({"benchmark": "scan_weights_probe", "command": " ".join(sys.argv),
                   "results": {"variants": results, "shape": shape}}, f, indent=1)
    scanned = [r for r in results if r["loop"] == "scan" and "runs" in r]
    if a.best_flags and scanned:
        best = min(scanned, key=lambda r: r["runs"][0]["ms_per_step"])
        with open(a.best_flags, "w") as f:
            f.write(best["xla_flags"])
        print(f"fastest scanned variant: {best['variant']} ({best['runs'][0]['ms_per_step']} ms "
              f"at {best['runs'][0]['rows']} rows)")


if __name__ == "__main__":
    main()
