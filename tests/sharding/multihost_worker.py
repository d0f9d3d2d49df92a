"""One process of the two-process test (test_multihost.py): run as a script.

argv: checkpoint dir, output dir, the greedy prompts (JSON), their max_tokens. The
JAXSERVE_* env names the coordinator, the process count and this process's id; XLA_FLAGS
gives each process 2 CPU devices. Process 0 writes process0.json: the greedy tokens, the
outputs of `requests()` (every request feature) and what its runner sampled per request;
process 1 writes process1.json: what its own runner sampled (each process samples on its
own devices from its own masks, so equal records mean equal masks).

The test imports `run_all` to run the same requests on one process.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

ENGINE = dict(dtype="float32", mesh="1x4", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, compilation_cache_dir=None)
TIERED = dict(mesh="1x4", kv_offloading_size=0.02)   # with test_tiered_cache's PLAIN
TIERED_CONVERSATIONS = 5   # (its trace's histories outgrow the 11-page pool: 20 pages by turn 3)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                         "days": {"type": "integer", "maximum": 9}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "noop"}}]


def requests() -> list[tuple[str | list[int], object]]:
    """(prompt, SamplingParams): structured outputs of every kind, the grammars the
    server makes for tool_choice "required" and a named function, and every sampling
    feature; seeded (the engines' own seeds for the one without: the same counter)."""
    from jaxserve import SamplingParams
    from jaxserve.api.tools import ToolSetup
    from jaxserve.structured_outputs import StructuredOutputsParams as SO

    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"type": "string", "maxLength": 4}},
              "required": ["a", "b"], "additionalProperties": False}
    sampled = dict(temperature=1.0, max_tokens=20)
    constrained = [
        SO(json=schema), SO(json=json.dumps(schema), disable_any_whitespace=True),
        SO(regex=r"[a-c]{2,5}(x|yz)"), SO(choice=["yes", "no", "maybe"]),
        SO(grammar='start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'),
        SO(grammar='root ::= "x" [a-d]* "y"'), SO(json_object=True),
        ToolSetup("required", TOOLS, parallel=True).constraint(),
        ToolSetup("named", TOOLS, name="get_weather", parallel=False).constraint()]
    out: list = [(f"Answer {i}:", SamplingParams(seed=10 + i, structured_outputs=so, **sampled))
                 for i, so in enumerate(constrained)]
    out += [
        ("The quick brown fox", SamplingParams(seed=1, bad_words=["the", "o", "fox jumps"],
                                               **sampled)),
        ("Hello", SamplingParams(seed=2, allowed_token_ids=list(range(30, 90)),
                                 logit_bias={40: 5.0, 41: -100.0}, **sampled)),
        ("abc abc abc", SamplingParams(seed=3, presence_penalty=0.5, frequency_penalty=0.7,
                                       repetition_penalty=1.3, **sampled)),
        ("Once upon a time", SamplingParams(seed=4, logprobs=3, prompt_logprobs=2,
                                            **sampled)),
        ("x y z", SamplingParams(seed=5, n=2, best_of=3, **sampled)),
        ("x y z", SamplingParams(seed=6, n=3, top_k=20, top_p=0.9, min_p=0.05, **sampled)),
        ("The capital", SamplingParams(seed=7, stop=["e", "a"], include_stop_str_in_output=True,
                                       temperature=1.0, max_tokens=20)),
        ("0123", SamplingParams(seed=8, min_tokens=5, stop_token_ids=[50, 51, 52],
                                **sampled)),
        ("A long prompt that is cut to its last tokens",
         SamplingParams(seed=9, truncate_prompt_tokens=6, **sampled)),
        ("no seed", SamplingParams(**sampled)),
        ("greedy", SamplingParams(temperature=0.0, max_tokens=12, logprobs=1,
                                  structured_outputs=SO(regex="[a-z ]+"))),
    ]
    return out


def run_all(llm, greedy_prompts: list[list[int]], max_tokens: int) -> dict:
    """The greedy prompts, then `requests()` (the same order everywhere: a seedless
    request takes the engine's next seed), as JSON: text, tokens, finish reasons,
    logprobs."""
    from jaxserve import SamplingParams

    greedy = llm.generate([{"prompt_token_ids": p} for p in greedy_prompts],
                          SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                         ignore_eos=True), use_tqdm=False)
    prompts, params = zip(*requests())
    outs = llm.generate(list(prompts), list(params), use_tqdm=False)

    def lps(steps):
        return None if steps is None else [
            None if s is None else sorted((t, lp.logprob) for t, lp in s.items())
            for s in steps]
    return {"tokens": [o.outputs[0].token_ids for o in greedy],
            "features": [{"prompt_logprobs": lps(o.prompt_logprobs), "completions": [
                {"text": c.text, "token_ids": list(c.token_ids),
                 "finish_reason": c.finish_reason, "logprobs": lps(c.logprobs)}
                for c in o.outputs]} for o in outs]}


def record_sampled(runner) -> dict[str, list[int]]:
    """What `runner` samples from now on, per request id (its collect wrapped)."""
    seen: dict[str, list[int]] = {}
    collect = runner.collect

    def recording(step):
        out = collect(step)
        for rid, t in out.sampled.items():
            seen.setdefault(rid, []).extend(t if isinstance(t, list) else [t])
        return out
    runner.collect = recording
    return seen


def main(path: str, out_dir: str, prompts_json: str, max_tokens: int) -> None:
    import jax

    from jaxserve import LLM
    from jaxserve.engine import multihost

    assert multihost.initialize() and jax.device_count() == 4
    llm = LLM(path, **ENGINE)
    sampled = record_sampled(llm.engine.runner)
    result: dict = {"sampled": sampled}
    if not multihost.is_leader():
        llm.engine.follow()
    else:
        before = llm.engine.num_compilations
        result.update(run_all(llm, json.loads(prompts_json), max_tokens))
        llm.engine.shutdown()
        result.update(devices=jax.device_count(), processes=jax.process_count(),
                      compilations_after_warmup=llm.engine.num_compilations - before)
    result["tiered"] = run_tiered(path)
    with open(os.path.join(out_dir, f"process{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)


def run_tiered(path: str) -> dict | None:
    """A second engine, with the prefix cache's host tier, over test_tiered_cache's
    multi-turn trace of TIERED_CONVERSATIONS conversations (a device pool of 11 pages):
    each process keeps its devices' heads of every page it offloads. The leader returns
    the trace's tokens, cached tokens and host-tier counts; the follower follows (None)."""
    from jaxserve import LLM
    from jaxserve.engine import multihost
    from tests.engine.test_tiered_cache import PLAIN, trace

    llm = LLM(path, **TIERED, **PLAIN)
    if not multihost.is_leader():
        llm.engine.follow()
        return None
    tokens, cached = trace(llm, TIERED_CONVERSATIONS)
    llm.engine.shutdown()
    host = llm.engine.stats().host
    return {"tokens": [list(t) for t in tokens], "cached": cached,
            "host": [host.hits, host.pages_offloaded, host.pages_restored]}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
