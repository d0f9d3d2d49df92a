"""Two processes on localhost under jax.distributed (CPU collectives: gloo), one
1x4 mesh over both (2 devices each): process 0 schedules, process 1 follows. The greedy
tokens equal transformers' -- the same tokens one process gives (test_mesh_parity.py) --
and every request feature (structured outputs of every kind, tool_choice grammars,
bad_words, allowed_token_ids, logit_bias, penalties, logprobs, prompt_logprobs, n and
best_of, seeds, stop strings, min_tokens, truncation) gives what one process gives, with
each process sampling the same tokens from its own masks. And the step sent to the
followers is plain data: grammars as their specs, bad words as their tokens."""
from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxserve.engine import multihost
from jaxserve.engine.bad_words import BadWords
from jaxserve.engine.grammar import GrammarCompiler
from jaxserve.structured_outputs import StructuredOutputsParams as SO
from tests.engine.test_tiered_cache import PLAIN, trace
from tests.sharding.multihost_worker import ENGINE, TIERED, TIERED_CONVERSATIONS, run_all
from tests.sharding.test_mesh_parity import _prompts, _reference

WORKER = os.path.join(os.path.dirname(__file__), "multihost_worker.py")
MAX_TOKENS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _close(a, b, path="") -> None:
    """Equal JSON, floats (logprobs) to float32 noise: the collectives of one process
    and of two may add in different orders."""
    if isinstance(a, float) and isinstance(b, float):
        assert abs(a - b) <= 1e-4, (path, a, b)
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), (path, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    else:
        assert a == b, (path, a, b)


def test_two_processes_give_what_one_gives(checkpoint, tmp_path):
    path = checkpoint("llama")
    prompts = _prompts()
    # 2 CPU devices a process; the suite's other XLA flags (tests/conftest.py's compile
    # speed ones) stay
    xla = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = {**os.environ, "XLA_FLAGS": " ".join([*xla, "--xla_force_host_platform_device_count=2"]),
           "JAX_PLATFORMS": "cpu",
           "JAXSERVE_COORDINATOR_ADDRESS": f"127.0.0.1:{_free_port()}",
           "JAXSERVE_NUM_PROCESSES": "2"}
    # Each process logs to a file: a pipe read only after the other process ends can fill
    # up and block its writer (jax's C++ runtime logs there too) until it misses heartbeats.
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = []
    for i, log in enumerate(logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(
                [sys.executable, WORKER, path, str(tmp_path), json.dumps(prompts),
                 str(MAX_TOKENS)],
                env={**env, "JAXSERVE_PROCESS_ID": str(i)}, stdout=f, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=400)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    tails = "\n".join(f"--- process {i} ---\n{log.read_text()[-3000:]}"
                       for i, log in enumerate(logs))
    assert [p.returncode for p in procs] == [0, 0], tails
    leader, follower = (json.loads((tmp_path / f"process{i}.json").read_text())
                        for i in range(2))
    assert leader["processes"] == 2 and leader["devices"] == 4
    assert leader["compilations_after_warmup"] == 0
    assert leader["tokens"] == [t[:MAX_TOKENS] for t in _reference(path, prompts)]
    # The follower sampled what the leader did, request by request: the same masks.
    assert follower["sampled"] == leader["sampled"] and len(leader["sampled"]) > 20
    # One process on the same 1x4 mesh (this one's CPU devices), the same requests
    # (compiling only the programs they use: no warmup).
    one = json.loads(json.dumps(run_all(LLM(path, **ENGINE, enforce_eager=True), prompts,
                                        MAX_TOKENS)))
    assert one["tokens"] == leader["tokens"]
    _close(leader["features"], one["features"])
    # (constrained at temperature 1: the grammars held, so they were applied)
    texts = [c["text"] for f in one["features"] for c in f["completions"]]
    assert texts[3] in ("yes", "no", "maybe") and texts[5].startswith("x")
    # The host tier: each process kept its heads of the pages; restored, they give the
    # tokens (and hits) one process gives.
    tiered, hits = leader["tiered"], follower["tiered"]
    assert hits is None and tiered["host"][2] > 0, tiered["host"]
    one = LLM(path, **TIERED, **PLAIN)
    want, cached = trace(one, TIERED_CONVERSATIONS)
    assert tiered["tokens"] == [list(t) for t in want] and tiered["cached"] == cached
    assert tiered["host"] == [one.engine.stats().host.hits, one.engine.stats().host.pages_offloaded,
                              one.engine.stats().host.pages_restored]


def _step(params: SamplingParams) -> SchedulerOutput:
    new = [NewRequestData(f"r{i}", [5, 6, 7], [], params, ([1, 2],), 0, 3) for i in range(2)]
    return SchedulerOutput(new, CachedRequestData.empty(), 6, [], [])


def test_a_step_is_plain_data_followers_rebuild(checkpoint):
    """A grammar goes as its spec (llguidance's objects do not pickle), compiled by the
    follower's compiler into a matcher that allows the same tokens; bad words go as
    their tokens; extra_args (anything, offline) is left out."""
    from transformers import AutoTokenizer
    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(checkpoint("llama")), 256, (2,))
    so = SO(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    params = SamplingParams(structured_outputs=so, grammar=compiler.compile(so),
                            bad_words=["x"], bad_words_automaton=BadWords([[4], [7, 8]]),
                            extra_args={"callback": lambda: None})
    with pytest.raises(TypeError):
        pickle.dumps(params.grammar)         # llguidance's matcher: what the step held
    with pytest.raises((AttributeError, pickle.PicklingError)):
        pickle.dumps(params.extra_args)
    compiled: list[SO] = []
    follower = GrammarCompiler(AutoTokenizer.from_pretrained(checkpoint("llama")), 256, (2,))
    got = multihost.loads(multihost.dumps(_step(params)),
                          lambda spec: compiled.append(spec) or follower.compile(spec))
    assert compiled == [so]                  # once: both requests share the grammar
    a, b = (r.sampling_params for r in got.new_reqs)
    assert a is b and a.extra_args is None and a == params
    assert a.bad_words_automaton.singles.tolist() == [4]
    assert a.bad_words_automaton.banned(a.bad_words_automaton.next(0, 7)).tolist() == [8]
    mine, theirs = params.grammar.matcher(), a.grammar.matcher()
    for t in compiler._hf('{"a":12}', add_special_tokens=False).input_ids:
        rows = np.full((2, 8), 0xFFFFFFFF, np.uint32)
        mine.fill(rows[0])
        theirs.fill(rows[1])
        np.testing.assert_array_equal(rows[0], rows[1])
        assert (rows[0][t >> 5] >> (t & 31)) & 1      # the text is allowed
        mine.accept(t)
        theirs.accept(t)
