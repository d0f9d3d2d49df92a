"""benchmarks/multimodal/vision_ttft.py's conversation mode on the tiny Qwen3.5 checkpoint:
without prefix caching every turn recomputes the image's span, which the encoder cache
serves after the first turn encoded it."""
from __future__ import annotations

from benchmarks.multimodal import vision_ttft
from tests.checkpoints import make_tiny_vision_serving_checkpoint


def test_a_conversation_encodes_its_image_once(tmp_path):
    path = make_tiny_vision_serving_checkpoint("qwen3_5", tmp_path / "vl",
                                               max_position_embeddings=4096)
    out = vision_ttft.conversation(path, 64, turns=3)
    assert (out["images_encoded"], out["encoder_cache_hits"]) == (1, 2)
    assert out["encoder_hit_rate"] == round(2 / 3, 3)
    assert out["ttft_ms"]["first turn"] > 0 and out["ttft_ms"]["later turns"] > 0
