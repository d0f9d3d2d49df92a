"""The device batch every model takes: one ragged step, padded into a bucket."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class ModelInputs:
    token_ids: jax.Array        # int32[T]   T = token bucket; padding tokens are 0
    positions: jax.Array        # int32[T]   position of each token in its sequence
    slot_mapping: jax.Array     # int32[T]   page * page_size + offset; padding -> slots of null page 0
    query_start_loc: jax.Array  # int32[R+1] cumulative query lengths; padded rows repeat the last value
    seq_lens: jax.Array         # int32[R]   KV length of each request after this step
    page_table: jax.Array       # int32[R, P] pages of each request; unused entries 0
    num_seqs: jax.Array         # int32[1]   live requests (rows past it are padding)
    # Hybrid models only: recurrent-state slot of each row (0 = the null slot of padding rows).
    state_slots: jax.Array | None = None   # int32[R]
    # Hybrid models only (None otherwise): recurrent-state slot copies around the forward
    # (models/state_copies.py), K = max_num_seqs rows of (src slot, dst slot), the first
    # num_* real and the rest padding. Restores run before the layers (a prefix hit: a
    # snapshot into the request's slot), saves after them (a slot's state at the end of
    # this step's chunk, into a snapshot). The model never reads them: the runner applies them.
    state_restores: jax.Array | None = None       # int32[K, 2]
    num_state_restores: jax.Array | None = None   # int32[1]
    state_saves: jax.Array | None = None          # int32[K, 2]
    num_state_saves: jax.Array | None = None      # int32[1]
    # Models with sliding-window layers (Gemma 4): those layers' pages are a KV group of
    # their own (pages out of the window are freed), so they have their own slots and
    # page table, as above. None: they use slot_mapping / page_table.
    sliding_slot_mapping: jax.Array | None = None   # int32[T]
    sliding_page_table: jax.Array | None = None     # int32[R, P]
    # LoRA (None: off): each token's adapter slot (0 = none, padding too); the runner
    # turns it into the forward's LoRA variables (models/lora/slots.forward_variables).
    lora_slot_ids: jax.Array | None = None          # int32[T]
    # Vision-language models serving images (None otherwise). mrope_positions: Qwen3.5's
    # 3-axis positions (temporal, row, column; text tokens: `positions` on each axis).
    # image_rows: the row of image_embeds holding each token's embedding, -1 for a text
    # token; image_embeds: the runner's encoder cache [C, E] (read only here).
    mrope_positions: jax.Array | None = None        # int32[3, T]
    # Gemma 4 (use_bidirectional_attention "vision"): the last position each token sees on
    # the sliding layers (an image token: its image's last; others: their own).
    image_horizon: jax.Array | None = None          # int32[T]
    image_rows: jax.Array | None = None             # int32[T]
    image_embeds: jax.Array | None = None           # [C, E]


def merge_image_embeds(x: jax.Array, inputs: ModelInputs) -> jax.Array:
    """Token embeddings x [T, E] with each image token's row taken from the encoder cache
    (unscaled, as both families put them in)."""
    if inputs.image_rows is None or inputs.image_embeds is None:
        return x
    rows = inputs.image_embeds[jnp.maximum(inputs.image_rows, 0)].astype(x.dtype)
    return jnp.where((inputs.image_rows >= 0)[:, None], rows, x)
