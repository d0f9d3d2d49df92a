"""vLLM's request limits and fields over HTTP: logprobs past the engine's max_logprobs
is a 400 naming the field and the limit (--max-logprobs raises it: the in-process
limit is tests/engine/test_llm_vllm_names.py); truncate_prompt_tokens keeps the
prompt's tail; chat's echo, add_special_tokens and continue_final_message; cache_salt
keys prefix-cache hits; /tokenize renders messages exactly as chat does and takes
vLLM's fields (or refuses them by name)."""
from __future__ import annotations

import json
import random

import httpx

from tests.api.conftest import API_KEY

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _post(server, path: str, body: dict) -> httpx.Response:
    model = httpx.get(server.url + "/v1/models", headers=HEADERS).json()["data"][0]["id"]
    return httpx.post(server.url + path, json={"model": model, **body}, headers=HEADERS,
                      timeout=60)


def _error(resp: httpx.Response) -> dict:
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


def test_logprobs_past_max_logprobs_is_a_400(server):
    err = _error(_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                   "logprobs": 21}))
    assert err["param"] == "logprobs"
    assert "logprobs=21 is more than this engine's max_logprobs=20" in err["message"]
    err = _error(_post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
        "top_logprobs": 21}))
    assert "max_logprobs=20" in err["message"]
    ok = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 20})
    assert ok.status_code == 200, ok.text
    # (completions key top_logprobs by token text: two tokens of one text are one entry)
    ok = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
        "top_logprobs": 20})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20


def test_truncate_prompt_tokens(server):
    body = {"prompt": list(range(5, 45)), "max_tokens": 2, "temperature": 0}
    full = _post(server, "/v1/completions", body).json()
    assert full["usage"]["prompt_tokens"] == 40
    cut = _post(server, "/v1/completions", {**body, "truncate_prompt_tokens": 7}).json()
    tail = _post(server, "/v1/completions", {**body, "prompt": list(range(38, 45))}).json()
    assert cut["usage"]["prompt_tokens"] == 7
    assert cut["choices"][0]["text"] == tail["choices"][0]["text"]
    err = _error(_post(server, "/v1/completions", {**body, "truncate_prompt_tokens": 0}))
    assert err["param"] == "truncate_prompt_tokens"
    chat = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hello there, how are you?"}],
        "max_tokens": 2, "truncate_prompt_tokens": 3})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 3


# ---- chat: echo, add_special_tokens, continue_final_message ----------------------------

ASKED = [{"role": "user", "content": "hi"}]
# An answer the client began: the model goes on with it.
PREFILL = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
GOES_ON = {"messages": PREFILL, "add_generation_prompt": False, "continue_final_message": True}


