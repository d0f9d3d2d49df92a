"""The Gated DeltaNet token mixer of Qwen3.5 / Qwen3.6 (linear attention with state).

Per request it carries, instead of a KV cache, a fixed-size state in a slot of two
arrays (the engine allocates one slot per running request; slot 0 is the null
slot that padding rows point at):
    conv state       [S, Hk * G * (kernel-1)]  the last kernel-1 inputs of the causal
                                            conv, channel-major (pallas_kernels/gated_delta/conv.py)
    recurrent state  [S, Hv, Dk, Dv]        float32, the delta-rule memory

Channels are grouped by key head: group h holds q_h (Dk), k_h (Dk) and the r = Hv/Hk
value heads that key head serves (r * Dv), so G = 2 Dk + r Dv. The checkpoint's
`in_proj_qkv` / `conv1d` rows are [all q | all k | all v]; models/weights.py regroups
them at load time. With this layout the whole mixer is independent per key-head
group, so tensor parallelism splits groups over the model axis with no collective
until out_proj (one all-reduce, as o_proj).
"""
from __future__ import annotations

from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from models.config import ModelConfig
from models.inputs import ModelInputs
from models.layers import INIT_STD, Einsum, logical_param
from pallas_kernels.gated_delta import ragged_causal_conv1d, ragged_gated_delta_rule
from sharding.parallel import heads_spec, over_model_axis

Dtype = Any
# The axes the model axis splits in each state array (the conv state's channel axis
# holds whole key-head groups, so its M parts are whole groups too).
CONV_HEAD_AXIS, STATE_HEAD_AXIS = 1, 1
CONV_NDIM = 2


def state_shapes(cfg: ModelConfig, num_slots: int, dtype: Dtype
                 ) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """(conv state, recurrent state) of one linear-attention layer for num_slots slots."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    g = 2 * dk + hv // hk * dv
    # One row per slot: stored [S, kernel-1, Hk, G], a scanned model's stacked state
    # was copied whole into another layout and back around every step on TPU.
    return (jax.ShapeDtypeStruct((num_slots, hk * g * (cfg.linear_conv_kernel_dim - 1)), dtype),
            jax.ShapeDtypeStruct((num_slots, hv, dk, dv), jnp.float32))


def has_initial_state(inputs: ModelInputs) -> jax.Array:
    """bool[R]: the row continues a request (tokens computed before this step), so its
    state is read from its slot; a request's first chunk starts from zeros."""
    q_lens = inputs.query_start_loc[1:] - inputs.query_start_loc[:-1]
    return inputs.seq_lens > q_lens


@partial(jax.jit, static_argnames=("dk", "dv", "eps", "impl", "interpret", "decode_tokens"))
def _mix_local(qkv, z, b, a, conv_w, a_log, dt_bias, norm_w, conv_state, rec_state, slots, qsl,
               num_seqs, has_init, *, dk: int, dv: int, eps: float, impl: str, interpret: Any,
               decode_tokens: int = 1):
    """One device's part of GatedDeltaNet._mix (its key-head groups only). A jit of its
    own: traced once per shape, not once per layer (XLA inlines it)."""
    t, hk, g_width = qkv.shape
    kc = conv_w.shape[0]
    y, conv_state = ragged_causal_conv1d(
        qkv.reshape(t, hk * g_width), conv_w.reshape(kc, hk * g_width),
        conv_state, slots, qsl, num_seqs, has_init)
    y = y.reshape(t, hk, g_width)
    q, k = y[..., :dk], y[..., dk:2 * dk]
    v = y[..., 2 * dk:].reshape(t, -1, dv)                      # [T, Hv, Dv]
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    o, rec_state = ragged_gated_delta_rule(
        q, k, v, g, beta, rec_state, slots, qsl, num_seqs, has_init, impl=impl,
        interpret=interpret, decode_tokens=decode_tokens)
    # Gated RMSNorm per value head: plain w, then * silu(z), in float32.
    o32 = o.astype(jnp.float32)
    o32 = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)
    o = (norm_w * o32.astype(o.dtype)).astype(jnp.float32)
    o = (o * jax.nn.silu(z.astype(jnp.float32))).astype(z.dtype)
    return o, conv_state, rec_state


