"""benchmarks.loading.safetensors_read on a tiny Qwen3 (one mesh, one dtype): every reader loads
the same params (the benchmark raises otherwise) and the results carry each run, and
PackageSlices' index mapping reads exactly numpy's slices."""
from __future__ import annotations

import itertools
import json

import numpy as np
from safetensors.numpy import save_file

from benchmarks.loading.safetensors_read import PackageSlices, main


def test_safetensors_read(tiny_qwen3, tmp_path):
    main(["--checkpoint-dir", tiny_qwen3, "--meshes", "1x2", "--dtypes", "float32",
          "--repeats", "2", "--output-dir", str(tmp_path)])
    doc = json.loads((tmp_path / "safetensors_read.json").read_text())
    rows = doc["results"]["loads"]
    readers = [r["reader"] for r in rows]
    assert {"package header + views", "package get_tensor", "package get_slice"} <= set(readers)
    assert len(readers) == len(set(readers)) == len(doc["results"]["open_s"])
    for r in rows:
        assert r["mesh"] == "1x2" and len(r["runs_s"]) == 2 and r["min_s"] <= r["median_s"]
    assert rows[0]["vs_first"] == 1.0
    assert doc["config"]["checkpoint"]["hidden_size"] == 64


def test_lazy_slice_reads_what_numpy_slices(tmp_path):
    w = np.arange(12 * 20, dtype=np.float32).reshape(12, 20)
    save_file({"w": w}, str(tmp_path / "w.safetensors"))
    st = PackageSlices(tmp_path / "w.safetensors")
    # An o_proj-like layout (transposed, the first axis split) and a plain split.
    for lazy, ref in [(st.get("w").T.reshape((20, 3, 4)), w.T.reshape(20, 3, 4)),
                      (st.get("w").reshape((3, 4, 20)), w.reshape(3, 4, 20))]:
        assert lazy.shape == ref.shape
        np.testing.assert_array_equal(np.asarray(lazy), ref)
        cuts = [slice(None), slice(1, 3), slice(0, 1), slice(None, None, 2)]
        for index in itertools.product(cuts, repeat=3):
            np.testing.assert_array_equal(lazy[index], ref[index], err_msg=str(index))
    # A reshape that is not an axis split reads the whole tensor.
    np.testing.assert_array_equal(st.get("w").reshape((240,)), w.reshape(240))
