"""Engine behaviour beyond greedy parity: prefix caching, sampling features, preemption."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxserve import LLM, SamplingParams
from tests.engine.conftest import assert_no_leaks

PAGE = 16


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("qwen3"), dtype="float32", max_model_len=160, max_num_seqs=8,
               max_num_batched_tokens=64, page_size=PAGE)


@pytest.fixture(autouse=True)
def _no_leaks(request):
    yield
    if "llm" in request.fixturenames:
        assert_no_leaks(request.getfixturevalue("llm").engine)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


def test_prefix_cache_computes_only_the_tail(llm):
    engine = llm.engine
    prompt = _ids(100, seed=1)       # 6 full pages + 4 tokens
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = engine.num_scheduled_tokens
    first = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    first_cost = engine.num_scheduled_tokens - before
    assert first_cost == 100 + 8 - 1           # prompt, then one token per decode step
    before = engine.num_scheduled_tokens
    second = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    second_cost = engine.num_scheduled_tokens - before
    assert second.num_cached_tokens == 96      # the 6 full pages
    assert second_cost == (100 - 96) + 8 - 1   # only the uncached tail is computed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    # After reset_prefix_cache the same prompt is computed in full again.
    assert llm.reset_prefix_cache() is True
    before = engine.num_scheduled_tokens
    third = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert third.num_cached_tokens == 0
    assert engine.num_scheduled_tokens - before == first_cost
    assert third.outputs[0].token_ids == first.outputs[0].token_ids


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12)
    prompt = {"prompt_token_ids": _ids(20, seed=2)}
    alone = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": _ids(n, seed=n)} for n in (7, 30, 45)]
    batch = llm.generate(others[:2] + [prompt] + others[2:],
                         [SamplingParams(temperature=0.7, max_tokens=15)] * 2 + [params]
                         + [SamplingParams(temperature=0.0, max_tokens=9)], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    other_seed = llm.generate(prompt, SamplingParams(temperature=1.0, top_p=0.9, top_k=50,
                                                     seed=99, max_tokens=12), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_completions_share_the_prompt_pages(llm):
    engine = llm.engine
    prompt = _ids(64, seed=3)          # exactly 4 pages
    before = engine.num_scheduled_tokens
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5,
                                      ignore_eos=True), use_tqdm=False)[0]
    cost = engine.num_scheduled_tokens - before
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1   # different samples
    # The first completion computes the prompt; the others reuse 3 of its 4 pages
    # (the last page holds the token whose logits they need).
    assert cost == 64 + 2 * (64 - 48) + 3 * 4


def test_logprobs_and_prompt_logprobs_match_torch(llm, checkpoint):
    prompt = _ids(24, seed=4)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=4, logprobs=3,
                                      prompt_logprobs=2, ignore_eos=True),
                       use_tqdm=False)[0]
    comp = out.outputs[0]
    model = AutoModelForCausalLM.from_pretrained(checkpoint("qwen3"), dtype=torch.float32)
    full = torch.tensor([prompt + comp.token_ids])
    with torch.inference_mode():
        ref = torch.log_softmax(model(full).logits[0].float(), -1).numpy()
    # Sampled tokens: each dict holds the chosen token (rank 1 when greedy) + top 3.
    for j, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert tok in entry and entry[tok].rank == 1
        assert len(entry) == 3
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t]) < 1e-4
        top = np.argsort(-row)[:3]
        assert set(entry) == set(top.tolist())
    assert abs(comp.cumulative_logprob - sum(e[t].logprob for t, e in
                                             zip(comp.token_ids, comp.logprobs))) < 1e-5
    # Prompt logprobs: None for the first token, then the prompt token + top 2.
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(prompt)
    for pos in range(1, len(prompt)):
        entry, row = plp[pos], ref[pos - 1]
        assert abs(entry[prompt[pos]].logprob - row[prompt[pos]]) < 1e-4
        assert entry[prompt[pos]].rank == int((row > row[prompt[pos]]).sum()) + 1
        for t in np.argsort(-row)[:2]:
            assert int(t) in entry


def test_prompt_logprobs_in_chunks_skip_the_chunks_without_targets(checkpoint, monkeypatch):
    """One prompt-logprobs program over the largest token bucket, PROMPT_LOGPROBS_CHUNK
    tokens at a time (16 here: 4 chunks of a 64-token step): the first request asks for
    none, so chunk 0 is skipped and the second's 30 prompt tokens span chunks 1-3."""
    from jaxserve.runner import model_runner
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_CHUNK", 16)
    small = LLM(checkpoint("qwen3"), dtype="float32", max_model_len=96, max_num_seqs=4,
                max_num_batched_tokens=64, page_size=PAGE, enforce_eager=True)
    first, second = _ids(20, seed=11), _ids(30, seed=12)
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    outs = small.generate([{"prompt_token_ids": first}, {"prompt_token_ids": second}],
                          [plain, SamplingParams(temperature=0.0, max_tokens=1,
                                                 prompt_logprobs=1)], use_tqdm=False)
    assert small.engine.num_steps == 1            # both prompts in one 64-token step
    assert outs[0].prompt_logprobs is None
    model = AutoModelForCausalLM.from_pretrained(checkpoint("qwen3"), dtype=torch.float32)
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([second])).logits[0].float(), -1).numpy()
    plp = outs[1].prompt_logprobs
    assert plp[0] is None and len(plp) == len(second)
    for pos in range(1, len(second)):
        got = plp[pos][second[pos]]
        assert abs(got.logprob - ref[pos - 1, second[pos]]) < 1e-4, pos
        assert got.rank == int((ref[pos - 1] > ref[pos - 1, second[pos]]).sum()) + 1


