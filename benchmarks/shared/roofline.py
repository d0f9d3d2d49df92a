"""The device's practical ceilings, measured once: copy bandwidth and matmul TFLOP/s.

    python -m benchmarks.shared.roofline --output-dir DIR [--copy-mib 256,1024] [--matmul-sizes ...] \
        [--dtype bfloat16,float8_e4m3fn]

Copy bandwidth: `x + 1` over a large array in one jit (XLA cannot elide it), in place
(the input donated), bytes read + written / time, best of `--iters`; the ceiling of a
memory-bound step such as batch-1 decode. Matmul: square matmuls in each `--dtype`
(default bfloat16 on a GPU/TPU, float32 on a CPU; fp8 operands accumulate in float32 and
return bfloat16), 2 n^3 / time, best. A dtype the device cannot multiply is recorded
with its error, not fatal. Writes roofline.json, which `benchmarks.offline.latency` and
`benchmarks.offline.compare` read with `--roofline` (its `matmul_tflops` is the first dtype's).
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from benchmarks.shared.results_io import markdown_table, new_figure, write_results


def best_seconds(fn: Callable[[], Any], iters: int) -> float:
    import jax
    jax.block_until_ready(fn())   # compile and warm up
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(mib: int, iters: int) -> dict[str, float]:
    """In place (the input is donated): a fresh output buffer every call would time the
    allocator's page faults too (on this CPU 11 GB/s instead of 65)."""
    import jax
    import jax.numpy as jnp
    state = [jnp.ones((mib << 20) // 4, jnp.float32)]
    nbytes = state[0].nbytes
    bump = jax.jit(lambda a: a + 1, donate_argnums=0)

    def step() -> Any:
        state[0] = bump(state[0])
        return state[0]
    s = best_seconds(step, iters)
    return {"mib": mib, "seconds": s, "gb_per_s": 2 * nbytes / s / 1e9}


def matmul_tflops(n: int, dtype: str, iters: int) -> dict[str, Any]:
    """A dtype the backend cannot multiply (fp8 on a chip without fp8 units, say) gives
    {"error": ...}: one missing figure must not lose the others."""
    import jax
    import jax.numpy as jnp
    ka, kb = jax.random.split(jax.random.key(0))
    narrow = jnp.dtype(dtype).itemsize == 1
    try:
        a = jax.random.normal(ka, (n, n), jnp.bfloat16 if narrow else dtype).astype(dtype)
        b = jax.random.normal(kb, (n, n), jnp.bfloat16 if narrow else dtype).astype(dtype)
        # fp8 x fp8: float32 accumulation, bfloat16 out (what an fp8 GEMM unit returns)
        mm = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32)
                     .astype(jnp.bfloat16)) if narrow else jax.jit(jnp.matmul)
        s = best_seconds(lambda: mm(a, b), iters)
    except Exception as e:   # noqa: BLE001 -- the device's answer is the result
        return {"n": n, "dtype": dtype, "error": f"{type(e).__name__}: {e}"[:300]}
    return {"n": n, "dtype": dtype, "seconds": s, "tflops": 2 * n ** 3 / s / 1e12}


