"""Speculative decoding (ngram prompt lookup) changes no output: each kind of model
(dense, MoE, Qwen3.5 hybrid) runs the same requests on a plain engine and on one that
verifies drafts, and the tokens (and logprobs, texts, finish reasons) are the same --
for greedy requests and, since a draft's position samples with the key of its token
index, for seeded sampling too. The prompts repeat a short random pattern, so the
proposer drafts; every test checks that drafts were verified and some accepted (it
cannot pass with speculation idle), that nothing compiled after warmup and that every
page and state slot is given back."""
from __future__ import annotations

import contextlib
import random
from collections import defaultdict

import pytest
import torch

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoints.tiny_tokenizer import make_tiny_tokenizer
from jaxserve.structured_outputs import StructuredOutputsParams as SO
from tests.checkpoints import make_tiny_model
from tests.engine.conftest import assert_no_leaks, run_staggered

# Each engine costs its warmup: the dense model runs every scenario; the hybrid (state
# backup and rollback, snapshots) those that touch its recurrent state; the MoE (tokens
# routed per position) those where several positions of a row are computed at once.
ALL = ("llama", "qwen3_moe", "qwen3_5")
DENSE_AND_HYBRID = ("llama", "qwen3_5")
DENSE = ("llama",)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5,
        "prompt_lookup_min": 2}
# 23 usable pages of 16 tokens: four requests of ~130 tokens do not fit (preemption).
ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
              num_pages=24, compilation_cache_dir=None)
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
# The tiny random models' next-token distributions are almost flat (top logprob ~ -5 of
# 256): sampled outputs would never repeat, so nothing would be drafted. Their lm_head is
# scaled so that at temperature 0.8 the top token has probability ~0.6 (greedy outputs are
# those of the unscaled model).
LOGIT_SCALE = 25.0


def peaked_checkpoint(kind: str, path) -> str:
    model = make_tiny_model(kind)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(LOGIT_SCALE)
    model.save_pretrained(str(path), safe_serialization=True)
    make_tiny_tokenizer(str(path))
    return str(path)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """kind -> (plain LLM, speculative LLM), built once for this module's tests. The plain
    engine only gives the reference outputs: it skips warmup and compiles what its
    requests use (enforce_eager); the speculative one warms up (nothing compiles after)."""
    made: dict[str, tuple[LLM, LLM]] = {}

    def get(kind: str) -> tuple[LLM, LLM]:
        if kind not in made:
            path = peaked_checkpoint(kind, tmp_path_factory.mktemp(kind))
            made[kind] = (LLM(path, enforce_eager=True, **ENGINE),
                          LLM(path, speculative_config=SPEC, **ENGINE))
            for llm in made[kind]:
                fail_if_stuck(llm.engine)
        return made[kind]
    return get


def fail_if_stuck(engine, limit: int = 3000) -> None:
    """engine.step raises once it has run `limit` steps without the engine emptying (a
    request that never advances would make generate() loop for ever)."""
    step, busy = engine.step, [0]

    def guarded():
        busy[0] += 1
        if busy[0] > limit:
            busy[0] = 0
            raise AssertionError(f"{limit} steps and the requests are not done: stuck")
        out = step()
        if not engine.has_unfinished_requests():
            busy[0] = 0
        return out
    engine.step = guarded


@pytest.fixture
def pair(request, engines):
    """The engines of the kind a test is parametrized with (indirect)."""
    return engines(request.param)


def kinds(*names: str):
    return pytest.mark.parametrize("pair", names, indirect=True)


def is_hybrid(llm: LLM) -> bool:
    return llm.engine.scheduler.kv.state_slots is not None


