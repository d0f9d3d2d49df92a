"""The endpoints vLLM's clients call beyond OpenAI's: /ping, /load, /reset_prefix_cache,
/tokenizer_info, several served model names, and lm-eval's loglikelihood request
(/v1/completions with echo and max_tokens 0) with its text offsets.

The real server (the session `server`) for what the CLI sets up; an in-process app on a
real engine for the settings the CLI does not give (several names, /tokenizer_info).
"""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.api.loading import LoadingGate
from jaxserve.api.metrics import Metrics
from jaxserve.api.server import create_app
from jaxserve.api.settings import ServerSettings
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.engine_core import prompt_page_hashes
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.build.startup import StartupProgress
from tests.api.conftest import API_KEY, SERVER_ARGS
from tests.engine.conftest import assert_no_leaks

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEXT = "The capital of France is Paris, and the capital of Italy is"
IDS = [5, 17, 33, 60, 61, 62, 90, 120, 7, 7, 7, 200]


def _server_flag(name: str) -> int:
    return int(SERVER_ARGS[SERVER_ARGS.index(name) + 1])


@pytest.fixture(scope="module")
def llm(api_checkpoint) -> LLM:
    """The server's model and limits, offline (the reference for its logprobs)."""
    return LLM(api_checkpoint, dtype="float32", max_model_len=_server_flag("--max-model-len"),
               max_num_seqs=_server_flag("--max-num-seqs"),
               max_num_batched_tokens=_server_flag("--max-num-batched-tokens"))


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=120)


