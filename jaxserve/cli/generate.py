"""`python -m jaxserve.generate`: offline generation from the command line.

With no --model it runs the built-in tiny random-weight model, whose output is
random text; pass --model /path/to/hf-checkpoint, a Hugging Face repo id in the
local cache or an alias such as qwen3-8b for a real one.
"""
from __future__ import annotations

import argparse
import logging
import time

from jaxserve.checkpoints.default_model import DEFAULT_MODEL_NAME, default_model_dir
from jaxserve.checkpoints.model_configs import ALIASES
from jaxserve.config.engine_args import add_engine_args, engine_kwargs

logger = logging.getLogger("jaxserve")

# The engine flags this command takes: made from EngineConfig's fields.
GENERATE_ENGINE_FLAGS = ("seed", "dtype", "quantization", "kv_cache_dtype", "max_model_len",
                         "max_num_seqs", "load_format", "tokenizer", "revision",
                         "download_dir", "tensor_parallel_size", "enforce_eager",
                         "speculative_config")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxserve.generate", description=__doc__)
    ap.add_argument("--model", default=None,
                    help="checkpoint directory (config.json, *.safetensors, tokenizer), Hugging "
                         "Face repo id (Org/Name: from the local HF cache, else downloaded) or "
                         "alias (" + ", ".join(ALIASES) + "); default: the built-in tiny "
                         "random model")
    ap.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    # Its own max_num_seqs: a few prompts need few rows, and each row bucket is a sampler
    # program to compile before the first token.
    add_engine_args(ap, GENERATE_ENGINE_FLAGS, defaults={"max_num_seqs": 16})
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    from jaxserve import LLM, SamplingParams   # (jax loads after the flags: fast --help)
    model, load_format = args.model, args.load_format
    if model is None:
        model, load_format = default_model_dir(), "dummy"
        logger.info("no --model given: using the built-in %s (random weights, so the output "
                    "is random text); pass --model /path/to/hf-checkpoint for a real model",
                    DEFAULT_MODEL_NAME)
    kwargs = {**engine_kwargs(args), "load_format": load_format}
    llm = LLM(model, max_num_batched_tokens=max(256, args.max_num_seqs), **kwargs)
    prompts = args.prompt or ["Hello, my name is", "The capital of France is"]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    for o in outs:
        print(f"{o.prompt!r} -> {o.outputs[0].text!r}")
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tokens/s)")


if __name__ == "__main__":
    main()