def repetitive(rng: random.Random, n: int) -> list[int]:
    """A random pattern of 6-10 tokens repeated to n tokens, after a random prefix."""
    pattern = [rng.randrange(3, 256) for _ in range(rng.randint(6, 10))]
    prefix = [rng.randrange(3, 256) for _ in range(rng.randint(0, 8))]
    body = pattern * (n // len(pattern) + 1)
    return (prefix + body)[:n]


def prompts_of(seed: int, count: int, lo: int = 12, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [repetitive(rng, rng.randint(lo, hi)) for _ in range(count)]


def generate(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.finished and getattr(o, "error", None) is None for o in outs)
    return outs


def tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


@contextlib.contextmanager
def speculating(plain: LLM, spec: LLM, *, min_accepted: int = 1):
    """Around a test's runs: drafts were verified and at least min_accepted accepted; no
    program compiled but in the plain engine's steps (it compiles on first use, and the
    count is the process's); both engines gave back every page and state slot."""
    sched = spec.engine.scheduler
    before = sched.stats()
    compiled = spec.engine.num_compilations
    plain_step, by_plain = plain.engine.step, [0]

    def counted():
        start = plain.engine.num_compilations
        try:
            return plain_step()
        finally:
            by_plain[0] += plain.engine.num_compilations - start
    plain.engine.step = counted
    try:
        yield
    finally:
        plain.engine.step = plain_step
    compiled += by_plain[0]
    after = sched.stats()
    assert after.spec_num_drafts > before.spec_num_drafts
    assert after.spec_num_draft_tokens > before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert accepted >= min_accepted, (before, after)
    assert after.spec_num_accepted_tokens <= after.spec_num_draft_tokens
    assert sum(after.spec_accepted_per_pos) == after.spec_num_accepted_tokens
    assert spec.engine.num_compilations == compiled, "something compiled after warmup"
    assert plain.engine.scheduler.stats().spec_num_drafts == 0
    assert_no_leaks(plain.engine)
    assert_no_leaks(spec.engine)


@contextlib.contextmanager
def recording(llm: LLM):
    """-> {request id: the tokens each step gave it, a list per step} while it is open
    (what the runner returned: tokens after a stop are still there)."""
    runner = llm.engine.runner
    steps: dict[str, list[list[int]]] = defaultdict(list)
    collect = runner.collect

    def record(step):
        out = collect(step)
        for rid, t in out.sampled.items():
            steps[rid].append(t if isinstance(t, list) else [t])
        return out
    runner.collect = record
    try:
        yield steps
    finally:
        del runner.collect


def accepted_positions(steps: list[list[int]]) -> list[int]:
    """Output positions whose token was an accepted draft with more tokens after it in
    the same step."""
    out, at = [], 0
    for toks in steps:
        out += range(at, at + len(toks) - 1)
        at += len(toks)
    return out


_LOOPING: dict[tuple, list[list[int]]] = {}


def looping_prompts(llm: LLM, seed: int, count: int) -> list[list[int]]:
    """Repetitive prompts followed by their first 64 greedy tokens: by then most outputs
    have fallen into a loop of a few tokens that their continuations keep to, so they are
    drafted (from the prompt) from the first decode step on, and a token's first
    appearance in an output can be an accepted draft."""
    key = (llm.engine.config.model, seed, count)
    if key not in _LOOPING:
        base = prompts_of(seed, count, lo=16, hi=40)
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        _LOOPING[key] = [p + t[0] for p, t in zip(base, tokens(generate(llm, base, params)))]
    return _LOOPING[key]


# ---- 1. greedy, continuous batching ------------------------------------------------------
@pytest.mark.parametrize("pair, every", [("llama", 1), ("llama", 3), ("qwen3_moe", 2),
                                         ("qwen3_5", 2)], indirect=["pair"])
def test_greedy_staggered_arrivals(pair, every):
    """Requests join a running batch every `every` steps: repetitive prompts (drafts mostly
    accepted) and random ones (drafts from the outputs' own loops, often rejected: the
    rollback of KV positions and of a hybrid's state runs)."""
    plain, spec = pair
    rng = random.Random(every)
    prompts = prompts_of(every, 6) + [[rng.randrange(3, 256) for _ in range(rng.randint(5, 40))]
                                      for _ in range(3)]
    rng.shuffle(prompts)
    before = spec.engine.scheduler.stats()
    with speculating(plain, spec, min_accepted=10):
        want = run_staggered(plain.engine, prompts, GREEDY, every)
        got = run_staggered(spec.engine, prompts, GREEDY, every)
    after = spec.engine.scheduler.stats()
    assert len(want) == len(prompts)
    assert got == want
    assert all(len(t) == GREEDY.max_tokens for t in got.values())
    rejected = ((after.spec_num_draft_tokens - before.spec_num_draft_tokens)
                - (after.spec_num_accepted_tokens - before.spec_num_accepted_tokens))
    assert rejected > 0


# ---- 2. preemption ---------------------------------------------------------------------
@kinds(*DENSE_AND_HYBRID)
def test_preemption(pair):
    """Four requests of ~130 tokens in a pool of 23 pages: some are preempted mid-output
    (drafts and a hybrid's backup dropped) and recomputed."""
    plain, spec = pair
    prompts = prompts_of(21, 5, lo=60, hi=90)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    preempted = spec.engine.scheduler.num_preemptions
    with speculating(plain, spec, min_accepted=10):
        want = generate(plain, prompts, params)
        got = generate(spec, prompts, params)
    assert spec.engine.scheduler.num_preemptions > preempted
    assert tokens(got) == tokens(want)


# ---- 3. prefix-cache hits ----------------------------------------------------------------
@kinds(*DENSE_AND_HYBRID)
def test_shared_prefix_hits(pair):
    plain, spec = pair
    for llm in pair:   # (a hybrid's snapshots of earlier tests could crowd out new ones)
        llm.reset_prefix_cache()
    rng = random.Random(31)
    system = repetitive(rng, 50)
    prompts = [system + repetitive(rng, rng.randint(4, 20)) for _ in range(4)]
    with speculating(plain, spec):
        want = [tokens(generate(plain, [p], GREEDY))[0] for p in prompts]
        got, hits = [], []
        for p in prompts:   # one after another: the later ones find the system prompt
            out = generate(spec, [p], GREEDY)[0]
            got.append([c.token_ids for c in out.outputs])
            hits.append(out.num_cached_tokens)
    assert got == want
    assert all(h >= 32 for h in hits[2:]), hits


@kinds(*DENSE_AND_HYBRID)
def test_multi_turn_reuses_pages_written_while_speculating(pair):
    """Each turn's prompt is the previous prompt, its answer (computed as accepted drafts)
    and a new message: the hits include the speculated answer's pages (a hybrid's only up
    to its last state snapshot: none is taken after a step that verified drafts)."""
    plain, spec = pair
    for llm in pair:
        llm.reset_prefix_cache()
    rng = random.Random(37)
    history = repetitive(rng, 30)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    previous_prompt = previous = 0
    with speculating(plain, spec, min_accepted=5):
        for turn in range(4):
            want = tokens(generate(plain, [history], params))[0][0]
            out = generate(spec, [history], params)[0]
            assert out.outputs[0].token_ids == want, turn
            if turn:
                hit = out.num_cached_tokens
                assert hit >= (previous_prompt // 16 * 16 if is_hybrid(spec)
                               else previous - 16), (turn, hit, previous)
            previous_prompt = len(history)
            previous = len(history) + len(want) - 1   # (its last token was not computed)
            history = history + want + repetitive(rng, rng.randint(3, 12))


# ---- 4. seeded sampling and logprobs -------------------------------------------------------
@kinds(*ALL)
def test_seeded_sampling_with_logprobs(pair):
    plain, spec = pair
    prompts = prompts_of(41, 6)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=32,
                             ignore_eos=True, logprobs=2) for i in range(len(prompts))]
    with speculating(plain, spec, min_accepted=5):
        want = generate(plain, prompts, params)
        got = generate(spec, prompts, params)
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        assert len(g.logprobs) == len(g.token_ids) == len(w.logprobs)
        for tok, lg, lw in zip(g.token_ids, g.logprobs, w.logprobs):
            assert tok in lg and set(lg) == set(lw)
            for t in lg:
                assert abs(lg[t].logprob - lw[t].logprob) < 1e-4
                assert lg[t].rank == lw[t].rank
        assert abs(g.cumulative_logprob - w.cumulative_logprob) < 1e-3


