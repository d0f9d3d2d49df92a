"""The engine on an accelerator: the Pallas kernels against the XLA path and a float32
reference, same device, with agreement floors.

    python -m benchmarks.gpu.gpu_engine_check [--out-dir DIR] [--name NAME] [--cases llama-h128,...]

For each tiny random checkpoint (written here with transformers, float32 weights, head
dims the GPU kernels take), three engines on the same device: attention_backend="pallas"
(the Mosaic GPU / TPU kernels: ragged paged attention, the gated delta decode step) and
"xla" (the page loop), both served as users serve, bfloat16 weights and a bfloat16 (or
fp8) KV cache, and "reference" (the plain jnp spec) in float32 weights and cache, the
yardstick. Staggered prompt lengths, some longer than Gemma's sliding window, greedy
decoding; reported per case and backend against the reference: requests whose greedy
tokens are identical, tokens before the first divergence, and the largest and mean
difference of the prompt logprobs (of the prompt's own next tokens).

Floors (`passed` per case): each 16-bit engine's mean |delta prompt logprob| against the
float32 reference within the case's `max_mean`, and the kernels' within twice the XLA
path's + 0.01 (the same dtypes, so the same rounding: a kernel that is less accurate
than the page loop by more than that has a bug, e.g. a wrong mask or page moves every
position). The absolute floors are the CPU run of this check (bf16 weights and cache vs
float32) times 4 (Gemma) to 15 (the others, whose CPU figures leave out bf16
arithmetic): provisional until a GPU run has been read. Exit status 1 when a case
errs or misses a floor. Random Gemma 4 models are
chaotic (attention scale 1 on unit-RMS q and k: a bf16 rounding of q moves scores by
O(1)), hence its wider floor. The engines skip warmup (enforce_eager: each program
compiles on first use) so a case fits a GPU session's minute. Writes NAME.json and
prints one line per case.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

from benchmarks.shared.results_io import git_commit

MROPE_256 = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
             "mrope_section": [11, 11, 10], "mrope_interleaved": True}
# name: (checkpoint kind, config overrides, engine overrides)
# Floors: the 16-bit engines' mean |delta prompt logprob| against the float32 reference.
# On this project's CPU (bf16 weights and cache vs float32; results in benchmarks/README.md)
# llama-h128 0.0017, qwen3_5-h256 0.0021, gemma4-h256-h512 0.14.
MAX_MEAN = {"llama-h128": 0.03, "llama-h128-fp8kv": 0.1, "gemma4-h256-h512": 0.6,
            "qwen3_5-h256": 0.03, "llama-tiny": 0.03}
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
    # A CPU-sized llama (the session's tiny mode): head_dim 16, any kernel path; one layer
    # (each compiles on its own on CPU, and three engines compile here).
    "llama-tiny": ("llama", dict(num_hidden_layers=1), {}),
}
PROMPT_LENS = (3, 17, 40, 65, 130, 200, 9, 300)
NEW_TOKENS = 24


def run_engine(path: str, backend: str, prompts, overrides: dict, new_tokens: int,
               cache_dir: str):
    """The reference runs in float32 weights and cache, the others as served (bf16)."""
    from jaxserve import LLM, SamplingParams
    ref = backend == "reference"
    llm = LLM(path, attention_backend=backend, dtype="float32" if ref else "bfloat16",
              kv_cache_dtype="float32" if ref else overrides.get("kv_cache_dtype", "bfloat16"),
              max_num_seqs=len(prompts), max_num_batched_tokens=1024, num_pages=512,
              max_model_len=-(-(max(map(len, prompts)) + new_tokens) // 16) * 16,
              enforce_eager=True, compilation_cache_dir=cache_dir)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                            prompt_logprobs=0)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[lp[tok].logprob for lp, tok in zip(o.prompt_logprobs[1:], p[1:])]
                for o, p in zip(outs, prompts)]
    return tokens, logprobs, seconds


def compare(name: str, root: str, prompt_lens=PROMPT_LENS, new_tokens: int = NEW_TOKENS,
            cache_dir: str = "") -> dict:
    import numpy as np
    from tests.checkpoints import make_tiny_checkpoint
    kind, cfg, engine = CASES[name]
    path = make_tiny_checkpoint(kind, os.path.join(root, name), **cfg)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, n).tolist() for n in prompt_lens]
    res = {b: run_engine(path, b, prompts, engine, new_tokens, cache_dir)
           for b in ("reference", "pallas", "xla")}
    tok_r, lp_r, _ = res["reference"]
    row = dict(case=name, kind=kind, engine=engine, prompts=len(prompts),
               tokens=new_tokens * len(prompts))
    for backend in ("pallas", "xla"):
        toks, lps, seconds = res[backend]
        same = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                for a, b in zip(toks, tok_r)]
        diffs = [abs(a - b) for pa, pb in zip(lps, lp_r) for a, b in zip(pa, pb)]
        row[backend] = dict(identical_requests=sum(n == new_tokens for n in same),
                            tokens_before_divergence=sum(same),
                            prompt_logprob_max_abs_diff=max(diffs),
                            prompt_logprob_mean_abs_diff=float(np.mean(diffs)),
                            generate_s=round(seconds, 2))
    row["floors"] = floors(name, row)
    row["passed"] = all(row["floors"].values())
    return row


def floors(name: str, row: dict) -> dict[str, bool]:
    """The module doc's floors, each True when met."""
    pallas = row["pallas"]["prompt_logprob_mean_abs_diff"]
    xla = row["xla"]["prompt_logprob_mean_abs_diff"]
    cap = MAX_MEAN[name]
    return {f"pallas mean |dlogprob| <= {cap}": pallas <= cap,
            f"xla mean |dlogprob| <= {cap}": xla <= cap,
            "pallas mean |dlogprob| <= 2 x xla's + 0.01": pallas <= 2 * xla + 0.01}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="bench_results")
    ap.add_argument("--name", default="gpu_engine_check", help="NAME.json")
    ap.add_argument("--cases", default="gemma4-h256-h512,qwen3_5-h256,llama-h128-fp8kv,llama-h128")
    ap.add_argument("--prompt-lens", default=",".join(map(str, PROMPT_LENS)))
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--compilation-cache-dir", default="",
                    help="the engines' persistent compilation cache ('' = none)")
    args = ap.parse_args(argv)
    lens = tuple(int(n) for n in args.prompt_lens.split(","))
    import jax
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name in args.cases.split(","):
            t0 = time.perf_counter()
            try:
                row = compare(name, root, lens, args.new_tokens, args.compilation_cache_dir)
            except Exception as e:      # one case's failure must not hide the others'
                row = dict(case=name, error=f"{type(e).__name__}: {e}"[:2000],
                           traceback=traceback.format_exc()[-4000:])
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
            if "traceback" in row:
                print(row["traceback"], file=sys.stderr, flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"{args.name}.json"), "w") as f:
        json.dump(dict(command=" ".join(["python -m benchmarks.gpu.gpu_engine_check",
                                         *(sys.argv[1:] if argv is None else argv)]),
                       jax=jax.__version__, device=jax.devices()[0].device_kind,
                       git=git_commit(), rows=rows), f, indent=2)
    return rows


if __name__ == "__main__":
    sys.exit(0 if all(r.get("passed") for r in main()) else 1)
