"""The memory the caches may take: given, a share of free memory (the device's, or given:
the planner sizes the cache of a device that is not here), less the activations' estimated
peak. planning/cache_plan.py turns it into pages and state slots."""
from __future__ import annotations

import logging
import os

import jax

logger = logging.getLogger("jaxserve")

_CPU_RAM_FRACTION = 0.25  # on CPU never take more than this share of available RAM
# Live float32 [rows, vocab] arrays in the costliest sampler program (penalties, top-k/p
# sort, logprobs): XLA:TPU gives it 2.85 GB of temporaries at 256 x 248,320 (11.2 copies).
SAMPLER_COPIES = 12


def activation_bytes(mc, m: int, tokens: int, rows: int, itemsize: int,
                     max_model_len: int) -> int:
    """Rough peak of one program's temporaries per device, the larger of the forward's
    and the sampler's. Forward: the widest per-layer temporaries of a token bucket
    (residual + the attention's projections -- q (and its output gate), k, v; or a
    linear-attention layer's q|k|v, z, a, b -- + MLP gate/up, split by M where sharded;
    experts see top-k copies of each token, plus the shared expert). Sampler: float32
    logits [rows, V], gathered whole, SAMPLER_COPIES of them, and the penalties' int32
    token history [rows, max_model_len] (268 MB at 256 x 262,144) it is given each step."""
    attn = max(((mc.num_heads * (2 if mc.attn_output_gate else 1) + 2 * mc.layer_num_kv_heads(i))
                * mc.layer_head_dim(i) for i in mc.kv_layers()), default=0) // m
    if mc.is_hybrid:
        linear = mc.linear_conv_dim + mc.linear_num_value_heads * (mc.linear_value_head_dim + 2)
        attn = max(attn, linear // m)
    dense = max(mc.mlp_width(i) for i in range(mc.num_layers))
    mlp = 2 * (mc.moe_intermediate_size * mc.num_experts_per_tok
               + mc.shared_expert_intermediate_size
               + (dense if mc.is_gemma4 else 0) if mc.is_moe else dense) // m
    per_token = (3 * mc.hidden_size + attn + mlp) * itemsize
    sampler = SAMPLER_COPIES * rows * mc.vocab_size * 4 + rows * max_model_len * 4
    return max(tokens * per_token, sampler)


def kv_budget_bytes(free_bytes: int, hbm_utilization: float, activation: int) -> int:
    """The KV cache's (and a hybrid's state slots') share of what the weights leave:
    hbm_utilization of it, but never eating into the estimated activation peak."""
    return max(0, min(int(free_bytes * hbm_utilization), free_bytes - activation))


def available_host_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


def cache_budget_bytes(*, kv_cache_memory_bytes: int | None, hbm_utilization: float | None,
                       activation_bytes: int, device: jax.Device | None,
                       free_bytes: int | None = None) -> tuple[int, bool]:
    """(bytes per device the caches may take, whether to stop at what max_num_seqs
    sequences need) for planning.cache_plan.plan_caches: kv_cache_memory_bytes when
    given; on a CPU device hbm_utilization of the host's free RAM (None: a quarter, taken
    only as far as needed); else hbm_utilization of the memory the weights leave
    (free_bytes, or read from `device`), never eating into the estimated activation
    peak."""
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes, False
    if free_bytes is None and device.platform == "cpu":
        if hbm_utilization is None:
            return int(available_host_bytes() * _CPU_RAM_FRACTION), True
        return int(available_host_bytes() * hbm_utilization), False
    if hbm_utilization is None:
        raise ValueError("hbm_utilization: None is the CPU's default; EngineConfig."
                         "for_platform gives accelerators theirs")
    if free_bytes is None:
        stats = device.memory_stats() or {}
        free_bytes = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    return kv_budget_bytes(free_bytes, hbm_utilization, activation_bytes), False
