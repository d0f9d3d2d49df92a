"""The engine on an accelerator: the Pallas kernels against the XLA path, same device.

    python -m benchmarks.gpu_engine_check [--out-dir DIR] [--cases llama,gemma4,...]

For each tiny random checkpoint (written here with transformers, float32 weights, head
dims the GPU kernels take), three engines on the same device and the same bfloat16 (or
fp8) KV cache: attention_backend="pallas" (the Mosaic GPU / TPU kernels: ragged paged
attention, the gated delta decode step), "xla" (the page loop, the CPU default that the
parity tests hold to transformers) and "reference" (the plain jnp spec), the last as
the yardstick. Staggered prompt lengths, some longer than Gemma's sliding window,
greedy decoding; reported per case and backend against the reference: requests whose
greedy tokens are identical, tokens before the first divergence, and the largest and
mean difference of the prompt logprobs (of the prompt's own next tokens). The kernels
cast probabilities to the cache's 16-bit dtype for P V and use approximate exp2, so
they agree to ~1e-2, not bit for bit, and random Gemma 4 models are chaotic (attention
scale 1 on unit-RMS q and k: XLA and the reference differ at near-ties too): read the
kernel's figures beside the XLA loop's. A wrong mask or page moves every position.
Writes gpu_engine_check.json and prints one line per case.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

MROPE_256 = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
             "mrope_section": [11, 11, 10], "mrope_interleaved": True}
# name: (checkpoint kind, config overrides, engine overrides)
CASES = {
    "llama-h128": ("llama", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=128, max_position_embeddings=1024), {}),
    "llama-h128-fp8kv": ("llama", dict(hidden_size=256, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=128,
                                       max_position_embeddings=1024),
                         dict(kv_cache_dtype="fp8")),
    # Gemma 4 at the 31B's head dims: sliding layers 256, global K = V layers 512.
    "gemma4-h256-h512": ("gemma4_kv", dict(hidden_size=256, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=256,
                                           global_head_dim=512, num_global_key_value_heads=1,
                                           sliding_window=64, max_position_embeddings=1024), {}),
    # Qwen3.5 hybrid at the flagship's attention head dim, DeltaNet heads of 64.
    "qwen3_5-h256": ("qwen3_5", dict(hidden_size=256, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=256,
                                     linear_key_head_dim=64, linear_value_head_dim=64,
                                     rope_parameters=MROPE_256, max_position_embeddings=1024),
                     {}),
}
PROMPT_LENS = (3, 17, 40, 65, 130, 200, 9, 300)
NEW_TOKENS = 24


def run_engine(path: str, backend: str, prompts, overrides: dict):
    from jaxserve import LLM, SamplingParams
    llm = LLM(path, attention_backend=backend, kv_cache_dtype=overrides.get("kv_cache_dtype",
              "bfloat16"), max_num_seqs=8, max_num_batched_tokens=256, num_pages=512,
              max_model_len=1024, compilation_cache_dir="")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            prompt_logprobs=0)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[lp[tok].logprob for lp, tok in zip(o.prompt_logprobs[1:], p[1:])]
                for o, p in zip(outs, prompts)]
    return tokens, logprobs, seconds


def compare(name: str, root: str) -> dict:
    import numpy as np
    from tests.checkpoints import make_tiny_checkpoint
    kind, cfg, engine = CASES[name]
    path = make_tiny_checkpoint(kind, os.path.join(root, name), **cfg)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, n).tolist() for n in PROMPT_LENS]
    res = {b: run_engine(path, b, prompts, engine) for b in ("reference", "pallas", "xla")}
    tok_r, lp_r, _ = res["reference"]
    row = dict(case=name, kind=kind, engine=engine, prompts=len(prompts),
               tokens=NEW_TOKENS * len(prompts))
    for backend in ("pallas", "xla"):
        toks, lps, seconds = res[backend]
        same = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                for a, b in zip(toks, tok_r)]
        diffs = [abs(a - b) for pa, pb in zip(lps, lp_r) for a, b in zip(pa, pb)]
        row[backend] = dict(identical_requests=sum(n == NEW_TOKENS for n in same),
                            tokens_before_divergence=sum(same),
                            prompt_logprob_max_abs_diff=max(diffs),
                            prompt_logprob_mean_abs_diff=float(np.mean(diffs)),
                            generate_s=round(seconds, 2))
    return row


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="bench_results")
    ap.add_argument("--cases", default="gemma4-h256-h512,qwen3_5-h256,llama-h128-fp8kv,llama-h128")
    args = ap.parse_args(argv)
    import jax
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name in args.cases.split(","):
            t0 = time.perf_counter()
            try:
                row = compare(name, root)
            except Exception as e:      # one case's failure must not hide the others'
                row = dict(case=name, error=f"{type(e).__name__}: {e}"[:2000],
                           traceback=traceback.format_exc()[-4000:])
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
            if "traceback" in row:
                print(row["traceback"], file=sys.stderr, flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "gpu_engine_check.json"), "w") as f:
        json.dump(dict(command=" ".join(sys.argv), jax=jax.__version__,
                       device=jax.devices()[0].device_kind, rows=rows), f, indent=2)
    return rows


if __name__ == "__main__":
    main()