def stream_chunks(server, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      headers=AUTH, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    assert all("error" not in c for c in chunks), chunks
    return chunks


def merged(chunks: list[dict]) -> dict[int, dict]:
    """The streamed choices put together: text, logprobs lists and finish reason."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            acc = out.setdefault(c["index"], {"text": "", "finish_reason": None, "logprobs": {
                "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}})
            acc["text"] += c["text"]
            acc["finish_reason"] = c["finish_reason"] or acc["finish_reason"]
            for key, values in (c["logprobs"] or {}).items():
                acc["logprobs"][key] += values
    return out


# ---- probes and admin ---------------------------------------------------------------------
def test_ping_and_load_are_open_and_the_admin_routes_need_the_key(server):
    for method in ("GET", "POST"):
        r = httpx.request(method, server.url + "/ping")
        assert r.status_code == 200 and r.content == b""
    r = httpx.get(server.url + "/load")
    assert r.status_code == 200 and r.json() == {"server_load": 0}
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 401
    r = httpx.post(server.url + "/reset_prefix_cache", headers=AUTH)
    assert r.status_code == 200 and r.content == b""
    # vLLM's /tokenizer_info exists only when asked for (it shows the chat template).
    assert httpx.get(server.url + "/tokenizer_info", headers=AUTH).status_code == 404


class HeldEngine:
    """Holds every request until `release` (what /load counts does not depend on a model)."""
    tokenizer = None
    dead = False
    stats = SimpleNamespace(num_running=0)

    def __init__(self):
        self.inputs = InputProcessor(tokenizer=None, vocab_size=100, max_model_len=64)
        self.started = 0
        self.release = asyncio.Event()

    async def generate(self, request):
        self.started += 1
        await self.release.wait()
        raise RuntimeError("released")
        yield   # an async generator


def test_load_counts_the_requests_in_flight():
    engine = HeldEngine()
    app = create_app(engine, ServerSettings(served_model_names=("m",), max_model_len=64,
                                            disable_log_stats=True))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as c:
            load = lambda: c.get("/load")  # noqa: E731
            assert (await load()).json() == {"server_load": 0}
            body = {"prompt": [[5, 6], [7]], "max_tokens": 4, "n": 2}   # 1 request, 4 seqs
            held = [asyncio.create_task(c.post("/v1/completions", json=body)),
                    asyncio.create_task(c.post("/v1/completions",
                                               json={"prompt": [5], "stream": True}))]
            while engine.started < 3:
                await asyncio.sleep(0.01)
            during = (await load()).json()
            engine.release.set()
            await asyncio.gather(*held)
            return during, (await load()).json()
    during, after = asyncio.run(go())
    assert during == {"server_load": 2} and after == {"server_load": 0}


# ---- lm-eval's loglikelihood request -----------------------------------------------------
def loglikelihood_request(model: str) -> dict:
    """What lm-eval's local-completions model sends to score continuations."""
    return {"model": model, "prompt": [TEXT, IDS], "max_tokens": 0, "temperature": 0,
            "logprobs": 1, "echo": True, "seed": 1234}


def test_loglikelihood_request_equals_offline_prompt_logprobs(server, api_checkpoint, llm):
    r = post(server, "/v1/completions", loglikelihood_request(api_checkpoint))
    assert r.status_code == 200, r.text
    answer = r.json()
    tok = llm.get_tokenizer()
    ref = llm.generate([TEXT, {"prompt_token_ids": IDS}],
                       SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert answer["usage"]["completion_tokens"] == 0
    assert answer["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in ref)
    for choice, out, text in zip(answer["choices"], ref, [TEXT, tok.decode(IDS)]):
        assert choice["text"] == text and choice["finish_reason"] == "length"
        lp, ids = choice["logprobs"], out.prompt_token_ids
        assert lp["tokens"] == [tok.decode([t]) for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = [e[t].logprob for t, e in zip(ids[1:], out.prompt_logprobs[1:])]
        assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)
        # top_logprobs: the most likely token (lm-eval's is_greedy compares it).
        for top, entry in zip(lp["top_logprobs"][1:], out.prompt_logprobs[1:]):
            best = next(v for v in entry.values() if v.rank == 1)
            assert top == pytest.approx({best.decoded_token: best.logprob}, abs=1e-5)
        assert lp["text_offset"] == [sum(map(len, lp["tokens"][:j]))
                                     for j in range(len(ids))]
    assert_no_leaks(llm.engine)


def test_loglikelihood_stream_equals_non_stream(server, api_checkpoint):
    body = loglikelihood_request(api_checkpoint)
    whole = post(server, "/v1/completions", body).json()["choices"]
    streamed = merged(stream_chunks(server, body))
    assert sorted(streamed) == [0, 1]
    for c in whole:
        s = streamed[c["index"]]
        assert (s["text"], s["finish_reason"]) == (c["text"], "length")
        assert s["logprobs"] == c["logprobs"]


def test_max_tokens_0_without_echo_is_refused(server, api_checkpoint):
    r = post(server, "/v1/completions", {"model": api_checkpoint, "prompt": TEXT,
                                         "max_tokens": 0})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "echo" in err["message"]
    r = post(server, "/v1/completions", {"prompt": TEXT, "max_tokens": -1, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_text_offsets_run_on_across_chunks(server, api_checkpoint, llm, echo):
    body = {"model": api_checkpoint, "prompt": [TEXT, IDS], "max_tokens": 6, "n": 2,
            "temperature": 0, "ignore_eos": True, "logprobs": 2, "echo": echo}
    whole = post(server, "/v1/completions", body).json()["choices"]
    chunks = stream_chunks(server, body)
    assert len(chunks) >= 4 * 6     # a chunk per token of each choice
    streamed = merged(chunks)
    prompt_lens = [len(llm.engine.inputs.tokenize(TEXT)), len(IDS)]
    for c in whole:
        s = streamed[c["index"]]
        assert s["text"] == c["text"]
        assert s["logprobs"] == c["logprobs"]
        lp = c["logprobs"]
        assert len(lp["tokens"]) == 6 + echo * prompt_lens[c["index"] // 2]
        assert lp["text_offset"] == [sum(map(len, lp["tokens"][:j]))
                                     for j in range(len(lp["tokens"]))]


# ---- in-process: settings the CLI does not give --------------------------------------------
@pytest.fixture
def engine(llm):
    """The offline LLM's engine behind an AsyncEngine (its thread owns it meanwhile)."""
    eng = AsyncEngine(llm.engine.info.config, core=llm.engine)
    yield eng
    eng.shutdown()
    assert_no_leaks(llm.engine)


def call(app, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=120) as c:
            return await c.request(method, path, **kw)
    return asyncio.run(go())


def app_for(engine, **settings):
    return create_app(engine, ServerSettings(max_model_len=engine.info.max_model_len,
                                             disable_log_stats=True, **settings))


def test_several_served_model_names(engine, api_checkpoint):
    app = app_for(engine, served_model_names=("primary", "alias"))
    models = call(app, "GET", "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["primary", "alias"]
    assert all(m["root"] == api_checkpoint and m["max_model_len"] == engine.info.max_model_len
               for m in models)
    for name in ("primary", "alias", None):
        body = {"prompt": TEXT, "max_tokens": 2, **({"model": name} if name else {})}
        r = call(app, "POST", "/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == "primary"
    r = call(app, "POST", "/tokenize", json={"model": "alias", "prompt": TEXT})
    assert r.status_code == 200
    r = call(app, "POST", "/v1/completions", json={"model": "other", "prompt": TEXT})
    assert r.status_code == 404
    assert "`primary`, `alias`" in r.json()["error"]["message"]


def test_served_model_names_are_checked():
    with pytest.raises(ValueError, match="served_model_names"):
        ServerSettings(served_model_names=(), max_model_len=8)
    with pytest.raises(ValueError, match="served_model_names"):
        ServerSettings(served_model_names=("a", ""), max_model_len=8)
    one = ServerSettings(served_model_names="a", max_model_len=8)
    assert one.served_model_names == ("a",) and one.served_model_name == "a"


def test_tokenizer_info(engine):
    tok = engine.tokenizer
    info = call(app_for(engine, served_model_names=("m",), enable_tokenizer_info_endpoint=True),
                "GET", "/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tok).__name__
    for name in ("bos_token", "eos_token", "pad_token"):
        assert info[name] == getattr(tok, name)
    assert info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == tok.model_max_length
    assert info["vocab_size"] == len(tok)
    assert info["max_model_len"] == engine.info.max_model_len
    assert not [k for k in info if k.endswith("_file")]
    assert info["added_tokens_decoder"][str(tok.eos_token_id)] == tok.eos_token
    # The server's --chat-template is the one chats are rendered with: it is reported.
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    info = call(app_for(engine, served_model_names=("m",), chat_template=template,
                        enable_tokenizer_info_endpoint=True), "GET", "/tokenizer_info").json()
    assert info["chat_template"] == template


def test_reset_prefix_cache_empties_the_cache_while_requests_run(engine, llm):
    app = app_for(engine, served_model_names=("m",))
    core = llm.engine
    prompt = list(range(3, 3 + 40))       # two full pages of 16
    hashes = prompt_page_hashes(prompt, core.info.config.page_size)
    assert call(app, "POST", "/v1/completions",
                json={"prompt": prompt, "max_tokens": 1}).status_code == 200
    assert core.cached_prefix_pages(hashes) == 2

    async def generate_and_reset():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=120) as c:
            long = asyncio.create_task(c.post("/v1/completions", json={
                "prompt": [9, 8, 7], "max_tokens": 60, "ignore_eos": True}))
            await asyncio.sleep(0.2)
            reset = await c.post("/reset_prefix_cache")
            return reset, await long
    reset, long = asyncio.run(generate_and_reset())
    assert reset.status_code == 200
    assert long.status_code == 200 and long.json()["usage"]["completion_tokens"] == 60
    assert core.cached_prefix_pages(hashes) == 0


def test_a_stopped_engine_fails_ping_and_reset(llm):
    eng = AsyncEngine(llm.engine.info.config, core=llm.engine)
    app = app_for(eng, served_model_names=("m",))
    assert call(app, "POST", "/ping").status_code == 200
    eng.shutdown()
    for method in ("GET", "POST"):
        assert call(app, method, "/ping").status_code == 503
    r = call(app, "POST", "/reset_prefix_cache")
    assert r.status_code == 503 and "engine" in r.json()["error"]["message"]


def test_ping_while_the_engine_loads():
    gate = LoadingGate(StartupProgress(), Metrics("m"), "1.0")
    for method in ("GET", "POST"):
        r = call(gate, method, "/ping")
        assert r.status_code == 503 and r.json()["status"] == "loading"


# ---- vLLM's server flags that reach the app -------------------------------------------------
def test_several_api_keys_each_let_in(engine):
    """--api-key k1 k2 (vLLM takes several)."""
    app = app_for(engine, served_model_names=("m",), api_key=("k1", "k2"))
    for key, status in (("k1", 200), ("k2", 200), ("k3", 401), (None, 401)):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        assert call(app, "GET", "/v1/models", headers=headers).status_code == status, key


def test_disable_fastapi_docs(engine):
    on = app_for(engine, served_model_names=("m",))
    off = app_for(engine, served_model_names=("m",), disable_fastapi_docs=True)
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert call(on, "GET", path).status_code == 200, path
        assert call(off, "GET", path).status_code == 404, path


def test_default_chat_template_kwargs_go_under_the_requests(engine):
    """--default-chat-template-kwargs: a template variable for every request, which the
    request's own chat_template_kwargs override (the prompt's length tells which won)."""
    template = ("{% if long_prompt %}{% for _ in range(20) %}x {% endfor %}{% endif %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    app = app_for(engine, served_model_names=("m",), chat_template=template,
                  default_chat_template_kwargs={"long_prompt": True})

    def prompt_tokens(**extra) -> int:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
        r = call(app, "POST", "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]
    with_default = prompt_tokens()
    overridden = prompt_tokens(chat_template_kwargs={"long_prompt": False})
    assert with_default >= overridden + 20
