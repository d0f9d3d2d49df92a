"""The vision towers' blocked attention (models/vision/common.attention) on CPU, alone: one
encoder call's worth of patches holding several images packed, one image, or images and
padding, optionally alternating with the function as it was at another git revision.

    python -m benchmarks.multimodal.encoder_attention [--patches 4096] [--block 1024] \\
        [--against REV] [--repeats 3]

Qwen3.6's tower's heads (16 of 72), float32; cases: 4 images filling the call, one image
filling it, 3 images and padding. Each: the largest deviation from the other revision's
output, then the best of --repeats calls, REV first in every round.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

HEADS, HEAD_DIM = 16, 72


def cases(t: int) -> dict[str, np.ndarray]:
    third = t * 3 // 10
    return {"4 images": np.repeat(np.arange(4), t // 4),
            "1 image": np.zeros(t, np.int64),
            "3 images + padding": np.concatenate([np.repeat(np.arange(3), third),
                                                  -np.ones(t - 3 * third, np.int64)])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--patches", type=int, default=4096)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--against", default=None, help="git revision to time alternately")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    from benchmarks.step.cpu_attention import module_at
    from models.vision import common
    mods = {"this tree": common}
    if args.against:
        mods = {args.against: module_at(args.against, "models/vision/common.py"), **mods}
    t = args.patches
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((t, HEADS, HEAD_DIM)), jnp.float32)
               for _ in range(3))
    for case, seg in cases(t).items():
        seg = jnp.asarray(seg, jnp.int32)
        fns, outs = {}, {}
        for name, mod in mods.items():
            fns[name] = jax.jit(lambda q, k, v, s, mod=mod: mod.attention(
                q, k, v, s, s, HEAD_DIM ** -0.5, block=args.block))
            outs[name] = np.asarray(fns[name](q, k, v, seg))
        if len(outs) > 1:
            a, b = outs.values()
            print(f"{case}: max deviation between the revisions {np.abs(a - b).max():.2g}")
        best = {name: float("inf") for name in fns}
        for _ in range(args.repeats):
            for name, f in fns.items():
                t0 = time.perf_counter()
                f(q, k, v, seg).block_until_ready()
                best[name] = min(best[name], time.perf_counter() - t0)
        print(f"{case}: " + ", ".join(f"{n} {1e3 * s:.1f} ms" for n, s in best.items()),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
