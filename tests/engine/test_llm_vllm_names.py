"""vLLM's offline names on jaxserve: LLM's keyword arguments (fields, flag aliases,
vLLM-only ones), max_logprobs, enforce_eager, TextPrompt / TokensPrompt, the tqdm
bar, and SamplingParams' best_of, truncate_prompt_tokens, output_kind and numpy ids."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import io
import random
import re

import numpy as np
import pytest
from tqdm.auto import tqdm

from jaxserve import (LLM, EngineConfig, RequestOutputKind, SamplingParams, TextPrompt,
                      TokensPrompt)
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.llm_kwargs import ALIASES, VLLM_ONLY, engine_kwargs
from tests.engine.conftest import assert_no_leaks

SIZES = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


@pytest.fixture(scope="module")
def llm(checkpoint):
    """block_size: vLLM's name of page_size; disable_log_stats=True is true of LLM."""
    return LLM(checkpoint("qwen3"), block_size=32, max_logprobs=30, disable_log_stats=True,
               **SIZES)


@pytest.fixture(scope="module")
def eager(checkpoint):
    return LLM(checkpoint("qwen3"), page_size=32, enforce_eager=True, max_logprobs=-1, **SIZES)


@pytest.fixture(autouse=True)
def _no_leaks(request):
    yield
    for name in ("llm", "eager"):
        if name in request.fixturenames:
            assert_no_leaks(request.getfixturevalue(name).engine)


# ---- LLM's keyword arguments ---------------------------------------------------------

def test_aliases_come_from_the_fields_metadata():
    for f in dataclasses.fields(EngineConfig):
        for alias in f.metadata.get("aliases", ()):
            if alias.startswith("--"):
                assert ALIASES[alias[2:].replace("-", "_")] == f.name
    assert ALIASES["block_size"] == "page_size"
    assert ALIASES["gpu_memory_utilization"] == "hbm_utilization"
    got = engine_kwargs(dict(gpu_memory_utilization=0.5, tensor_parallel_size=2,
                             data_parallel_size=1, trust_remote_code=False, revision="main",
                             tokenizer="tok", download_dir="/tmp/x", quantization="int8",
                             kv_cache_dtype="fp8", seed=3, enforce_eager=True,
                             disable_log_stats=True, tokenizer_mode="auto"))
    assert got == dict(hbm_utilization=0.5, tensor_parallel_size=2, data_parallel_size=1,
                       trust_remote_code=False, revision="main", tokenizer="tok",
                       download_dir="/tmp/x", quantization="int8", kv_cache_dtype="fp8",
                       seed=3, enforce_eager=True)
    EngineConfig(model="m", **got)     # each is a real field


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(block_sise=16), TypeError, "'block_sise'.*did you mean 'block_size'"),
    (dict(gpu_memory_utilisation=0.5), TypeError, "did you mean 'gpu_memory_utilization'"),
    (dict(max_logprob=5), TypeError, "did you mean 'max_logprobs'"),
    (dict(frobnicate=1), TypeError, "unexpected keyword argument 'frobnicate'$"),
    (dict(tp=2), TypeError, "'tp'"),
    (dict(model="x"), TypeError, "'model'"),
    (dict(block_size=16, page_size=16), TypeError, "both 'block_size' and 'page_size'"),
    (dict(seed=None), ValueError, r"seed=None"),
    (dict(disable_log_stats=False), ValueError, "disable_log_stats=False.*statistics"),
    (dict(tokenizer_mode="slow"), ValueError, "tokenizer_mode='slow'"),
    (dict(enable_lora=True, max_loras=0), ValueError, "max_loras=0: must be an int >= 1"),
    (dict(lora_target_modules=["q_proj"]), ValueError, "lora_target_modules"),
    (dict(enable_lora=True, lora_modules="a=/x"), ValueError,
     r"lora_modules=\.\.\.\) is not taken offline.*lora_request=LoRARequest"),
    (dict(cpu_offload_gb=4), ValueError, "cpu_offload_gb"),
    (dict(kv_offloading_size=-1.0), ValueError, "kv_offloading_size=-1.0: must be >= 0"),
    (dict(kv_offloading_backend="lmcache"), ValueError, "kv_offloading_backend='lmcache'"),
    (dict(num_gpu_blocks_override=1), ValueError, r"LLM\(num_gpu_blocks_override=...\): "
                                                  "num_pages=1"),
])
def test_kwargs_llm_cannot_honour_are_refused_by_name(kwargs, error, message):
    with pytest.raises(error, match=message):
        LLM("/no/such/model", **kwargs)   # refused before anything is loaded


