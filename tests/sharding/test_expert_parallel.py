"""--enable-expert-parallel: each device holds num_experts/M whole experts (not 1/M of
every expert). Greedy tokens equal transformers' and the logprobs the tensor-parallel
engine's, for Qwen3-MoE, the Qwen3.5 MoE hybrid and Gemma 4's MoE; the expert weights
are split by expert, the rest as with tensor parallelism; the compiled step keeps one
[T, E] all-reduce per block and gathers no weight; and the flag is refused where it
would change nothing (a dense model, one device) or cannot place the experts."""
from __future__ import annotations

import random

import jax
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from jax.sharding import PartitionSpec as P

from jaxserve import LLM, SamplingParams
from models.config import ModelConfig
from models.weights import param_logical_axes
from sharding import MODEL, check_model_axis, make_mesh, mesh_rules, param_shardings
from tests.checkpoints import make_tiny_checkpoint, reference_greedy
from tests.sharding.conftest import assert_step_collectives

NUM_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=3)
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture
def no_warmup(monkeypatch):
    """Numerics only: compile on first use (test_no_recompile covers warmup)."""
    from jaxserve.runner.model_runner import ModelRunner
    monkeypatch.setattr(ModelRunner, "warmup", lambda self, *a, **k: self.allocate_caches())


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (6, 29, 52)]


def _run(path: str, mesh: str, **kw) -> tuple[LLM, list[list[int]], list[np.ndarray]]:
    llm = LLM(path, dtype="float32", mesh=mesh, max_model_len=96, max_num_seqs=4,
              max_num_batched_tokens=32, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    lps = [np.array([[lp.logprob for lp in sorted(step.values(), key=lambda lp: lp.rank)]
                     for step in o.outputs[0].logprobs]) for o in outs]
    return llm, [o.outputs[0].token_ids for o in outs], lps


def _expert_leaves(params) -> list[tuple[str, jax.Array]]:
    return [(jax.tree_util.keystr(k), x) for k, x in jax.tree_util.tree_leaves_with_path(params)
            if "experts" in jax.tree_util.keystr(k)]


def assert_experts_split_whole(llm: LLM, num_experts: int) -> None:
    """Every expert weight is split over its expert axis only: device d holds experts
    d*X/M .. (d+1)*X/M - 1, each whole; every other weight is placed as without the flag
    (the dense MLP, the shared expert and attention split by width and head)."""
    core = llm.engine
    m, per = core.mesh.shape[MODEL], num_experts // core.mesh.shape[MODEL]
    devices = core.mesh.devices.flat[:].tolist()
    experts = _expert_leaves(core.params)
    assert experts
    for name, x in experts:
        assert x.sharding.spec == P(MODEL, None, None), name
        whole = np.asarray(x)
        for shard in x.addressable_shards:
            d = devices.index(shard.device)
            assert shard.data.shape == (per, *x.shape[1:]), name
            np.testing.assert_array_equal(np.asarray(shard.data), whole[d * per:(d + 1) * per])
    tp = flatten_dict(param_shardings(param_logical_axes(core.model), core.mesh,
                                      mesh_rules(core.model_config, m)))
    for path, x in flatten_dict(core.params).items():
        if "experts" not in path:
            assert x.sharding.spec == tp[path].spec, path


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """The sharding tests' Qwen3-MoE (8 query heads, 2 KV heads, 8 experts)."""
    from tests.sharding.conftest import SHAPES
    return make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ep_moe"),
                                **SHAPES["qwen3_moe"])


def test_qwen3_moe_equals_transformers_and_tensor_parallel(moe_checkpoint, no_warmup):
    expected = reference_greedy(moe_checkpoint, _prompts(), NUM_NEW)
    _, tp_tokens, tp_lps = _run(moe_checkpoint, "1x4")
    assert tp_tokens == expected
    for mesh in ("1x4", "1x8"):   # 2 experts per device, then 1
        llm, tokens, lps = _run(moe_checkpoint, mesh, enable_expert_parallel=True)
        assert tokens == expected, mesh
        for a, b in zip(lps, tp_lps):
            np.testing.assert_allclose(a, b, atol=2e-5, err_msg=mesh)
        assert llm.engine.layout.expert_parallel
        assert_experts_split_whole(llm, 8)
        if mesh == "1x8":   # the combine's one all-reduce per block, no weight gathered
            assert_step_collectives(llm.engine)


