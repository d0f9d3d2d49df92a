"""HF `architectures` name -> model class (one per family), and model construction."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from models.config import SERVING_DTYPES, SUPPORTED_ARCHITECTURES, ModelConfig
from models.family import FAMILIES, GEMMA4, LLAMA, QWEN3, QWEN3_5, QWEN3_MOE, family_of
from models.gemma4 import Gemma4ForCausalLM
from models.llama import LlamaForCausalLM, Qwen3ForCausalLM
from models.qwen3_5 import Qwen3_5ForCausalLM
from models.qwen3_moe import Qwen3MoeForCausalLM
from pallas_kernels.held_dtypes import cpu_has_bf16_dot
from pallas_kernels.kv_cache_dtypes import KV_QUANT_DTYPE_NAMES
from pallas_kernels.ragged_paged_attention import resolve_backend

# One implementation per family (models/family.py): every architecture of a family runs
# it (Qwen3.5 / 3.6 dense and MoE, and the vision-language checkpoints of Qwen3.5 and
# Gemma 4, serve their text model).
_FAMILY_CLASSES: dict[str, type] = {
    LLAMA.name: LlamaForCausalLM,
    QWEN3.name: Qwen3ForCausalLM,
    QWEN3_MOE.name: Qwen3MoeForCausalLM,
    QWEN3_5.name: Qwen3_5ForCausalLM,
    GEMMA4.name: Gemma4ForCausalLM,
}
assert set(_FAMILY_CLASSES) == {f.name for f in FAMILIES}
ARCHITECTURES: dict[str, type] = {a: _FAMILY_CLASSES[f.name] for f in FAMILIES
                                  for a in f.architectures}
assert tuple(sorted(ARCHITECTURES)) == SUPPORTED_ARCHITECTURES


def get_model_class(architecture: str) -> type:
    """The flax module class serving `architecture` (ValueError naming the supported ones)."""
    return _FAMILY_CLASSES[family_of(architecture).name]


def resolve_dtype(dtype: Any, config: ModelConfig) -> jnp.dtype:
    """"auto" (or None) -> the checkpoint's dtype (float32 when config.json names none
    of SERVING_DTYPES). The one rule for the engine, the planner and the loader."""
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        dtype = config.dtype if config.dtype in SERVING_DTYPES else "float32"
    try:
        return jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"unknown dtype {dtype!r}") from None


def compute_dtype(dtype: Any, platform: str) -> jnp.dtype:
    """What a model served in `dtype` computes in on `platform`: float32 on CPU for
    bfloat16 / float16. XLA:CPU has no 16-bit float arithmetic: it runs every such op
    as convert to float32, op, convert back, and converts the weights for every matmul
    (a 58M-param Llama's decode step: 156 ms in bf16, 53 ms in float32). On the same
    weights (an exact upcast) a float32 matmul gives what a bf16 one with float32
    accumulation gives; the activations between ops keep more precision."""
    dtype = jnp.dtype(dtype)
    narrow = dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return jnp.dtype(jnp.float32) if platform == "cpu" and narrow else dtype


def matmul_dtype(dtype: Any, platform: str) -> jnp.dtype:
    """The dtype the linear layers' dots take their operands in: `dtype`, except on a
    CPU, where a narrow float model's dots run in float32 on upcast weights
    (compute_dtype) unless the CPU multiplies bfloat16 natively; then a bf16 model keeps
    its projection weights bf16 and rounds each dot's input to bf16 (float32 result), as
    on an accelerator. float16 has no such path on CPU."""
    dtype = jnp.dtype(dtype)
    if platform == "cpu" and dtype == jnp.dtype(jnp.bfloat16) and cpu_has_bf16_dot():
        return dtype
    return compute_dtype(dtype, platform)


def resolve_kv_dtype(kv_cache_dtype: Any, model_dtype: Any) -> jnp.dtype:
    """The KV cache's dtype: "auto" (or None) = the model's; a quantized name
    (pallas_kernels.kv_cache_dtypes: fp8, fp8_e4m3, fp8_e5m2, int8) its storage type;
    else a serving dtype."""
    if kv_cache_dtype is None or kv_cache_dtype == "auto":
        return jnp.dtype(model_dtype)
    name = KV_QUANT_DTYPE_NAMES.get(kv_cache_dtype, kv_cache_dtype)
    try:
        return jnp.dtype(name)
    except TypeError:
        raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}") from None


def build_model(config: ModelConfig, dtype: Any = "auto", attention_backend: str = "auto",
                scan_layers: bool = False) -> nn.Module:
    """The flax module for `config`; parameters and activations in `dtype`.

    attention_backend: a name of pallas_kernels.ragged_paged_attention.resolve_backend,
    which owns what "auto" means; resolved here for the default backend. scan_layers: the layers under jax.lax.scan over stacked params
    (models/llama.py).
    """
    return get_model_class(config.architecture)(config=config, dtype=resolve_dtype(dtype, config),
                                                attention_backend=resolve_backend(attention_backend),
                                                scan_layers=scan_layers)
