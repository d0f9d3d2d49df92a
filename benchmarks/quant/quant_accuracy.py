"""benchmarks.quant.quantization, part 2: what quantization does to the next-token
distribution, against the unquantized float32 engine on the same prompts.

Each engine scores the same prompts with `prompt_logprobs=2`: per prompt position the
logprob of the actual next token and the two most likely tokens (the output
processor's dict: the actual token, then ranks 1 and 2). Per scheme: top-1 agreement
(the quantized engine's most likely token is the baseline's) and mean / max |delta
logprob| of the actual token, and the change of mean NLL (the loss, nats per token).
Every engine runs float32 activations: only the weights' and the KV cache's storage
differ from the baseline.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

WEIGHT_SCHEMES = ("none", "fp8", "int8")
KV_SCHEMES = ("auto", "fp8", "fp8_e5m2", "int8")
RANDOM_KINDS = ("llama", "qwen3_moe", "qwen3_5")    # tests.checkpoints' tiny random models
TRAINED = "byte-llama"                               # benchmarks.shared.byte_lm, trained here


@dataclass(frozen=True)
class Subject:
    name: str
    path: str
    prompts: list[list[int]]
    note: str


def make_subjects(work_dir: str | Path, names: tuple[str, ...], num_prompts: int,
                  prompt_len: int, train_steps: int, seed: int = 0, log=print) -> list[Subject]:
    """The checkpoints (written under work_dir once; a name may also be a checkpoint
    directory) and their prompts: uniform random ids for the random models, held-out
    stdlib source bytes for the trained one."""
    from tests.checkpoints import make_tiny_checkpoint

    work_dir = Path(work_dir)
    out = []
    for name in names:
        if name == TRAINED:
            from benchmarks.shared.byte_lm import corpus, train, windows
            path = work_dir / f"{TRAINED}-{train_steps}"
            rec = train(path, steps=train_steps, seq_len=prompt_len, seed=seed, log=log)
            ids = windows(corpus(held_out=True), num_prompts, prompt_len,
                          np.random.default_rng(seed + 2))
            note = (f"trained here: {rec['num_params'] / 1e6:.1f} M params, {rec['steps']} steps, "
                    f"held-out loss {rec['heldout_loss']:.2f} nats/byte; prompts: held-out text")
            out.append(Subject(name, str(path), ids.tolist(), note))
            continue
        path = Path(name) if Path(name).is_dir() else work_dir / f"tiny-{name}"
        if not (path / "config.json").is_file():
            make_tiny_checkpoint(name, path)
        rng = np.random.default_rng(seed)
        ids = rng.integers(3, 256, (num_prompts, prompt_len))   # vocab 256 in all of them
        out.append(Subject(name, str(path), ids.tolist(),
                           "tiny random weights (tests/checkpoints.py); prompts: random ids"))
    return out


def score(path: str, prompts: list[list[int]], **engine_kw: Any) -> dict[str, np.ndarray]:
    """One engine's prompt logprobs, flattened over prompts and positions 1..."""
    from jaxserve import LLM, SamplingParams

    llm = LLM(path, dtype="float32", max_model_len=max(map(len, prompts)) + 16,
              max_num_seqs=8, max_num_batched_tokens=512, **engine_kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2),
                        use_tqdm=False)
    actual, top1, lp1, lp2 = [], [], [], []
    for o in outs:
        for pos, d in enumerate(o.prompt_logprobs):
            if d is None:          # the first token has no context
                continue
            actual.append(d[o.prompt_token_ids[pos]].logprob)
            by_rank = {lp.rank: (tok, lp.logprob) for tok, lp in d.items()}
            top1.append(by_rank[1][0])
            lp1.append(by_rank[1][1])
            lp2.append(by_rank[2][1] if 2 in by_rank else np.nan)
    del llm
    return {"actual": np.array(actual), "top1": np.array(top1), "top1_lp": np.array(lp1),
            "top2_lp": np.array(lp2)}


