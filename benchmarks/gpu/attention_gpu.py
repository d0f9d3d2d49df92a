"""Ragged paged attention on one Hopper GPU: decode bandwidth and prefill FLOP/s.

    python -m benchmarks.gpu.attention_gpu [--out-dir bench_results] [--page-size 16]
    python -m benchmarks.gpu.attention_gpu --dry-run      # CPU: exports every full-size case for
                                                      # cuda, then tiny shapes in GPU interpret mode

Decode: one new token per request, batch 1/8/64/256 at context 1k and 8k. The
figure of merit is achieved HBM bandwidth (K/V, queries and outputs moved / time)
against a measured device-to-device copy (read + write of a 2 GiB array, donated,
best of 5: benchmarks/shared/roofline.py), the practical roofline of a memory-bound kernel.
Prefill: 1 x 4096 and 8 x 1024 fresh tokens (causal, the K/V already in the
cache), TFLOP/s (4 * N * H * L^2 / 2 per sequence) against
jax.nn.dot_product_attention(implementation="cudnn") on dense [B, L, N, H] inputs.
Heads: Qwen3-8B (32 q / 8 kv / 128), Qwen3.6-27B full attention (24 q / 4 kv / 256) and
Gemma-4-31B's two layer types: sliding window 1024 (32 q / 16 kv / 256; a decode reads only
the window's pages, and the bytes counted are the window's) and global (32 q / 4 kv / 512).
Cases whose KV cache would pass --max-cache-gib are skipped.

Each timing runs the op `--inner` times inside one jit (a scan with a data
dependency between calls), so dispatch overhead is not counted; the median of
`--iters` such runs is reported. Writes attention_gpu.json and attention_gpu.md.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

if __package__ in (None, ""):   # run as a script (python benchmarks/gpu/attention_gpu.py): the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from pallas_kernels.ragged_paged_attention import make_kv_cache, ragged_paged_attention  # noqa: E402

MODELS = {  # name: (q heads, kv heads, head dim, sliding window)
    "qwen3-8b": (32, 8, 128, None),
    "qwen3.6-27b-full": (24, 4, 256, None),
    "gemma-4-31b-sliding": (32, 16, 256, 1024),
    "gemma-4-31b-global": (32, 4, 512, None),
}
DECODE_BATCHES = (1, 8, 64, 256)
DECODE_CONTEXTS = (1024, 8192)
PREFILLS = ((1, 4096), (8, 1024))     # (sequences, tokens each)


def paged_batch(q_lens, kv_lens, num_q_heads, num_kv_heads, head_dim, page_size, dtype, seed=0):
    """Device arrays for one ragged step; pages dealt in a random order."""
    rng = np.random.default_rng(seed)
    pages_per_req = max(-(-kv // page_size) for kv in kv_lens)
    num_pages = 1 + len(kv_lens) * pages_per_req
    order = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    page_table = order.reshape(len(kv_lens), pages_per_req)
    shape = make_kv_cache(1, page_size, num_kv_heads, head_dim, dtype).shape
    key_q, key_kv = jax.random.split(jax.random.key(seed))
    cache = jax.random.normal(key_kv, (num_pages,) + shape[1:], dtype)
    num_tokens = int(sum(q_lens))
    q = jax.random.normal(key_q, (num_tokens, num_q_heads, head_dim), dtype)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return (q, cache, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(page_table),
            jnp.asarray(qsl), jnp.asarray([len(kv_lens)], jnp.int32))


def chained(fn, n: int):
    """fn(q, *rest) n times in one jit; each call's q depends on the previous output."""
    def run(q, *rest):
        def body(c, _):
            out = fn(q + c.astype(q.dtype), *rest)
            return (out.reshape(-1)[0] * 0).astype(jnp.float32), None
        c, _ = lax.scan(body, jnp.float32(0), None, length=n)
        return c
    return jax.jit(run)


