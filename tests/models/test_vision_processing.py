"""Image preprocessing without torchvision (models/vision/processing.py): the checkpoint's
image processor loads with the PIL backend whatever class its preprocessor_config.json
names, takes mm_processor_kwargs, splits a batch per image consistently with the joint
output; placeholder expansion equals transformers' own replace_image_token (the full
processors cannot be built without torchvision, so their expansion function is run on
its own) followed by tokenization."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from jaxserve.checkpoints.tiny_tokenizer import make_tiny_tokenizer
from models.vision.processing import (ImageTokens, expand_image_tokens, load_image_processor,
                                      preprocess, vision_family)

QWEN_MARKS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
GEMMA_MARKS = ["<|image>", "<|image|>", "<image|>"]


def image(h: int, w: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _save(processor, path, type_name: str) -> str:
    """Save as the published checkpoints do: preprocessor_config.json naming the
    torchvision class."""
    processor.save_pretrained(str(path))
    cfg_file = path / "preprocessor_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["image_processor_type"] = type_name
    cfg_file.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from transformers import Qwen2VLImageProcessorPil
    return _save(Qwen2VLImageProcessorPil(patch_size=16, merge_size=2),
                 tmp_path_factory.mktemp("qproc"), "Qwen2VLImageProcessorFast")


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    from transformers import Gemma4ImageProcessorPil
    return _save(Gemma4ImageProcessorPil(max_soft_tokens=70), tmp_path_factory.mktemp("gproc"),
                 "Gemma4ImageProcessor")


def test_loads_the_pil_backend_and_takes_processor_kwargs(qwen_dir, gemma_dir):
    big = image(600, 900)
    q = load_image_processor(qwen_dir)
    assert type(q).__name__ == "Qwen2VLImageProcessorPil"
    small = load_image_processor(qwen_dir, max_pixels=64 * 32 * 32)
    assert preprocess(small, "qwen3_5", [big])[0].num_tokens <= 64 < preprocess(q, "qwen3_5", [big])[0].num_tokens
    g = load_image_processor(gemma_dir)
    assert type(g).__name__ == "Gemma4ImageProcessorPil"
    assert preprocess(g, "gemma4", [big])[0].num_tokens <= 70
    assert 70 < preprocess(load_image_processor(gemma_dir, max_soft_tokens=140), "gemma4", [big])[0].num_tokens <= 140


def test_qwen_split_per_image_matches_the_joint_output(qwen_dir):
    proc = load_image_processor(qwen_dir)
    images = [image(64, 96, 0), image(300, 120, 1), image(40, 40, 2)]
    joint = proc(images=images, return_tensors="np")
    parts = preprocess(proc, "qwen3_5", images)
    np.testing.assert_array_equal(np.concatenate([p.pixels for p in parts]), joint["pixel_values"])
    assert [p.grid for p in parts] == [tuple(g) for g in joint["image_grid_thw"].tolist()]
    assert [p.num_tokens for p in parts] == [t * h * w // 4 for t, h, w in joint["image_grid_thw"].tolist()]
    assert all(p.pixels.shape == (np.prod(p.grid), 3 * 2 * 16 * 16) for p in parts)


def _reference_ids(processor_cls, fake_self, marker: str, text: str, image_inputs: dict, tok) -> list[int]:
    """transformers' expansion: each marker replaced by replace_image_token's string."""
    pieces = text.split(marker)
    out = pieces[0]
    for i, rest in enumerate(pieces[1:]):
        out += processor_cls.replace_image_token(fake_self, image_inputs, i) + rest
    return tok(out, add_special_tokens=False)["input_ids"]


def test_qwen_expansion_matches_transformers(qwen_dir):
    from transformers import Qwen3VLProcessor
    tok = make_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": QWEN_MARKS})
    proc = load_image_processor(qwen_dir)
    images = preprocess(proc, "qwen3_5", [image(64, 96, 0), image(150, 70, 1)])
    mark = "".join(QWEN_MARKS)
    text = f"Hello {mark} and then {mark}\nthe end"
    fake = SimpleNamespace(image_processor=proc, image_token="<|image_pad|>")
    inputs = {"image_grid_thw": np.array([im.grid for im in images])}
    want = _reference_ids(Qwen3VLProcessor, fake, "<|image_pad|>", text, inputs, tok)
    tokens = ImageTokens(image=tok.convert_tokens_to_ids("<|image_pad|>"))
    got = expand_image_tokens(tok(text, add_special_tokens=False)["input_ids"], images, tokens)
    assert got == want and got.count(tokens.image) == sum(im.num_tokens for im in images) > 2


def test_gemma4_expansion_matches_transformers(gemma_dir):
    from transformers import Gemma4Processor
    tok = make_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": GEMMA_MARKS})
    proc = load_image_processor(gemma_dir)
    images = preprocess(proc, "gemma4", [image(64, 96, 0), image(150, 40, 1)])
    text = "Look: <|image|> versus <|image|>."
    fake = SimpleNamespace(boi_token="<|image>", eoi_token="<image|>", image_token="<|image|>")
    inputs = {"num_soft_tokens_per_image": [im.num_tokens for im in images]}
    want = _reference_ids(Gemma4Processor, fake, "<|image|>", text, inputs, tok)
    boi, img, eoi = tok.convert_tokens_to_ids(GEMMA_MARKS)
    got = expand_image_tokens(tok(text, add_special_tokens=False)["input_ids"], images,
                              ImageTokens(image=img, start=boi, end=eoi))
    assert got == want and got.count(boi) == 2


def test_image_tokens_from_published_ids_and_mismatches_refused():
    qwen = {"model_type": "qwen3_5", "vision_config": {"depth": 27}, "image_token_id": 248056}
    gemma = {"model_type": "gemma4", "vision_config": {"hidden_size": 1152}, "image_token_id": 258880,
             "boi_token_id": 255999, "eoi_token_id": 258882}
    assert ImageTokens.from_config(qwen) == ImageTokens(image=248056)
    assert ImageTokens.from_config(gemma) == ImageTokens(image=258880, start=255999, end=258882)
    with pytest.raises(ValueError, match="no vision tower"):
        vision_family({"model_type": "llama"})
    with pytest.raises(ValueError, match="no vision tower"):
        vision_family({"model_type": "gemma4", "vision_config": None})
    assert preprocess(None, "gemma4", []) == []     # no images: the processor is not called
    tokens = ImageTokens(image=9)
    with pytest.raises(ValueError, match="more image placeholders"):
        expand_image_tokens([1, 9, 9], [], tokens)
    with pytest.raises(ValueError, match="1 image"):
        expand_image_tokens([1, 2], [SimpleNamespace(num_tokens=3)], tokens)



def test_a_quantized_or_missing_tower_is_refused(tmp_path):
    """Float8 vision weights (with their scales) would load as raw codes: refused by name;
    a checkpoint without a tower says so."""
    import torch
    from safetensors.torch import save_file

    from models.vision.common import read_tensors
    w = torch.ones(4, 4)
    save_file({"model.visual.blocks.0.attn.qkv.weight": w.to(torch.float8_e4m3fn),
               "model.visual.blocks.0.attn.qkv.weight_scale_inv": torch.ones(1, 1),
               "model.language_model.embed_tokens.weight": w}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no vision tower"):
        read_tensors(tmp_path, ("model.vision_tower.",))
    with pytest.raises(ValueError, match="'model.visual.blocks.0.attn.qkv.weight' is stored as float8"):
        read_tensors(tmp_path, ("model.visual.",))
    save_file({"model.visual.x": w.to(torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    assert read_tensors(tmp_path, ("model.visual.",))["model.visual.x"].dtype == np.float32
