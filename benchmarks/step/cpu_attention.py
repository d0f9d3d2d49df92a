"""The CPU attention kernel (paged_loop.py) at an engine's own call, alone: the whole
stacked cache, q float32, a bf16 cache held as its bits, as the llama bf16 engine of
benchmarks/vllm_cpu calls it (16 heads, 4 kv heads of 64, 16-token pages, 12 layers' pages).

    python -m benchmarks.step.cpu_attention [--cases decode,prefill] [--context 250] \\
        [--against REV] [--repeats 3]

decode: 48 one-token rows of a 64-token program at --context (+0-47) tokens each;
prefill: one 2048-token chunk of ten 200-token prompts and 48 tokens of an 11th. Each
case is checked against the reference kernel (max deviation printed), then timed (best and
median of 8 calls; glibc's malloc set as the engine sets it, jaxserve/build/cpu_malloc.py).
--against REV also loads paged_loop.py as it was at git revision REV and times the two
alternately, REV first in every round.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from types import ModuleType

import numpy as np

NUM_HEADS, KV_HEADS, HEAD_DIM, PAGE, ROWS, WIDTH = 16, 4, 64, 16, 64, 64
NUM_PAGES = 49164       # the llama bf16 engine's 12 layers of pages (805 MB)
SM_SCALE = HEAD_DIM ** -0.5


def case_args(case: str, context: int, num_pages: int = NUM_PAGES) -> tuple:
    import jax.numpy as jnp
    rng = np.random.default_rng(0)
    if case == "decode":
        tokens, q_lens = ROWS, [1] * 48
        kv_lens = [context + int(n) for n in rng.integers(0, 48, len(q_lens))]
    elif case == "prefill":
        tokens, q_lens = 2048, [200] * 10 + [48]
        kv_lens = list(q_lens)
    else:
        raise SystemExit(f"unknown case {case!r} (decode, prefill)")
    n = len(q_lens)
    if n * WIDTH + 1 > num_pages:
        raise SystemExit(f"{num_pages} pages hold fewer than {n} requests of {WIDTH} pages")
    # finite bf16 bit patterns (exponent below the all-ones of inf / NaN)
    cache = rng.integers(0, 2**16, (num_pages, 2 * KV_HEADS, PAGE, HEAD_DIM), dtype=np.uint16)
    cache = (cache & 0xBFFF) | 0x3C00
    lens = np.zeros(ROWS, np.int32)
    lens[:n] = kv_lens
    table = np.zeros((ROWS, WIDTH), np.int32)
    base = 5 * (num_pages // 12)   # one layer's region; a request's pages contiguous
    for r in range(n):
        table[r] = (base + 1 + r * WIDTH + np.arange(WIDTH)) % num_pages
    starts = np.full(ROWS + 1, sum(q_lens), np.int32)
    starts[:n + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    q = rng.standard_normal((tokens, NUM_HEADS, HEAD_DIM)).astype(np.float32)
    return tuple(jnp.asarray(a) for a in (q, cache, lens, table, starts,
                                          np.asarray([n], np.int32)))


def module_at(rev: str, path: str = "pallas_kernels/ragged_paged_attention/paged_loop.py"
              ) -> ModuleType:
    """A module file (default paged_loop.py) as it was at git revision `rev`, imported
    under another name."""
    text = subprocess.run(["git", "show", f"{rev}:{path}"], check=True, capture_output=True,
                          text=True).stdout
    fd, file = tempfile.mkstemp(suffix=".py")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(f"{name}_{rev}", file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def timer(mod: ModuleType, args: tuple, calls: int):
    import jax
    f = jax.jit(lambda *a: mod.ragged_paged_attention(*a, sm_scale=SM_SCALE))
    f(*args).block_until_ready()

    def run() -> tuple[float, float]:
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter()
            f(*args).block_until_ready()
            ts.append(time.perf_counter() - t0)
        return 1e3 * min(ts), 1e3 * float(np.median(ts))
    return f, run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="decode,prefill")
    ap.add_argument("--context", type=int, default=250, help="decode rows' context (+0-47)")
    ap.add_argument("--against", default=None, help="git revision to time alternately")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--num-pages", type=int, default=NUM_PAGES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from jaxserve.build.cpu_malloc import keep_freed_memory
    keep_freed_memory()   # as the engine does: large temporaries not mapped afresh each call
    import jax
    import jax.numpy as jnp
    from pallas_kernels.ragged_paged_attention import paged_loop, reference
    mods = {"this tree": paged_loop}
    if args.against:
        mods = {args.against: module_at(args.against), **mods}
    for case in args.cases.split(","):
        a = case_args(case, args.context, args.num_pages)
        real = int(a[4][int(a[5][0])])
        want = jax.jit(lambda q, c, *r: reference.ragged_paged_attention(
            q, jax.lax.bitcast_convert_type(c, jnp.bfloat16), *r, sm_scale=SM_SCALE))(*a)
        runs = {}
        for name, mod in mods.items():
            f, runs[name] = timer(mod, a, args.calls)
            dev = float(jnp.max(jnp.abs(f(*a)[:real] - want[:real])))
            print(f"{case} {name}: max deviation from the reference {dev:.2g}", flush=True)
        for rep in range(args.repeats):
            for name, run in runs.items():
                best, med = run()
                print(f"{case} {name} round {rep + 1}: {best:.2f} ms (median {med:.2f})",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