def median_seconds(fn, args, iters: int, per_call: int) -> float:
    jax.block_until_ready(fn(*args))                     # compile + warm up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) / per_call)
    return statistics.median(times)


def copy_bandwidth(num_bytes: int, iters: int) -> float:
    """Bytes/s of a device-to-device copy (x + 1 reads and writes every byte): in place
    (donated) and the best of `iters`, benchmarks/shared/roofline.py's figure. Undonated and as a
    median it read 2,763 GB/s on an H200 whose donated best-of copy reads ~4.3 TB/s."""
    from benchmarks.shared.roofline import copy_bandwidth as roofline_copy
    return roofline_copy(max(1, num_bytes >> 20), max(iters, 5))["gb_per_s"] * 1e9


def decode_bytes(batch, ctx, nq, nkv, hd, itemsize, window=None) -> int:
    kv = batch * min(ctx, window or ctx) * nkv * 2 * hd * itemsize
    return kv + 2 * batch * nq * hd * itemsize          # + queries in, outputs out


def prefill_flops(seqs, length, nq, hd) -> float:
    return 4.0 * nq * hd * seqs * length * (length + 1) / 2   # causal: half of Q K^T and P V


def run(args) -> dict:
    dtype = jnp.bfloat16
    itemsize = 2
    attn_kw = dict(impl="pallas", interpret="gpu" if args.dry_run else False)
    if args.dry_run:     # tiny shapes, kernel body in GPU interpret mode, XLA as the baseline
        models = {"tiny": (4, 2, 64, None), "tiny-window": (4, 2, 64, 24)}
        batches, contexts, prefills = (2,), (40,), ((1, 32),)
        baseline_impl, copy_bytes = None, 1 << 24
    else:
        models, batches, contexts, prefills = MODELS, DECODE_BATCHES, DECODE_CONTEXTS, PREFILLS
        baseline_impl, copy_bytes = "cudnn", 2 << 30
    copy_bw = copy_bandwidth(copy_bytes, args.iters)
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s", flush=True)
    rows = []

    def add(row: dict) -> None:        # printed at once: a run cut short still says what it measured
        rows.append(row)
        print(json.dumps(row), flush=True)

    for name, (nq, nkv, hd, window) in models.items():
        attn = functools.partial(ragged_paged_attention, sm_scale=hd ** -0.5,
                                 sliding_window=window, **attn_kw)
        cache_gib = lambda seqs, ctx: seqs * ctx * nkv * 2 * hd * itemsize / 2 ** 30
        for ctx in contexts:
            for batch in batches:
                if cache_gib(batch, ctx) > args.max_cache_gib:
                    continue
                data = paged_batch([1] * batch, [ctx] * batch, nq, nkv, hd, args.page_size, dtype)
                t = median_seconds(chained(attn, args.inner), data, args.iters, args.inner)
                moved = decode_bytes(batch, ctx, nq, nkv, hd, itemsize, window)
                add(dict(kind="decode", model=name, batch=batch, context=ctx, window=window,
                         us=t * 1e6, gb_per_s=moved / t / 1e9, frac_of_copy=moved / t / copy_bw))
                del data
        for seqs, length in prefills if window is None else ():
            data = paged_batch([length] * seqs, [length] * seqs, nq, nkv, hd, args.page_size, dtype)
            t = median_seconds(chained(attn, args.inner), data, args.iters, args.inner)
            kq, kk, kv = jax.random.split(jax.random.key(1), 3)
            dense_q = jax.random.normal(kq, (seqs, length, nq, hd), dtype)
            dense_k = jax.random.normal(kk, (seqs, length, nkv, hd), dtype)
            dense_v = jax.random.normal(kv, (seqs, length, nkv, hd), dtype)
            base = lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, scale=hd ** -0.5, implementation=baseline_impl)
            try:
                t_base = median_seconds(chained(base, args.inner), (dense_q, dense_k, dense_v),
                                        args.iters, args.inner)
            except Exception as e:    # e.g. cuDNN without this head dim
                print(f"baseline {baseline_impl} at {name}: {type(e).__name__}: "
                      f"{str(e)[:300]}", file=sys.stderr)
                t_base = float("nan")
            flops = prefill_flops(seqs, length, nq, hd)
            add(dict(kind="prefill", model=name, batch=seqs, context=length, us=t * 1e6,
                     tflops=flops / t / 1e12, baseline=baseline_impl or "xla",
                     baseline_us=t_base * 1e6, baseline_tflops=flops / t_base / 1e12))
            del data
    dev = jax.devices()[0]
    return dict(command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                device=getattr(dev, "device_kind", dev.platform), jax=jax.__version__,
                host=platform.node(), dry_run=args.dry_run, page_size=args.page_size,
                dtype="bfloat16", copy_gb_per_s=copy_bw / 1e9, rows=rows)


