"""Qwen3-MoE: the Llama/Qwen3 decoder with a sparse mixture-of-experts MLP.

Experts are stacked weights [X, E, F] / [X, F, E]. Choice for this version:
grouped matmul with `jax.lax.ragged_dot` -- the T*k (token, expert) pairs are
sorted by expert so each expert multiplies only its own rows (no dense compute
over all experts).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from models.config import ModelConfig
from models.layers import INIT_STD, MLP, Einsum, activation, logical_param, quantized_param
from models.quantization import dequantize, quantize_rows
from models.llama import LlamaForCausalLM
from sharding.mesh import MODEL
from sharding.parallel import context_model_axis_size, over_model_axis

Dtype = Any


class SparseMoeBlock(nn.Module):
    config: Any   # ModelConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:   # [T, E] -> [T, E]
        cfg, dt = self.config, self.dtype
        E, X, k = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok

        # Router: softmax over all experts in float32, then top-k.
        router_logits = Einsum("TE,EX->TX", (E, X), ("embed", None), dtype=dt, name="gate")(x)
        probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
        top_w, top_i = jax.lax.top_k(probs, k)                            # [T, k]
        if cfg.norm_topk_prob:
            top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
        top_w = top_w.astype(x.dtype)

        out = routed_experts(cfg, dt, x, top_w, top_i, Experts(cfg, dt, name="experts")())
        if cfg.shared_expert_intermediate_size:
            # Qwen3.5-MoE: a dense expert every token uses, scaled by its own sigmoid gate.
            shared = MLP(cfg, dt, cfg.shared_expert_intermediate_size, name="shared_expert")(x)
            gate = Einsum("TE,EO->TO", (E, 1), ("embed", None), dtype=dt, name="shared_expert_gate")(x)
            out = out + jax.nn.sigmoid(gate) * shared
        return out


def routed_experts(cfg: Any, dt: Dtype, x: jax.Array, top_w: jax.Array, top_i: jax.Array,
                   weights: tuple[tuple[jax.Array, jax.Array | None], ...]) -> jax.Array:
    """sum_k top_w[t, k] * expert_{top_i[t, k]}(x[t]) for x [T, E] -> [T, E]; weights:
    (kernel, scale or None) of the stacked experts' gate, up and down projections."""
    k, T = cfg.num_experts_per_tok, x.shape[0]
    act = activation(cfg)
    (w_gate, s_gate), (w_up, s_up), (w_down, s_down) = weights
    # Quantized experts with one scale per output channel: the grouped matmuls read
    # the converted kernels and each row's output is scaled by its expert's scales
    # (scale None: nothing to do). Block scales (FP8 checkpoints) are dequantized
    # first, outside the per-device function, where XLA fuses it elementwise.
    if s_gate is not None and s_gate.shape[1] != 1:
        w_gate, w_up, w_down = (_dequantize_experts(w, s, cfg.weight_quant.block_in, dt) for w, s in
                                ((w_gate, s_gate), (w_up, s_up), (w_down, s_down)))
        s_gate = s_up = s_down = None
    per_channel = s_gate is not None

    expert_parallel = cfg.expert_parallel and context_model_axis_size() > 1

    def grouped(x, top_w, top_i, w_gate, w_up, w_down, *scales):
        # Group the T*k (token, expert) pairs by expert for ragged_dot. Expert parallel:
        # this device holds experts [first, first + X_local); the pairs of other devices'
        # experts sort last, past every group, and contribute nothing.
        x_local = w_gate.shape[0]
        flat_expert = top_i.reshape(T * k)
        if expert_parallel:
            local = flat_expert - jax.lax.axis_index(MODEL) * x_local
            mine = (local >= 0) & (local < x_local)
            flat_expert = jnp.where(mine, local, x_local)
        order = jnp.argsort(flat_expert, stable=True)
        token = order // k                                             # source token of each row
        # (bincount drops the other devices' pairs: values >= length are not counted)
        group_sizes = jnp.bincount(flat_expert, length=x_local).astype(jnp.int32)
        xs = x[token].astype(dt)                                       # [T*k, E]

        def matmul(a, w, i):
            if not per_channel:
                return jax.lax.ragged_dot(a, w, group_sizes)
            rows = scales[i][flat_expert[order], 0]                    # [T*k, out]
            if cfg.weight_quant.dynamic_activations:                   # w8a8
                aq, a_scale = quantize_rows(a, w.dtype)
                acc = jnp.int32 if w.dtype == jnp.int8 else jnp.float32
                y = jax.lax.ragged_dot(aq, w, group_sizes, preferred_element_type=acc)
                return (y.astype(jnp.float32) * a_scale * rows).astype(dt)
            y = jax.lax.ragged_dot(a, w.astype(dt), group_sizes,
                                   preferred_element_type=jnp.float32)
            return (y * rows).astype(dt)

        gate = matmul(xs, w_gate, 0)                                   # [T*k, F]
        up = matmul(xs, w_up, 1)
        y = matmul(act(gate) * up, w_down, 2)                          # [T*k, E]
        y = y * top_w.reshape(T * k)[order][:, None]
        if expert_parallel:   # rows past the groups are unspecified by ragged_dot
            y = jnp.where(mine[order][:, None], y, 0)
        return jnp.zeros_like(x).at[token].add(y.astype(x.dtype))

    scales = (s_gate, s_up, s_down) if per_channel else ()
    rep = PartitionSpec()
    if expert_parallel:
        # Expert parallel (--enable-expert-parallel, sharding/rules.py): each device runs
        # its own X/M whole experts on every token routed to them, and the partial [T, E]
        # outputs are summed once -- the same single all-reduce as tensor parallelism, no
        # all-to-all (every device already holds all tokens). Scales follow their experts.
        x_split = PartitionSpec(MODEL, None, None)
        w_specs, scale_specs = (x_split,) * 3, (x_split,) * len(scales)
    else:
        # Tensor-parallel experts: each device runs every expert on its slice of F and
        # the partial [T, E] outputs are summed once, after the combine (left to XLA, the
        # all-reduce lands on the k-times larger [T*k, E] rows). Per-channel scales
        # follow their outputs: F (gate, up) split, E (down) whole -- scaling a partial
        # sum before the all-reduce is the same as after.
        f_out, f_in = PartitionSpec(None, None, MODEL), PartitionSpec(None, MODEL, None)
        w_specs = (f_out, f_out, f_in)
        scale_specs = (f_out, f_out, rep) if per_channel else ()
    return over_model_axis(grouped, in_specs=(rep, rep, rep, *w_specs, *scale_specs),
                           out_specs=rep, sum_outputs=True)(x, top_w, top_i, w_gate, w_up, w_down,
                                                            *scales)


