"""benchmarks/multimodal/encoder_tpu_compile.py on the tests' tiny tower: the chosen encoder
programs compile for TPU v6e and report their compile time and memory."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("libtpu")
from benchmarks.multimodal import encoder_tpu_compile  # noqa: E402  (after the skip)


def test_tiny_tower_buckets_compile(tmp_path):
    out = tmp_path / "enc.json"
    assert encoder_tpu_compile.main(["--tiny", "--mesh", "1x1", "--buckets", "16,64",
                                     "--max-num-batched-tokens", "256",
                                     "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["tower"] == "tiny" and res["target"] == "tpu-v6e"
    assert [p["patches"] for p in res["programs"]] == [16, 64]
    assert set(res["buckets"]) >= {16, 64}
    for p in res["programs"]:
        assert p["compile_s"] > 0 and p["argument_bytes"] > 0 and p["temp_bytes"] >= 0