@kinds(*DENSE_AND_HYBRID)
def test_seeded_sampling_n2(pair):
    plain, spec = pair
    prompts = prompts_of(43, 3)
    params = SamplingParams(n=2, temperature=0.8, top_k=20, seed=7, max_tokens=24,
                            ignore_eos=True)
    with speculating(plain, spec):
        want = generate(plain, prompts, params)
        got = generate(spec, prompts, params)
    assert tokens(got) == tokens(want)
    assert all(len(o.outputs) == 2 for o in got)
    assert any(o.outputs[0].token_ids != o.outputs[1].token_ids for o in got)


# ---- 5. max_tokens and max_model_len inside an accepted run --------------------------------
@kinds(*DENSE_AND_HYBRID)
def test_max_tokens_inside_an_accepted_run(pair):
    plain, spec = pair
    prompts = looping_prompts(plain, 61, 8)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (1, 2, 3, 4, 5, 7, 9, 12)]
    with speculating(plain, spec, min_accepted=5), recording(spec) as steps:
        want = generate(plain, prompts, params)
        got = generate(spec, prompts, params)
    assert tokens(got) == tokens(want)
    for o, p in zip(got, params):
        assert len(o.outputs[0].token_ids) == p.max_tokens
        assert o.outputs[0].finish_reason == "length"
    # Some requests reached max_tokens with drafts accepted in their last step.
    assert sum(len(steps[o.request_id][-1]) > 1 for o in got) >= 2