def load_roofline(path: str | None) -> dict[str, Any] | None:
    """{"copy_gb_per_s", "matmul_tflops", "device", ...} from a roofline.json, or None."""
    if not path:
        return None
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if doc.get("benchmark") != "roofline":
        raise ValueError(f"{path} is not a roofline result (benchmark={doc.get('benchmark')!r})")
    return {**doc["results"]["best"], "file": path}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--copy-mib", default=None,
                   help="array sizes (MiB), default 1024,2048 on an accelerator, 256,1024 on CPU")
    p.add_argument("--matmul-sizes", default=None,
                   help="default 4096,8192,16384 on an accelerator, 512,1024,2048 on CPU")
    p.add_argument("--dtype", default=None,
                   help="matmul dtypes, comma-separated (e.g. bfloat16,float8_e4m3fn); "
                        "default bfloat16, float32 on CPU")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--name", default="roofline")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    import jax
    cpu = jax.default_backend() == "cpu"
    copy_mib = args.copy_mib or ("256,1024" if cpu else "1024,2048")
    copy_sizes = [int(s) for s in copy_mib.split(",")]
    mm_sizes = [int(s) for s in (args.matmul_sizes or ("512,1024,2048" if cpu
                                                       else "4096,8192,16384")).split(",")]
    dtypes = (args.dtype or ("float32" if cpu else "bfloat16")).split(",")
    dtype = dtypes[0]
    jobs = [("copy", s, None) for s in copy_sizes] + [("matmul", n, d) for d in dtypes
                                                      for n in mm_sizes]
    copies, mms = [], []
    for kind, size, dt in tqdm(jobs, desc="roofline"):
        if kind == "copy":
            copies.append(copy_bandwidth(size, args.iters))
        else:
            mms.append(matmul_tflops(size, dt, args.iters))
    dev = jax.devices()[0]
    by_dtype = {d: max((m["tflops"] for m in mms if m["dtype"] == d and "tflops" in m),
                       default=None) for d in dtypes}
    best = {"copy_gb_per_s": max(c["gb_per_s"] for c in copies),
            "matmul_tflops": by_dtype[dtype], "matmul_dtype": dtype,
            "matmul_tflops_by_dtype": by_dtype, "device": f"{dev.platform}:{dev.device_kind}"}
    results = {"best": best, "copy": copies, "matmul": mms}
    rows = [[f"copy {c['mib']} MiB", f"{c['gb_per_s']:.1f} GB/s", f"{c['seconds'] * 1e3:.2f}"]
            for c in copies]
    rows += [[f"matmul {m['n']}^3 {m['dtype']}", f"{m['tflops']:.3f} TFLOP/s",
              f"{m['seconds'] * 1e3:.2f}"] if "tflops" in m else
             [f"matmul {m['n']}^3 {m['dtype']}", "failed", m["error"][:120]] for m in mms]
    rows += [["**best copy** (read + write, donated)", f"**{best['copy_gb_per_s']:.1f} GB/s**",
              ""]]
    rows += [[f"**best matmul {d}**", "n/a" if t is None else f"**{t:.3f} TFLOP/s**", ""]
             for d, t in by_dtype.items()]

    def plot(path: str) -> None:
        from matplotlib.ticker import NullLocator
        plt, fig, (ax1, ax2) = new_figure(2)
        ax1.plot([c["mib"] for c in copies], [c["gb_per_s"] for c in copies], "o-")
        ax1.set(title="copy bandwidth (read + write, in place)", xlabel="MiB", ylabel="GB/s",
                xscale="log")
        ax1.set_xticks([c["mib"] for c in copies], [str(c["mib"]) for c in copies])
        for d in dtypes:
            ok = [m for m in mms if m["dtype"] == d and "tflops" in m]
            ax2.plot([m["n"] for m in ok], [m["tflops"] for m in ok], "o-", label=d)
        ax2.set(title="square matmul", xlabel="n", ylabel="TFLOP/s", xscale="log")
        ax2.set_xticks(mm_sizes, [str(n) for n in mm_sizes])
        ax2.legend()
        for ax in (ax1, ax2):
            ax.xaxis.set_minor_locator(NullLocator())   # the ticks are the sizes run
            ax.grid(alpha=0.3)
        fig.suptitle(best["device"])
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    write_results(args.output_dir, args.name, benchmark="roofline", argv=argv or [],
                  config={**vars(args), "copy_mib": copy_sizes, "matmul_sizes": mm_sizes,
                          "dtype": dtype, "dtypes": dtypes},
                  results=results, table=markdown_table(["measurement", "best", "ms"], rows),
                  plot=plot)
    return results


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