def test_prompt_logprobs_are_complete_even_when_the_prompt_is_cached(llm):
    prompt = {"prompt_token_ids": _ids(40, seed=8)}
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    first = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2),
                         use_tqdm=False)[0]      # fills the prefix cache
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0          # prompt logprobs need every position
    assert again.prompt_logprobs[0] is None
    assert all(e is not None for e in again.prompt_logprobs[1:])
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_stop_strings_stop_tokens_and_eos(llm):
    tok = llm.get_tokenizer()
    prompt = {"prompt_token_ids": _ids(10, seed=5)}
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40,
                                               ignore_eos=True), use_tqdm=False)[0].outputs[0]
    text = free.text
    assert text == tok.decode(free.token_ids, skip_special_tokens=True)
    # A stop string taken from the middle of the free-running text.
    stop = text[len(text) // 2: len(text) // 2 + 3]
    if not stop.strip():
        pytest.skip("random text has no usable stop string")   # pragma: no cover
    cut = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop],
                                              ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[:text.index(stop)]
    kept = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop],
                                               include_stop_str_in_output=True,
                                               ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:text.index(stop) + len(stop)]
    # A stop token id: the 5th generated token.
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    by_id = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40,
                                                stop_token_ids=[stop_id], ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    assert by_id.token_ids == free.token_ids[:first + 1]
    # min_tokens: the stop token cannot be sampled among the first min_tokens outputs.
    later = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40,
                                                stop_token_ids=[stop_id], min_tokens=first + 1,
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert later.token_ids[:first] == free.token_ids[:first]
    assert stop_id not in later.token_ids[:first + 1]
    assert len(later.token_ids) > first + 1


def test_penalties_change_greedy_output(llm):
    prompt = {"prompt_token_ids": _ids(12, seed=6)}
    plain = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30,
                                                ignore_eos=True), use_tqdm=False)[0]
    rep = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30,
                                              repetition_penalty=2.0, frequency_penalty=1.5,
                                              ignore_eos=True), use_tqdm=False)[0]
    ids_plain, ids_rep = plain.outputs[0].token_ids, rep.outputs[0].token_ids
    assert ids_plain != ids_rep
    repeats = lambda ids: len(ids) - len(set(ids))  # noqa: E731
    assert repeats(ids_rep) <= repeats(ids_plain)


def test_text_prompts_and_chat(llm):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = llm.generate(["Hello", "The capital of France is"], params, use_tqdm=False)
    assert [o.prompt for o in out] == ["Hello", "The capital of France is"]
    assert out[1].prompt_token_ids == tok("The capital of France is").input_ids
    msgs = [{"role": "user", "content": "hi there"}]
    chat = llm.chat(msgs, params, use_tqdm=False)[0]
    want_ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
    assert chat.prompt_token_ids == want_ids
    same = llm.generate({"prompt_token_ids": want_ids}, params, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == same.outputs[0].token_ids


def test_preemption_gives_identical_output(checkpoint):
    # 12 usable pages of 16 tokens; 4 requests that each grow to 3+ pages must
    # take turns: the scheduler preempts and later recomputes them.
    path = checkpoint("llama")
    prompts = [{"prompt_token_ids": _ids(30 + 5 * i, seed=10 + i)} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    roomy = LLM(path, dtype="float32", max_model_len=96, max_num_seqs=4,
                max_num_batched_tokens=32, enforce_eager=True)   # (tokens only: no warmup)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(path, dtype="float32", max_model_len=96, max_num_seqs=4,
                max_num_batched_tokens=32, num_pages=13, enable_prefix_caching=False,
                enforce_eager=True)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == want
    assert_no_leaks(tight.engine)
    assert_no_leaks(roomy.engine)


def test_chat_gives_the_template_tools_and_tool_calls(llm):
    """LLM.chat(tools=...) as vLLM's; an assistant's tool call reaches the template with
    its JSON arguments as an object (templates iterate or dump them)."""
    template = ("{% for t in tools %}{{ t.function.name }};{% endfor %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}[{{ c.function.arguments.city }}]"
                "{% endfor %}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out = llm.chat(history, SamplingParams(max_tokens=1), chat_template=template, tools=tools,
                   add_generation_prompt=False, use_tqdm=False)[0]
    text = llm.get_tokenizer().decode(out.prompt_token_ids)
    assert "get_weather;" in text and "assistant:[Paris]" in text and "tool:sunny" in text
