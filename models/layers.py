"""Building blocks shared by the decoder families: norm, RoPE, attention, MLP.

Glossary (docs/CONVENTIONS.md): T tokens, E hidden, N query heads, K kv heads,
H head dim, F MLP width, V vocab. Parameters carry logical axis names
(embed, vocab, heads, kv_heads, head_dim, mlp, experts, norm) for sharding.
Weights are stored [in..., out...] so each projection is one einsum.
"""
from __future__ import annotations

import math
from functools import partial
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from models.config import FULL_ATTENTION, ModelConfig, WeightQuant
from models.inputs import ModelInputs
from models.lora.ops import LORA, LORA_STEP, SlotGroups, projection_split, sharded_lora_add
from models.quantization import SCALE_SUFFIX, quantized_matmul, scale_shape, storage_dtype
from pallas_kernels.ragged_paged_attention import (KV_HEAD_AXIS, backend_options,
                                                    ragged_paged_attention, write_kv)
from sharding.parallel import heads_spec, over_model_axis
from sharding.rules import RULES

Dtype = Any
INIT_STD = 0.02
# A projection kernel stored [out..., in...] instead of "kernel"'s [in..., out...] (the
# loader's choice on CPU, models/weights.store_kernels_out_in): out_in_dot below.
KERNEL_OUT_IN = "kernel_out_in"


def logical_param(module: nn.Module, name: str, init: Callable[..., Any], shape: tuple[int, ...], axes: tuple[str | None, ...],
           dtype: Dtype) -> jax.Array:
    if module.has_variable("params", name):
        # apply: read it. module.param would check its shape by tracing the initializer
        # (jax.eval_shape, ~1 ms a param on every trace of every program).
        value = nn.unbox(module.get_variable("params", name))
        if value.shape != tuple(shape):
            raise ValueError(f"param {'/'.join((*module.path, name))} has shape {value.shape}, "
                             f"the model expects {tuple(shape)}")
        return value
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


# Up to this many rows an out_in dot (XLA:CPU) takes the weight as its left operand.
WEIGHT_LEFT_MAX_ROWS = 64


def out_in_dot(x: jax.Array, w: jax.Array, out_dtype: Any) -> jax.Array:
    """x [rows, in] times a kernel stored [out, in]: [rows, out]. XLA:CPU's dot packs its
    right operand on every call, so up to WEIGHT_LEFT_MAX_ROWS rows (decode sizes) the
    weight goes on the left (y^T = W x^T: only x is packed) and the small result is
    transposed; the barrier keeps XLA from folding that transpose back into the other
    form. 12 layers of the benchmark llama's bf16 projections (benchmarks/step/cpu_linear.py
    --stack 12): 16 rows 1.27x faster, 32 1.14x, 48 and 64 1.09x, but 96 rows 0.86x and
    256 0.48x; its decode step at 48 rows ~1.1x (benchmarks/README.md). In float32 on an
    AVX2 EPYC: 16 rows 3.3x, 48 1.7x, 64 1.2x against flax's [in, out], 96 even, 256 0.94x."""
    if x.shape[0] > WEIGHT_LEFT_MAX_ROWS:
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                                   preferred_element_type=out_dtype)
    return weight_left_dot(x, w, out_dtype)


