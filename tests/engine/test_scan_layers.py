"""The scanned layers (the default on GPU/TPU) serve the same tokens as the Python
layer loop (the default on CPU), for a dense model and a hybrid one with recurrent
state, alone and tensor-parallel, with chunked prefill and several requests at once.
Numerics only: the engines skip warmup (enforce_eager)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.build.layout import engine_layout
from models.config import ModelConfig
from sharding import make_mesh
from sharding.tpu_targets import abstract_tpu_mesh
from tests.checkpoints import make_tiny_checkpoint
from tests.engine.conftest import assert_no_leaks


@pytest.mark.parametrize("kind,mesh", [("llama", "1x1"), ("qwen3_5", "1x2")])
def test_scanned_layers_serve_the_loops_greedy_tokens(checkpoint, tmp_path, kind, mesh):
    # two periods of a hybrid's layer pattern, so the scan steps over blocks
    path = checkpoint(kind) if kind == "llama" else \
        make_tiny_checkpoint(kind, tmp_path, num_hidden_layers=8)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 3 for j in range(n)]}
               for i, n in enumerate([5, 40, 17, 63, 2, 29])]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for scan in (False, True):
        llm = LLM(path, dtype="float32", max_model_len=128, max_num_seqs=4,
                  max_num_batched_tokens=32, mesh=mesh, scan_layers=scan, enforce_eager=True)
        assert llm.engine.layout.scan_layers is scan
        params_tree = llm.engine.params
        assert ("layers" in params_tree) is scan and ("layers_0" in params_tree) is not scan
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[scan] = [o.outputs[0].token_ids for o in outs]
        assert_no_leaks(llm.engine)
    assert all(len(t) == 12 for t in tokens[True])
    assert tokens[True] == tokens[False]


def test_cpu_defaults_to_the_layer_loop_and_accelerators_to_the_scan(checkpoint):
    mc = ModelConfig.from_pretrained(checkpoint("llama"))
    config = EngineConfig(model="m", max_model_len=64, max_num_seqs=2)
    assert engine_layout(config, mc, make_mesh("1x1")).scan_layers is False
    assert engine_layout(config, mc, abstract_tpu_mesh("tpu-v6e")).scan_layers is True
    forced = replace(config, scan_layers=True)
    assert engine_layout(forced, mc, make_mesh("1x1")).scan_layers is True
