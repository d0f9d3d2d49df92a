"""The engine's forward step with --enable-expert-parallel compiled for TPU v6e on a 1x4
mesh by libtpu's deviceless compiler: the grouped matmuls run on each device's own
experts, and the only collectives are the [T, E] all-reduces (after the embedding, each
o_proj and each MoE block) -- no expert weight is gathered or moved."""
from __future__ import annotations

import pytest

from jaxserve.config import EngineConfig
from jaxserve.checkpoints.model_names import load_model_config
from jaxserve.planning.plan_compile import build_abstract_engine
from jaxserve.runner.programs import FORWARD
from sharding.tpu_targets import abstract_tpu_mesh, tpu_target
from tests.checkpoints import make_tiny_checkpoint
from tests.sharding.conftest import collectives

pytest.importorskip("libtpu")

TARGET, MESH = "tpu-v6e", "1x4"


def test_expert_parallel_step_compiles_with_only_activation_all_reduces(tmp_path):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "moe", num_attention_heads=8,
                                num_key_value_heads=4, head_dim=128, num_experts=8,
                                moe_intermediate_size=128)
    config = EngineConfig(model=path, mesh=MESH, load_format="dummy", dtype="bfloat16",
                          num_pages=256, max_model_len=512, max_num_seqs=16,
                          max_num_batched_tokens=256, attention_backend="pallas",
                          compilation_cache_dir=None, enable_expert_parallel=True)
    eng = build_abstract_engine(config, load_model_config(path), abstract_tpu_mesh(TARGET, MESH),
                                tpu_target(TARGET).usable_hbm_bytes)
    assert eng.layout.expert_parallel
    mc = eng.layout.model_config
    prog = max((p for p in eng.programs if p.kind == FORWARD), key=lambda p: (p.tokens, p.pages))
    ops = collectives(eng.runner.lower(prog).compile().as_text())
    # The layers under scan (the TPU default): one layer body, so the embedding's, the
    # o_proj's and the MoE block's all-reduce each appear once, as with tensor-parallel
    # experts. (Expert-split weights under the tensor-parallel grouped matmul: XLA moved
    # the weights by all-to-all here, which this check caught.)
    assert [kind for _, kind in ops] == ["all-reduce"] * 3, ops
    assert all(f"[{prog.tokens},{mc.hidden_size}]" in shape for shape, _ in ops), ops
