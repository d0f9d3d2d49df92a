"""Pure-jnp gated delta rule (Qwen3.5/3.6 linear attention): the spec and test oracle.

Per value head h with state S [Dk, Dv] (float32), token by token:
    S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q
with q, k l2-normalised (eps 1e-6 inside the rsqrt), q scaled by Dk**-0.5, and
key head j serving value heads j*G .. j*G+G-1 (G = Hv // Hk, repeat_interleave),
as transformers' torch_{chunk,recurrent}_gated_delta_rule with
use_qk_l2norm_in_kernel=True.

The chunked form (UT transform / WY representation) does C tokens at once:
with A = strictly_lower((beta k) k^T * Gamma), Gamma[i, j] = exp(cum_i - cum_j)
for j <= i, solve (I + A) U = beta v and (I + A) W = beta k exp(cum); then per
chunk, from the state S entering it,
    V' = U - W S;  O = (q exp(cum)) S + (q k^T * Gamma) V'
    S  <- exp(cum_last) S + (k exp(cum_last - cum))^T V'.
Padding a chunk with k = v = q = 0, beta = 0, g = 0 leaves S exact: padded rows
of U and W are zero and the decay stops accumulating after the last real token.

Layouts: tokens-first ([L, H, D]) at the interface; [H, C, D] inside a chunk.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST       # f32 matmuls must not drop to bf16/TF32 passes on accelerators
L2_EPS = 1e-6


def l2norm(x: jax.Array) -> jax.Array:
    """x * rsqrt(sum(x^2) + eps) over the last axis, in float32 (transformers / FLA)."""
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def prepare_qk(q: jax.Array, k: jax.Array, num_v_heads: int) -> tuple[jax.Array, jax.Array]:
    """l2-normalised float32 q (scaled by Dk**-0.5) and k, expanded to the value heads.

    q, k: [..., Hk, Dk] -> [..., Hv, Dk]. Normalising before the repeat is the
    same as after it (each head is normalised on its own) and cheaper."""
    num_k_heads, head_k = q.shape[-2], q.shape[-1]
    if num_v_heads % num_k_heads:
        raise ValueError(f"{num_v_heads} value heads is not a multiple of {num_k_heads} key heads")
    group = num_v_heads // num_k_heads
    q = l2norm(q) * (head_k ** -0.5)
    k = l2norm(k)
    if group > 1:
        q = jnp.repeat(q, group, axis=-2)
        k = jnp.repeat(k, group, axis=-2)
    return q, k


def recurrent_step(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                   beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token for any leading batch shape B: state [B.., H, Dk, Dv]; q, k prepared
    [B.., H, Dk]; v [B.., H, Dv] and g, beta [B.., H] in float32. Returns (o, state)."""
    state = state * jnp.exp(g)[..., None, None]
    kv = jnp.sum(state * k[..., :, None], axis=-2)                  # S^T k: [B.., H, Dv]
    delta = (v - kv) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    o = jnp.sum(state * q[..., :, None], axis=-2)
    return o, state


