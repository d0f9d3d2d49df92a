"""benchmarks.cache.host_tier_copies at toy size: the results' structure and its refusal of a
copy that does not fit beside the source pages."""
from __future__ import annotations

import json

import pytest

import benchmarks.cache.host_tier_copies as htc


def test_toy_run(tmp_path):
    out_file = tmp_path / "copies.json"
    out = htc.main(["--layers", "2", "--kv-heads", "1", "--head-dim", "8", "--pages", "16",
                    "--copy-pages", "3", "--pages-per-call", "2", "--repeats", "1",
                    "--json", str(out_file)])
    assert json.loads(out_file.read_text()) == json.loads(json.dumps(out))
    assert out["page_bytes"] == 2 * (2 * 1 * 16 * 8) * 2      # layers * [2K, S, H] * 2 bytes
    assert out["copied_bytes"] == 3 * out["page_bytes"]
    assert set(out["gb_per_s"]) == {"offload", "restore", "link_to_device", "link_to_host"}
    assert all(v > 0 for v in out["gb_per_s"].values())
    assert out["restore_share_of_link"] == pytest.approx(
        out["gb_per_s"]["restore"] / out["gb_per_s"]["link_to_device"])


def test_copy_pages_must_fit():
    with pytest.raises(ValueError, match="--copy-pages 8"):
        htc.run(2, 1, 8, 16, 16, 8, 2, 1)
