"""Drafts from a model on device: a smaller draft model of the same vocabulary, or the
target's MTP layer (models/mtp.py). Speculative methods draft_model and mtp.

The drafter keeps a KV cache of its own on the target's page ids: the same page table
and slots, its own arrays (the cache plan counts its bytes in every page). After each
target step, once the host knows the tokens accepted and the token after them (the
bonus), one program does the drafter's work for the step:

1. catch-up: the drafter computes the step's tokens as the target did (same positions,
   slots and pages), so its KV holds every position the target's does. The MTP layer
   reads, at each token, the target's hidden state there and the embedding of the token
   after it (the next known token, the accepted draft, or the bonus).
2. k greedy steps of one token per proposing row, from the bonus (draft model: its input
   at the bonus's position v; MTP: the catch-up's output at v - 1 already predicts the
   first draft, then k - 1 steps from position v). They write KV at positions up to
   v + k - 1, which the scheduler allocated ahead (Scheduler num_lookahead_tokens); the
   next step's catch-up writes those positions again with the tokens the target kept.

Drafts are proposals only: the target verifies them (spec_decode.py), so a drafter's
mistakes cost speed, never correctness. Positions of rejected drafts are written over
by later steps, in the drafter's cache as in the target's.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.config.speculative import DRAFT_MODEL, MTP
from jaxserve.runner.layer_caches import abstract_layer_caches, make_layer_caches
from jaxserve.runner.runner_config import DrafterConfig
from jaxserve.runner.sampler import first_argmax
from models.config import ModelConfig
from models.inputs import ModelInputs
from sharding import replicated


class ModelDrafter:
    def __init__(self, config: DrafterConfig, *, model: nn.Module, params: dict,
                 target_model: nn.Module, cache_config: ModelConfig,
                 mesh: Mesh, abstract: bool = False):
        """model / params: the draft model, or models.mtp.MTPHead and its params;
        cache_config: the ModelConfig its caches follow (the MTP's: one layer)."""
        if config.method not in (DRAFT_MODEL, MTP):
            raise ValueError(f"unknown drafter method {config.method!r}")
        self.method = config.method
        self.model, self.params, self.target_model = model, params, target_model
        self.mesh = mesh
        self.page_size = config.page_size
        self.max_num_seqs = config.max_num_seqs
        self.pages_per_req = config.pages_per_req
        self.k = config.num_speculative_tokens
        kw = dict(num_pages=config.num_pages, page_size=config.page_size,
                  kv_dtype=config.kv_dtype, num_state_slots=0, conv_state_dtype=model.dtype)
        if abstract:
            self.caches = abstract_layer_caches(cache_config, mesh, **kw)
            kv_sh = jax.tree_util.tree_map(lambda s: s.sharding, self.caches)
        else:
            self.caches, kv_sh = make_layer_caches(cache_config, mesh, **kw)
        self._rep = replicated(mesh)
        self.program = None   # jitted by jit(), once the target's shardings are known
        self._kv_sh = kv_sh

    def jit(self, target_param_shardings: Any) -> None:
        """Builds the jitted program once the target's param shardings are known."""
        d_sh = jax.tree_util.tree_map(lambda x: x.sharding, self.params)
        rep = self._rep
        self.program = jax.jit(
            self._propose_fn, donate_argnums=(2,),
            in_shardings=(target_param_shardings, d_sh, self._kv_sh, rep, rep, rep, rep, rep,
                          rep, rep, rep),
            out_shardings=(rep, self._kv_sh))

    # ---- the program ---------------------------------------------------------------
    def _propose_fn(self, tparams, dparams, caches, hidden, inputs: ModelInputs, next_ids,
                    last_index, bonus, start, page_table, num_rows):
        """hidden: the target step's hidden states, padded [T_max, E]; inputs: the step's
        (T tokens); next_ids int32[T]: each token's next token (MTP); per proposing row
        (R = max_num_seqs, the first num_rows real): last_index int32[R], the step index
        of its last accepted token (position v - 1); bonus int32[R], the token at v;
        start int32[R], v; page_table int32[R, pages_per_req]. -> (drafts int32[R, k],
        caches)."""
        t = inputs.token_ids.shape[0]
        target, model = self.target_model, self.model
        logits = partial(target.apply, {"params": tparams}, method="compute_logits") \
            if self.method == MTP else \
            partial(model.apply, {"params": dparams}, method="compute_logits")

        def embed(batch: ModelInputs) -> jax.Array:
            """The target's embedding of the batch's tokens [T, E]."""
            return target.apply({"params": tparams}, batch, method="embed")[0]

        drafts = jnp.zeros((self.max_num_seqs, self.k), jnp.int32)
        if self.method == MTP:
            h, caches = model.apply({"params": dparams}, caches, inputs,
                                    embed(inputs.replace(token_ids=next_ids)), hidden[:t])
            prev = h[last_index]
            tok = first_argmax(logits(prev))
            drafts = drafts.at[:, 0].set(tok)
            first, offset = 1, -1   # step j reads (draft j, its hidden) at position v + j - 1
        else:
            _, caches = model.apply({"params": dparams}, caches, inputs)
            prev, tok = None, bonus
            first, offset = 0, 0    # step j reads token j (the bonus, then drafts) at v + j

        def step(j, carry):
            caches, tok, prev, drafts = carry
            step_inputs = self._decode_inputs(tok, start + j + offset, page_table, num_rows)
            if self.method == MTP:
                h, caches = model.apply({"params": dparams}, caches, step_inputs,
                                        embed(step_inputs), prev)
            else:
                h, caches = model.apply({"params": dparams}, caches, step_inputs)
            tok = first_argmax(logits(h))
            return caches, tok, h if prev is not None else None, drafts.at[:, j].set(tok)

        if first < self.k:
            caches, _, _, drafts = jax.lax.fori_loop(first, self.k, step,
                                                     (caches, tok, prev, drafts))
        return drafts, caches

    def _decode_inputs(self, tok, pos, page_table, num_rows) -> ModelInputs:
        """One token per row: rows past num_rows are padding (the null page, no length)."""
        r = self.max_num_seqs
        rows = jnp.arange(r, dtype=jnp.int32)
        live = rows < num_rows[0]
        ps = self.page_size
        page = page_table[rows, jnp.clip(pos // ps, 0, self.pages_per_req - 1)]
        return ModelInputs(
            token_ids=jnp.where(live, tok, 0), positions=jnp.where(live, pos, 0),
            slot_mapping=jnp.where(live, page * ps + pos % ps, 0),
            query_start_loc=jnp.minimum(jnp.arange(r + 1, dtype=jnp.int32), num_rows[0]),
            seq_lens=jnp.where(live, pos + 1, 0), page_table=page_table, num_seqs=num_rows)

    # ---- host side --------------------------------------------------------------------
    def propose(self, tparams: dict, hidden: jax.Array, inputs: ModelInputs,
                next_ids: np.ndarray,
                rows: list[tuple[int, int, int]], page_table: np.ndarray) -> np.ndarray:
        """rows: (last accepted token's step index, bonus token, bonus position) of each
        proposing row, page_table: their page-table rows -> drafts int32[len(rows), k].
        Runs the catch-up even when no row proposes."""
        r = self.max_num_seqs
        n = len(rows)
        last, bonus, start = (np.zeros(r, np.int32) for _ in range(3))
        if n:
            last[:n], bonus[:n], start[:n] = np.asarray(rows, np.int32).T
        table = np.zeros((r, self.pages_per_req), np.int32)
        table[:n] = page_table
        drafts, self.caches = self.program(tparams, self.params, self.caches, hidden, inputs,
                                            next_ids, last, bonus, start, table,
                                            np.array([n], np.int32))
        return np.asarray(jax.device_get(drafts))[:n]

    def warmup_args(self, tparams: dict, hidden: jax.Array, inputs: ModelInputs) -> tuple:
        """The program's arguments for a step of `inputs` with no proposing row."""
        r, t = self.max_num_seqs, inputs.token_ids.shape[0]
        z = np.zeros(r, np.int32)
        return (tparams, self.params, self.caches, hidden, inputs, np.zeros(t, np.int32), z, z,
                z, np.zeros((r, self.pages_per_req), np.int32), np.zeros(1, np.int32))
