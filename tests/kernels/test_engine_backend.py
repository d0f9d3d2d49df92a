"""The engine with the Pallas attention backend (TPU kernel body, interpret mode on CPU)
gives the same greedy tokens as with the reference backend, on the parity checkpoints;
and the whole model step lowers for cuda and tpu with one kernel per layer."""
from __future__ import annotations

import functools
import json
import os
import random

import jax
import jax.numpy as jnp
import pytest
from jax import export

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from models.config import ModelConfig
from models.layer_stack import cache_shapes
from models.registry import build_model
from models.weights import abstract_params, dummy_inputs
from tests.checkpoints import make_tiny_checkpoint

KINDS = ("llama", "qwen3", "qwen3_moe")
PROMPT_LENS = (5, 16, 33, 40)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in made:
            made[kind] = make_tiny_checkpoint(kind, tmp_path_factory.mktemp(kind),
                                              bos_token_id=1, eos_token_id=2)
        return made[kind]
    return get


def _generate(path: str, backend: str) -> list[list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENS]
    # One 16-token bucket (one compile): prompts are chunked and share steps with decodes;
    # no warmup (tokens only): the samplers greedy requests never use are not compiled.
    llm = LLM(path, dtype="float32", max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=16, attention_backend=backend, enforce_eager=True)
    assert llm.engine.model.attention_backend == backend
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# One model: the kernel sees only q, k, v and pages, alike for every family here (GQA
# included); the TPU body in interpret mode costs ~40 s an engine on CPU.
@pytest.mark.parametrize("kind", ["llama"])
def test_pallas_interpret_engine_matches_reference(kind, checkpoint):
    path = checkpoint(kind)
    assert _generate(path, "pallas_interpret") == _generate(path, "reference")


def test_config_validates_backend():
    assert EngineConfig(model="m").attention_backend == "auto"
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model="m", attention_backend="triton")


@pytest.mark.parametrize("scan_layers", [False, True], ids=["layer_loop", "scan_layers"])
@pytest.mark.parametrize("platform,marker", [("cuda", "mosaic_gpu"), ("tpu", "tpu_custom_call")])
def test_model_step_lowers_with_one_kernel_per_layer(platform, marker, scan_layers, checkpoint):
    """The kernel lowered once (its jit is shared by the layers), called by every layer of
    the Python loop; by the scanned body once, whatever the depth (what keeps a deep
    model's compile time flat)."""
    with open(os.path.join(checkpoint("qwen3"), "config.json")) as f:
        hf = json.load(f)
    cfg = ModelConfig.from_hf_dict({**hf, "head_dim": 128})    # a head_dim the GPU kernel takes
    model = build_model(cfg, jnp.bfloat16, attention_backend="pallas", scan_layers=scan_layers)
    params = abstract_params(model)
    caches = cache_shapes(cfg, num_pages=16, page_size=16, kv_dtype=jnp.bfloat16,
                          num_state_slots=0, conv_state_dtype=jnp.bfloat16)
    inputs = jax.eval_shape(functools.partial(dummy_inputs, 32, 4, 4))
    step = jax.jit(lambda p, c, i: model.apply({"params": p}, c, i), donate_argnums=(1,))
    text = export.export(step, platforms=[platform])(params, caches, inputs).mlir_module()
    assert cfg.num_layers > 1
    assert text.count(f"custom_call @{marker}") == 1
    assert text.count("call @_write_and_attend(") == (1 if scan_layers else cfg.num_layers)
