"""The LoRA forward's cost on CPU: the base forward against 1, 4 and 16 adapters.

    python -m benchmarks.lora.lora_cpu [--iters 10] [--rank 16]

The small Qwen3 of the CPU figures (hidden 512, 8 layers), float32, layer loop; the
forward alone (models' apply, no sampling) for a prefill step (16 requests x 16 tokens)
and a decode step (64 requests, 1 token, 200-token contexts). With N adapters the
requests are spread evenly over N slots of N + 1 (every linear projection adapted,
rank --rank). Prints each time (best of --iters) and its ratio to the base forward,
measured in one run so the machine's load affects all alike; --ragged-too adds the
ragged-dot form (what TPU and GPU run) for comparison.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.shared.common import make_small_qwen3
from models.config import ModelConfig
from models.layer_stack import cache_shapes
from models.lora import ops
from models.lora.slots import forward_variables, init_stacks, slot_weights, write_slot
from models.lora.targets import lora_targets
from models.registry import build_model
from models.weights import load_params
from tests.models.batch_util import make_inputs

PAGE = 16


def _stacks(targets, num: int, rank: int):
    stacks = init_stacks(targets, num, rank, jnp.float32)
    rng = np.random.default_rng(0)
    for slot in range(1, num + 1):
        w = {n: (rng.standard_normal((t.in_dim, rank), np.float32) * 0.02,
                 rng.standard_normal((rank, t.out_dim), np.float32) * 0.02)
             for n, t in targets.items()}
        stacks = write_slot(stacks, jnp.int32(slot), slot_weights(w, 2.0, targets, rank, np.float32))
    return stacks


def _step(kind: str):
    if kind == "prefill":
        seqs = [(np.full(16, 5), 0, [1 + i]) for i in range(16)]
        return make_inputs(seqs, page_size=PAGE, num_tokens=256, num_rows=16, pages_per_row=1)
    seqs = [(np.full(1, 5), 200, list(range(1 + 13 * i, 14 + 13 * i))) for i in range(64)]
    return make_inputs(seqs, page_size=PAGE, num_tokens=64, num_rows=64, pages_per_row=13)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--ragged-too", action="store_true")
    args = ap.parse_args()
    path = make_small_qwen3(os.path.join(tempfile.gettempdir(), "jaxserve-bench-qwen3-small"))
    cfg = ModelConfig.from_pretrained(path)
    model = build_model(cfg, jnp.float32)
    params = load_params(path, cfg, model, jnp.float32)
    targets = lora_targets(model, cfg)
    shapes = cache_shapes(cfg, num_pages=64 * 13 + 1, page_size=PAGE, kv_dtype=jnp.float32,
                          num_state_slots=0, conv_state_dtype=jnp.float32)
    caches = {k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.items()}
    base_fn = jax.jit(lambda p, c, i: model.apply({"params": p}, c, i)[0])
    lora_fn = jax.jit(lambda p, s, ids, c, i: model.apply(
        {"params": p, **forward_variables(s, ids)}, c, i)[0])

    ragged_jit = jax.jit(lambda p, s, ids, c, i: model.apply(
        {"params": p, **forward_variables(s, ids)}, c, i)[0])

    def ragged_fn(*args):   # the same forward with the ragged-dot form on every platform
        saved, ops._grouped_delta = ops._grouped_delta, ops._ragged_delta
        try:   # traced (on its first call) with the ragged form
            return ragged_jit(*args)
        finally:
            ops._grouped_delta = saved
    forms = {"windows": lora_fn, "ragged": ragged_fn} if args.ragged_too else {"windows": lora_fn}
    stacks = {n: _stacks(targets, n, args.rank) for n in (1, 4, 16)}

    def best(fn) -> float:
        fn().block_until_ready()
        times = []
        for _ in range(args.iters):
            t = time.perf_counter()
            fn().block_until_ready()
            times.append(time.perf_counter() - t)
        return min(times)

    print(f"backend {jax.default_backend()}, rank {args.rank}, best of {args.iters}")
    for kind in ("prefill", "decode"):
        inputs, spans = _step(kind)
        t_base = best(lambda: base_fn(params, caches, inputs))
        line = [f"{kind:8s} T={inputs.token_ids.shape[0]:3d}  base {t_base * 1e3:7.2f} ms"]
        print(" ".join(line), flush=True)
        for form, fn in forms.items():
            line = [f"  {form:7s}"]
            for n, st in stacks.items():
                ids = np.zeros(inputs.token_ids.shape[0], np.int32)
                for r, (a, b) in enumerate(spans):
                    ids[a:b] = 1 + r % n
                t = best(lambda: fn(params, st, jnp.asarray(ids), caches, inputs))
                line.append(f"{n:2d} adapters {t * 1e3:7.2f} ms (x{t / t_base:.2f})")
            print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
