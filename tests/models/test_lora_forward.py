"""The whole model's forward with LoRA (models/layers.Einsum + models/lora): for each
family, three peft adapters (different ranks and targets, one rsLoRA) written on the
tiny checkpoint give float32 logits within 1e-4 of transformers + peft with that adapter
active, alone and in one batch mixing base rows and the three adapters; the same on a
1x2 mesh; without LoRA the traced program has no LoRA op."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model

from models import gemma4, layers
from models.config import ModelConfig
from models.layer_stack import cache_shapes
from models.lora.adapter import load_peft_adapter
from models.lora.slots import (forward_variables, init_stacks, slot_weights, stack_shardings,
                               write_slot)
from models.lora.targets import adapter_weights, lora_targets
from models.registry import build_model
from models.weights import load_params, param_logical_axes
from sharding import kv_head_layout, make_mesh, mesh_rules, param_shardings
from tests.checkpoints import make_tiny_checkpoint, model_class
from tests.models.batch_util import make_inputs
from tests.models.test_parity import assert_close, prompt
from tests.models.test_rope_tables import plain_tables

PAGE, NUM_PAGES, STATE_SLOTS, MAX_RANK = 16, 24, 6, 8
T_PAD, R_PAD, P_PAD = 64, 4, 4
LENS = (13, 9, 11, 7)   # one prompt per row: base, then adapters 1..3

_ATTN, _MLP = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]
_DELTANET = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
# kind -> (scanned?, three adapters' peft configs). The hybrid's regex keeps its vision
# tower out.
_HYBRID_RE = r".*language_model.*\.({})"
FAMILIES = {
    "llama": (False, [dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
                      dict(r=4, lora_alpha=8, use_rslora=True, target_modules=_ATTN + _MLP),
                      dict(r=2, lora_alpha=4, target_modules=["k_proj", "gate_proj", "up_proj"])]),
    "qwen3": (True, [dict(r=8, lora_alpha=16, target_modules=_ATTN),
                     dict(r=4, lora_alpha=8, use_rslora=True, target_modules=_ATTN + _MLP),
                     dict(r=2, lora_alpha=4, target_modules=_MLP)]),
    # The tiny Qwen3-MoE has no dense or shared MLP: attention only (experts are refused).
    "qwen3_moe": (False, [dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
                          dict(r=4, lora_alpha=8, use_rslora=True, target_modules=_ATTN),
                          dict(r=2, lora_alpha=4, target_modules=["k_proj", "o_proj"])]),
    "qwen3_5": (True, [dict(r=8, lora_alpha=16, target_modules=_HYBRID_RE.format("|".join(_DELTANET))),
                       dict(r=4, lora_alpha=8, use_rslora=True,
                            target_modules=_HYBRID_RE.format("|".join(_ATTN + _MLP + _DELTANET))),
                       dict(r=2, lora_alpha=4, target_modules=_HYBRID_RE.format("q_proj|in_proj_z|down_proj"))]),
    "gemma4": (False, [dict(r=8, lora_alpha=16, target_modules=_ATTN),
                       dict(r=4, lora_alpha=8, use_rslora=True, target_modules=_ATTN + _MLP),
                       dict(r=2, lora_alpha=4, target_modules=["v_proj", "up_proj"])]),
}


class Family:
    """One tiny checkpoint, its three adapters in slots 1..3, and the reference logits of
    prompt i under adapter i (0: the base model) from transformers + peft."""

    def __init__(self, kind: str, scan: bool, adapters: list[dict], tmp):
        path = make_tiny_checkpoint(kind, tmp / kind)
        self.cfg = cfg = ModelConfig.from_pretrained(path)
        self.model = build_model(cfg, jnp.float32, scan_layers=scan)
        self.params = load_params(path, cfg, self.model, jnp.float32)
        self.apply = jax.jit(self.model.apply)
        self.logits_fn = jax.jit(lambda p, h: self.model.apply({"params": p}, h, method="compute_logits"))
        targets = lora_targets(self.model, cfg)
        self.stacks = init_stacks(targets, len(adapters), MAX_RANK, jnp.float32)
        self.prompts = [prompt(n, seed=i) for i, n in enumerate(LENS)]
        base = model_class(kind).from_pretrained(path, dtype=torch.float32)
        self.want = [self._torch_logits(base, self.prompts[0])]
        self.base_on_1 = self._torch_logits(base, self.prompts[1])   # without adapter 1
        for slot, kw in enumerate(adapters, start=1):
            torch.manual_seed(slot)
            base = model_class(kind).from_pretrained(path, dtype=torch.float32)
            peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **kw))
            peft_model.save_pretrained(tmp / f"{kind}-{slot}")
            self.want.append(self._torch_logits(peft_model, self.prompts[slot]))
            adapter = load_peft_adapter(str(tmp / f"{kind}-{slot}"))
            weights = adapter_weights(adapter, targets, cfg, max_rank=MAX_RANK)
            self.stacks = write_slot(self.stacks, jnp.int32(slot), slot_weights(
                weights, adapter.scaling, targets, MAX_RANK, np.float32))

    def one_row(self) -> tuple[dict, object]:
        """Empty caches and the inputs of prompt 0 alone (for tracing, not for logits)."""
        hybrid = self.cfg.is_hybrid
        inputs, _ = make_inputs([(self.prompts[0], 0, [1])], page_size=PAGE, num_tokens=T_PAD,
                                num_rows=R_PAD, pages_per_row=P_PAD,
                                state_slots=[1] if hybrid else None)
        shapes = cache_shapes(self.cfg, num_pages=NUM_PAGES, page_size=PAGE, kv_dtype=jnp.float32,
                              num_state_slots=STATE_SLOTS if hybrid else 0,
                              conv_state_dtype=jnp.float32)
        return {k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.items()}, inputs

    @staticmethod
    def _torch_logits(model, tokens) -> np.ndarray:
        with torch.no_grad():
            return model.eval()(input_ids=torch.tensor(tokens, dtype=torch.long)[None]).logits[0].numpy()

    def run(self, rows: list[int], stacks=None, params=None, apply=None) -> list[np.ndarray]:
        """Prompts `rows` (index i = adapter i) in one step; stacks=None: no LoRA at all;
        apply: a jitted model.apply of the caller's (default: the family's)."""
        params = self.params if params is None else params
        seqs = [(self.prompts[i], 0, [1 + 2 * j, 2 + 2 * j]) for j, i in enumerate(rows)]
        hybrid = self.cfg.is_hybrid
        inputs, spans = make_inputs(seqs, page_size=PAGE, num_tokens=T_PAD, num_rows=R_PAD,
                                    pages_per_row=P_PAD,
                                    state_slots=list(range(1, len(rows) + 1)) if hybrid else None)
        shapes = cache_shapes(self.cfg, num_pages=NUM_PAGES, page_size=PAGE, kv_dtype=jnp.float32,
                              num_state_slots=STATE_SLOTS if hybrid else 0,
                              conv_state_dtype=jnp.float32)
        caches = {k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.items()}
        variables = {"params": params}
        if stacks is not None:
            slot_ids = np.zeros(T_PAD, np.int32)
            for (a, b), i in zip(spans, rows):
                slot_ids[a:b] = i
            variables.update(forward_variables(stacks, jnp.asarray(slot_ids)))
        hidden, _ = (apply or self.apply)(variables, caches, inputs)
        logits = np.asarray(self.logits_fn(params, hidden))
        return [logits[a:b] for a, b in spans]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    made: dict[str, Family] = {}

    def get(kind: str) -> Family:
        if kind not in made:
            made[kind] = Family(kind, *FAMILIES[kind], tmp_path_factory.mktemp("lora_forward"))
        return made[kind]
    return get


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, families):
    return families(request.param)


def test_each_adapter_alone_matches_peft(family):
    for i in range(1, 4):
        (got,) = family.run([i], family.stacks)
        assert_close(got, family.want[i])
    # The adapters change the logits (else the test above proves nothing): the base
    # model's, which the base row matches (test_mixed_batch...), are far from adapter 1's.
    # (transformers' base logits: a run without LoRA here would compile a second program.)
    assert np.abs(family.base_on_1 - family.want[1]).max() > 1e-3


def test_mixed_batch_gives_each_row_its_adapter(family):
    """Base rows and three adapters in one step: each row as its adapter alone."""
    got = family.run([0, 1, 2, 3], family.stacks)
    for i, g in enumerate(got):
        assert_close(g, family.want[i])


def test_no_lora_traces_no_lora_op(family, monkeypatch):
    # The LoRA op's per-platform choice (ops._grouped_add) is its mark; the RoPE tables
    # choose per platform too (layers.rope_tables): plain ones here.
    for module in (layers, gemma4):
        monkeypatch.setattr(module, "rope_tables", plain_tables)
    caches, inputs = family.one_row()
    text = str(jax.make_jaxpr(family.model.apply)({"params": family.params}, caches, inputs))
    assert "platform_index" not in text
    slot_ids = jnp.zeros(T_PAD, jnp.int32)
    lora = str(jax.make_jaxpr(family.model.apply)(
        {"params": family.params, **forward_variables(family.stacks, slot_ids)}, caches, inputs))
    assert "platform_index" in lora


def test_mixed_batch_on_1x2_mesh(families):
    """The llama family's mixed batch with its params and stacks sharded on a 1x2 mesh
    (A split on the input of row-parallel projections, B on the output of the others)."""
    fam = families("llama")
    cfg, mesh = fam.cfg, make_mesh("1x2", jax.devices()[:2])
    assert kv_head_layout(cfg.num_heads, cfg.num_kv_heads, 2) == cfg.num_kv_heads
    params = jax.device_put(fam.params, param_shardings(param_logical_axes(fam.model), mesh,
                                                        mesh_rules(cfg, 2)))
    stacks = jax.device_put(fam.stacks, stack_shardings(lora_targets(fam.model, cfg), mesh))
    with jax.set_mesh(mesh):
        got = fam.run([0, 1, 2, 3], stacks, params)
    for i, g in enumerate(got):
        assert_close(g, fam.want[i])


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_mixed_batch_through_the_cpu_all_slots_pass(families, kind, monkeypatch):
    """The CPU's all-slots pass (models/lora/ops._all_slots_add) inside the real forward:
    a scanned Qwen3 and the hybrid's attention, MLP and DeltaNet projections. The tiny
    models are too narrow for _cpu_add to pick it (their slots weigh more than the
    kernels), so its bounds are lifted here, for a fresh trace; the pass's [T, S * R]
    products appear in the lowered step only then, and every row still gets its
    adapter's logits."""
    from models.lora import ops
    fam = families(kind)
    products = f"tensor<{T_PAD}x{fam.stacks['scales'].shape[0] * MAX_RANK}xf32>"

    def lowered() -> str:
        caches, inputs = fam.one_row()
        variables = {"params": fam.params,
                     **forward_variables(fam.stacks, jnp.zeros(T_PAD, jnp.int32))}
        return jax.jit(lambda *a: fam.model.apply(*a)).lower(variables, caches, inputs).as_text()

    without = lowered().count(products)
    monkeypatch.setattr(ops, "ALL_SLOTS_MAX_WEIGHT", float("inf"))
    monkeypatch.setattr(ops, "ALL_SLOTS_MIN_WINDOWS", 0.0)
    assert lowered().count(products) > without
    got = fam.run([0, 1, 2, 3], fam.stacks, apply=jax.jit(lambda *a: fam.model.apply(*a)))
    for i, g in enumerate(got):
        assert_close(g, fam.want[i])