def check_lowering(page_size: int) -> int:
    """Export every full-size kernel configuration of the benchmark for "cuda" (no GPU
    needed): catches shapes the Mosaic GPU kernel rejects before a GPU session."""
    count = 0
    for nq, nkv, hd, window in MODELS.values():
        attn = functools.partial(ragged_paged_attention, sm_scale=hd ** -0.5,
                                 sliding_window=window, impl="pallas")
        shapes = [([1] * b, [c] * b) for c in DECODE_CONTEXTS for b in DECODE_BATCHES]
        shapes += [([n] * s, [n] * s) for s, n in PREFILLS]
        for q_lens, kv_lens in shapes:
            data = jax.eval_shape(functools.partial(
                paged_batch, q_lens, kv_lens, nq, nkv, hd, page_size, jnp.bfloat16))
            text = jax.export.export(chained(attn, 2), platforms=["cuda"])(*data).mlir_module()
            assert "mosaic_gpu" in text, (nq, nkv, hd, len(q_lens))
            count += 1
    return count


def markdown(result: dict) -> str:
    lines = [f"# Ragged paged attention on {result['device']}", "",
             f"`{result['command']}` (jax {result['jax']}, page size {result['page_size']}, "
             f"{result['dtype']}); device-to-device copy: {result['copy_gb_per_s']:.0f} GB/s", "",
             "## Decode (one token per request)", "",
             "| model | batch | context | time (us) | GB/s (window's KV) | of copy BW |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        if r["kind"] == "decode":
            lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['us']:.1f} | "
                         f"{r['gb_per_s']:.0f} | {100 * r['frac_of_copy']:.0f}% |")
    lines += ["", "## Prefill (causal, fresh sequences)", "",
              "| model | sequences x tokens | time (us) | TFLOP/s | baseline | baseline TFLOP/s |",
              "|---|---:|---:|---:|---|---:|"]
    for r in result["rows"]:
        if r["kind"] == "prefill":
            lines.append(f"| {r['model']} | {r['batch']} x {r['context']} | {r['us']:.1f} | "
                         f"{r['tflops']:.1f} | {r['baseline']} | {r['baseline_tflops']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="bench_results")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--inner", type=int, default=20, help="kernel calls per timed jit call")
    ap.add_argument("--max-cache-gib", type=float, default=24.0,
                    help="skip decode cases whose KV cache is larger")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU check: tiny shapes, the GPU kernel in interpret mode")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.iters, args.inner = 1, 1
        print(f"lowered {check_lowering(args.page_size)} full-size configurations for cuda")
    elif jax.devices()[0].platform != "gpu":
        ap.error("needs a GPU (use --dry-run on CPU)")
    result = run(args)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "attention_gpu.json"), "w") as f:
        json.dump(result, f, indent=2)
    table = markdown(result)
    with open(os.path.join(args.out_dir, "attention_gpu.md"), "w") as f:
        f.write(table)
    print(table)
    return result


if __name__ == "__main__":
    main()
