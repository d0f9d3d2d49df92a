"""A bf16 linear layer on XLA:CPU at decode sizes, in the three forms its dot can take, and
this machine's memory bandwidth (what a decode step's weight reads are bound by).

    python -m benchmarks.step.cpu_linear [--rows 16,48,64,256,2048] [--shape 2816x1024]
    python -m benchmarks.step.cpu_linear --stack 12 [--rows 16,32,48,64,96,128,256] \
        [--dtype float32]

Forms, each y = x W^T for x [rows, in] bf16 and a bf16 weight, float32 out:
  out_in   W stored [out, in], contracted on its second axis (the engine's form on a
           CPU with native bf16 dots, models/weights.store_kernels_out_in);
  in_out   W stored [in, out] (flax's own layout);
  w_lhs    W [out, in] as the dot's left operand: y^T = W x^T, left transposed [out, rows]
           (XLA folds a transpose of the result back into the out_in form);
  w_lhs_t  w_lhs, then transposed to [rows, out] behind an optimization barrier that stops
           that fold: models/layers.weight_left_dot, which out_in_dot uses up to
           WEIGHT_LEFT_MAX_ROWS rows.
--stack N times N layers of the benchmark llama's projections instead (q/k/v 1536x1024,
o 1024x1024, gate/up 5632x1024, down 1024x2816, residual adds between them) in the forms
in_out, out_in and w_lhs_t, in --dtype (bfloat16; float32: a float32 model's dots, or a
bf16 model's on a CPU without native bf16 dots, models/registry.matmul_dtype): the dots
as a decode step chains them, each result read by the next op.
XLA:CPU hands these dots to YNNPACK, which packs its right operand on every call (here:
the whole weight; with w_lhs only x). Bandwidth: jnp.sum over 256 MiB of int32.
Each figure is the best of --repeats rounds of --calls calls (per call), after one warm call.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

FORMS = ("out_in", "in_out", "w_lhs", "w_lhs_t")
# The llama of benchmarks/vllm_cpu: one layer's projections [out, in].
LLAMA_LAYER = ((1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816))


def dot_fn(form: str):
    import jax
    import jax.numpy as jnp
    if form == "out_in":
        return lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                                                preferred_element_type=jnp.float32)
    if form == "in_out":
        return lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)
    if form == "w_lhs":
        return lambda x, w: jax.lax.dot_general(w, x, (((1,), (1,)), ((), ())),
                                                preferred_element_type=jnp.float32)
    if form == "w_lhs_t":
        from models.layers import weight_left_dot
        return lambda x, w: weight_left_dot(x, w, jnp.float32)
    raise ValueError(f"form {form!r}: expected one of {FORMS}")


def stack_fn(form: str):
    """A decode step's chain of projections over the LLAMA_LAYER weights of each layer
    ([out, in]; in_out's transposed), activations in the weights' dtype."""
    import jax
    dot = dot_fn(form)

    def f(x, weights):
        for qkv_w, o_w, gate_up_w, down_w in zip(*[iter(weights)] * 4):
            attn = dot(x, qkv_w)[:, :x.shape[1]].astype(x.dtype)
            x = x + dot(attn, o_w).astype(x.dtype)
            gate_up = dot(x, gate_up_w)
            half = gate_up.shape[1] // 2
            act = (jax.nn.silu(gate_up[:, :half]) * gate_up[:, half:]).astype(x.dtype)
            x = x + dot(act, down_w).astype(x.dtype)
        return x
    return f


def per_call_ms(fn, args: tuple, calls: int, repeats: int) -> float:
    import jax
    f = jax.jit(fn)
    f(*args).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = f(*args)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / calls)
    return 1e3 * best


def bandwidth_gbs(mib: int, repeats: int) -> float:
    import jax.numpy as jnp
    x = jnp.ones((mib << 20) // 4, jnp.int32)
    ms = per_call_ms(jnp.sum, (x,), 1, repeats)
    return x.nbytes / (ms / 1e3) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,48,64,256,2048")
    ap.add_argument("--shape", default="2816x1024", help="out x in of the weight")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bandwidth-mib", type=int, default=256)
    ap.add_argument("--stack", type=int, default=0, help="layers of LLAMA_LAYER instead")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the stack's weights and activations")
    args = ap.parse_args(argv)
    from jaxserve.build.cpu_malloc import keep_freed_memory
    keep_freed_memory()      # as the engine does
    import jax.numpy as jnp
    if args.stack:
        return time_stack(args)
    n_out, n_in = (int(v) for v in args.shape.split("x"))
    rng = np.random.default_rng(0)
    w_oi = jnp.asarray(rng.standard_normal((n_out, n_in)), jnp.bfloat16)
    weights = {"out_in": w_oi, "in_out": w_oi.T.copy(), "w_lhs": w_oi, "w_lhs_t": w_oi}
    print(f"weight {n_out}x{n_in} bf16 ({w_oi.nbytes / 2**20:.1f} MiB); ms a call "
          f"(best of {args.repeats} x {args.calls})")
    print("rows  " + "  ".join(f"{f:>8s}" for f in FORMS) + "   out_in / w_lhs")
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, n_in)), jnp.bfloat16)
        ms = {f: per_call_ms(dot_fn(f), (x, weights[f]), args.calls, args.repeats)
              for f in FORMS}
        print(f"{rows:5d} " + "  ".join(f"{ms[f]:8.3f}" for f in FORMS)
              + f"   {ms['out_in'] / ms['w_lhs']:.2f}", flush=True)
    if args.bandwidth_mib:
        print(f"memory bandwidth (jnp.sum over {args.bandwidth_mib} MiB): "
              f"{bandwidth_gbs(args.bandwidth_mib, args.repeats):.1f} GB/s")
    return 0


STACK_FORMS = ("in_out", "out_in", "w_lhs_t")


def time_stack(args: argparse.Namespace) -> int:
    """The STACK_FORMS over --stack layers, alternating, best of --repeats each."""
    import jax.numpy as jnp
    rng = np.random.default_rng(0)
    out_in = [jnp.asarray(0.03 * rng.standard_normal(shape), args.dtype)
              for shape in LLAMA_LAYER * args.stack]
    weights = {"in_out": [w.T.copy() for w in out_in], "out_in": out_in, "w_lhs_t": out_in}
    mib = sum(w.nbytes for w in out_in) / 2**20
    print(f"{args.stack} layers of {LLAMA_LAYER} {args.dtype} ({mib:.0f} MiB); ms a stack "
          f"(best of {args.repeats} x {args.calls})")
    print("rows " + "".join(f"{f:>9s}" for f in STACK_FORMS) + "   in_out / w_lhs_t")
    stacks = {f: stack_fn(f) for f in STACK_FORMS}
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, LLAMA_LAYER[0][1])), args.dtype)
        best = {f: float("inf") for f in stacks}
        for _ in range(args.repeats):      # alternating: the machine's drift hits all
            for f, fn in stacks.items():   # (the same functions: compiled once per size)
                best[f] = min(best[f], per_call_ms(fn, (x, weights[f]), args.calls, 1))
        print(f"{rows:5d}" + "".join(f" {best[f]:8.2f}" for f in STACK_FORMS)
              + f"   {best['in_out'] / best['w_lhs_t']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
