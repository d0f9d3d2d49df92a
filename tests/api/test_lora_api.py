"""LoRA adapters over HTTP (docs/LORA.md): --enable-lora --lora-modules (name=path and
vLLM's JSON form), `model: "<adapter>"` in completions and chat (streamed or not) gives
the tokens and logprobs of transformers + peft with that adapter, /v1/models lists the
adapters with their parent, unknown names are 404s naming them, and the runtime
load / unload endpoints (behind the env switch and the API key) add and remove adapters;
an adapter in use is not unloaded. One server for the module."""
from __future__ import annotations

import json
import random
import threading

import httpx
import pytest
import torch
from openai import OpenAI
from peft import LoraConfig, get_peft_model
from transformers import AutoTokenizer

from jaxserve.api import server as server_module
from jaxserve.api.lora_adapters import runtime_updates_allowed
from jaxserve.api.settings import ServerSettings
from tests.api.conftest import API_KEY, Server
from tests.checkpoints import model_class

NUM_NEW = 5
_ADAPTERS = {"a1": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
             "a2": dict(r=4, lora_alpha=8, use_rslora=True, target_modules="all-linear"),
             "a3": dict(r=2, lora_alpha=4, target_modules=["k_proj", "up_proj"])}


class Adapters:
    """Three peft adapters of the API checkpoint and their reference answers."""

    def __init__(self, path: str, tmp):
        self.path, self.dirs, self.models = path, {}, {}
        self.models[None] = model_class("qwen3").from_pretrained(path, dtype=torch.float32).eval()
        for seed, (name, kw) in enumerate(_ADAPTERS.items(), start=1):
            torch.manual_seed(seed)
            base = model_class("qwen3").from_pretrained(path, dtype=torch.float32)
            peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **kw))
            self.dirs[name] = str(tmp / name)
            peft_model.save_pretrained(self.dirs[name])
            self.models[name] = peft_model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def want(self, name: str | None, prompt: list[int]) -> tuple[list[str], list[float]]:
        """Greedy tokens (as the logprobs' token strings) and their logprobs."""
        model, ids = self.models[name], list(prompt)
        with torch.inference_mode():
            for _ in range(NUM_NEW):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            lps = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)
        new = ids[len(prompt):]
        return ([self.tokenizer.decode([t]) for t in new],
                [float(lps[len(prompt) - 1 + j, t]) for j, t in enumerate(new)])


@pytest.fixture(scope="module")
def adapters(api_checkpoint, tmp_path_factory) -> Adapters:
    return Adapters(api_checkpoint, tmp_path_factory.mktemp("lora_api"))


