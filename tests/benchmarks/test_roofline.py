"""benchmarks.roofline on tiny sizes: the files, positive figures, and load_roofline."""
from __future__ import annotations

import json

import pytest

from benchmarks.roofline import load_roofline, main


def test_roofline_writes_and_loads(tmp_path):
    main(["--copy-mib", "1,4", "--matmul-sizes", "64,128", "--iters", "2",
          "--output-dir", str(tmp_path)])
    doc = json.loads((tmp_path / "roofline.json").read_text())
    assert doc["benchmark"] == "roofline" and doc["ratio"] is None
    assert [c["mib"] for c in doc["results"]["copy"]] == [1, 4]
    assert [m["n"] for m in doc["results"]["matmul"]] == [64, 128]
    best = doc["results"]["best"]
    assert best["copy_gb_per_s"] == max(c["gb_per_s"] for c in doc["results"]["copy"]) > 0
    assert best["matmul_tflops"] > 0 and best["matmul_dtype"] == "float32"
    assert best["device"].startswith("cpu")
    assert (tmp_path / "roofline.png").read_bytes()[:4] == b"\x89PNG"
    assert "best copy" in (tmp_path / "roofline.md").read_text()
    loaded = load_roofline(str(tmp_path / "roofline.json"))
    assert loaded["copy_gb_per_s"] == best["copy_gb_per_s"]
    assert load_roofline(None) is None


def test_load_roofline_rejects_other_results(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"benchmark": "compare", "results": {}}))
    with pytest.raises(ValueError, match="not a roofline"):
        load_roofline(str(path))