def _chat(server, **body) -> dict:
    resp = _post(server, "/v1/chat/completions", {"max_tokens": 4, "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _message(server, **body) -> dict:
    return _chat(server, **body)["choices"][0]["message"]


def _deltas(server, **body) -> list[dict]:
    model = httpx.get(server.url + "/v1/models", headers=HEADERS).json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 4, "temperature": 0, "stream": True, **body}
    deltas = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      headers=HEADERS, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                deltas += [c["delta"] for c in json.loads(line[6:])["choices"]]
    return deltas


def test_chat_echo_puts_the_last_message_of_the_answers_role_first(server):
    plain = _message(server, **GOES_ON)
    echoed = _message(server, echo=True, **GOES_ON)
    assert echoed == {**plain, "content": "The answer is" + plain["content"]}
    assert echoed["role"] == "assistant"
    deltas = _deltas(server, echo=True, **GOES_ON)
    assert deltas[:2] == [{"role": "assistant", "content": ""}, {"content": "The answer is"}]
    assert "".join(d.get("content") or "" for d in deltas) == echoed["content"]
    # After a generation prompt the answer is a new message: nothing to echo.
    assert _message(server, messages=ASKED, echo=True) == _message(server, messages=ASKED)
    assert _deltas(server, messages=ASKED, echo=True)[1] != {"content": "hi"}
    # Without one the model goes on with the last message, whatever its role (vLLM's).
    user = _message(server, messages=ASKED, add_generation_prompt=False, echo=True)
    assert user["role"] == "user" and user["content"].startswith("hi")


def test_chat_add_special_tokens_and_continue_final_message(server):
    base = _chat(server, messages=ASKED, max_tokens=1)["usage"]["prompt_tokens"]
    more = _chat(server, messages=ASKED, max_tokens=1, add_special_tokens=True)
    assert more["usage"]["prompt_tokens"] == base + 1   # BOS on top of the template's
    tokens = _post(server, "/tokenize", {"messages": ASKED, "add_special_tokens": True}).json()
    assert tokens["count"] == base + 1 and tokens["tokens"][:2] == [1, 1]
    assert _post(server, "/tokenize", {"messages": ASKED}).json()["count"] == base
    # The template's end of the last message is left out: the prompt stops inside it.
    goes_on = _post(server, "/tokenize", GOES_ON).json()
    closed = _post(server, "/tokenize", {**GOES_ON, "continue_final_message": False}).json()
    assert goes_on["count"] < closed["count"]
    assert goes_on["tokens"] == closed["tokens"][:goes_on["count"]]
    assert _chat(server, max_tokens=1, **GOES_ON)["usage"]["prompt_tokens"] == goes_on["count"]
    err = _error(_post(server, "/v1/chat/completions", {
        "messages": PREFILL, "continue_final_message": True, "max_tokens": 1}))
    assert err["param"] == "continue_final_message" and "add_generation_prompt" in \
        err["message"]
    # /v1/completions adds them by default (as vLLM); false leaves the text's tokens.
    usage = [_post(server, "/v1/completions", {"prompt": "hi there", "max_tokens": 1,
                                               **extra}).json()["usage"]["prompt_tokens"]
             for extra in ({}, {"add_special_tokens": False})]
    tokens = _post(server, "/tokenize", {"prompt": "hi there"}).json()
    assert usage == [tokens["count"], tokens["count"] - 1] and tokens["tokens"][0] == 1


# ---- cache_salt -------------------------------------------------------------------------

def _prefix_cache_hits(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


def test_cache_salt_keys_prefix_cache_hits(server):
    """Hits only among requests of the same salt (none is a salt of its own). Pages of
    16 tokens: a 40-token prompt has 2 to share. Three tokens each, so the hit is
    published (after its step) before the answer (after the last step)."""
    rng = random.Random(37)
    prompt = [rng.randrange(3, 256) for _ in range(40)]

    def hits(path: str, body: dict, salt: str | None) -> float:
        before = _prefix_cache_hits(server)
        extra = {} if salt is None else {"cache_salt": salt}
        resp = _post(server, path, {**body, "max_tokens": 3, "ignore_eos": True, **extra})
        assert resp.status_code == 200, resp.text
        return _prefix_cache_hits(server) - before

    salts = ["tenant-a", "tenant-b", None, "tenant-a", "tenant-b", None]
    assert [hits("/v1/completions", {"prompt": prompt}, s) for s in salts] == \
        [0, 0, 0, 32, 32, 32]
    chat = {"messages": [{"role": "user", "content": "".join(
        rng.choice("abcdefghij ") for _ in range(60))}]}
    assert [hits("/v1/chat/completions", chat, s) > 0
            for s in ("tenant-a", "tenant-b", "tenant-a")] == [False, False, True]
    for salt in ("", "s" * 1025, 5):
        err = _error(_post(server, "/v1/completions", {"prompt": "hi", "cache_salt": salt}))
        assert err["param"] == "cache_salt"


# ---- /tokenize: chat's rendering, vLLM's fields ---------------------------------------

def test_tokenize_takes_vllms_fields_or_refuses_them_by_name(server):
    out = _post(server, "/tokenize", {"prompt": "hi there", "return_token_strs": True}).json()
    assert out["tokens"][0] == 1 and out["token_strs"][0] == "<s>"
    assert len(out["token_strs"]) == out["count"] == len(out["tokens"])
    bare = _post(server, "/tokenize", {"prompt": "hi there", "add_special_tokens": False})
    assert bare.json()["tokens"] == out["tokens"][1:]
    bad_tool = [{"type": "function", "function": {"name": ""}}]
    for body, param in [
            ({"messages": ASKED, "chat_template": "{{ messages }}"}, "chat_template"),
            ({"messages": ASKED, "mm_processor_kwargs": {"a": 1}}, "mm_processor_kwargs"),
            ({"messages": ASKED, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
            ({"messages": ASKED, "tools": bad_tool}, "tools"),       # chat refuses it too
            ({"messages": PREFILL, "continue_final_message": True}, "continue_final_message"),
            ({"prompt": "hi", "add_generation_prompt": False}, "add_generation_prompt"),
            ({"prompt": "hi", "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
            ({"prompt": "hi", "messages": ASKED}, "prompt")]:
        assert _error(_post(server, "/tokenize", body))["param"] == param, body
    chat = _post(server, "/v1/chat/completions", {"messages": ASKED, "tools": bad_tool,
                                                  "tool_choice": "none", "max_tokens": 1})
    assert _error(chat)["param"] == "tools"


def test_tokenize_renders_messages_as_chat_does(tool_server):
    """chat_template_kwargs reach the template (the test template opens a think block
    with think=true) and tools are described, in /tokenize as in chat."""
    body = {"messages": ASKED, "chat_template_kwargs": {"think": True},
            "tools": [{"type": "function", "function": {"name": "get_time"}}]}
    tokens = _post(tool_server, "/tokenize", body).json()
    text = _post(tool_server, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"]
    assert "TOOLS:get_time;" in text and text.endswith("<assistant><think>\n")
    chat = _post(tool_server, "/v1/chat/completions", {**body, "tool_choice": "none",
                                                       "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == tokens["count"]
