"""LoRA adapters through the engine (docs/LORA.md, part 2b): LLM(enable_lora=True) and
generate(..., lora_request=...) give each request the greedy tokens and float32
logprobs of transformers + peft with its adapter active, alone and in batches that mix
the base model with adapters; fewer device slots than adapters (requests wait, slots
swap) compile nothing after warmup; the prefix cache never shares pages between
adapters; preempted requests resume with their adapter; bad adapters are refused by
name. Two engines for the module: a llama with 2 slots and a tight page pool, a
Qwen3.5 hybrid with 3 slots."""
from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.errors import InputError
from tests.checkpoints import model_class
from tests.engine.conftest import add, assert_no_leaks
from tests.models.test_lora_forward import FAMILIES

NUM_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=1)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


class Served:
    """One engine with three peft adapters of its tiny checkpoint (the part 2a test's:
    ranks 8, 4 with rsLoRA, 2; different targets) and their torch references."""

    def __init__(self, kind: str, path: str, tmp, **engine_args):
        self.kind, self.path = kind, path
        self.torch = {0: model_class(kind).from_pretrained(path, dtype=torch.float32).eval()}
        self.loras: dict[int, LoRARequest | None] = {0: None}
        for i, kw in enumerate(FAMILIES[kind][1], start=1):
            torch.manual_seed(i)
            base = model_class(kind).from_pretrained(path, dtype=torch.float32)
            peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **kw))
            peft_model.save_pretrained(tmp / f"a{i}")
            self.torch[i] = peft_model.eval()
            self.loras[i] = LoRARequest(f"a{i}", i, str(tmp / f"a{i}"))
        self.llm = LLM(path, dtype="float32", enable_lora=True, max_lora_rank=8,
                       max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                       **engine_args)
        self._want: dict[tuple, tuple[list[int], list[float]]] = {}

    def want(self, adapter: int, prompt: list[int]) -> tuple[list[int], list[float]]:
        """transformers (+ peft adapter `adapter`, 0: none): greedy tokens, each one's
        float32 logprob."""
        key = (adapter, tuple(prompt))
        if key not in self._want:
            model, ids = self.torch[adapter], list(prompt)
            with torch.inference_mode():
                for _ in range(NUM_NEW):
                    ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
                lps = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)
            new = ids[len(prompt):]
            self._want[key] = new, [float(lps[len(prompt) - 1 + j, t]) for j, t in enumerate(new)]
        return self._want[key]

    def run(self, jobs: list[tuple[int, list[int]]]) -> list[tuple[list[int], list[float]]]:
        """(adapter, prompt) of each request, all in one generate call."""
        outs = self.llm.generate([{"prompt_token_ids": p} for _, p in jobs], GREEDY,
                                 use_tqdm=False, lora_request=[self.loras[a] for a, _ in jobs])
        return [(c.token_ids, [e[t].logprob for t, e in zip(c.token_ids, c.logprobs)])
                for c in (o.outputs[0] for o in outs)]

    def check(self, jobs: list[tuple[int, list[int]]], got) -> None:
        for (adapter, prompt), (tokens, lps) in zip(jobs, got):
            want_tokens, want_lps = self.want(adapter, prompt)
            assert tokens == want_tokens, (adapter, prompt)
            np.testing.assert_allclose(lps, want_lps, atol=1e-4)


@pytest.fixture(scope="module")
def llama(checkpoint, tmp_path_factory):
    # 2 slots for 3 adapters; 8 usable pages of 16 tokens: four requests of 28 tokens
    # take all 8 when admitted and need 12 as they decode, so some are preempted.
    return Served("llama", checkpoint("llama"), tmp_path_factory.mktemp("lora_llama"),
                  max_loras=2, num_pages=9)


@pytest.fixture(scope="module")
def hybrid(checkpoint, tmp_path_factory):
    return Served("qwen3_5", checkpoint("qwen3_5"), tmp_path_factory.mktemp("lora_qwen3_5"),
                  max_loras=3, enforce_eager=True)


@pytest.fixture(params=["llama", "hybrid"])
def served(request) -> Served:
    return request.getfixturevalue(request.param)


