"""What `jaxserve bench throughput` and `jaxserve bench latency` share: the engine flags,
the engine (an offline LLM), and the sampling vLLM's offline benchmarks use (n
completions, temperature 1, top-p 1, eos ignored, so every request produces exactly
max_tokens and both engines do the same work)."""
from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxserve.bench.datasets import Prompt
from jaxserve.config.engine_args import FLAGS, add_engine_args, engine_kwargs

logger = logging.getLogger("jaxserve")


def add_offline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint directory, Hugging Face repo id or alias; default: the "
                        "built-in tiny random model")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--disable-detokenize", action="store_true",
                   help="do not turn output tokens into text (time the engine alone)")
    p.add_argument("--output-json", default=None, help="write the results here")
    add_engine_args(p, FLAGS)


def check_offline(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.n < 1:
        p.error(f"--n must be >= 1, got {args.n}")


def make_llm(args: argparse.Namespace) -> Any:
    """The engine the flags describe (imports jax: only here, so `--help` stays fast)."""
    # (jax loads only here: `jaxserve bench ... --help` and the client stay light)
    from jaxserve import LLM
    from jaxserve.checkpoints.default_model import default_model_dir
    kwargs = engine_kwargs(args)
    model = args.model
    if model is None:
        model, kwargs["load_format"] = default_model_dir(), "dummy"
        logger.info("no --model given: the built-in tiny model (random weights)")
    return LLM(model, **kwargs)


def sampling_params(n: int, max_tokens: int, detokenize: bool) -> Any:
    from jaxserve import SamplingParams   # (jaxserve's exports load on first use)
    return SamplingParams(n=n, temperature=1.0, top_p=1.0, ignore_eos=True,
                          max_tokens=max_tokens, detokenize=detokenize)


def engine_prompt(p: Prompt) -> Any:
    return p.prompt if isinstance(p.prompt, str) else {"prompt_token_ids": list(p.prompt)}


def generate(llm: Any, prompts: Sequence[Prompt], n: int, detokenize: bool,
             progress: bool = False) -> tuple[float, list[Any]]:
    """Seconds of one LLM.generate over `prompts` and its outputs; every completion must
    have its max_tokens (eos is ignored), else the run compared nothing."""
    params = [sampling_params(n, p.output_len, detokenize) for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate([engine_prompt(p) for p in prompts], params, use_tqdm=progress)
    seconds = time.perf_counter() - t0
    for o, p in zip(outs, prompts):
        got = [len(c.token_ids) for c in o.outputs]
        if got != [p.output_len] * n:
            raise RuntimeError(f"request {o.request_id} produced {got} tokens, "
                               f"wanted {n} x {p.output_len}")
    return seconds, outs


def run_command(args: argparse.Namespace, llm: Any,
                run: Callable[[Any, argparse.Namespace], dict[str, Any]],
                report: Callable[[dict[str, Any]], str]) -> dict[str, Any]:
    """The body of `bench latency` and `bench throughput` once their flags are read: the
    engine (`llm`, or one built from the flags), the run, its printed report and
    --output-json."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    res = run(llm if llm is not None else make_llm(args), args)
    print(report(res))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=4)
    return res
