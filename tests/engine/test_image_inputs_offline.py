"""Images in, up to the processed prompt (issue 42 part 2), without an engine: chat
messages with image_url parts and offline multi_modal_data become prompt ids whose image
placeholders are expanded exactly as transformers' chat template + image processor +
replace_image_token give, plus a payload (pixels, spans, content hashes); every bad image
is an InputError naming the field; the offline paths hand the engine the same payload."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from jaxserve.errors import InputError
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.engine.llm import LLM
from jaxserve.config.media import MediaConfig
from jaxserve.multimodal.front import ImageFront
from jaxserve.sampling_params import SamplingParams
from tests.checkpoints import VISION_MARKERS, make_tiny_vision_serving_checkpoint
from tests.image_server import ImageServer, data_url, encoded, noise_image

KINDS = ("qwen3_5", "gemma4_vl")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {k: make_tiny_vision_serving_checkpoint(k, tmp_path_factory.mktemp(k) / "ckpt")
            for k in KINDS}


def processor(path: str, media: MediaConfig | None = None, **front) -> InputProcessor:
    from transformers import AutoTokenizer
    return InputProcessor(tokenizer=AutoTokenizer.from_pretrained(path), vocab_size=264,
                          max_model_len=1024,
                          images=ImageFront.for_model(path, media or MediaConfig(), **front))


@pytest.fixture(scope="module")
def inputs(checkpoints) -> dict[str, InputProcessor]:
    return {k: processor(p) for k, p in checkpoints.items()}


def reference_ids(kind: str, path: str, messages: list[dict], images: list) -> list[int]:
    """transformers: the chat template on messages with {"type": "image"} parts, each
    marker replaced by the full processor's replace_image_token for the image processor's
    output, tokenized."""
    from transformers import AutoImageProcessor, AutoTokenizer, Gemma4Processor, Qwen3VLProcessor
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    image_proc = AutoImageProcessor.from_pretrained(path, backend="pil")
    out = image_proc(images=images, return_tensors="np")
    (start, _), (image, _), (end, _) = VISION_MARKERS[kind]
    if kind == "qwen3_5":
        fake, cls = SimpleNamespace(image_processor=image_proc, image_token=image), Qwen3VLProcessor
    else:
        fake, cls = SimpleNamespace(boi_token=start, eoi_token=end, image_token=image), Gemma4Processor
    pieces = text.split(image)
    assert len(pieces) == len(images) + 1
    text = pieces[0] + "".join(cls.replace_image_token(fake, out, i) + rest
                               for i, rest in enumerate(pieces[1:]))
    return tok(text, add_special_tokens=False)["input_ids"]


def parts(*items) -> list[dict]:
    """Content parts: str -> text, PIL image -> image_url with a data URL."""
    return [{"type": "text", "text": x} if isinstance(x, str)
            else {"type": "image_url", "image_url": {"url": data_url(x)}} for x in items]


def as_template(messages: list[dict]) -> list[dict]:
    return [{**m, "content": [{"type": "image"} if p["type"] == "image_url" else p
                              for p in m["content"]]} if isinstance(m["content"], list) else m
            for m in messages]


A, B, C = noise_image(50, 70, 0), noise_image(120, 40, 1), noise_image(64, 64, 2)
CONVERSATIONS = {
    "one image": ([{"role": "user", "content": parts("What is ", A, " about?")}], [A]),
    "several images": ([{"role": "user", "content": parts(A, "and", B, C)}], [A, B, C]),
    "between turns": ([{"role": "user", "content": "hello"},
                       {"role": "assistant", "content": "hi there"},
                       {"role": "user", "content": parts("look: ", B, " and now?")}], [B]),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(CONVERSATIONS))
def test_chat_ids_and_payload_match_transformers(kind, case, checkpoints, inputs):
    messages, images = CONVERSATIONS[case]
    ids, mm = inputs[kind].render_chat_mm(messages)
    assert ids == reference_ids(kind, checkpoints[kind], as_template(messages), images)
    image_id = inputs[kind].images.tokens.image
    assert len(mm.images) == len(images)
    for im in mm.images:    # each span is a run of image tokens, nothing more
        assert ids[im.offset:im.offset + im.length] == [image_id] * im.length
        assert im.offset + im.length == len(ids) or ids[im.offset + im.length] != image_id
    assert sum(im.length for im in mm.images) == ids.count(image_id)


def test_content_hash_is_of_the_pixels(inputs):
    p = inputs["qwen3_5"]
    msgs = [{"role": "user", "content": parts(A, B, A.copy())}]
    hashes = [im.content_hash for im in p.render_chat_mm(msgs)[1].images]
    assert hashes[0] == hashes[2] != hashes[1]
    jpeg = [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": data_url(A, "JPEG")}}]}]     # other pixels after a lossy re-encode
    assert p.render_chat_mm(jpeg)[1].images[0].content_hash != hashes[0]


def test_pixels_are_the_reference_processors_transparency_included(checkpoints, inputs):
    """A PNG with an alpha channel (and a palette one): the payload's pixels equal the
    image processor's own on the original image (which lays transparency over white)."""
    from PIL import Image
    from transformers import AutoImageProcessor
    rgba = np.random.default_rng(3).integers(0, 256, (60, 80, 4), dtype=np.uint8)
    for image in (Image.fromarray(rgba, "RGBA"), A.convert("P")):
        for kind in KINDS:
            ref = AutoImageProcessor.from_pretrained(checkpoints[kind], backend="pil")(
                images=[image], return_tensors="np")["pixel_values"]
            mm = inputs[kind].render_chat_mm([{"role": "user", "content": parts(image)}])[1]
            np.testing.assert_array_equal(mm.images[0].processed.pixels, ref.reshape(
                mm.images[0].processed.pixels.shape))