def test_each_adapter_alone_matches_peft(served):
    for adapter in range(4):
        jobs = [(adapter, _prompt(11 + adapter, seed=adapter))]
        served.check(jobs, served.run(jobs))
    # The adapters change the model (else the test above proves nothing).
    p = _prompt(11, seed=0)
    assert served.want(0, p)[1] != pytest.approx(served.want(1, p)[1], abs=1e-3)
    assert_no_leaks(served.llm.engine)


def test_mixed_batch_gives_each_request_its_adapter(served):
    """Base requests and three adapters in one generate call: each gets what it gets
    alone. With 3 slots (the hybrid) one step runs all three adapters and the base."""
    jobs = [(a, _prompt(9 + 3 * a, seed=10 + a)) for a in (0, 1, 2, 3, 0, 2)]
    engine = served.llm.engine
    mixes = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        mixes.append({r.lora_slot for r in engine.scheduler.running})
        return out
    engine.scheduler.schedule = recording
    try:
        got = served.run(jobs)
    finally:
        del engine.scheduler.schedule
    served.check(jobs, got)
    most = max(len(m) for m in mixes)
    assert most == (2 + 1 if served.kind == "llama" else 3 + 1)   # + the base's slot 0
    assert_no_leaks(engine)


def test_mixed_batch_on_1x4_mesh_with_repeated_kv_heads(llama):
    """The same llama and adapters under --mesh 1x4 (the stacks split as the base
    kernels: A on row-parallel inputs, B on column-parallel outputs; the llama's 2 KV
    heads stored twice each over the 4 devices, so a k/v adapter's B is repeated as the
    loader repeats the base kernel's heads): a batch mixing base rows and the adapters
    gives each request the greedy tokens and float32 logprobs of transformers + peft,
    which the engine without a mesh gives (test_mixed_batch_gives_each_request_its_adapter;
    the unmeshed engine is not run here, so the other tests' slot state stays theirs).
    All three adapters adapt k_proj or v_proj."""
    meshed = LLM(llama.path, dtype="float32", enable_lora=True, max_lora_rank=8, max_loras=3,
                 max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, mesh="1x4",
                 enforce_eager=True)
    layout = meshed.engine.runner.lora.targets["layers.0.self_attn.k_proj"]
    assert layout.kv_repeat == 2   # the case this test is for
    jobs = [(a, _prompt(10 + 2 * i, seed=60 + i)) for i, a in enumerate((0, 1, 2, 3))]
    outs = meshed.generate([{"prompt_token_ids": p} for _, p in jobs], GREEDY, use_tqdm=False,
                           lora_request=[llama.loras[a] for a, _ in jobs])
    llama.check(jobs, [(c.token_ids, [e[t].logprob for t, e in zip(c.token_ids, c.logprobs)])
                       for c in (o.outputs[0] for o in outs)])
    assert_no_leaks(meshed.engine)


def test_fewer_slots_than_adapters_wait_and_swap_without_compiling(llama):
    """3 adapters, 2 slots: a request whose adapter finds every slot in use waits while
    later ones run; slots are written again as adapters come and go; nothing compiles."""
    engine = llama.llm.engine
    jobs = [(a, _prompt(8, seed=20 + i)) for i, a in enumerate((1, 2, 3, 1, 3, 2, 0))]
    loads, waited = [], []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        loads.extend(out.lora_loads)
        sched = engine.scheduler
        waiting = [r.lora_id for r in sched.waiting]
        running = {r.lora_id for r in sched.running}
        # A request waits for a slot while one behind it (another adapter's) runs.
        waited.extend(a for a in waiting if a and a not in running and len(running - {0}) == 2)
        return out
    compiled = engine.num_compilations
    engine.scheduler.schedule = recording
    try:
        got = llama.run(jobs)
    finally:
        del engine.scheduler.schedule
    llama.check(jobs, got)
    assert engine.num_compilations == compiled
    assert waited
    # Every adapter ran, in two slots: at least two were (re)written this call.
    assert len(loads) >= 2 and {slot for slot, _ in loads} <= {1, 2}
    assert all(engine.scheduler.lora.refs(a) == 0 for a in (1, 2, 3))
    assert_no_leaks(engine)


