"""benchmarks.shared.roofline on tiny sizes: the files, positive figures, and load_roofline."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.shared.roofline import load_roofline, main
from tests.benchmarks.conftest import assert_figure


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
    assert_figure(tmp_path / "roofline.png")
    assert "best copy" in (tmp_path / "roofline.md").read_text()
    loaded = load_roofline(str(tmp_path / "roofline.json"))
    assert loaded["copy_gb_per_s"] == best["copy_gb_per_s"]
    assert load_roofline(None) is None


def test_load_roofline_rejects_other_results(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"benchmark": "compare", "results": {}}))
    with pytest.raises(ValueError, match="not a roofline"):
        load_roofline(str(path))


def test_cli_without_matplotlib_exits_0_with_results_and_a_warning(tmp_path):
    """`python -m benchmarks.shared.roofline` in a Python where matplotlib cannot be imported:
    the measurement succeeded, so JSON and table are written and the exit status is 0."""
    block = ("import runpy, sys; sys.modules['matplotlib'] = None; "
             "sys.argv = ['roofline', *sys.argv[1:]]; "
             "runpy.run_module('benchmarks.shared.roofline', run_name='__main__')")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", block, "--copy-mib", "1", "--matmul-sizes",
                          "64", "--iters", "1", "--output-dir", str(tmp_path)],
                         cwd=root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "roofline.json").read_text())["benchmark"] == "roofline"
    assert "best copy" in (tmp_path / "roofline.md").read_text()
    assert not (tmp_path / "roofline.png").exists()
    assert "roofline.png not drawn: matplotlib is not installed" in run.stderr
    assert 'pip install -e ".[bench]"' in run.stderr


def test_roofline_takes_several_matmul_dtypes(tmp_path):
    """--dtype a,b: a peak per dtype; the first is the one MFU reads (matmul_tflops)."""
    main(["--copy-mib", "1", "--matmul-sizes", "64", "--iters", "1", "--dtype",
          "float32,bfloat16", "--output-dir", str(tmp_path)])
    doc = json.loads((tmp_path / "roofline.json").read_text())
    assert [(m["dtype"], m["n"]) for m in doc["results"]["matmul"]] == [("float32", 64),
                                                                         ("bfloat16", 64)]
    best = doc["results"]["best"]
    by_dtype = best["matmul_tflops_by_dtype"]
    assert set(by_dtype) == {"float32", "bfloat16"} and all(t > 0 for t in by_dtype.values())
    assert best["matmul_tflops"] == by_dtype["float32"] and best["matmul_dtype"] == "float32"
    assert "best matmul bfloat16" in (tmp_path / "roofline.md").read_text()
