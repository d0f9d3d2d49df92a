"""Images through the server (issue 42 part 2), with the openai client: image_url parts
(data URLs, http(s) URLs from a local server, file:// under --allowed-local-media-path)
become the same expanded prompt ids as transformers gives (checked through /tokenize);
every bad image is a 400 naming `messages`; a good image is served (part 3): the answer
is transformers' greedy generation on the same image, streamed or not, for a data URL,
an http URL and a file:// URL alike."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.api.conftest import API_KEY, Server
from tests.checkpoints import make_tiny_vision_serving_checkpoint
from tests.engine.test_image_engine import NUM_NEW, reference
from tests.engine.test_image_inputs_offline import A, B, as_template, parts, reference_ids
from tests.image_server import ImageServer, data_url, encoded

MAX_BYTES = 200_000


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "a.png").write_bytes(encoded(A))
    srv = ImageServer({"a.png": encoded(A)}, big_bytes=4 * MAX_BYTES)
    yield root, srv
    srv.close()


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory, media):
    path = make_tiny_vision_serving_checkpoint("qwen3_5", tmp_path_factory.mktemp("vl") / "q")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "2")
        mp.setenv("JAXSERVE_MAX_IMAGE_BYTES", str(MAX_BYTES))
        srv = Server(path, "--max-model-len", "256", "--limit-mm-per-prompt",
                     json.dumps({"image": 2, "video": 0}), "--allowed-local-media-path",
                     str(media[0]))
    srv.checkpoint = path
    yield srv
    srv.stop()


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)


def chat_error(srv: Server, content: list[dict]) -> str:
    """The 400's message for one user message of these parts."""
    with pytest.raises(openai.BadRequestError) as e:
        client(srv).chat.completions.create(model=srv_model(srv), max_tokens=4,
                                            messages=[{"role": "user", "content": content}])
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == "messages" and len(err["message"]) < 400
    return err["message"]


def srv_model(srv: Server) -> str:
    return client(srv).models.list().data[0].id


def url_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_tokenize_gives_transformers_ids_for_data_and_http_urls(vl_server, media):
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                {"role": "user", "content": parts("look ", A, " and ", B)}]
    want = reference_ids("qwen3_5", vl_server.checkpoint, as_template(messages), [A, B])
    r = httpx.post(vl_server.url + "/tokenize", json={"messages": messages},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert r.status_code == 200 and r.json()["tokens"] == want
    over_http = [{"role": "user", "content": [url_part(media[1].url + "/a.png")]}]
    local = [{"role": "user", "content": [url_part(f"file://{media[0]}/a.png")]}]
    got = [httpx.post(vl_server.url + "/tokenize", json={"messages": m},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120).json()["tokens"]
           for m in (over_http, local, [{"role": "user", "content": parts(A)}])]
    assert got[0] == got[1] == got[2]


def test_a_chat_with_an_image_is_answered_as_transformers_does(vl_server, media):
    from transformers import AutoTokenizer
    path = vl_server.checkpoint
    messages = [{"role": "user", "content": parts("what is this?", A)}]
    ids = reference_ids("qwen3_5", path, as_template(messages), [A])
    want = AutoTokenizer.from_pretrained(path).decode(reference(path, ids, [A])[0],
                                                      skip_special_tokens=True)
    greedy = dict(model=srv_model(vl_server), max_tokens=NUM_NEW, temperature=0.0,
                  extra_body={"ignore_eos": True})
    for content in (parts("what is this?", A),
                    [{"type": "text", "text": "what is this?"}, url_part(media[1].url + "/a.png")],
                    [{"type": "text", "text": "what is this?"},
                     url_part(f"file://{media[0]}/a.png")]):
        out = client(vl_server).chat.completions.create(
            messages=[{"role": "user", "content": content}], **greedy)
        assert out.choices[0].message.content == want
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == NUM_NEW
    chunks = client(vl_server).chat.completions.create(messages=messages, stream=True, **greedy)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    # Text alone still runs.
    out = client(vl_server).chat.completions.create(
        model=srv_model(vl_server), max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("content, message", [
    ([url_part("data:image/png;base64,iVBORw0KGgoAAAANSUhEUg==")], "cannot be decoded"),
    ([url_part(data_url(A, "TIFF").replace("image/tiff", "image/png"))], "format is not one of"),
    (parts(A, B, A), "3 images; at most 2"),
    ([url_part("file:///etc/hostname")], "outside --allowed-local-media-path"),
    ([{"type": "video_url", "video_url": {"url": "x"}}], "video inputs are not served"),
    ([{"type": "input_audio", "input_audio": {"data": "x"}}], "audio inputs are not served"),
    ([{"type": "image_embeds", "image_embeds": "x"}], "'image_embeds'"),
    ([{"type": "image_pil", "image_pil": "x"}], "'image_pil'"),
])
def test_bad_images_are_400s_naming_messages(vl_server, content, message):
    assert message in chat_error(vl_server, content)


@pytest.mark.parametrize("path, message", [
    ("/missing.png", "HTTP 404"), ("/big", f"larger than the {MAX_BYTES} bytes"),
    ("/slow", "took longer than 2 s")])
def test_url_failures_are_400s(vl_server, media, path, message):
    assert message in chat_error(vl_server, [url_part(media[1].url + path)])


def test_an_image_on_a_text_only_model_is_a_400(server):
    assert "takes text only" in chat_error(server, parts("x", A))