@kinds(*DENSE)
def test_max_model_len_inside_an_accepted_run(pair):
    plain, spec = pair
    max_len = ENGINE["max_model_len"]
    prompts = [repetitive(random.Random(i), max_len - n) for i, n in enumerate((2, 3, 5, 9, 14))]
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    with speculating(plain, spec):
        want = generate(plain, prompts, params)
        got = generate(spec, prompts, params)
    assert tokens(got) == tokens(want)
    for o, p in zip(got, prompts):
        assert len(p) + len(o.outputs[0].token_ids) == max_len
        assert o.outputs[0].finish_reason == "length"


# ---- 6. stop tokens and stop strings -----------------------------------------------------
@kinds(*DENSE_AND_HYBRID)
def test_stop_token_ids_inside_an_accepted_run(pair):
    """Each request stops at a token that, run freely, was an accepted draft with more
    tokens after it: those are dropped, as one-at-a-time decoding never samples them."""
    plain, spec = pair
    prompts = looping_prompts(plain, 61, 8)
    with recording(spec) as steps:
        free = generate(spec, prompts, GREEDY)
    params = []
    for o in free:
        toks = o.outputs[0].token_ids
        inside = accepted_positions(steps[o.request_id])
        first = [p for p in inside if toks.index(toks[p]) == p]
        stop = toks[(first or inside or [len(toks) - 1])[0]]
        # (eos still ignored, as in the free run: the stop id must be what ends it)
        params.append(SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[stop],
                                     ignore_eos=True))
    with speculating(plain, spec), recording(spec) as steps:
        want = generate(plain, prompts, params)
        got = generate(spec, prompts, params)
    assert tokens(got) == tokens(want)
    dropped = 0
    for g, w, p in zip(got, want, params):
        dropped += sum(map(len, steps[g.request_id])) > len(g.outputs[0].token_ids)
        g, w = g.outputs[0], w.outputs[0]
        assert (g.finish_reason, g.stop_reason, g.text) == (w.finish_reason, w.stop_reason,
                                                            w.text)
        assert g.finish_reason == "stop" and g.stop_reason == p.stop_token_ids[0]
        assert g.token_ids[-1] == p.stop_token_ids[0]
    assert dropped >= 2


@pytest.mark.parametrize("include", [False, True])
@kinds(*DENSE)
def test_stop_strings_inside_an_accepted_run(pair, include):
    """Stop strings the free output's text completes at an accepted draft."""
    plain, spec = pair
    tok = plain.get_tokenizer()
    prompts = looping_prompts(plain, 71, 10)
    with recording(spec) as steps:
        free = generate(spec, prompts, GREEDY)
    params = []
    for o in free:
        toks, stop = o.outputs[0].token_ids, None
        for p in accepted_positions(steps[o.request_id]):
            before, text = tok.decode(toks[:p]), tok.decode(toks[:p + 1])
            # The token adds text, and the string made of its last two characters does
            # not occur any earlier.
            if len(text) > len(before) and text.startswith(before) and \
                    "\ufffd" not in text and text[-2:] not in text[:-1]:
                stop = text[-2:]
                break
        params.append(SamplingParams(temperature=0.0, max_tokens=32, stop=[stop or "@@@"],
                                     include_stop_str_in_output=include, logprobs=1))
    with speculating(plain, spec), recording(spec) as steps:
        want = generate(plain, prompts, params)
        got = generate(spec, prompts, params)
    dropped = 0
    for g, w, p in zip(got, want, params):
        dropped += sum(map(len, steps[g.request_id])) > len(g.outputs[0].token_ids)
        g, w = g.outputs[0], w.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == \
            (w.token_ids, w.text, w.finish_reason, w.stop_reason)
        if g.finish_reason == "stop":
            assert g.stop_reason == p.stop[0]
            assert g.text.endswith(p.stop[0]) == include
        # A logprob per token kept (none for the tokens dropped after the stop).
        assert len(g.logprobs) == len(g.token_ids)
        assert [sorted(d) for d in g.logprobs] == [sorted(d) for d in w.logprobs]
        assert abs(g.cumulative_logprob - w.cumulative_logprob) < 1e-3
    assert dropped >= 3