@pytest.fixture(scope="module")
def lora_server(api_checkpoint, adapters):
    srv = Server(api_checkpoint, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                 "--lora-modules", f"a1={adapters.dirs['a1']}",
                 json.dumps({"name": "a2", "path": adapters.dirs["a2"],
                             "base_model_name": "tiny-base"}),
                 env={"JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    yield srv
    srv.stop()


@pytest.fixture
def client(lora_server) -> OpenAI:
    return OpenAI(base_url=lora_server.url + "/v1", api_key=API_KEY)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(12)]


def _completion(client: OpenAI, model: str, prompt: list[int], stream: bool = False):
    kw = dict(model=model, prompt=prompt, max_tokens=NUM_NEW, temperature=0.0, logprobs=1,
              extra_body={"ignore_eos": True})
    if not stream:
        c = client.completions.create(**kw)
        assert c.model == model
        return c.choices[0].logprobs.tokens, c.choices[0].logprobs.token_logprobs
    tokens, lps = [], []
    for chunk in client.completions.create(stream=True, **kw):
        assert chunk.model == model
        for ch in chunk.choices:
            if ch.logprobs:
                tokens += ch.logprobs.tokens
                lps += ch.logprobs.token_logprobs
    return tokens, lps


def _check(got, want) -> None:
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_route_to_the_adapter(client, adapters, lora_server, stream):
    served = client.models.list().data[0].id
    for i, (model, name) in enumerate(((served, None), ("a1", "a1"), ("a2", "a2"))):
        prompt = _prompt(i)
        _check(_completion(client, model, prompt, stream), adapters.want(name, prompt))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_routes_to_the_adapter(client, adapters, lora_server, stream):
    messages = [{"role": "user", "content": "hello there"}]
    kw = dict(messages=messages, max_tokens=NUM_NEW, temperature=0.0, logprobs=True,
              extra_body={"ignore_eos": True})
    answers = {}
    for model in ("a1", "a2"):
        if stream:
            tokens = [t.token for chunk in client.chat.completions.create(model=model, stream=True,
                                                                          **kw)
                      for ch in chunk.choices if ch.logprobs for t in ch.logprobs.content]
        else:
            c = client.chat.completions.create(model=model, **kw)
            assert c.model == model
            tokens = [t.token for t in c.choices[0].logprobs.content]
        answers[model] = tokens
    # The prompt as the server renders it (/tokenize takes an adapter's name too).
    ids = httpx.post(lora_server.url + "/tokenize", json={"model": "a1", "messages": messages},
                     headers={"Authorization": f"Bearer {API_KEY}"}).json()["tokens"]
    for model in ("a1", "a2"):
        assert answers[model] == adapters.want(model, ids)[0]


def test_models_lists_adapters_and_unknown_names_are_404(client, adapters):
    models = {m.id: m for m in client.models.list().data}
    served = next(iter(models))
    assert models["a1"].parent == served and models["a1"].root == adapters.dirs["a1"]
    assert models["a2"].parent == "tiny-base"
    with pytest.raises(Exception) as e:
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=1)
    assert e.value.status_code == 404 and "no-such-adapter" in str(e.value)


def test_runtime_load_use_and_unload(lora_server, client, adapters):
    url, auth = lora_server.url, {"Authorization": f"Bearer {API_KEY}"}
    body = {"lora_name": "a3", "lora_path": adapters.dirs["a3"]}
    assert httpx.post(url + "/v1/load_lora_adapter", json=body).status_code == 401
    r = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=auth)
    assert r.status_code == 200, r.text
    again = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=auth)
    assert again.status_code == 400 and "already been loaded" in again.text
    bad = httpx.post(url + "/v1/load_lora_adapter", headers=auth,
                     json={"lora_name": "x", "lora_path": "/no/such/dir"})
    assert bad.status_code == 400 and "adapter_config.json" in bad.text
    assert "a3" in {m.id for m in client.models.list().data}
    prompt = _prompt(7)
    _check(_completion(client, "a3", prompt), adapters.want("a3", prompt))
    # Three adapters, two slots: a1 and a2 still answer as themselves.
    _check(_completion(client, "a1", prompt), adapters.want("a1", prompt))
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a3"}, headers=auth)
    assert r.status_code == 200, r.text
    assert "a3" not in {m.id for m in client.models.list().data}
    gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a3"}, headers=auth)
    assert gone.status_code == 404 and "a3" in gone.text
    with pytest.raises(Exception) as e:
        client.completions.create(model="a3", prompt="hi", max_tokens=1)
    assert e.value.status_code == 404


def test_load_inplace_replaces_an_adapter_under_its_name(lora_server, client, adapters):
    """vLLM's load_inplace: a name already served is refused without it (naming the
    field), and replaced with it: the same name then answers as the new files."""
    url, auth = lora_server.url, {"Authorization": f"Bearer {API_KEY}"}
    load = lambda path, **kw: httpx.post(url + "/v1/load_lora_adapter", headers=auth,
                                         json={"lora_name": "swap", "lora_path": path, **kw})
    prompt = _prompt(9)
    assert load(adapters.dirs["a3"]).status_code == 200
    _check(_completion(client, "swap", prompt), adapters.want("a3", prompt))
    again = load(adapters.dirs["a1"])
    assert again.status_code == 400 and "load_inplace" in again.text
    bad = load("/no/such/dir", load_inplace=True)
    assert bad.status_code == 400 and "adapter_config.json" in bad.text
    _check(_completion(client, "swap", prompt), adapters.want("a3", prompt))   # kept
    r = load(adapters.dirs["a1"], load_inplace=True)
    assert r.status_code == 200, r.text
    _check(_completion(client, "swap", prompt), adapters.want("a1", prompt))
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "swap"}, headers=auth)
    assert r.status_code == 200, r.text


