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

from models.layers import INIT_STD, MLP, Einsum, logical_param
from models.llama import LlamaForCausalLM
from sharding.mesh import MODEL
from sharding.parallel import over_model_axis

Dtype = Any


class SparseMoeBlock(nn.Module):
    config: Any   # ModelConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:   # [T, E] -> [T, E]
        cfg, dt = self.config, self.dtype
        E, X, k = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok
        T = x.shape[0]

        # Router: softmax over all experts in float32, then top-k.
        router_logits = Einsum("TE,EX->TX", (E, X), ("embed", None), dtype=dt, name="gate")(x)
        probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
        top_w, top_i = jax.lax.top_k(probs, k)                            # [T, k]
        if cfg.norm_topk_prob:
            top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
        top_w = top_w.astype(x.dtype)

        experts = _Experts(cfg, dt, name="experts")
        w_gate, w_up, w_down = experts()

        def grouped(x, top_w, top_i, w_gate, w_up, w_down):
            # Group the T*k (token, expert) pairs by expert for ragged_dot.
            flat_expert = top_i.reshape(T * k)
            order = jnp.argsort(flat_expert, stable=True)
            token = order // k                                             # source token of each row
            group_sizes = jnp.bincount(flat_expert, length=X).astype(jnp.int32)
            xs = x[token].astype(dt)                                       # [T*k, E]
            gate = jax.lax.ragged_dot(xs, w_gate, group_sizes)             # [T*k, F]
            up = jax.lax.ragged_dot(xs, w_up, group_sizes)
            y = jax.lax.ragged_dot(nn.silu(gate) * up, w_down, group_sizes)   # [T*k, E]
            y = y * top_w.reshape(T * k)[order][:, None]
            return jnp.zeros_like(x).at[token].add(y.astype(x.dtype))

        # Tensor-parallel experts (sharding/rules.py): each device runs every expert on
        # its slice of F and the partial [T, E] outputs are summed once, after the
        # combine (left to XLA, the all-reduce lands on the k-times larger [T*k, E] rows).
        rep, f_out, f_in = PartitionSpec(), PartitionSpec(None, None, MODEL), \
            PartitionSpec(None, MODEL, None)
        out = over_model_axis(grouped, in_specs=(rep, rep, rep, f_out, f_out, f_in),
                              out_specs=rep, sum_outputs=True)(x, top_w, top_i, w_gate, w_up, w_down)
        if cfg.shared_expert_intermediate_size:
            # Qwen3.5-MoE: a dense expert every token uses, scaled by its own sigmoid gate.
            shared = MLP(cfg, dt, cfg.shared_expert_intermediate_size, name="shared_expert")(x)
            gate = Einsum("TE,EO->TO", (E, 1), ("embed", None), dtype=dt, name="shared_expert_gate")(x)
            out = out + jax.nn.sigmoid(gate) * shared
        return out


class _Experts(nn.Module):
    """Holds the stacked expert weights (param paths mlp/experts/{gate,up,down}_proj)."""
    config: Any
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.config
        E, F, X = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        init = nn.initializers.normal(INIT_STD)
        w_gate = logical_param(self, "gate_proj", init, (X, E, F), ("experts", "embed", "mlp"), self.dtype)
        w_up = logical_param(self, "up_proj", init, (X, E, F), ("experts", "embed", "mlp"), self.dtype)
        w_down = logical_param(self, "down_proj", init, (X, F, E), ("experts", "mlp", "embed"), self.dtype)
        return w_gate, w_up, w_down


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def mlp_cls_for(config, layer_idx: int) -> type:
        # Dense layers (mlp_only_layers, or off the decoder_sparse_step grid) use intermediate_size.
        return SparseMoeBlock if config.is_moe_layer(layer_idx) else MLP