def compare(base: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> dict[str, float]:
    d = np.abs(other["actual"] - base["actual"])
    agree = float(np.mean(other["top1"] == base["top1"]))
    return {"positions": int(len(d)), "top1_agreement": agree,
            "mean_abs_dlogprob": float(d.mean()), "max_abs_dlogprob": float(d.max()),
            "nll": float(-other["actual"].mean()),
            "delta_nll": float(base["actual"].mean() - other["actual"].mean())}


def baseline_stats(base: dict[str, np.ndarray]) -> dict[str, float]:
    """How peaked the baseline's distributions are: a flat one puts many near-ties at
    the top, which any perturbation may flip."""
    margin = base["top1_lp"] - base["top2_lp"]
    return {"nll": float(-base["actual"].mean()),
            "mean_top1_prob": float(np.exp(base["top1_lp"]).mean()),
            "median_top1_top2_margin": float(np.nanmedian(margin)),
            "share_margin_below_0.05": float(np.nanmean(margin < 0.05))}


def run_accuracy(subjects: list[Subject], schemes: list[tuple[str, str]] | None = None,
                 log=print) -> dict[str, Any]:
    """Every scheme (weights, kv) against the none/auto float32 baseline, per subject."""
    schemes = schemes or [(w, k) for w in WEIGHT_SCHEMES for k in KV_SCHEMES
                          if (w, k) != ("none", "auto")]
    rows, baselines = [], {}
    for s in subjects:
        t0 = time.perf_counter()
        base = score(s.path, s.prompts)
        baselines[s.name] = {**baseline_stats(base), "note": s.note,
                             "seconds": time.perf_counter() - t0}
        log(f"  accuracy {s.name}: baseline {baselines[s.name]}")
        for w, k in schemes:
            t0 = time.perf_counter()
            got = score(s.path, s.prompts, quantization=None if w == "none" else w,
                        kv_cache_dtype=k)
            rows.append({"model": s.name, "weights": w, "kv": k, **compare(base, got),
                         "seconds": time.perf_counter() - t0})
            log(f"  accuracy {s.name} {w}/{k}: {rows[-1]}")
    return {"baselines": baselines, "rows": rows}


def markdown(res: dict[str, Any]) -> str:
    from benchmarks.shared.results_io import markdown_table

    base = [[name, b["note"], f"{b['nll']:.3f}", f"{b['mean_top1_prob']:.3f}",
             f"{b['median_top1_top2_margin']:.3f}", f"{b['share_margin_below_0.05']:.3f}"]
            for name, b in res["baselines"].items()]
    rows = [[r["model"], r["weights"], r["kv"], r["positions"], f"{r['top1_agreement']:.4f}",
             f"{r['mean_abs_dlogprob']:.4f}", f"{r['max_abs_dlogprob']:.3f}",
             f"{r['delta_nll']:+.4f}"] for r in res["rows"]]
    return "\n\n".join([
        "### Accuracy vs the unquantized float32 engine (prompt logprobs)",
        "Baselines (float32 weights and KV): NLL of the actual next token (nats), the "
        "mean probability of the top token, the median top-1 - top-2 logprob margin and "
        "the share of positions whose margin is below 0.05 (near-ties any perturbation "
        "can flip). Random models' distributions are nearly flat, so their top-1 "
        "agreement is a pessimistic figure.",
        markdown_table(["model", "what", "NLL", "mean top-1 p", "median margin",
                        "margin < 0.05"], base),
        "Per scheme (weights x KV; auto = the model dtype, float32 here): top-1 agreement "
        "with the baseline, mean and max |delta logprob| of the actual next token, and "
        "the change of NLL (+: worse).",
        markdown_table(["model", "weights", "KV", "positions", "top-1 agreement",
                        "mean abs dlogprob", "max abs dlogprob", "dNLL"], rows)])
