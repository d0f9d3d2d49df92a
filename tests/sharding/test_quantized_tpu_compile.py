"""The quantized engine compiled for TPU by libtpu's deviceless compilers: fp8 weights and
an fp8 KV cache on v6e, int8 weights and an int8 KV cache on v5e (no fp8 arithmetic),
with the planner's bytes per device equal to the compiler's."""
from __future__ import annotations

import pytest

from jaxserve.checkpoints.model_names import load_model_config
from jaxserve.planning.plan import make_plan
from jaxserve.planning.plan_compile import compile_plan
from tests.checkpoints import make_tiny_checkpoint

pytest.importorskip("libtpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """Lane-aligned heads (head_dim 128) as every served model; bfloat16 weights."""
    import torch
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("qtpu"), dtype=torch.bfloat16,
                                num_attention_heads=8, num_key_value_heads=4,
                                intermediate_size=256, head_dim=128)


@pytest.mark.parametrize("target,mesh,scheme,activations", [
    ("tpu-v6e", "1x1", "fp8", None), ("tpu-v6e", "1x4", "fp8", None),
    ("tpu-v5e", "1x1", "int8", None), ("tpu-v5e", "1x4", "int8", "dynamic")])
def test_quantized_forward_compiles_and_the_planner_agrees(tiny, target, mesh, scheme, activations):
    """w8a16 everywhere; w8a8 int8 (the int8 MXU) on v5e too."""
    r = compile_plan(tiny, target=target, mesh=mesh, quantization=scheme, kv_cache_dtype=scheme,
                     activation_quantization=activations, max_model_len=256,
                     select=lambda progs: progs[:1])
    (p,) = r.programs
    assert r.error is None and p.compiled, p.error
    # The planner, from the config alone, gives the engine's weights and cache bytes ...
    plan = make_plan(load_model_config(tiny), model=tiny, mesh=mesh, quantization=scheme,
                     kv_cache_dtype=scheme, max_model_len=256, max_num_seqs=r.max_num_seqs,
                     hbm_bytes=r.hbm_bytes)
    assert plan.weight_bytes_per_device == r.weight_bytes_per_device
    assert plan.quantization == scheme and plan.kv_dtype.startswith("float8" if scheme == "fp8" else "int8")
    # ... and what the compiled forward step takes as arguments.
    assert r.planner_bytes_per_device == pytest.approx(p.argument_bytes, rel=0.01)
    bf16 = make_plan(load_model_config(tiny), model=tiny, mesh=mesh, max_model_len=256)
    assert plan.kv_bytes_per_token_per_device * 2 == bf16.kv_bytes_per_token_per_device
    assert plan.weight_bytes_per_device < 0.7 * bf16.weight_bytes_per_device


def test_w8a8_int8_multiplies_in_int8_on_v5e():
    """Dynamic activations: XLA:TPU gets an s8 x s8 -> s32 product (the int8 MXU), not
    a float matmul of converted operands."""
    import jax
    import jax.numpy as jnp

    from models.quantization import quantized_matmul
    from tests.tpu_compile import compile_on_tpu
    f = lambda x, q, s: quantized_matmul(x, q, s, 1, None, jnp.bfloat16, dynamic_activations=True)
    text = compile_on_tpu(f, jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16),
                          jax.ShapeDtypeStruct((1024, 512), jnp.int8),
                          jax.ShapeDtypeStruct((1, 512), jnp.float32), target="tpu-v5e").as_text()
    import re
    products = re.findall(r"= (\w+)\[[^\]]*\]\S* (?:convolution|dot)\((%[\w.]+), (%[\w.]+)\)", text)
    types = {m.group(1): m.group(2) for m in re.finditer(r"(%[\w.]+) = (\w+)\[", text)}
    assert products
    for result, a, b in products:
        assert (result, types[a], types[b]) == ("s32", "s8", "s8")