def weight_left_dot(x: jax.Array, w: jax.Array, out_dtype: Any) -> jax.Array:
    """out_in_dot's small-batch form at any size: (W x^T)^T, the transpose kept apart."""
    y_t = jax.lax.dot_general(w, x, (((1,), (1,)), ((), ())), preferred_element_type=out_dtype)
    return jax.lax.optimization_barrier(y_t).T


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * w, normalised in float32.

    plus_one=False: plain w, cast back before the multiply (Llama / Qwen3).
    plus_one=True: (1 + w) applied in float32, then cast (Qwen3.5; the weight is stored
    as the offset from one, param "offset_scale", zeros at init).
    weight_f32=True: plain w applied in float32, then cast (Gemma 4).
    use_weight=False: no weight at all (Gemma 4's v_norm and router norm).
    """
    dim: int
    eps: float
    dtype: Dtype = jnp.float32
    plus_one: bool = False
    weight_f32: bool = False
    use_weight: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if not self.use_weight:
            return y.astype(x.dtype)
        if self.weight_f32:
            w = logical_param(self, "scale", nn.initializers.ones, (self.dim,), ("norm",), self.dtype)
            return (y * w.astype(jnp.float32)).astype(x.dtype)
        if self.plus_one:
            w = logical_param(self, "offset_scale", nn.initializers.zeros, (self.dim,), ("norm",),
                              self.dtype)
            return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
        w = logical_param(self, "scale", nn.initializers.ones, (self.dim,), ("norm",), self.dtype)
        return w * y.astype(x.dtype)  # transformers casts back before the weight multiply


class Einsum(nn.Module):
    """A projection: one einsum with a kernel whose first `num_contract` dims contract."""
    eq: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    num_contract: int = 1
    use_bias: bool = False
    dtype: Dtype = jnp.float32
    out_dtype: Dtype | None = None
    # Stored quantized (models/quantization.py): "kernel" in the quantized dtype plus
    # "kernel_scale"; None: "kernel" in dtype.
    quant: WeightQuant | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        n = self.num_contract
        if self.quant is not None:
            y = quantized_matmul(x, *quantized_param(self, "kernel", self.shape, self.axes, n,
                                                     self.quant), n, self.quant.block_in,
                                 self.dtype, self.out_dtype, self.quant.dynamic_activations)
            return self._add_lora(x, self._add_bias(y))
        w, out_in = self._kernel()
        x_dtype, out_dtype = self.dtype, self.out_dtype
        if jnp.dtype(w.dtype).itemsize < jnp.dtype(self.dtype).itemsize:
            # A 16-bit kernel in a float32 model (CPU with native bf16 dots: models/registry.
            # matmul_dtype): the dot takes both operands in the kernel's dtype and gives
            # float32, as a bf16 model does on any accelerator; converting the kernel instead
            # would cost a whole-weight convert per call.
            x_dtype, out_dtype = w.dtype, out_dtype or self.dtype
        rows, xd = x.shape[:-n], x.astype(x_dtype)
        if out_in:
            # [out..., in...] read as [out, in]: both reshapes are free on row-major arrays.
            y = out_in_dot(xd.reshape(-1, math.prod(self.shape[:n])),
                           w.reshape(-1, math.prod(self.shape[:n])), out_dtype)
            y = y.reshape(*rows, *self.shape[n:])
        elif n > 1:
            # x's last n axes contract with the kernel's first n (as in "TNH,NHE->TE"). One
            # merged axis instead: both reshapes are free on row-major arrays, while the
            # two-axis contraction made XLA CPU copy the whole kernel on every call.
            y = jnp.tensordot(xd.reshape(*rows, -1), w.reshape(-1, *self.shape[n:]), axes=1,
                              preferred_element_type=out_dtype)
        else:
            y = jnp.einsum(self.eq, xd, w, preferred_element_type=out_dtype)
        # The adapters read the input as the base dot did (rounded to a 16-bit kernel's
        # dtype: the LoRA stacks are in it too under --lora-dtype auto, build/parts.py).
        return self._add_lora(xd, self._add_bias(y))

    def _kernel(self) -> tuple[jax.Array, bool]:
        """The kernel, and whether it is stored [out..., in...] (KERNEL_OUT_IN, set by the
        loader on CPU: models/weights.store_kernels_out_in)."""
        if not self.has_variable("params", KERNEL_OUT_IN):
            return logical_param(self, "kernel", nn.initializers.normal(INIT_STD), self.shape,
                                 self.axes, self.dtype), False
        w = nn.unbox(self.get_variable("params", KERNEL_OUT_IN))
        n = self.num_contract
        if w.shape != (*self.shape[n:], *self.shape[:n]):
            raise ValueError(f"param {'/'.join((*self.path, KERNEL_OUT_IN))} has shape {w.shape}, "
                             f"the model expects {(*self.shape[n:], *self.shape[:n])}")
        return w, True

    def _add_lora(self, x: jax.Array, y: jax.Array) -> jax.Array:
        """y plus each token's adapter delta when the forward has LoRA stacks for this
        projection (models/lora/slots.forward_variables); without them nothing is traced."""
        if not self.has_variable(LORA, "a"):
            return y
        step = {k: self.get_variable(LORA_STEP, k) for k in (*SlotGroups._fields, "scales")}
        groups = SlotGroups(*(step[k] for k in SlotGroups._fields))
        n, rows = self.num_contract, x.shape[:-self.num_contract]
        out = sharded_lora_add(y.reshape(*rows, -1), x.reshape(*rows, -1), groups,
                               self.get_variable(LORA, "a"), self.get_variable(LORA, "b"),
                               step["scales"], projection_split(self.axes, n, RULES))
        return out.reshape(y.shape)

    def _add_bias(self, y: jax.Array) -> jax.Array:
        if not self.use_bias:
            return y
        return y + logical_param(self, "bias", nn.initializers.zeros, self.shape[self.num_contract:],
                                 self.axes[self.num_contract:], self.dtype)


def quantized_param(module: nn.Module, name: str, shape: tuple[int, ...],
                    axes: tuple[str | None, ...], num_contract: int, quant: WeightQuant,
                    num_stacked: int = 0) -> tuple[jax.Array, jax.Array]:
    """(q, scale) of a quantized kernel: param `name` in the quantized dtype and
    `name + SCALE_SUFFIX` float32 (models/quantization.py), sharded along the kernel's
    output axes. num_stacked: leading axes stacking kernels (experts), each its own scales."""
    s = num_stacked
    q = logical_param(module, name, nn.initializers.zeros, shape, axes, storage_dtype(quant))
    scale = logical_param(module, name + SCALE_SUFFIX, nn.initializers.ones,
                          (*shape[:s], *scale_shape(shape[s:], num_contract, quant.block_in)),
                          (*axes[:s], None, *axes[s + num_contract:]), jnp.float32)
    return q, scale


class Embed(nn.Module):
    vocab_size: int
    dim: int
    dtype: Dtype = jnp.float32

    def setup(self) -> None:
        self.embedding = logical_param(self, "embedding", nn.initializers.normal(INIT_STD),
                                (self.vocab_size, self.dim), ("vocab", "embed"), self.dtype)

    def __call__(self, token_ids: jax.Array) -> jax.Array:   # int32[T] -> [T, E]
        return jnp.take(self.embedding, token_ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:             # [T, E] -> float32 [T, V]
        return jnp.einsum("TE,VE->TV", x.astype(self.dtype), self.embedding,
                          preferred_element_type=jnp.float32)


# ---- rotary position embedding ---------------------------------------------

def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> np.ndarray:
    """Inverse frequencies float32[H/2], computed in float32 as transformers does."""
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / np.power(np.float32(theta), exponent)).astype(np.float32)
    if scaling is None:
        return inv
    kind = scaling["rope_type"]
    if kind == "linear":
        return (inv / np.float32(scaling["factor"])).astype(np.float32)
    if kind == "llama3":
        factor = np.float32(scaling["factor"])
        low, high = np.float32(scaling["low_freq_factor"]), np.float32(scaling["high_freq_factor"])
        old_len = np.float32(scaling["original_max_position_embeddings"])
        wavelen = np.float32(2 * np.pi) / inv
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = np.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return np.where(medium, blended, scaled).astype(np.float32)
    if kind == "proportional":
        # Gemma 4's global layers: the first fraction of the frequencies as default RoPE
        # over the whole head (exponents / head_dim), the rest 0, so dims i and i + H/2
        # rotate for the first ones and pass through for the others.
        angles = int(scaling["partial_rotary_factor"] * head_dim // 2)
        inv = np.concatenate([inv[:angles], np.zeros(head_dim // 2 - angles, np.float32)])
        return (inv / np.float32(scaling.get("factor", 1.0))).astype(np.float32)
    raise ValueError(f"unsupported rope type {kind!r}")


RopeTables = tuple[jax.Array, jax.Array]   # cos, sin float32[T, 1, rot/2]


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> RopeTables:
    """cos and sin of each token's angles, at positions int32[T], or int32[T, rot/2]: a
    position per frequency (mrope_positions). On XLA:CPU they are computed in a loop of
    one trip, whose results no fusion can take in (and which XLA keeps once for every
    layer: the same computation): fused into their consumers, as XLA fuses them, each is
    recomputed per head and per half of the rotation, in every layer (the benchmark
    llama's 2048-token prefill spent ~8 % of its step there; benchmarks/README.md)."""
    if positions.ndim == 1:
        positions = positions[:, None]
    freqs = positions.astype(jnp.float32) * jnp.asarray(inv_freq)[None, :]   # [T, rot/2]
    cos, sin = jax.lax.platform_dependent(freqs, cpu=_cos_sin_apart, default=_cos_sin)
    return cos[:, None, :], sin[:, None, :]


def _cos_sin(freqs: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jnp.cos(freqs), jnp.sin(freqs)


def _cos_sin_apart(freqs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """_cos_sin in a while loop XLA cannot count the trips of (a flag ends it), so it
    keeps the loop and its results are buffers."""
    zeros = jnp.zeros_like(freqs)
    _, cos, sin = jax.lax.while_loop(lambda c: ~c[0], lambda c: (True, *_cos_sin(freqs)),
                                     (jnp.bool_(False), zeros, zeros))
    return cos, sin


def apply_rope(x: jax.Array, tables: RopeTables) -> jax.Array:
    """Rotate-half RoPE by rope_tables' angles on the first rot = 2 * (their width) dims of
    x [T, n, H] (dim i pairs with i + rot / 2); the rest pass through (partial RoPE)."""
    cos, sin = tables
    rot = 2 * cos.shape[-1]
    x1, x2 = jnp.split(x[..., :rot].astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return out if rot == x.shape[-1] else jnp.concatenate([out, x[..., rot:]], axis=-1)


def mrope_axes(section: tuple[int, ...], num_freqs: int) -> np.ndarray:
    """Qwen3.5's interleaved 3-axis RoPE: the position axis (0 temporal, 1 row, 2 column)
    each frequency rotates by (transformers' recomposition_frequencies)."""
    i = np.arange(num_freqs)
    axes = np.zeros(num_freqs, np.int32)
    axes[(i % 3 == 1) & (i < 3 * section[1])] = 1
    axes[(i % 3 == 2) & (i < 3 * section[2])] = 2
    return axes


def mrope_positions(inputs: ModelInputs, section: tuple[int, ...], num_freqs: int) -> jax.Array:
    """Each token's position per rotary frequency, int32[T, num_freqs], from the step's
    3-axis positions; the plain positions when the step has none or the model uses one axis."""
    if not section or inputs.mrope_positions is None:
        return inputs.positions
    return inputs.mrope_positions[jnp.asarray(mrope_axes(section, num_freqs))].T


# ---- attention and MLP -------------------------------------------------------

def kv_heads_axis(cfg: ModelConfig, layer: int) -> str:
    """The logical axis of a layer's KV heads: Gemma 4's global layers, with a count of
    their own, have their own name (sharding/rules.py), so each count is replicated on
    the mesh as it needs."""
    if cfg.layer_type(layer) == FULL_ATTENTION and cfg.full_num_kv_heads:
        return "global_kv_heads"
    return "kv_heads"


class Attention(nn.Module):
    """GQA attention over the paged KV cache (Llama / Qwen3 style).

    Qwen3.5's gated attention adds, from the config: q_proj giving per head the query
    then an output gate (o = attn * sigmoid(gate)), (1 + w) q/k norms and partial RoPE.
    """
    config: ModelConfig
    dtype: Dtype = jnp.float32
    attention_backend: str = "reference"   # EngineConfig.attention_backend, "auto" resolved

    @nn.compact
    def __call__(self, x: jax.Array, cache: jax.Array, inputs: ModelInputs, first_page: Any = 0,
                 kv_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """cache: the stacked KV cache; this layer's pages start at first_page
        (models/layer_stack.py). kv_scale: float32 [K, 2], this layer's K and V scales
        when the cache is stored quantized."""
        cfg, dt = self.config, self.dtype
        E, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias, gated, wq = cfg.attention_bias, cfg.attn_output_gate, cfg.weight_quant
        q_width = 2 * H if gated else H   # per head: query, then the gate
        q = Einsum("TE,ENH->TNH", (E, N, q_width), ("embed", "heads", "head_dim"), 1, bias, dt,
                   quant=wq, name="q_proj")(x)
        if gated:
            q, gate = jnp.split(q, 2, axis=-1)
        k = Einsum("TE,EKH->TKH", (E, K, H), ("embed", "kv_heads", "head_dim"), 1, bias, dt, quant=wq,
                   name="k_proj")(x)
        v = Einsum("TE,EKH->TKH", (E, K, H), ("embed", "kv_heads", "head_dim"), 1, bias, dt, quant=wq,
                   name="v_proj")(x)
        if cfg.qk_norm:
            q = RMSNorm(H, cfg.rms_norm_eps, dt, cfg.norm_plus_one, name="q_norm")(q)
            k = RMSNorm(H, cfg.rms_norm_eps, dt, cfg.norm_plus_one, name="k_norm")(k)
        inv_freq = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        positions = mrope_positions(inputs, cfg.mrope_section, len(inv_freq))
        tables = rope_tables(positions, inv_freq)
        q, k = apply_rope(q, tables), apply_rope(k, tables)
        if self.is_initializing():
            # init only needs parameter shapes; the cache layout belongs to the kernel
            # module, so init callers may pass any placeholder cache.
            o = q
        else:
            o, cache = paged_attention(q, k, v, cache, inputs, first_page, sm_scale=H ** -0.5,
                                       backend=self.attention_backend, kv_scale=kv_scale)
        if gated:
            o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)
        out = Einsum("TNH,NHE->TE", (N, H, E), ("heads", "head_dim", "embed"), 2, bias, dt, quant=wq,
                     name="o_proj")(o)
        return out, cache


@partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "impl", "interpret"))
def _write_and_attend(q, k, v, cache, kv_scale, slots, seq_lens, page_table, query_start_loc,
                      num_seqs, first_page, horizon, *, sm_scale: float,
                      sliding_window: int | None, impl: str, interpret: Any):
    """One device's part of paged_attention. A jit of its own: jax traces it once per
    shape, not once per layer (most of a forward's tracing on CPU, where the layers are
    a Python loop), and XLA inlines it, so the compiled program is the same."""
    page_size = cache.shape[2]
    if k is not None:   # None: a KV-sharing layer reads another layer's pages
        # Negative slots are dropped by write_kv: they must stay negative.
        slots = jnp.where(slots < 0, slots, slots + first_page * page_size)
        # Write first: a request may read pages that this very step fills.
        cache = write_kv(cache, k, v, slots, kv_scale=kv_scale)
    o = ragged_paged_attention(q, cache, seq_lens, page_table + first_page, query_start_loc,
                               num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
                               impl=impl, interpret=interpret, kv_scale=kv_scale,
                               horizon=horizon)
    return o, cache


def paged_attention(q: jax.Array, k: jax.Array | None, v: jax.Array | None, cache: jax.Array,
                    inputs: ModelInputs, first_page: Any = 0, *, sm_scale: float, backend: str,
                    kv_scale: jax.Array | None = None, sliding_window: int | None = None,
                    horizon: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Writes k, v [T, K, H] into the cache (None: nothing to write, a KV-sharing layer),
    then attends q [T, N, H] over it. The inputs' page ids count from first_page: the
    layer's own pages of a stacked cache. sliding_window: a sliding-window layer, which
    sees the last `sliding_window` positions and whose pages are the sliding KV group's
    (inputs.sliding_slot_mapping / sliding_page_table, when the batch has them).
    horizon: int32[T] the last position each token sees (Gemma 4's image tokens on its
    sliding layers: their whole image); None: causal.

    Under a mesh each device does this for its own heads only (shard_map over the
    model axis): attention is independent per KV head, so no collective is needed
    and the cache never leaves its shard.
    """
    impl, interpret = backend_options(backend)
    local = partial(_write_and_attend, sm_scale=sm_scale, sliding_window=sliding_window, impl=impl,
                    interpret=interpret)
    slots, page_table = inputs.slot_mapping, inputs.page_table
    if sliding_window is not None and inputs.sliding_page_table is not None:
        slots, page_table = inputs.sliding_slot_mapping, inputs.sliding_page_table
    heads, kv = heads_spec(3, 1), heads_spec(cache.ndim, KV_HEAD_AXIS)
    rep = PartitionSpec()
    scale = rep if kv_scale is None else heads_spec(2, 0)
    fn = over_model_axis(local, in_specs=(heads, heads, heads, kv, scale, rep, rep, rep, rep, rep, rep,
                                          rep), out_specs=(heads, kv))
    return fn(q, k, v, cache, kv_scale, slots, inputs.seq_lens, page_table,
              inputs.query_start_loc, inputs.num_seqs, jnp.asarray(first_page, jnp.int32), horizon)


def activation(cfg: ModelConfig) -> Callable[[jax.Array], jax.Array]:
    """The gated MLP's activation: SwiGLU's silu or GeGLU's tanh-approximated gelu."""
    return nn.silu if cfg.hidden_act == "silu" else partial(jax.nn.gelu, approximate=True)


class MLP(nn.Module):
    """SwiGLU (GeGLU for Gemma): down(act(gate(x)) * up(x)); width = intermediate_size
    unless given."""
    config: ModelConfig
    dtype: Dtype = jnp.float32
    width: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        E, F, dt = self.config.hidden_size, self.width or self.config.intermediate_size, self.dtype
        wq = self.config.weight_quant
        gate = Einsum("TE,EF->TF", (E, F), ("embed", "mlp"), dtype=dt, quant=wq, name="gate_proj")(x)
        up = Einsum("TE,EF->TF", (E, F), ("embed", "mlp"), dtype=dt, quant=wq, name="up_proj")(x)
        return Einsum("TF,FE->TE", (F, E), ("mlp", "embed"), dtype=dt, quant=wq,
                      name="down_proj")(activation(self.config)(gate) * up)