def _dequantize_experts(q: jax.Array, scale: jax.Array, block: int | None, dtype: Any) -> jax.Array:
    return jax.vmap(lambda qe, se: dequantize(qe, se, 1, block, dtype))(q, scale)


class Experts(nn.Module):
    """Holds the stacked expert weights (param paths mlp/experts/{gate,up,down}_proj,
    quantized: plus {...}_proj_scale [X, blocks, out])."""
    config: Any
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self) -> tuple[tuple[jax.Array, jax.Array | None], ...]:
        """((kernel, scale or None) for gate, up, down)."""
        cfg = self.config
        E, F, X = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        init, wq = nn.initializers.normal(INIT_STD), cfg.weight_quant

        def weight(name, shape, axes):
            if wq is not None:
                return quantized_param(self, name, shape, axes, 1, wq, num_stacked=1)
            return logical_param(self, name, init, shape, axes, self.dtype), None

        return (weight("gate_proj", (X, E, F), ("experts", "embed", "expert_mlp")),
                weight("up_proj", (X, E, F), ("experts", "embed", "expert_mlp")),
                weight("down_proj", (X, F, E), ("experts", "expert_mlp", "embed")))


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def mlp_cls_for(config: ModelConfig, layer_idx: int) -> type:
        # Dense layers (mlp_only_layers, or off the decoder_sparse_step grid) use intermediate_size.
        return SparseMoeBlock if config.is_moe_layer(layer_idx) else MLP