def test_offline_generate_and_chat_hand_the_engine_the_same_payload(inputs):
    p = inputs["qwen3_5"]
    llm = LLM.__new__(LLM)      # the parsing half of LLM: the engine only records requests
    added = []
    llm.engine = SimpleNamespace(inputs=p, add_request=added.append,
                                 has_unfinished_requests=lambda: False)
    llm._next_id = 0
    chat_ids, chat_mm = p.render_chat_mm([{"role": "user", "content": parts("x", A)}])
    marker = "".join(m for m, _ in VISION_MARKERS["qwen3_5"])
    text = p.tokenizer.apply_chat_template([{"role": "user", "content": "x" + marker}],
                                           tokenize=False, add_generation_prompt=True)
    ids, mm = p.image_front.expand(p.tokenize(text, add_special_tokens=False), [A])
    assert ids == chat_ids and [i.content_hash for i in mm.images] == \
        [i.content_hash for i in chat_mm.images]
    for call in (lambda: llm.generate({"prompt": text, "multi_modal_data": {"image": A}}),
                 lambda: llm.generate({"prompt_token_ids": p.tokenize(text, add_special_tokens=False),
                                       "multi_modal_data": {"image": [A]}}),
                 lambda: llm.chat([{"role": "user", "content": parts("x", A)}])):
        call()
    # (the text prompt is tokenized with the tokenizer's special tokens: a BOS first)
    assert [list(r.prompt_token_ids[-len(chat_ids):]) for r in added] == [chat_ids] * 3
    assert [list(r.prompt_token_ids) for r in added[1:]] == [chat_ids] * 2
    assert [[i.content_hash for i in r.multi_modal.images] for r in added] == \
        [[i.content_hash for i in chat_mm.images]] * 3
    with pytest.raises(InputError, match="2 image.* given but the prompt has 1"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": [A, B]}})
    with pytest.raises(InputError, match="'video'.*not served"):
        llm.generate({"prompt": text, "multi_modal_data": {"video": [A]}})
    with pytest.raises(InputError, match="not a PIL image"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": "a.png"}})


def bad(p: InputProcessor, content: list[dict], match: str) -> None:
    with pytest.raises(InputError, match=match) as e:
        p.render_chat_mm([{"role": "user", "content": content}])
    assert e.value.param == "messages" and len(str(e.value)) < 400


def url_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_bad_images_are_refused_by_name(inputs, tmp_path):
    p = inputs["qwen3_5"]
    bad(p, [url_part("data:image/png;base64,iVBORw0KGgoAAAANSUhEUg==")], "cannot be decoded")
    bad(p, [url_part("data:image/png;base64,@@@")], "not valid base64")
    bad(p, [url_part("data:image/png;base64," + "QUFB" * 10)], "format is not one of")
    tiff = data_url(A, "TIFF").replace("image/tiff", "image/png")
    bad(p, [url_part(tiff)], "format is not one of")
    bad(p, [url_part("data:text/plain;base64,QUFB")], "media type must be image")
    bad(p, [url_part("ftp://example.com/a.png")], "scheme must be")
    bad(p, [url_part("file:///etc/passwd")], "--allowed-local-media-path")
    bad(p, parts(noise_image(4, 900)), "aspect ratio")     # Qwen's smart_resize: > 200
    bad(p, parts(*[A] * 17), "17 images; at most 16")
    for kind in ("video_url", "input_audio", "image_pil", "image_embeds", "input_image"):
        bad(p, [{"type": kind, kind: {}}], repr(kind))
    bad(p, [{"type": "image_url", "image_url": {"url": "x", "detail": "low"}}], "detail")


def test_limits_local_files_and_text_only(checkpoints, tmp_path):
    path = checkpoints["qwen3_5"]
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(encoded(A))
    (tmp_path / "outside.png").write_bytes(encoded(A))
    media = MediaConfig.from_settings(limit_mm_per_prompt={"image": 1},
                                      allowed_local_media_path=str(allowed),
                                      mm_processor_kwargs={"max_pixels": 4 * 32 * 32})
    p = processor(path, media)
    ids, mm = p.render_chat_mm([{"role": "user", "content": [url_part(f"file://{allowed}/a.png")]}])
    assert mm.images[0].length == 4       # the processor kwargs apply: at most 4 tokens
    bad(p, [url_part(f"file://{allowed}/../outside.png")], "outside --allowed-local-media-path")
    bad(p, [url_part(f"file://{allowed}/none.png")], "cannot be read")
    bad(p, parts(A, A), "2 images; at most 1")
    bad(processor(path, language_model_only=True), parts(A), "--language-model-only")
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_kwargs import engine_kwargs
    from jaxserve.multimodal.front import image_front
    config = EngineConfig(model=path, **engine_kwargs(dict(   # LLM(...)'s keywords
        language_model_only=True, limit_mm_per_prompt={"image": 3},
        allowed_local_media_path=str(allowed))))
    assert "--language-model-only" in image_front(config).refusal
    front = image_front(replace(config, language_model_only=False))
    assert front.refusal is None and front.media.max_images == 3
    assert front.media.allowed_local_media_path == str(allowed.resolve())
    from tests.checkpoints import make_tiny_checkpoint
    text_only = make_tiny_checkpoint("qwen3", tmp_path / "text")
    bad(processor(text_only), parts(A), r"takes text only")
    for kwargs, name in (({"a": 1}, "'a'"), ({"patch_size": 8}, "'patch_size'")):
        with pytest.raises(ValueError, match=f"mm_processor_kwargs: {name} is not a setting"):
            ImageFront.for_model(path, MediaConfig(processor_kwargs=kwargs))
    with pytest.raises(ValueError, match="video"):
        MediaConfig.from_settings(limit_mm_per_prompt={"image": 2, "video": 1},
                                  allowed_local_media_path=None, mm_processor_kwargs=None)


def test_http_urls_with_size_and_time_limits(checkpoints):
    srv = ImageServer({"a.png": encoded(A)})
    try:
        media = MediaConfig(fetch_timeout_s=1.0, max_image_bytes=100_000)
        p = processor(checkpoints["qwen3_5"], media)
        ids, mm = p.render_chat_mm([{"role": "user", "content": [url_part(srv.url + "/a.png")]}])
        local = p.render_chat_mm([{"role": "user", "content": parts(A)}])
        assert ids == local[0] and mm.images[0].content_hash == local[1].images[0].content_hash
        bad(p, [url_part(srv.url + "/missing.png")], "HTTP 404")
        two = p.render_chat_mm([{"role": "user", "content": [url_part(srv.url + "/a.png")] * 2}])[1]
        assert [im.content_hash for im in two.images] == [mm.images[0].content_hash] * 2
        bad(p, [url_part(srv.url + "/a.png"), url_part(srv.url + "/missing.png")], "HTTP 404")
        bad(p, [url_part(srv.url + "/big")], "larger than the 100000 bytes")
        bad(p, [url_part(srv.url + "/slow")], "took longer than 1 s")
        bad(p, [url_part("http://127.0.0.1:1/a.png")], "failed: ConnectError")
    finally:
        srv.close()


def test_engine_request_carries_the_images(inputs):
    for p in inputs.values():
        ids, mm = p.render_chat_mm([{"role": "user", "content": parts("hi", A)}])
        assert p.process("r", ids, SamplingParams(max_tokens=4), multi_modal=mm).multi_modal is mm
        assert p.process("r", ids[:3], SamplingParams(max_tokens=4)).multi_modal is None