def chunk_step(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
               beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One chunk of C tokens (padding rows zero, see module doc): state [H, Dk, Dv];
    q, k [H, C, Dk] prepared; v [H, C, Dv]; g, beta [H, C]. Returns (o [H, C, Dv], state)."""
    return chunk_scan_step(state, chunk_prologue(q, k, v, g, beta))


def chunk_prologue(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """The state-independent part of a chunk; works for any leading batch dims
    (e.g. [H, N, C, D] for all chunks of a sequence at once)."""
    size = g.shape[-1]
    cum = jnp.cumsum(g, axis=-1)                                     # [.., C]
    lower = jnp.tril(jnp.ones((size, size), bool))
    # exp only on the causal half: cum_i - cum_j > 0 above the diagonal could overflow.
    gamma = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    k_beta = k * beta[..., None]
    a = jnp.einsum("...ik,...jk->...ij", k_beta, k, precision=_HI) * gamma
    a = jnp.where(jnp.tril(lower, -1), a, 0.0) + jnp.eye(size, dtype=a.dtype)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(cum)[..., None]], axis=-1)
    sol = lax.linalg.triangular_solve(a, rhs, left_side=True, lower=True, unit_diagonal=True)
    dv = v.shape[-1]
    u, w = sol[..., :dv], sol[..., dv:]
    attn = jnp.einsum("...ik,...jk->...ij", q, k, precision=_HI) * gamma
    q_dec = q * jnp.exp(cum)[..., None]
    k_dec = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])
    return u, w, attn, q_dec, k_dec, chunk_decay


def chunk_scan_step(state: jax.Array, parts: tuple[jax.Array, ...]
                    ) -> tuple[jax.Array, jax.Array]:
    """The sequential part of a chunk: read the entering state, produce (o, new state)."""
    u, w, attn, q_dec, k_dec, chunk_decay = parts
    v_new = u - jnp.einsum("hck,hkv->hcv", w, state, precision=_HI)
    o = (jnp.einsum("hck,hkv->hcv", q_dec, state, precision=_HI)
         + jnp.einsum("hij,hjv->hiv", attn, v_new, precision=_HI))
    state = (state * chunk_decay[:, None, None]
             + jnp.einsum("hck,hcv->hkv", k_dec, v_new, precision=_HI))
    return o, state


def _prepare(q, k, v, g, beta, initial_state):
    if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: expected [L, Hk, Dk] x2, [L, Hv, Dv]")
    length, num_v, head_v = v.shape
    if g.shape != (length, num_v) or beta.shape != (length, num_v):
        raise ValueError(f"g {g.shape}, beta {beta.shape}: expected {(length, num_v)}")
    qf, kf = prepare_qk(q, k, num_v)
    shape = (num_v, q.shape[-1], head_v)
    if initial_state is None:
        state = jnp.zeros(shape, jnp.float32)
    elif initial_state.shape != shape:
        raise ValueError(f"initial_state {initial_state.shape}: expected {shape}")
    else:
        state = initial_state.astype(jnp.float32)
    f32 = lambda x: x.astype(jnp.float32)
    return qf, kf, f32(v), f32(g), f32(beta), state


def chunk_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                           initial_state: jax.Array | None = None, *,
                           chunk_size: int = 64) -> tuple[jax.Array, jax.Array]:
    """One sequence in the chunked form. q, k [L, Hk, Dk]; v [L, Hv, Dv]; g (log
    decay, <= 0), beta [L, Hv]; initial_state [Hv, Dk, Dv] or None (zeros).
    Returns (o [L, Hv, Dv] in v.dtype, final state [Hv, Dk, Dv] float32)."""
    qf, kf, vf, gf, bf, state = _prepare(q, k, v, g, beta, initial_state)
    length = q.shape[0]
    pad = -length % chunk_size
    n = (length + pad) // chunk_size

    def chunks(x):      # [L, H, ...] -> [H, N, C, ...], zero padded (exact, see module doc)
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        x = x.reshape(n, chunk_size, *x.shape[1:])
        return jnp.moveaxis(x, 2, 0)

    # All chunks' state-independent work at once; only the state recursion is sequential.
    parts = chunk_prologue(*(chunks(x) for x in (qf, kf, vf, gf, bf)))
    parts = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), parts)      # chunk axis first for scan
    state, o = lax.scan(lambda s, p: chunk_scan_step(s, p)[::-1], state, parts)
    o = jnp.moveaxis(o, 1, 2).reshape(n * chunk_size, v.shape[1], v.shape[2])   # [N, H, C, Dv] -> [L', H, Dv]
    return o[:length].astype(v.dtype), state


def recurrent_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                               beta: jax.Array, initial_state: jax.Array | None = None
                               ) -> tuple[jax.Array, jax.Array]:
    """chunk_gated_delta_rule's result computed token by token (lax.scan)."""
    qf, kf, vf, gf, bf, state = _prepare(q, k, v, g, beta, initial_state)
    state, o = lax.scan(lambda s, x: recurrent_step(s, *x)[::-1], state, (qf, kf, vf, gf, bf))
    return o.astype(v.dtype), state