def test_a_replaced_version_is_unloaded_once_its_requests_end():
    """The version load_inplace replaced is unloaded by id as soon as the engine lets it
    (it refuses while a request uses it); an engine that stops ends the wait."""
    import asyncio

    from jaxserve.api.lora_adapters import LoRAAdapters
    from jaxserve.errors import EngineDeadError
    from jaxserve.lora_request import LoRARequest

    class Engine:
        def __init__(self, busy_polls: int, error: type[Exception] = ValueError):
            self.busy_polls, self.error, self.removed = busy_polls, error, []

        async def remove_lora(self, lora_int_id: int) -> None:
            if self.busy_polls:
                self.busy_polls -= 1
                raise self.error("in use by 1 unfinished request(s)")
            self.removed.append(lora_int_id)

    class Inputs:
        checked_lora = staticmethod(lambda req: None)

    async def replace(engine) -> tuple[LoRAAdapters, LoRARequest]:
        loras = LoRAAdapters((LoRARequest("x", 1, "/v1"),), True, Inputs())
        await loras.load("x", "/v2", None, engine, load_inplace=True)
        new = loras.get("x")
        await asyncio.gather(*loras._retiring)
        return loras, new

    engine = Engine(busy_polls=3)
    loras, new = asyncio.run(replace(engine))
    assert (new.lora_int_id, new.lora_path) == (2, "/v2") and engine.removed == [1]
    assert not loras._retiring
    dead = Engine(busy_polls=1, error=EngineDeadError)
    asyncio.run(replace(dead))
    assert dead.removed == []


def test_an_adapter_in_use_is_not_unloaded(lora_server, client):
    url, auth = lora_server.url, {"Authorization": f"Bearer {API_KEY}"}
    started, done = threading.Event(), threading.Event()

    def long_stream():
        for _ in client.completions.create(model="a1", prompt=_prompt(8), max_tokens=100,
                                           temperature=0.0, stream=True,
                                           extra_body={"ignore_eos": True}):
            started.set()
        done.set()
    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(120)
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a1"}, headers=auth)
    # vLLM's gauge of the adapters in use (its value: the time of the snapshot, which
    # the engine publishes after each step): it shows a1 running.
    seen = []
    while not done.is_set() and not any('running_lora_adapters="a1"' in x for x in seen):
        seen = [line for line in httpx.get(url + "/metrics").text.splitlines()
                if line.startswith("vllm:lora_requests_info{")]
    t.join()
    assert len(seen) == 1 and 'max_lora="2"' in seen[0], seen
    assert 'running_lora_adapters="a1"' in seen[0], seen
    assert done.is_set()
    assert r.status_code == 400 and "in use" in r.text
    assert "a1" in {m.id for m in client.models.list().data}


def test_runtime_updates_need_the_env_switch(monkeypatch):
    assert not runtime_updates_allowed({})
    assert runtime_updates_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert runtime_updates_allowed({"JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    settings = ServerSettings(served_model_names=("m",), max_model_len=64)
    for name in ("JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        monkeypatch.delenv(name, raising=False)
    paths = {r.path for router in server_module._keyed_routers(settings) for r in router.routes}
    assert "/v1/load_lora_adapter" not in paths
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    paths = {r.path for router in server_module._keyed_routers(settings) for r in router.routes}
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= paths
