"""benchmarks.shared.reference: batch sizes to try, out-of-memory fallback, model sizes."""
from __future__ import annotations

import pytest
import torch

from benchmarks.shared import reference
from benchmarks.shared.model_stats import model_stats


def test_candidate_sizes():
    assert reference.candidate_sizes("auto", 50, 256) == ([64, 32, 16, 8, 4, 2, 1], True)
    assert reference.candidate_sizes("auto", 1000, 128)[0][0] == 128
    assert reference.candidate_sizes("auto", 1, 256) == ([1], True)
    assert reference.candidate_sizes("16,4,32", 50, 256) == ([32, 16, 4], False)
    with pytest.raises(ValueError):
        reference.candidate_sizes("0", 5, 8)


def test_out_of_memory_halves(monkeypatch):
    """"auto" keeps the largest size that does not run out of memory."""
    def fake(model, items, bs, pad_id, cache):
        if bs > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        return reference.RefRun(bs, "dynamic", seconds=1.0 / bs)
    monkeypatch.setattr(reference, "run_static_batches", fake)
    run, tried = reference.run_reference(None, [], [16, 8, 4, 2], True, 0, "dynamic")
    assert run.batch_size == 4
    assert [t.get("out_of_memory", False) for t in tried] == [True, True, False]
    with pytest.raises(RuntimeError, match="every batch size"):
        reference.run_reference(None, [], [16, 8], True, 0, "dynamic")


def test_other_errors_are_not_swallowed(monkeypatch):
    def broken(*a):
        raise RuntimeError("shape mismatch")
    monkeypatch.setattr(reference, "run_static_batches", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        reference.run_reference(None, [], [4], True, 0, "dynamic")


def test_model_stats_match_torch(tiny_qwen3):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3)
    s = model_stats(tiny_qwen3)
    assert s.params == sum(p.numel() for p in model.parameters())   # tied: stored once
    assert s.tied and s.embedding_params == 256 * 64
    assert s.kv_bytes_per_token("float32") == 2 * 2 * 2 * 16 * 4
    assert s.weight_bytes("bfloat16") == 2 * s.params
    assert s.matmul_flops_per_token() == 2 * s.params