def test_prefix_cache_is_per_adapter(llama):
    """The same 3-page prompt under the base, adapter 1 and adapter 2: no page shared
    across them; adapter 1 again hits its own pages."""
    engine, prompt = llama.llm.engine, _prompt(50, seed=30)
    engine.reset_prefix_cache()
    cached = []
    for adapter in (0, 1, 2, 1):
        out = llama.llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                                 lora_request=llama.loras[adapter])[0]
        c = out.outputs[0]
        llama.check([(adapter, prompt)], [(c.token_ids, [e[t].logprob for t, e in
                                                         zip(c.token_ids, c.logprobs)])])
        cached.append(out.num_cached_tokens)
    assert cached == [0, 0, 0, 48]


def test_preempted_requests_resume_with_their_adapter(llama):
    """Four requests (two on adapter 1, one on adapter 2, the base: both slots in use)
    growing past what the pool holds: some are preempted (their slot released) and
    resume with the same adapter."""
    engine = llama.llm.engine
    engine.reset_prefix_cache()
    before = engine.scheduler.num_preemptions
    jobs = [(a, _prompt(28, seed=40 + i)) for i, a in enumerate((1, 0, 2, 1))]
    llama.check(jobs, llama.run(jobs))
    assert engine.scheduler.num_preemptions > before
    assert all(engine.scheduler.lora.refs(a) == 0 for a in (1, 2, 3))
    assert_no_leaks(engine)


def test_bad_adapters_are_refused_by_name(llama, tmp_path):
    inputs = llama.llm.engine.inputs
    ok = llama.loras[1]

    def refused(lora: LoRARequest, match: str) -> None:
        with pytest.raises(InputError, match=match) as e:
            inputs.process("x", [5, 6, 7], GREEDY, lora_request=lora)
        assert e.value.param == "lora_request"

    # A rank above --max-lora-rank (8).
    torch.manual_seed(0)
    big = get_peft_model(model_class("llama").from_pretrained(llama.path, dtype=torch.float32),
                         LoraConfig(init_lora_weights=False, r=16, target_modules=["q_proj"]))
    big.save_pretrained(tmp_path / "r16")
    refused(LoRARequest("r16", 7, str(tmp_path / "r16")), "rank 16 is above --max-lora-rank 8")
    # A target module the model lacks.
    shutil.copytree(ok.lora_path, tmp_path / "odd")
    cfg = json.loads((tmp_path / "odd" / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "qkv_fused"]
    (tmp_path / "odd" / "adapter_config.json").write_text(json.dumps(cfg))
    refused(LoRARequest("odd", 8, str(tmp_path / "odd")), "qkv_fused not in the model")
    refused(LoRARequest("none", 9, str(tmp_path / "missing")), "no adapter_config.json")
    # One id, two adapters (ok's id known first: the test does not lean on earlier ones).
    inputs.process("x", [5, 6, 7], GREEDY, lora_request=ok)
    refused(LoRARequest("a2", ok.lora_int_id, llama.loras[2].lora_path), "one id per adapter")
    # LoRA off: the adapter is refused, naming the switch.
    off = InputProcessor(tokenizer=None, vocab_size=256, max_model_len=64)
    with pytest.raises(InputError, match="without LoRA: start it with --enable-lora"):
        off.process("x", [5, 6], GREEDY, lora_request=ok)
    with pytest.raises(InputError, match="must be a jaxserve.LoRARequest"):
        inputs.process("x", [5, 6], GREEDY, lora_request="a1")
    with pytest.raises(ValueError, match="lora_int_id must be an int >= 1"):
        LoRARequest("a", 0, "/x")


def test_add_request_keeps_its_adapter(llama):
    """The engine's own path (as the server's): the request reaches the scheduler with
    its adapter, whose id salts its pages."""
    engine = llama.llm.engine
    add(engine, "direct", _prompt(20, seed=50), GREEDY, lora_request=llama.loras[3])
    req = engine.scheduler.get_request("direct")
    assert req.lora_request == llama.loras[3] and req.salt_key == (None, None, 3)
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(engine)
