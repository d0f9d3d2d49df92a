"""One projection's LoRA delta on CPU against its base dot, at a real model's widths.

    python -m benchmarks.lora.lora_op [--tokens 16,1024] [--in-dim 4096] [--out-dim 12288]
                                      [--rank 16] [--slots 17] [--dtype bfloat16|float32]
                                      [--iters 10]

The base: x [T, in] (bf16) times a bf16 [out, in] kernel into float32, as a bf16 model's
projection runs on a CPU with native bf16 dots (models/layers.Einsum). Then the base plus
models/lora/ops._cpu_add (what the engine runs there) with stacks of --dtype, for 1 and
for slots - 1 adapters (the tokens spread evenly over them), and the same with the
all-slots pass and the windowed loop each forced. Every array is an argument (no
constant folding). Prints each time (best of --iters, the cases round robin) and its
ratio to the base dot. Defaults: Qwen3-8B's gate projection, 16 adapters of rank 16.
"""
from __future__ import annotations

import argparse
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from models.lora import ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="16,1024")
    ap.add_argument("--in-dim", type=int, default=4096)
    ap.add_argument("--out-dim", type=int, default=12288)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=17)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    i, o, r, s, dt = args.in_dim, args.out_dim, args.rank, args.slots, jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((o, i)) * 0.02, jnp.bfloat16)
    a = jnp.asarray(rng.standard_normal((s, r, i)) * 0.02, dt).at[0].set(0)
    b = jnp.asarray(rng.standard_normal((s, r, o)) * 0.02, dt).at[0].set(0)
    scales = jnp.ones((s,), jnp.float32)

    forms = {"chosen": ops._cpu_add, "all-slots pass": ops._all_slots_add,
             "windowed loop": ops._windowed_add}

    def with_lora(form, x, w, ids, a, b, scales):
        y = jnp.einsum("ti,oi->to", x, w, preferred_element_type=jnp.float32)
        return form(y, x, ops.group_by_slot(ids, s), a, b, scales)   # x as Einsum passes it

    base_fn = jax.jit(lambda x, w: jnp.einsum("ti,oi->to", x, w,
                                              preferred_element_type=jnp.float32))
    print(f"[T, {i}] x [{o}, {i}] bf16 base dot; {s} slots of rank {r}, {args.dtype} stacks; "
          f"best of {args.iters}")
    for t in (int(v) for v in args.tokens.split(",")):
        x = jnp.asarray(rng.standard_normal((t, i)), jnp.bfloat16)
        cases = {"base dot": (base_fn, (x, w))}
        for n in (1, s - 1):
            ids = jnp.asarray(np.arange(t) % n + 1, jnp.int32)
            for name, form in forms.items():
                fn = jax.jit(partial(with_lora, form))
                cases[f"{n:2d} adapter(s), {name}"] = (fn, (x, w, ids, a, b, scales))
        times = {k: [] for k in cases}
        for fn, fargs in cases.values():
            fn(*fargs).block_until_ready()
        for _ in range(args.iters):
            for k, (fn, fargs) in cases.items():
                t0 = time.perf_counter()
                fn(*fargs).block_until_ready()
                times[k].append(time.perf_counter() - t0)
        ref = min(times["base dot"])
        for k, ts in times.items():
            print(f"  T={t:5d}  {k:32s} {1e3 * min(ts):8.2f} ms  x{min(ts) / ref:.2f}")


if __name__ == "__main__":
    main()
