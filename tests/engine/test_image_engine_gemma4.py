"""Gemma 4's images served end to end (issue 42 part 3), on CPU: its image tokens see
their whole image on the sliding layers (use_bidirectional_attention "vision"; the
window, smaller than an image here, bounds only the past), so chunks never end inside
an image and prefix hits end outside them; the per-layer inputs take the pad id at image
tokens. LLM.chat's greedy tokens and float32 logprobs equal transformers' full model's
`generate` for one image and two, alone and batched with a text-only row."""
from __future__ import annotations

import pytest

from jaxserve import LLM
from tests.checkpoints import make_tiny_vision_serving_checkpoint
from tests.engine.conftest import assert_no_leaks
from tests.engine.test_image_engine import GREEDY, TAIL, chat, check, reference
from tests.image_server import noise_image

BUDGET = 96          # holds the largest image (70 tokens); a two-image prompt takes two chunks
A, B, C = noise_image(64, 96, 0), noise_image(150, 40, 1), noise_image(64, 96, 2)
ONE, TWO, TEXT = chat("What is ", A, TAIL), chat("Compare ", A, " and", B, TAIL), \
    [{"role": "user", "content": "no image here, just text" + TAIL}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_vision_serving_checkpoint(
        "gemma4_vl", tmp_path_factory.mktemp("gvl") / "g", use_bidirectional_attention="vision",
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=264)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(checkpoint, dtype="float32", max_model_len=512, max_num_seqs=4,
               max_num_batched_tokens=BUDGET)


@pytest.fixture(scope="module")
def expected(llm, checkpoint) -> dict:
    render = llm.engine.inputs.render_chat_mm
    return {name: reference(checkpoint, render(msgs)[0], images, "gemma4_vl")
            for name, msgs, images in (("one", ONE, [A]), ("two", TWO, [A, B]),
                                       ("text", TEXT, []))}


def test_images_match_transformers_and_chunks_keep_images_whole(llm, expected):
    engine = llm.engine
    engine.reset_prefix_cache()
    before = engine.num_compilations
    chunks = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        chunks.extend(out.scheduled())
        return out
    engine.scheduler.schedule = recording
    try:
        alone = llm.chat(TWO, GREEDY, use_tqdm=False)[0]
        engine.reset_prefix_cache()
        outs = llm.chat([ONE, TEXT, TWO], GREEDY, use_tqdm=False)
    finally:
        engine.scheduler.schedule = schedule
    check(alone, expected["two"])
    for out, name in zip(outs, ("one", "text", "two")):
        check(out, expected[name])
    render = engine.inputs.render_chat_mm
    assert len(render(TWO)[0]) > BUDGET          # it takes more than one chunk
    spans = {rid: [(im.offset, im.offset + im.length) for im in render(msgs)[1].images]
             for rid, msgs in ((alone.request_id, TWO), (outs[0].request_id, ONE),
                               (outs[2].request_id, TWO))}
    ends = [(rid, start + n) for rid, start, n in chunks if rid in spans]
    assert not any(lo < end < hi for rid, end in ends for lo, hi in spans[rid])
    # a chunk was cut short at an image's start (its whole image went to the next step)
    assert any(end == lo for rid, end in ends for lo, _ in spans[rid][1:])
    assert engine.num_compilations == before, "something compiled after warmup"
    assert_no_leaks(engine)


def test_prefix_hits_end_outside_images(llm, checkpoint, expected):
    engine = llm.engine
    engine.reset_prefix_cache()
    ids, mm = engine.inputs.render_chat_mm(TWO)
    llm.chat(TWO, GREEDY, use_tqdm=False)
    again = llm.chat(TWO, GREEDY, use_tqdm=False)[0]
    check(again, expected["two"])
    hit = again.num_cached_tokens
    assert hit > mm.images[0].offset
    assert not any(im.offset < hit < im.offset + im.length for im in mm.images)
    # The first image swapped for another of the same size: same ids, no hit past it.
    swapped = llm.chat(chat("Compare ", C, " and", B, TAIL), GREEDY, use_tqdm=False)[0]
    assert swapped.num_cached_tokens <= mm.images[0].offset
    check(swapped, reference(checkpoint, ids, [C, B], "gemma4_vl"))
    assert_no_leaks(engine)


def test_images_on_the_pallas_kernel_match_transformers(checkpoint, expected):
    """The same requests on the Pallas attention kernel (its TPU body in interpret mode):
    the image mask (each token's horizon) is the kernel's, not a refusal."""
    llm = LLM(checkpoint, dtype="float32", max_model_len=512, max_num_seqs=4,
              max_num_batched_tokens=BUDGET, attention_backend="pallas_interpret",
              enforce_eager=True)
    assert llm.engine.inputs.image_front.refusal is None
    outs = llm.chat([ONE, TEXT, TWO], GREEDY, use_tqdm=False)
    for out, name in zip(outs, ("one", "text", "two")):
        check(out, expected[name])
    assert_no_leaks(llm.engine)