class _Weight(nn.Module):
    """One named parameter in its own scope, so param paths mirror the checkpoint's
    names (linear_attn/conv1d/kernel <- linear_attn.conv1d.weight)."""
    leaf: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    initializer: Any
    dtype: Dtype

    @nn.compact
    def __call__(self) -> jax.Array:
        return logical_param(self, self.leaf, self.initializer, self.shape, self.axes, self.dtype)


class GatedDeltaNet(nn.Module):
    config: ModelConfig
    dtype: Dtype = jnp.float32
    use_pallas: bool = False
    interpret: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, state: tuple[jax.Array, jax.Array], inputs: ModelInputs,
                 first_slot: Any = 0) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """state: the stacked (conv, recurrent) state; this layer's slots start at
        first_slot (models/layer_stack.py)."""
        cfg, dt = self.config, self.dtype
        E = cfg.hidden_size
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, kc = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        r = hv // hk
        g_width = 2 * dk + r * dv
        ax_k, ax_v = "linear_key_heads", "linear_value_heads"

        # Quantized (--quantization): the large projections; not the per-head gates
        # in_proj_b / in_proj_a (E x Hv each, and they set the decay of the whole state).
        wq = cfg.weight_quant
        qkv = Einsum("TE,EKG->TKG", (E, hk, g_width), ("embed", ax_k, None), dtype=dt, quant=wq,
                     name="in_proj_qkv")(x)
        z = Einsum("TE,EVD->TVD", (E, hv, dv), ("embed", ax_v, None), dtype=dt, quant=wq,
                   name="in_proj_z")(x)
        b = Einsum("TE,EV->TV", (E, hv), ("embed", ax_v), dtype=dt, name="in_proj_b")(x)
        a = Einsum("TE,EV->TV", (E, hv), ("embed", ax_v), dtype=dt, name="in_proj_a")(x)
        conv_w = _Weight("kernel", (kc, hk, g_width), (None, ax_k, None),
                         nn.initializers.normal(INIT_STD), dt, name="conv1d")()
        a_log = logical_param(self, "A_log", nn.initializers.zeros, (hv,), (ax_v,), dt)
        dt_bias = logical_param(self, "dt_bias", nn.initializers.ones, (hv,), (ax_v,), dt)
        norm_w = _Weight("scale", (dv,), ("norm",), nn.initializers.ones, dt, name="norm")()

        if self.is_initializing():
            o = z   # init only needs parameter shapes; `state` may be a placeholder
        else:
            o, state = self._mix(qkv, z, b, a, conv_w, a_log, dt_bias, norm_w, state, inputs,
                                 first_slot)
        out = Einsum("TVD,VDE->TE", (hv, dv, E), (ax_v, None, "embed"), 2, dtype=dt, quant=wq,
                     name="out_proj")(o)
        return out, state

    def _mix(self, qkv, z, b, a, conv_w, a_log, dt_bias, norm_w, state, inputs, first_slot):
        cfg = self.config
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        eps = cfg.rms_norm_eps
        has_init = has_initial_state(inputs)
        impl = "pallas" if self.use_pallas else "reference"
        local = partial(_mix_local, dk=dk, dv=dv, eps=eps, impl=impl, interpret=self.interpret,
                        decode_tokens=cfg.max_decode_tokens)

        rep = PartitionSpec()
        # Axis 1 of the [T, heads, ...] activations and of the conv kernel, axis 0 of the
        # per-value-head vectors: key-head groups and their value heads split together.
        h3, h2, h1 = heads_spec(3, 1), heads_spec(2, 1), heads_spec(1, 0)
        conv_sp, rec_sp = heads_spec(CONV_NDIM, CONV_HEAD_AXIS), heads_spec(4, STATE_HEAD_AXIS)
        fn = over_model_axis(
            local,
            in_specs=(h3, h3, h2, h2, h3, h1, h1, rep, conv_sp, rec_sp, rep, rep, rep, rep),
            out_specs=(h3, conv_sp, rec_sp))
        conv_state, rec_state = state
        o, conv_state, rec_state = fn(qkv, z, b, a, conv_w, a_log, dt_bias, norm_w, conv_state,
                                      rec_state, inputs.state_slots + first_slot,
                                      inputs.query_start_loc,
                                      inputs.num_seqs, has_init)
        return o, (conv_state, rec_state)