def test_every_vllm_only_argument_has_a_value_it_takes():
    """vLLM's engine arguments without a jaxserve knob (the command line's table) and
    LLM's own: each takes a value that is true of jaxserve and passes nothing on."""
    taken = {name: s.taken for name, s in VLLM_ONLY.items() if s.holds(s.taken)}
    assert {"disable_log_stats", "tokenizer_mode", "cpu_offload_gb",
            "compilation_config", "hf_token", "enable_mm_embeds"} <= set(taken)
    assert engine_kwargs(taken) == {}
    assert not set(VLLM_ONLY) & {f.name for f in dataclasses.fields(EngineConfig)}


def test_block_size_reaches_the_engine(llm):
    assert llm.engine.info.page_size == 32
    assert llm.engine.info.config.max_logprobs == 30


# ---- max_logprobs ----------------------------------------------------------------------

def test_max_logprobs_raises_the_limit(llm):
    prompt = {"prompt_token_ids": _ids(12, seed=1)}
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, logprobs=25,
                                              prompt_logprobs=30), use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 3
    for token, lps in zip(c.token_ids, c.logprobs):
        assert token in lps and len(lps) in (25, 26)   # the top 25, plus the sampled one
        ranks = sorted(lp.rank for t, lp in lps.items() if lp.rank <= 25)
        assert ranks == list(range(1, 26))
    assert all(len(e) in (30, 31) for e in out.prompt_logprobs[1:])
    with pytest.raises(ValueError, match="logprobs=31 is more than this engine's "
                                         "max_logprobs=30"):
        llm.generate(prompt, SamplingParams(logprobs=31), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs=31"):
        llm.generate(prompt, SamplingParams(prompt_logprobs=31), use_tqdm=False)


def test_max_logprobs_minus_one_is_the_vocabulary(eager):
    vocab = eager.engine.info.vocab_size
    assert eager.engine.inputs.max_logprobs == vocab
    out = eager.generate({"prompt_token_ids": _ids(5, seed=2)},
                         SamplingParams(temperature=0.0, max_tokens=2, logprobs=vocab),
                         use_tqdm=False)[0]
    lps = out.outputs[0].logprobs[0]
    assert len(lps) == vocab
    assert np.isclose(sum(np.exp(lp.logprob) for lp in lps.values()), 1.0, atol=1e-4)
    with pytest.raises(ValueError, match=f"max_logprobs={vocab}"):
        eager.generate({"prompt_token_ids": [5]}, SamplingParams(logprobs=vocab + 1),
                       use_tqdm=False)


# ---- enforce_eager ---------------------------------------------------------------------

def test_enforce_eager_skips_warmup_and_matches(llm, eager):
    assert eager.engine.info.warmup_compilations == 0
    assert llm.engine.info.warmup_compilations > 0
    prompts = [{"prompt_token_ids": _ids(9 + 4 * i, seed=10 + i)} for i in range(3)]
    before = eager.engine.num_compilations
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want
    assert eager.engine.num_compilations > before    # it compiled on first use


# ---- TextPrompt / TokensPrompt and numpy ids ------------------------------------------

def test_prompt_types_and_numpy_ids(llm):
    ids = llm.get_tokenizer()("The sky is").input_ids
    outs = llm.generate([TextPrompt(prompt="The sky is"),
                         TokensPrompt(prompt_token_ids=ids),
                         TokensPrompt(prompt_token_ids=np.asarray(ids, np.int64)),
                         {"prompt_token_ids": [np.int32(t) for t in ids], "prompt": "txt"},
                         "The sky is"], GREEDY, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert all(o.prompt_token_ids == ids and type(o.prompt_token_ids[0]) is int for o in outs)
    assert [o.prompt for o in outs] == ["The sky is", None, None, "txt", "The sky is"]
    # numpy ids in the sampling parameters work as ints.
    first = outs[0].outputs[0].token_ids[0]
    stopped = llm.generate(TokensPrompt(prompt_token_ids=ids), SamplingParams(
        temperature=0.0, max_tokens=6, stop_token_ids=[np.int64(first)]), use_tqdm=False)[0]
    assert stopped.outputs[0].token_ids == [first]
    assert stopped.outputs[0].stop_reason == first
    biased = llm.generate(TokensPrompt(prompt_token_ids=ids), SamplingParams(
        temperature=0.0, max_tokens=1, logit_bias={np.int64(7): 100.0},
        allowed_token_ids=[np.int64(7), np.int32(9)]), use_tqdm=False)[0]
    assert biased.outputs[0].token_ids == [7]


@pytest.mark.parametrize("prompt, message", [
    (TokensPrompt(prompt_token_ids=[5], multi_modal_data={"image": 1}),
     "1 image\\(s\\), but this model .* takes text only"),
    ({"prompt": "hi", "cache_salt": ""}, "cache_salt must not be empty"),
    ({"prompt": "hi", "cache_salt": 7}, "cache_salt must be a string"),
    ({"prompt": "hi", "cache_salt": "s" * 1025}, "cache_salt has 1025 characters"),
    ({"prompt": "hi", "prompt_embeds": [0.0]}, "'prompt_embeds'"),
    ({"prompt_token_id": [5]}, "'prompt_token_id' is not one jaxserve knows"),
    ({}, "needs 'prompt'"),
])
def test_unknown_prompt_keys_are_refused(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, GREEDY, use_tqdm=False)


def test_cache_salt_keys_prefix_cache_hits(llm):
    """vLLM's prompt key: a prompt's cached pages serve only prompts of the same salt
    (block_size 32: the 40-token prompt has one full page to share)."""
    ids = _ids(40, seed=77)
    def run(salt):
        prompt = TokensPrompt(prompt_token_ids=ids) if salt is None else \
            TokensPrompt(prompt_token_ids=ids, cache_salt=salt)
        return llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    first = run("tenant-a")
    outs = [run(salt) for salt in ("tenant-b", None, "tenant-a", "tenant-b", None)]
    assert [o.num_cached_tokens for o in [first, *outs]] == [0, 0, 0, 32, 32, 32]
    assert len({tuple(o.outputs[0].token_ids) for o in [first, *outs]}) == 1
    text = llm.generate([TextPrompt(prompt="salted text", cache_salt="tenant-a")], GREEDY,
                        use_tqdm=False)[0]
    assert text.prompt == "salted text"


def test_chat_continue_final_message(llm):
    """The model goes on with the last message: the prompt stops inside it."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "It is"}]
    out = llm.chat(chat, GREEDY, use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)[0]
    want = llm.get_tokenizer().apply_chat_template(chat, continue_final_message=True,
                                                   tokenize=True, return_dict=False)
    assert out.prompt_token_ids == list(want)
    closed = llm.chat(chat, GREEDY, use_tqdm=False, add_generation_prompt=False)[0]
    assert len(closed.prompt_token_ids) > len(want)
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(chat, GREEDY, use_tqdm=False, continue_final_message=True)


# ---- the tqdm bar ----------------------------------------------------------------------

class _Recording(tqdm):
    made: list = []

    def __init__(self, *args, **kwargs):
        kwargs["file"] = io.StringIO()
        super().__init__(*args, **kwargs)
        self.postfixes: list[str] = []
        _Recording.made.append(self)

    def update(self, n=1):
        self.postfixes.append(self.postfix)
        return super().update(n)


def test_progress_bar_shows_prompts_and_token_speeds(llm):
    _Recording.made.clear()
    prompts = [{"prompt_token_ids": _ids(6 + i, seed=20 + i)} for i in range(3)]
    llm.generate(prompts, GREEDY, use_tqdm=_Recording)
    (bar,) = _Recording.made
    assert bar.desc == "Processed prompts" and bar.total == 3 and bar.n == 3
    speed = re.compile(r"est\. speed input: ([\d.]+) toks/s, output: ([\d.]+) toks/s")
    assert len(bar.postfixes) == 3
    inputs, outputs = zip(*(map(float, speed.fullmatch(p).groups()) for p in bar.postfixes))
    assert min(inputs) > 0 and min(outputs) > 0
    # The real class writes the same bar; chat takes use_tqdm too.
    out = io.StringIO()
    llm.chat([{"role": "user", "content": "hi"}], GREEDY,
             use_tqdm=functools.partial(tqdm, file=out))
    assert "Processed prompts" in out.getvalue() and "est. speed input:" in out.getvalue()


# ---- best_of ---------------------------------------------------------------------------

def test_best_of_returns_the_n_most_likely_samples(llm):
    prompt = {"prompt_token_ids": _ids(7, seed=3)}
    sampled = dict(temperature=1.0, seed=11, max_tokens=5, ignore_eos=True)
    # The same four samples (children seeded seed+i), all returned and then ranked.
    every = llm.generate(prompt, SamplingParams(n=4, logprobs=0, **sampled),
                         use_tqdm=False)[0].outputs
    assert len({tuple(c.token_ids) for c in every}) > 1
    best = llm.generate(prompt, SamplingParams(n=2, best_of=4, **sampled),
                        use_tqdm=False)[0].outputs
    ranked = sorted(every, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.index for c in best] == [0, 1]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    assert [c.cumulative_logprob for c in best] == \
        pytest.approx([c.cumulative_logprob for c in ranked], abs=1e-5)
    assert all(c.logprobs is None for c in best)     # not asked for
    with_lps = llm.generate(prompt, SamplingParams(n=1, best_of=4, logprobs=2, **sampled),
                            use_tqdm=False)[0].outputs
    assert with_lps[0].token_ids == ranked[0].token_ids and len(with_lps[0].logprobs) == 5
    # best_of == n is plain n.
    same = llm.generate(prompt, SamplingParams(n=4, best_of=4, **sampled), use_tqdm=False)[0]
    assert [c.token_ids for c in same.outputs] == [c.token_ids for c in every]


# ---- truncate_prompt_tokens ------------------------------------------------------------

def test_truncate_prompt_tokens_keeps_the_tail(llm):
    long = _ids(100, seed=4)        # longer than max_model_len=64
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": long}, GREEDY, use_tqdm=False)
    cut = llm.generate({"prompt_token_ids": long},
                       dataclasses.replace(GREEDY, truncate_prompt_tokens=10), use_tqdm=False)[0]
    tail = llm.generate({"prompt_token_ids": long[-10:]}, GREEDY, use_tqdm=False)[0]
    assert cut.prompt_token_ids == long[-10:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    short = llm.generate({"prompt_token_ids": long[:20]},
                         SamplingParams(max_tokens=2, truncate_prompt_tokens=-1),
                         use_tqdm=False)[0]
    assert short.prompt_token_ids == long[:20]
    # -1 keeps max_model_len tokens, which then leave no room (as vLLM).
    with pytest.raises(ValueError, match="the prompt has 64 tokens"):
        llm.generate({"prompt_token_ids": long}, SamplingParams(truncate_prompt_tokens=-1),
                     use_tqdm=False)


# ---- output_kind on a stream -----------------------------------------------------------

@pytest.fixture(scope="module")
def stream_engine(checkpoint):
    engine = AsyncEngine(EngineConfig(model=checkpoint("qwen3"), page_size=32, **SIZES))
    yield engine
    engine.shutdown()


def _stream(engine: AsyncEngine, rid: str, prompt, params) -> list:
    async def run():
        return [out async for out in engine.generate(engine.inputs.process(rid, prompt,
                                                                           params))]
    return asyncio.run(asyncio.wait_for(run(), timeout=120))


def test_output_kinds_on_a_stream(stream_engine, llm):
    prompt = "The sky is"
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    final = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    kind = RequestOutputKind
    cumulative = _stream(stream_engine, "c", prompt, params)     # the default kind
    assert len(cumulative) > 1 and cumulative[-1].finished
    assert not any(o.finished for o in cumulative[:-1])
    ids = [o.outputs[0].token_ids for o in cumulative]
    assert all(a == b[:len(a)] and len(a) < len(b) for a, b in zip(ids, ids[1:]))
    last = cumulative[-1].outputs[0]
    assert (last.token_ids, last.text) == (final.token_ids, final.text)
    assert len(last.logprobs) == len(last.token_ids)
    assert len(cumulative[0].outputs[0].logprobs) == len(ids[0])   # not grown since

    delta = _stream(stream_engine, "d", prompt, dataclasses.replace(params,
                                                                  output_kind=kind.DELTA))
    assert len(delta) > 1
    assert sum((o.outputs[0].token_ids for o in delta if o.outputs), []) == final.token_ids
    assert "".join(o.outputs[0].text for o in delta if o.outputs) == final.text
    assert sum(len(o.outputs[0].logprobs) for o in delta if o.outputs) == len(final.token_ids)

    (only,) = _stream(stream_engine, "f", prompt,
                      dataclasses.replace(params, output_kind=kind.FINAL_ONLY))
    assert only.finished and only.outputs[0].token_ids == final.token_ids
    assert only.outputs[0].text == final.text

    # best_of > n streams only the final, ranked output.
    ranked = _stream(stream_engine, "b", prompt, SamplingParams(
        n=1, best_of=3, temperature=1.0, seed=5, max_tokens=4, output_kind=kind.DELTA))
    assert len(ranked) == 1 and ranked[0].finished and len(ranked[0].outputs) == 1