# ---- 7. structured outputs ---------------------------------------------------------------
@pytest.mark.parametrize("so", [
    SO(regex=r"(ab|cd|ef)+x"),
    SO(json={"type": "object", "properties": {"k": {"type": "array", "maxItems": 12,
                                                   "items": {"enum": ["ab", "abab", "c"]}}},
             "required": ["k"], "additionalProperties": False},
       disable_any_whitespace=True),
], ids=["regex", "json"])
@kinds(*DENSE)
def test_structured_outputs(pair, so):
    plain, spec = pair
    tok = plain.get_tokenizer()
    texts = ['{"k":["ab","ab","abab","ab","ab"]} ababab cdcd efef', "abababcdcdcdcdababef",
             '["abab","abab","abab","c","c","c"]']
    prompts = [tok(t, add_special_tokens=False).input_ids for t in texts]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so)] + \
        [SamplingParams(temperature=t, seed=s, max_tokens=60, structured_outputs=so)
         for t, s in ((0.7, 1), (1.0, 2))]
    with speculating(plain, spec):
        want = generate(plain, prompts * 2, params * 2)
        got = generate(spec, prompts * 2, params * 2)
    assert tokens(got) == tokens(want)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert [o.outputs[0].finish_reason for o in got] == \
        [o.outputs[0].finish_reason for o in want]


@kinds(*DENSE)
def test_bad_words_and_allowed_tokens(pair):
    """Token constraints whose mask follows the output (bad_words) and fixed ones."""
    plain, spec = pair
    tok = plain.get_tokenizer()
    ids = [tok(c, add_special_tokens=False).input_ids[0] for c in "abcx"]
    prompts = [ids[:3] * 10, ids[:2] * 12 + ids[2:] * 3]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                             allowed_token_ids=ids, bad_words=["ab", "xc"]),
              SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True,
                             allowed_token_ids=ids, bad_words=["ba"])]
    with speculating(plain, spec):
        want = generate(plain, prompts * 2, params * 2)
        got = generate(spec, prompts * 2, params * 2)
    assert tokens(got) == tokens(want)


# ---- 8. min_tokens with eos, penalties -----------------------------------------------------
@kinds(*DENSE)
def test_min_tokens_with_eos(pair):
    """eos is made likely (logit bias) and held back for the first min_tokens outputs: each
    position of a verified window is held back by its own output index, so eos comes right
    after min_tokens even where that is in the middle of a window of accepted drafts."""
    plain, spec = pair
    eos = plain.engine.info.eos_token_id
    prompts = looping_prompts(plain, 61, 8)
    mins = (0, 1, 2, 3, 4, 5, 7, 10)
    params = [SamplingParams(temperature=0.0, min_tokens=m, max_tokens=40,
                             logit_bias={eos: 100.0}) for m in mins[:-1]] + \
        [SamplingParams(temperature=0.8, seed=5, min_tokens=mins[-1], max_tokens=40,
                        logit_bias={eos: 4.0})]
    with speculating(plain, spec), recording(spec) as steps:
        want = generate(plain, prompts, params)
        got = generate(spec, prompts, params)
    assert tokens(got) == tokens(want)
    for o, p in zip(got[:-1], params):
        c = o.outputs[0]
        assert len(c.token_ids) == p.min_tokens + 1 and c.token_ids[-1] == eos
        assert c.finish_reason == "stop"
    assert [o.outputs[0].finish_reason for o in got] == \
        [o.outputs[0].finish_reason for o in want]
    # eos after accepted drafts, in the same step
    assert sum(len(steps[o.request_id][-1]) > 1 for o in got[:-1]) >= 2


@kinds(*DENSE)
def test_penalties(pair):
    """Penalties count the drafts before each position of a window as outputs (mild ones:
    the outputs still loop, so drafts are accepted, and the counts decide some tokens)."""
    plain, spec = pair
    prompts = looping_prompts(plain, 61, 8)
    settings = [dict(repetition_penalty=1.2, frequency_penalty=0.5),
                dict(frequency_penalty=0.2), dict(presence_penalty=1.0),
                dict(temperature=0.8, seed=9, frequency_penalty=0.5)]
    params = [SamplingParams(**{"temperature": 0.0, "max_tokens": 32, "ignore_eos": True,
                                **kw}) for kw in settings for _ in prompts]
    with speculating(plain, spec, min_accepted=20):
        want = generate(plain, prompts * len(settings), params)
        got = generate(spec, prompts * len(settings), params)
    assert tokens(got) == tokens(want)
