"""`jaxserve bench throughput`: offline throughput of the engine, as `vllm bench
throughput` measures it (its flags, printed lines and --output-json keys): every prompt
given to one LLM.generate at once, the time of that call, requests and tokens per
second. Start-up and warmup compilation are not timed; compilations during the timed
run are counted (0 expected: a compile there is counted as serving time).

    jaxserve bench throughput --model DIR --input-len 512 --output-len 128 --num-prompts 200
    jaxserve bench throughput --model DIR --dataset-name sharegpt --dataset-path FILE
"""
from __future__ import annotations

import argparse
from typing import Any

from jaxserve.bench import offline
from jaxserve.bench.datasets import (Prompt, prefix_repetition_dataset, random_dataset,
                                     sharegpt_dataset)

DATASETS = ("random", "sharegpt", "prefix_repetition")
OUTPUT_LEN = 128


def build_parser(prog: str = "jaxserve bench throughput") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--dataset-name", "--dataset", default="random", choices=DATASETS)
    a("--dataset-path", default=None, help="ShareGPT-format JSON file")
    a("--num-prompts", type=int, default=1000)
    a("--input-len", "--random-input-len", type=int, default=1024, help="random prompt tokens")
    a("--output-len", "--random-output-len", type=int, default=None,
      help=f"output tokens (default {OUTPUT_LEN}; ShareGPT: each reply's length unless given)")
    a("--random-range-ratio", "--range-ratio", type=float, default=0.0)
    a("--prefix-len", "--random-prefix-len", type=int, default=0,
      help="tokens every random prompt shares")
    a("--prefix-repetition-prefix-len", type=int, default=256)
    a("--prefix-repetition-suffix-len", type=int, default=256)
    a("--prefix-repetition-num-prefixes", type=int, default=10)
    a("--disable-tqdm", action="store_true", help="no progress bar")
    offline.add_offline_args(p)
    return p


def load_prompts(args: argparse.Namespace, llm: Any) -> list[Prompt]:
    """Token-id prompts (ShareGPT's tokenized with the model's tokenizer)."""
    vocab = llm.engine.inputs.vocab_size
    seed = args.seed or 0
    if args.dataset_name == "sharegpt":
        tok = llm.get_tokenizer()
        encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
        texts = sharegpt_dataset(args.dataset_path, args.num_prompts, seed, args.output_len,
                                 encode)
        return [Prompt(encode(p.prompt), p.prompt_len, p.output_len) for p in texts]
    if args.dataset_name == "prefix_repetition":
        return prefix_repetition_dataset(
            args.num_prompts, args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
            args.output_len or OUTPUT_LEN, seed, vocab)
    return random_dataset(args.num_prompts, args.input_len, args.output_len or OUTPUT_LEN,
                          args.random_range_ratio, seed, vocab, prefix_len=args.prefix_len)


def run(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    prompts = load_prompts(args, llm)
    warm = [Prompt(prompts[0].prompt if isinstance(prompts[0].prompt, str)
                   else prompts[0].prompt[:8], 0, 2)]
    offline.generate(llm, warm, 1, not args.disable_detokenize)   # untimed
    llm.reset_prefix_cache()   # the timed run finds nothing the warmup left
    before = llm.engine.num_compilations
    seconds, outs = offline.generate(llm, prompts, args.n, not args.disable_detokenize,
                                     progress=not args.disable_tqdm)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"elapsed_time": seconds, "num_requests": len(prompts),
            "total_num_tokens": prompt_tokens + output_tokens,
            "total_num_prompt_tokens": prompt_tokens, "total_num_output_tokens": output_tokens,
            "requests_per_second": len(prompts) / seconds,
            "tokens_per_second": (prompt_tokens + output_tokens) / seconds,
            "output_tokens_per_second": output_tokens / seconds,
            "compilations_during_run": llm.engine.num_compilations - before}


def report(res: dict[str, Any]) -> str:
    return (f"Throughput: {res['requests_per_second']:.2f} requests/s, "
            f"{res['tokens_per_second']:.2f} total tokens/s, "
            f"{res['output_tokens_per_second']:.2f} output tokens/s\n"
            f"Total num prompt tokens:  {res['total_num_prompt_tokens']}\n"
            f"Total num output tokens:  {res['total_num_output_tokens']}\n"
            f"Compilations during the run:  {res['compilations_during_run']}")


def parse(argv: list[str] | None, prog: str = "jaxserve bench throughput") -> argparse.Namespace:
    p = build_parser(prog)
    args = p.parse_args(argv)
    offline.check_offline(p, args)
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        p.error("--dataset-name sharegpt needs --dataset-path")
    if args.dataset_path and args.dataset_name != "sharegpt":
        p.error(f"--dataset-path is read by --dataset-name sharegpt, not {args.dataset_name}")
    if args.num_prompts < 1:
        p.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
    return args


def main(argv: list[str] | None = None, prog: str = "jaxserve bench throughput",
         llm: Any = None) -> dict[str, Any]:
    """llm: an engine already built from these flags (tests share one)."""
    return offline.run_command(parse(argv, prog), llm, run, report)