def test_quantized_experts_follow_their_scales(moe_checkpoint, no_warmup):
    """int8 experts with one scale per output channel: each device's scales are its own
    experts' (split with them), so the tokens and logprobs are the tensor-parallel
    engine's."""
    _, tp_tokens, tp_lps = _run(moe_checkpoint, "1x4", quantization="int8")
    llm, tokens, lps = _run(moe_checkpoint, "1x4", quantization="int8",
                            enable_expert_parallel=True)
    assert tokens == tp_tokens
    for a, b in zip(lps, tp_lps):
        np.testing.assert_allclose(a, b, atol=1e-4)
    scales = [x for name, x in _expert_leaves(llm.engine.params) if name.endswith("_scale']")]
    assert len(scales) == 3 * llm.engine.model_config.num_layers
    assert all(x.sharding.spec == P(MODEL, None, None) for x in scales)


def test_a_dense_draft_model_stays_tensor_parallel(moe_checkpoint, tmp_path, no_warmup):
    """Speculative decoding with a dense draft model: the target's experts split whole,
    the draft (no experts) tensor parallel, the outputs the target's."""
    draft = make_tiny_checkpoint("llama", tmp_path / "draft")
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
    llm, tokens, _ = _run(moe_checkpoint, "1x2", enable_expert_parallel=True,
                          speculative_config=spec)
    assert tokens == reference_greedy(moe_checkpoint, _prompts(), NUM_NEW)
    assert llm.engine.layout.expert_parallel


@pytest.mark.parametrize("kind, mesh", [
    ("qwen3_5_moe", "1x2"),     # a shared expert beside the experts
    ("gemma4_moe", "1x4"),      # a dense MLP beside the experts
])
def test_hybrid_and_gemma4_moe_equal_transformers(kind, mesh, tmp_path, no_warmup):
    path = make_tiny_checkpoint(kind, tmp_path / kind)
    expected = reference_greedy(path, _prompts(), NUM_NEW, kind)
    llm, tokens, _ = _run(path, mesh, enable_expert_parallel=True)
    assert tokens == expected
    assert_experts_split_whole(llm, 8)


def _config(**kw) -> ModelConfig:
    base = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=256, hidden_size=64,
                intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=20)
    return ModelConfig.from_hf_dict({**base, **kw})


def test_rules_split_experts_not_their_width():
    from models.registry import build_model
    mc = _config(moe_intermediate_size=32, shared_expert_intermediate_size=0)
    axes = param_logical_axes(build_model(mc, "float32", "reference"))
    specs = {k: v.spec for k, v in flatten_dict(param_shardings(
        axes, make_mesh("1x4"), mesh_rules(mc, 4, expert_parallel=True))).items()}
    layer = ("layers_0", "mlp")
    for proj in EXPERT_PROJS:
        assert specs[layer + ("experts", proj)] == P(MODEL, None, None)
    assert specs[layer + ("gate", "kernel")] == P(None, None)               # router
    assert specs[("layers_0", "self_attn", "q_proj", "kernel")] == P(None, MODEL, None)
    assert mesh_rules(mc, 4)["experts"] is None   # tensor parallel without the flag


def test_refused_where_it_changes_nothing_or_cannot_place_the_experts():
    # moe_intermediate_size=20 does not divide by 8: only expert parallelism can use 8.
    with pytest.raises(ValueError, match=r"M=8 does not divide moe_intermediate_size=20"):
        check_model_axis(_config(), 8)
    check_model_axis(_config(), 8, expert_parallel=True)
    with pytest.raises(ValueError, match=r"M=4 does not divide num_experts=6 "
                                         r"\(enable_expert_parallel=True places whole experts"):
        check_model_axis(_config(num_experts=6), 4, expert_parallel=True)
    with pytest.raises(ValueError, match=r"enable_expert_parallel=True: Qwen3ForCausalLM is a "
                                         r"dense model"):
        check_model_axis(_config(architectures=["Qwen3ForCausalLM"], num_experts=0), 4,
                         expert_parallel=True)
    with pytest.raises(ValueError, match=r"enable_expert_parallel=True: the model axis is 1"):
        check_model_axis(_config(), 1, expert_parallel=True)


def test_engine_refuses_a_dense_model_by_name(checkpoint):
    with pytest.raises(ValueError, match="enable_expert_parallel=True: .* dense model"):
        LLM(checkpoint("qwen3"), dtype="float32", mesh="1x2", max_model_len=64,
            enable_expert_parallel=True)
