"""Qwen3.5/3.6's multi-token-prediction (MTP) layer, a drafter for speculative decoding.

The checkpoint's `mtp.*` tensors: two RMSNorms, `fc` over [normed embedding of token
t + 1; normed final hidden state of the target at t] (2E -> E), one full-attention
decoder layer (as the target's: gated attention, (1 + w) norms, dense MLP or experts)
and a final norm; it shares the target's embedding and lm_head. Its output at
position t predicts token t + 2, and is the hidden state its next step reads in place
of the target's, so k steps draft k tokens.

Its KV cache is one full-attention layer's on the target's page ids (the runner's
drafter, jaxserve/runner/drafter.py). Params and caches have the model's layouts,
under the names the loader maps to `mtp.*` (models/weights.py, prefix "mtp.").
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import FULL_ATTENTION, ModelConfig
from models.inputs import ModelInputs
from models.layers import Einsum, RMSNorm

MTP_PREFIX = "mtp."


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """The MTP layer as a model of its own: one full-attention layer (its KV cache and
    its MLP kind follow from that; Qwen3.5's MoE variant: experts)."""
    if cfg.num_mtp_layers < 1:
        raise ValueError(f"{cfg.architecture} checkpoint has no MTP layer "
                         f"(config mtp_num_hidden_layers is 0 or absent)")
    if cfg.num_mtp_layers > 1:
        raise ValueError(f"{cfg.num_mtp_layers} MTP layers: only one is supported")
    if cfg.mtp_dedicated_embeddings:
        raise ValueError("MTP with dedicated embeddings (mtp_use_dedicated_embeddings) is "
                         "not supported")
    return replace(cfg, num_layers=1, layer_types=(FULL_ATTENTION,), mlp_only_layers=())


class MTPHead(nn.Module):
    config: ModelConfig          # mtp_config(target's run config)
    model_cls: type              # the target's class: its decoder layer is the MTP's
    dtype: Any = jnp.float32
    attention_backend: str = "reference"

    @nn.compact
    def __call__(self, caches: dict[str, Any], inputs: ModelInputs,
                 embeds: jax.Array | None = None, hidden: jax.Array | None = None
                 ) -> tuple[jax.Array, dict[str, Any]]:
        """embeds: the target's embedding of each token's next token [T, E]; hidden: the
        target's (or the MTP's previous step's) final hidden state at each token [T, E]
        (None at init). -> (hidden states [T, E], caches)."""
        cfg, dt = self.config, self.dtype
        e = cfg.hidden_size
        if embeds is None:
            embeds = hidden = jnp.zeros((inputs.token_ids.shape[0], e), dt)
        norm = partial(RMSNorm, e, cfg.rms_norm_eps, dt, cfg.norm_plus_one)
        x = jnp.concatenate([norm(name="pre_fc_norm_embedding")(embeds),
                             norm(name="pre_fc_norm_hidden")(hidden)], axis=-1)
        x = Einsum("TF,FE->TE", (2 * e, e), (None, "embed"), dtype=dt, quant=cfg.weight_quant,
                   name="fc")(x)
        layer = self.model_cls.make_layer(cfg, dt, self.attention_backend, 0, name="layers_0")
        x, caches = layer(x, caches, inputs, 0, 0)
        return norm(name="norm")(x), caches
