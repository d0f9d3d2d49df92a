"""The runner's side of the sliding-window KV group, model-free: its cache has the plan's
own page count and the global KV's sharding, and the programs warmup compiles take the
sliding slots and page table exactly when the runner has such a group."""
from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.layer_caches import abstract_layer_caches
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.runner_config import RunnerConfig
from jaxserve.runner.programs import FORWARD
from models.config import ModelConfig
from models.gemma4_config import gemma4_fields
from models.layer_stack import KV, KV_SLIDING
from sharding import make_mesh

PS = 16


def gemma_config() -> ModelConfig:
    d = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 4,
         "head_dim": 16, "global_head_dim": 32, "sliding_window": 64,
         "max_position_embeddings": 4096}
    return ModelConfig(**gemma4_fields("Gemma4ForCausalLM", d, d))


def llama_config() -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64,
                       intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=4,
                       head_dim=16)


def test_sliding_cache_has_its_own_pages_and_the_kv_sharding():
    mesh = make_mesh("1x4", jax.devices()[:4])
    specs = abstract_layer_caches(gemma_config(), mesh, num_pages=50, page_size=PS,
                                  kv_dtype=jnp.float32, num_state_slots=0,
                                  conv_state_dtype=jnp.float32, num_sliding_pages=9)
    kv, sliding = specs[KV], specs[KV_SLIDING]
    assert kv.shape[0] == 1 * 50 and sliding.shape[0] == 5 * 9   # 1 global, 5 sliding layers
    assert sliding.sharding == kv.sharding
    assert sliding.sharding.spec != jax.sharding.PartitionSpec()   # split by KV head
    same = abstract_layer_caches(gemma_config(), mesh, num_pages=50, page_size=PS,
                                 kv_dtype=jnp.float32, num_state_slots=0,
                                 conv_state_dtype=jnp.float32)
    assert same[KV_SLIDING].shape[0] == 5 * 50   # no group: the global page count


def abstract_runner(cfg: ModelConfig, num_sliding_pages: int) -> ModelRunner:
    """Nothing allocated or run: the caches are described, the params empty."""
    model = SimpleNamespace(config=cfg, dtype=jnp.float32)
    return ModelRunner(RunnerConfig(vocab_size=cfg.vocab_size, num_pages=40, page_size=PS,
                                    max_num_seqs=4, max_model_len=256,
                                    max_num_batched_tokens=32, kv_dtype=jnp.float32,
                                    num_sliding_pages=num_sliding_pages),
                       model=model, params={}, abstract=True)


@pytest.mark.parametrize("cfg,num_sliding", [(gemma_config, 12), (gemma_config, 0),
                                             (llama_config, 0)])
def test_warmup_inputs_carry_the_sliding_group_when_there_is_one(cfg, num_sliding):
    runner = abstract_runner(cfg(), num_sliding)
    if cfg is gemma_config:
        assert runner.kv_caches[KV_SLIDING].shape[0] == 5 * (num_sliding or 40)
    forwards = [p for p in runner.warmup_programs() if p.kind == FORWARD]
    assert forwards
    for prog in forwards:
        _, caches, inputs, *_ = prog.args()
        assert caches is runner.kv_caches
        if num_sliding:
            assert inputs.sliding_slot_mapping.shape == inputs.slot_mapping.shape
            assert inputs.sliding_page_table.shape == inputs.page_table.shape
            assert inputs.sliding_page_table.dtype == np.int32
        else:   # every existing program is unchanged
            assert inputs.sliding_slot_mapping is None and inputs.sliding_page_table is None
    assert (runner.batch.sliding_page_table is not None) == bool(num_sliding)
