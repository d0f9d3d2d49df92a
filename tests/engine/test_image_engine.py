"""Images served end to end (issue 42 part 3), Qwen3.5 on CPU: LLM.chat with one and two
images gives transformers' full vision-language model's greedy tokens and float32
logprobs (`generate` on the same safetensors), alone and in a batch with a text-only
row; a prefill chunk cuts through an image (the chunk budget is smaller than the
prompt); each image is encoded once; a repeated image is a prefix hit, the same
placeholder ids with other pixels are not; nothing compiles after warmup."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from tests.checkpoints import make_tiny_vision_serving_checkpoint, model_class
from tests.engine.conftest import assert_no_leaks
from tests.image_server import data_url, noise_image

NUM_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0)
BUDGET = 32           # tokens a step: prompts of ~60-90 tokens take several chunks
ATOL = 1e-4
A, B, C, D = (noise_image(50, 70, 0), noise_image(120, 40, 1), noise_image(128, 128, 2),
              noise_image(50, 70, 3))
TAIL = " tell me about it, in a few words please"


def chat(*items) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": x} if isinstance(x, str)
        else {"type": "image_url", "image_url": {"url": data_url(x)}} for x in items]}]


ONE, TWO, TEXT = chat("What is ", A, TAIL), chat("Compare ", B, " and", C, TAIL), \
    [{"role": "user", "content": "no image here, just text" + TAIL}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_vision_serving_checkpoint("qwen3_5", tmp_path_factory.mktemp("qvl") / "q")


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(checkpoint, dtype="float32", max_model_len=256, max_num_seqs=4,
               max_num_batched_tokens=BUDGET)


def reference(path: str, ids: list[int], images: list, kind: str = "qwen3_5"
              ) -> tuple[list[int], list[float]]:
    """transformers' generate (float32, greedy) of the full vision-language model on the
    prompt ids and the images' pixels from the checkpoint's image processor: (tokens,
    their logprobs)."""
    from transformers import AutoImageProcessor
    model = model_class(kind).from_pretrained(path, dtype=torch.float32).eval()
    input_ids = torch.tensor([ids])
    kw = {}
    if images:
        px = AutoImageProcessor.from_pretrained(path, backend="pil")(images=images,
                                                                      return_tensors="pt")
        kw = {k: px[k] for k in ("pixel_values", "image_grid_thw", "image_position_ids")
              if k in px}
        kw["mm_token_type_ids"] = (input_ids == model.config.image_token_id).int()
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=NUM_NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **kw)
    tokens = out.sequences[0, len(ids):].tolist()
    lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens)]
    return tokens, lps


@pytest.fixture(scope="module")
def expected(llm, checkpoint) -> dict[str, tuple[list[int], list[float]]]:
    render = llm.engine.inputs.render_chat_mm
    return {name: reference(checkpoint, render(msgs)[0], images) for name, msgs, images in
            (("one", ONE, [A]), ("two", TWO, [B, C]), ("text", TEXT, []))}


def check(out, want: tuple[list[int], list[float]]) -> None:
    tokens = out.outputs[0].token_ids
    assert tokens == want[0]
    got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]
    np.testing.assert_allclose(got, want[1], atol=ATOL, rtol=0)


def test_images_match_transformers_alone_and_batched(llm, expected):
    engine = llm.engine
    engine.reset_prefix_cache()
    before, encoded = engine.num_compilations, engine.scheduler.encoder.num_encoded
    chunks = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        chunks.extend(out.scheduled())
        return out
    engine.scheduler.schedule = recording
    try:
        check(llm.chat(ONE, GREEDY, use_tqdm=False)[0], expected["one"])
        check(llm.chat(TWO, GREEDY, use_tqdm=False)[0], expected["two"])
        engine.reset_prefix_cache()
        outs = llm.chat([TWO, TEXT, ONE], GREEDY, use_tqdm=False)
    finally:
        engine.scheduler.schedule = schedule
    for out, name in zip(outs, ("two", "text", "one")):
        check(out, expected[name])
    # Alone: A, B, C once each; batched: all three again (the cache was reset in between
    # only for pages, so the images are encoder-cache hits).
    assert engine.scheduler.encoder.num_encoded - encoded == 3
    # Some chunk starts strictly inside an image's span (prefill continues across it).
    spans = [(im.offset, im.offset + im.length)
             for im in engine.inputs.render_chat_mm(TWO)[1].images]
    assert any(lo < start < hi for _, start, _ in chunks for lo, hi in spans)
    assert engine.num_compilations == before, "something compiled after warmup"
    assert_no_leaks(engine)


def test_prefix_hit_needs_the_same_image(llm, checkpoint, expected):
    engine = llm.engine
    engine.reset_prefix_cache()
    ids, mm = engine.inputs.render_chat_mm(ONE)
    other_ids, other = engine.inputs.render_chat_mm(chat("What is ", D, TAIL))
    assert ids == other_ids and mm.images[0].content_hash != other.images[0].content_hash
    first = llm.chat(ONE, GREEDY, use_tqdm=False)[0]
    again = llm.chat(ONE, GREEDY, use_tqdm=False)[0]
    check(again, expected["one"])
    image_end = mm.images[0].offset + mm.images[0].length
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= image_end
    swapped = llm.chat(chat("What is ", D, TAIL), GREEDY, use_tqdm=False)[0]
    assert swapped.num_cached_tokens <= mm.images[0].offset
    check(swapped, reference(checkpoint, ids, [D]))
    assert swapped.outputs[0].token_ids != first.outputs[0].token_ids
    assert_no_leaks(engine)


def test_a_new_image_size_with_prefix_caching_runs_one_encoder_call(llm):
    """With prefix caching on (the default), an image of a size no other test sends runs
    one encoder call and no compilation; the same image again is a prefix hit past it
    and runs none (the benchmark's ~1 s for a new image there was XLA:CPU's first runs
    and a loaded machine, not a compile nor a second encoding: benchmarks/README.md)."""
    engine = llm.engine
    assert engine.prefix_caching
    encoder = engine.runner.encoder
    calls = []
    encode = encoder._encode

    def counting(*args):
        calls.append(args[2].shape)
        return encode(*args)
    before = engine.num_compilations
    msgs = chat("What is ", noise_image(90, 33, 7), TAIL)
    image = engine.inputs.render_chat_mm(msgs)[1].images[0]
    encoder._encode = counting
    try:
        first = llm.chat(msgs, GREEDY, use_tqdm=False)[0]
        assert len(calls) == 1
        again = llm.chat(msgs, GREEDY, use_tqdm=False)[0]
    finally:
        encoder._encode = encode
    assert len(calls) == 1 and again.num_cached_tokens >= image.offset + image.length
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert engine.num_compilations == before, "something compiled after warmup"
    assert_no_leaks(engine)


def test_a_tensor_parallel_mesh_gives_the_same_answers(checkpoint, expected):
    """Under --mesh 1x2 the tower and the encoder cache are replicated and the text model
    is split over the model axis: the same greedy tokens and logprobs as transformers, for
    one image and two, batched with a text-only row."""
    llm = LLM(checkpoint, dtype="float32", max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=BUDGET, mesh="1x2")
    engine = llm.engine
    assert engine.runner.mesh.shape["model"] == 2
    before = engine.num_compilations
    outs = llm.chat([ONE, TWO, TEXT], GREEDY, use_tqdm=False)
    for out, name in zip(outs, ("one", "two", "text")):
        check(out, expected[name])
    assert engine.num_compilations == before, "something compiled after warmup"
    assert_no_leaks(engine)


def test_ngram_speculation_keeps_the_greedy_tokens_with_images(llm, checkpoint):
    """Speculative decoding (ngram) on image prompts: drafts verified by forwards that
    read the image rows and Qwen's 3-axis positions give the plain engine's greedy
    tokens, and some drafts are accepted (the verify path ran). Tokens only: no warmup,
    each program compiles when first used."""
    spec = LLM(checkpoint, dtype="float32", max_model_len=256, max_num_seqs=4,
               max_num_batched_tokens=BUDGET, speculative_config={
                   "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                   "prompt_lookup_max": 3}, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    msgs = [ONE, TWO, chat("Now ", D, " then", A, TAIL)]
    want = [o.outputs[0].token_ids for o in llm.chat(msgs, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.chat(msgs, params, use_tqdm=False)]
    assert got == want
    assert spec.engine.stats().spec_num_accepted_tokens > 0
    assert_no_leaks(spec.engine)


@pytest.fixture(scope="module")
def mtp_checkpoint(checkpoint, tmp_path_factory) -> str:
    """The same checkpoint (tower and text model) with a random MTP layer added."""
    import shutil

    from tests.checkpoints import add_mtp_layer
    copy = tmp_path_factory.mktemp("qvl_mtp") / "q"
    shutil.copytree(checkpoint, copy)
    return add_mtp_layer(copy)


@pytest.fixture(scope="module")
def draft_checkpoint(tmp_path_factory) -> str:
    """A tiny full-attention Qwen3 of the vision checkpoint's vocabulary (a draft model
    must have full attention in every layer)."""
    from tests.checkpoints import make_tiny_checkpoint
    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("draft"), vocab_size=264)


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_model_drafters_keep_the_greedy_tokens_with_images(llm, checkpoint, mtp_checkpoint,
                                                           draft_checkpoint, method):
    """A model drafter (an MTP layer; a draft model) drafts from the placeholder ids,
    never the image embeddings, so its drafts may be worse, but
    the target verifies each: image prompts (one image, two, an image batched beside
    text) give the plain engine's greedy tokens, and drafts were made and verified."""
    config = {"method": method, "num_speculative_tokens": 2}
    if method == "draft_model":
        config["model"] = draft_checkpoint
    spec = LLM(mtp_checkpoint if method == "mtp" else checkpoint, dtype="float32",
               max_model_len=256, max_num_seqs=4, max_num_batched_tokens=BUDGET,
               speculative_config=config, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    msgs = [ONE, TWO, TEXT]
    want = [o.outputs[0].token_ids for o in llm.chat(msgs, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.chat(msgs, params, use_tqdm=False)]
    assert got == want
    s = spec.engine.scheduler.stats()
    assert s.spec_num_drafts > 0 and s.spec_num_draft_tokens > 0, s
    assert_no_leaks(spec.engine)
