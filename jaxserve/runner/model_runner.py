"""The jitted model step: applies a SchedulerOutput to the persistent batch, pads the
step into a bucket, runs, samples.

Three jitted functions, each compiled for a small fixed set of shapes at warmup: the
forward pass (one per token bucket, KV caches donated so every write is in place), the
sampler (one per row bucket, every kind of row at once, and one with penalties at the
largest) and prompt logprobs (one program: the forward hands it the hidden states padded
to the largest token bucket). Nothing compiles after warmup.

Under a mesh (this replica's 1xM devices) every function is jitted with explicit
shardings: parameters and KV caches as they were placed (KV split by KV head,
donated), batch inputs and all outputs replicated. The shardings are fixed at
construction, so warmup compiles exactly what serving runs. Calls trace under
`jax.set_mesh`, which lets the model put attention under shard_map.

An abstract runner (abstract=True: params given as ShapeDtypeStructs with their
shardings, caches described and never allocated) runs nothing; it lists and lowers
the same programs (warmup_programs, lower), e.g. for a TPU mesh of abstract chips.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.core.sched_output import SchedulerOutput
from jaxserve.runner.buckets import (page_buckets, pick_bucket, row_buckets,
                                     sampling_row_buckets, token_buckets)
from jaxserve.runner.drafter import ModelDrafter
from jaxserve.runner.host_tier import DRAFT_KV, HostTier, PendingOffload
from jaxserve.runner.image_encoder import ImageEncoder, VisionParts
from jaxserve.runner.image_rows import ImageRows
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.layer_caches import abstract_layer_caches, held_layer_caches
from jaxserve.runner.lora_store import LoRAStore
from jaxserve.runner.programs import GREEDY, PENALTIES, RANDOM
from jaxserve.runner.runner_config import RunnerConfig
from jaxserve.runner.runner_warmup import RunnerWarmup
from jaxserve.runner.sampler import compute_prompt_logprobs, sample
from jaxserve.runner.spec_collect import SpecCollect
from jaxserve.runner.step_rows import HostBatch, ScheduledRows
from models.inputs import ModelInputs
from models.layer_stack import CONV, KV, KV_SLIDING, RECURRENT
from models.lora.slots import forward_variables, set_slot
from models.state_copies import copy_state_slots
from sharding import make_mesh, replicated

logger = logging.getLogger("jaxserve")


@dataclass
class ModelRunnerOutput:
    # req_id -> its token; a row that verified drafts: [the drafts accepted, the next token]
    sampled: dict[str, int | list[int]] = field(default_factory=dict)
    # req_id -> per new token: (ids [1+K], logprobs [1+K], sampled token's rank), K = max_logprobs
    logprobs: dict[str, list[tuple[np.ndarray, np.ndarray, int]]] = field(default_factory=dict)
    # Speculative decoding: req_id -> the drafts its next step is to verify
    spec_token_ids: dict[str, list[int]] | None = None
    # req_id -> (first position, target logprob [n], rank [n], top ids [n, K], top lps [n, K])
    prompt_logprobs: dict[str, tuple] = field(default_factory=dict)
    # req_id -> why its grammar failed on this step's token (it ends with finish_reason "error")
    failed: dict[str, str] = field(default_factory=dict)


@dataclass
class _InFlight:
    """A dispatched step: device results not yet read back (see ModelRunner.dispatch)."""
    rows: ScheduledRows | None
    hb: HostBatch | None = None  # its inputs (a model drafter computes them too)
    hidden: Any = None           # the forward's padded hidden states (the MTP reads them)
    sampled: Any = None          # SamplerOutput on device, or None
    logprobs: bool = False       # whether a request wants the sampler's logprobs
    prompt_lps: Any = None       # (device arrays, spans), or None
    offloads: PendingOffload | None = None   # the host tier's copies to land
    want_logprobs: np.ndarray | None = None   # bool[n] per batch row, read at dispatch
    generation: int = 0          # InputBatch.generation at dispatch: rows moved since?
    dispatch_id: int = 0         # InputBatch.mark_in_flight's


# Prompt logprobs take the lm_head and the vocabulary's log_softmax over this many
# tokens at a time: it bounds their float32 [tokens, V] temporaries.
PROMPT_LOGPROBS_CHUNK = 256


class ModelRunner(RunnerWarmup, SpecCollect):
    def __init__(self, config: RunnerConfig, *, model: nn.Module, params: dict,
                 mesh: Mesh | None = None, abstract: bool = False,
                 drafter: ModelDrafter | None = None, lora: LoRAStore | None = None,
                 vision: VisionParts | None = None, caches_after_compile: bool = False):
        """model.config: the model as it runs on this mesh (KV heads as stored);
        abstract: params are ShapeDtypeStructs with shardings and the caches are only
        described (nothing allocated): the programs can be lowered, not run;
        drafter: its model drafter (methods mtp and draft_model; ngram needs none);
        lora: the served adapters (None: LoRA off): the forward then takes the device
        stacks of their slots and each token's slot;
        vision: the vision tower and its encoder cache's size, when it serves images;
        caches_after_compile: see allocate_caches."""
        self.config = c = config
        self.model = model
        self.params = params
        self.abstract = abstract
        # No mesh: a 1x1 mesh on the default device, so one code path serves both.
        self.mesh = mesh if mesh is not None else make_mesh("1x1", jax.devices()[:1])
        self._rep = replicated(self.mesh)
        # How the logits come out of the lm_head: split over vocab_axis, or whole.
        self._vocab_parallel = NamedSharding(self.mesh, PartitionSpec(None, c.vocab_axis))
        self.vocab_size = c.vocab_size
        self.max_logprobs = c.max_logprobs
        # Set by the engine once its tokenizer is loaded (after warmup: no program reads it).
        self.eos_token_ids: tuple[int, ...] = ()   # held back by min_tokens
        self.max_model_len = c.max_model_len
        max_sample_rows = c.max_num_seqs * (1 + c.num_speculative_tokens)
        self.token_buckets = token_buckets(c.max_num_batched_tokens, cpu_decode_tokens=(
            max_sample_rows if self.mesh.devices.flat[0].platform == "cpu" else 0))
        self.spec = c.speculative_config
        self.drafter = drafter
        self.row_buckets = row_buckets(max_sample_rows)
        self.sampling_row_buckets = sampling_row_buckets(max_sample_rows)
        # The jnp reference attention reads whole page-table rows: bucket their width.
        widths = page_buckets(c.pages_per_req) if c.context_buckets else None
        self.encoder = None if vision is None else ImageEncoder(
            vision, hidden_size=model.config.hidden_size, dtype=model.dtype, mesh=self.mesh,
            abstract=abstract)
        # The requests this runner holds, kept between steps (the scheduler sends diffs).
        self.batch = InputBatch(max_num_seqs=c.max_num_seqs, max_model_len=c.max_model_len,
                                page_size=c.page_size, token_buckets=self.token_buckets,
                                vocab_size=c.vocab_size, page_buckets=widths,
                                sliding=c.num_sliding_pages > 0,
                                num_state_slots=c.num_state_slots,
                                num_speculative_tokens=c.num_speculative_tokens,
                                lora=lora is not None,
                                images=vision and ImageRows(
                                    c.max_num_seqs, _mrope(vision, model),
                                    horizon=model.config.image_attention_both_ways))
        self.num_state_slots = c.num_state_slots
        # The stacked caches (models/layer_stack.py): KV heads as stored on this mesh.
        describe = abstract_layer_caches if abstract else held_layer_caches
        self.kv_caches = describe(
            model.config, self.mesh, num_pages=c.num_pages, page_size=c.page_size,
            kv_dtype=c.kv_dtype, num_state_slots=c.num_state_slots,
            num_sliding_pages=c.num_sliding_pages, conv_state_dtype=model.dtype)
        kv_sh = {kind: s.sharding for kind, s in self.kv_caches.items()}
        self._caches_pending = not abstract
        if not caches_after_compile:   # (else warmup does)
            self.allocate_caches()
        p_sh = jax.tree_util.tree_map(lambda x: x.sharding, params)
        rep = self._rep
        self._init_lora(lora)
        self._forward = jax.jit(self._forward_fn, donate_argnums=(1,),
                                in_shardings=(p_sh, kv_sh, rep, rep, rep, rep, *self._lora_sh),
                                out_shardings=(rep, rep, kv_sh))
        # (num_rows, mode) are static; jit takes no keyword arguments with in_shardings.
        self._sample = jax.jit(self._sample_fn, static_argnums=(3, 4),
                               in_shardings=(p_sh, rep, rep), out_shardings=rep)
        self._prompt_logprobs = jax.jit(self._prompt_logprobs_fn, in_shardings=(p_sh, rep, rep),
                                        out_shardings=rep)
        if drafter is not None:
            drafter.jit(p_sh)
        # What the forward pads its hidden states to, for the one prompt-logprobs program.
        self._max_tokens = self.token_buckets[-1]
        self.warmup_seconds, self.warmup_compilations = 0.0, 0
        self.warmup_cache_hits = self.warmup_fresh_compilations = 0
        self._hidden_spec = None    # the forward's hidden states, traced on first need
        self._init_prev_ids()
        self.host_tier: HostTier | None = None   # the prefix cache's (attach_host_tier)

    def attach_host_tier(self, budget_bytes: int) -> HostTier:
        """Gives the runner a host tier of budget_bytes (before warmup, which compiles its
        copy programs); ValueError when that holds no page."""
        self.host_tier = HostTier(self.host_tier_caches(), self.host_tier_layers(),
                                  budget_bytes, self.mesh.devices.flat[0], lambda: self.params)
        return self.host_tier

    def host_tier_caches(self) -> dict[str, jax.Array]:
        """The caches the host tier copies pages of: the target's, and a model drafter's KV
        (DRAFT_KV: on the same page ids, so its pages go and come back with the target's).
        A drafter keeps that one KV array and nothing else: an MTP layer is full attention,
        and build/drafter_loader refuses a draft model with any other kind of layer."""
        if self.drafter is None:
            return dict(self.kv_caches)
        return {**self.kv_caches, DRAFT_KV: self.drafter.caches[KV]}

    def adopt_host_tier_caches(self, caches: dict[str, jax.Array]) -> None:
        """host_tier_caches() after the tier's copies (which donate them)."""
        if self.drafter is not None:
            self.drafter.caches = {KV: caches[DRAFT_KV]}
        self.kv_caches = {k: caches[k] for k in self.kv_caches}

    def host_tier_layers(self) -> dict[str, int]:
        """Per cache kind, the layers stacked in it (what a host slot holds rows of)."""
        c, caches = self.config, self.host_tier_caches()
        per_kind = {KV: c.num_pages, KV_SLIDING: c.num_sliding_pages or c.num_pages,
                    CONV: c.num_state_slots, RECURRENT: c.num_state_slots,
                    DRAFT_KV: c.num_pages}
        return {k: caches[k].shape[0] // n for k, n in per_kind.items() if k in caches}

    def _init_prev_ids(self) -> None:
        """The forward's prev_ids when no step's tokens are in flight (every row's input
        token is then on the host): zeros, replicated."""
        self._no_prev_ids = None if self.abstract else jax.device_put(
            np.zeros(self.batch.max_sample_rows, np.int32), self._rep)
        self._prev_ids = self._no_prev_ids

    def _init_lora(self, lora: LoRAStore | None) -> None:
        """The adapters' device stacks (not donated to the forward: written between
        steps, in place, by their own program)."""
        self.lora, self.lora_stacks, self._lora_sh = lora, None, ()
        if lora is None:
            return
        sh = lora.shardings(self.mesh)
        self._lora_sh = (sh,)
        self.lora_stacks = (lora.abstract_stacks(self.mesh) if self.abstract
                            else lora.init_stacks(self.mesh))
        self._write_lora = jax.jit(set_slot, donate_argnums=0,
                                   in_shardings=(sh, self._rep, self._rep), out_shardings=sh)

    @property
    def _lora_args(self) -> tuple:
        """The forward's last argument: the stacks, when LoRA is on."""
        return () if self.lora is None else (self.lora_stacks,)

    def _load_adapters(self, loads: list) -> None:
        """Writes each (slot, adapter) of the step's lora_loads into its slot."""
        for slot, req in loads:
            self.lora_stacks = self._write_lora(self.lora_stacks, np.int32(slot),
                                                self.lora.slot_rows(req))

    # ---- jitted bodies -------------------------------------------------------------
    def _forward_fn(self, params, kv_caches, inputs: ModelInputs, logits_indices, prev_ids,
                    token_src, lora=None):
        """-> (every token's hidden state padded to the largest token bucket, the rows at
        logits_indices, the caches). The padding (a [T_max, E] write, ~13 us of a v6e's
        HBM bandwidth at E=5120) lets one prompt-logprobs program serve every bucket.
        prev_ids: the last step's sampled ids (int32[max_sample_rows], on device);
        token_src int32[T]: where a token's id is one of them (async scheduling: sampled by
        the step still in flight), -1: inputs.token_ids'.
        A hybrid's state-slot copies (prefix caching) run here, in the same donated
        program: restores before the layers read the slots, saves after they wrote them."""
        if inputs.state_restores is not None:
            kv_caches = copy_state_slots(kv_caches, inputs.state_restores,
                                         inputs.num_state_restores, self.num_state_slots)
        inputs = inputs.replace(token_ids=jnp.where(
            token_src >= 0, prev_ids[jnp.maximum(token_src, 0)], inputs.token_ids))
        variables = {"params": params}
        if lora is not None:   # each token's adapter delta (models/lora)
            variables.update(forward_variables(lora, inputs.lora_slot_ids))
        hidden, kv_caches = self.model.apply(variables, kv_caches, inputs)
        if inputs.state_saves is not None:
            kv_caches = copy_state_slots(kv_caches, inputs.state_saves, inputs.num_state_saves,
                                         self.num_state_slots)
        padded = jnp.pad(hidden, ((0, self._max_tokens - hidden.shape[0]), (0, 0)))
        return padded, hidden[logits_indices], kv_caches

    def _sample_fn(self, params, hidden_rows, tensors, num_rows: int, mode: str):
        logits = self.model.apply({"params": params}, hidden_rows[:num_rows],
                                  method="compute_logits")
        # Logits computed vocab-parallel (not the [V, E] weight gathered); the sampler
        # gathers them whole only in the branches that run when some row samples or
        # wants logprobs: a greedy batch's argmax reduces the per-shard maxima.
        logits = jax.lax.with_sharding_constraint(logits, self._vocab_parallel)
        out = sample(logits, tensors, penalties=mode == PENALTIES, greedy=mode == GREEDY,
                     num_logprobs=self.max_logprobs,
                     gather=partial(jax.lax.with_sharding_constraint, shardings=self._rep))
        # (SamplerOutput, its ids padded to max_sample_rows: the next forward's prev_ids)
        pad = self.batch.max_sample_rows - num_rows
        return out, jnp.pad(out.token_ids, (0, pad))

    def _prompt_logprobs_fn(self, params, hidden, targets):
        """hidden [T_max, E], targets int32[T_max] (-1: no logprob wanted) -> the
        compute_prompt_logprobs arrays over T_max tokens, computed PROMPT_LOGPROBS_CHUNK
        tokens at a time and only for the chunks that hold a target."""
        t = hidden.shape[0]
        c = min(t, PROMPT_LOGPROBS_CHUNK)
        n = -(-t // c)
        hidden = jnp.pad(hidden, ((0, n * c - t), (0, 0))).reshape(n, c, -1)
        targets = jnp.pad(targets, (0, n * c - t), constant_values=-1).reshape(n, c)

        def compute(h, tg):
            logits = self.model.apply({"params": params}, h, method="compute_logits")
            return compute_prompt_logprobs(logits, jnp.maximum(tg, 0), self.max_logprobs)

        def skip(h, tg):
            f, i = jnp.zeros((c,), jnp.float32), jnp.zeros((c,), jnp.int32)
            k = self.max_logprobs
            return f, i, jnp.zeros((c, k), jnp.float32), jnp.zeros((c, k), jnp.int32)

        def chunk(args):
            return jax.lax.cond(jnp.any(args[1] >= 0), compute, skip, *args)

        out = jax.lax.map(chunk, (hidden, targets))
        return jax.tree_util.tree_map(lambda x: x.reshape(n * c, *x.shape[2:])[:t], out)

    # ---- one step ------------------------------------------------------------------
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.dispatch(scheduler_output))

    def dispatch(self, scheduler_output: SchedulerOutput) -> _InFlight:
        """Applies the step's diff to the persistent batch, launches the step's device work
        and returns without waiting for it (data-parallel replicas dispatch in turn, then
        collect). A step that fails leaves rows the scheduler then aborts: they come back
        as finished ids and are dropped at the next dispatch."""
        rows = self.batch.update(scheduler_output, self.eos_token_ids)
        with jax.set_mesh(self.mesh):
            if scheduler_output.lora_loads:
                self._load_adapters(scheduler_output.lora_loads)
            if self.encoder is not None:   # before the forward that reads them
                self.batch.images.apply(scheduler_output.encoder_frees,
                                        scheduler_output.encoder_jobs)
                self.encoder.run(scheduler_output.encoder_jobs)
            offloads = None
            if self.host_tier is not None:   # before the forward, in order
                caches, offloads = self.host_tier.dispatch(
                    self.host_tier_caches(), scheduler_output.host_copies)
                self.adopt_host_tier_caches(caches)
            step = self._dispatch(rows)
        step.offloads = offloads
        return step

    def collect(self, step: _InFlight) -> ModelRunnerOutput:
        """Waits for a dispatched step and reads its results back to the host."""
        out = ModelRunnerOutput()
        self.batch.collected(step.dispatch_id)
        if step.offloads is not None:   # stored before the scheduler makes them visible
            step.offloads.land(self.host_tier.arrays)
        if step.prompt_lps is not None:
            arrays, spans = step.prompt_lps
            lp, rank, top_lp, top_ids = jax.device_get(arrays)
            for req_id, a, n, first in spans:
                out.prompt_logprobs[req_id] = (first, lp[a:a + n], rank[a:a + n],
                                               top_ids[a:a + n], top_lp[a:a + n])
        rows = step.rows
        if step.sampled is not None:
            self._collect_sampled(step, out)
        if self.drafter is not None and step.hb is not None:
            # Every step that ran a forward: the drafter's KV catches up with it.
            with jax.set_mesh(self.mesh):
                out.spec_token_ids = self._model_proposals(step)
        elif self.spec is not None and step.sampled is not None:
            out.spec_token_ids = self._propose(rows)
        return out

    def _collect_sampled(self, step: _InFlight, out: ModelRunnerOutput) -> None:
        # The logprob arrays come back only when a request wants them.
        result = jax.device_get(step.sampled if step.logprobs else
                                step.sampled.replace(logprobs=None, logprob_token_ids=None,
                                                     sampled_rank=None))
        rows = step.rows
        if rows.num_drafts is not None:
            self._collect_verified(rows, result, step.logprobs, out)
            return
        failed = self.batch.append_sampled(rows, result.token_ids, step.generation)
        out.failed = {rows.req_ids[i]: why for i, why in failed.items()}
        picked = np.flatnonzero(rows.sample)
        ids = [rows.req_ids[i] for i in picked]
        out.sampled = dict(zip(ids, result.token_ids[picked].tolist()))
        if step.logprobs:
            for i, rid in zip(picked, ids):
                if step.want_logprobs[i]:
                    out.logprobs[rid] = [(result.logprob_token_ids[i], result.logprobs[i],
                                          int(result.sampled_rank[i]))]

    def device_state_ok(self) -> bool:
        """After a failed step: whether the KV caches / recurrent state still hold data.
        They are donated to the forward call, so a failure inside it leaves them
        deleted (it raised after donating) or carrying the error (it failed on device);
        either way every request's cache is gone."""
        leaves = jax.tree_util.tree_leaves(self.kv_caches)
        try:
            if any(x.is_deleted() for x in leaves):
                return False
            jax.block_until_ready(leaves)
        except Exception:   # noqa: BLE001 -- any error here means the state is lost
            return False
        return True

    def _dispatch(self, rows: ScheduledRows) -> _InFlight:
        batch = self.batch
        step = _InFlight(rows, generation=batch.generation)
        if not rows.num_reqs:
            step.dispatch_id = batch.mark_in_flight(rows, False)
            return step
        hb = batch.build(rows)
        inputs = hb.inputs if self.encoder is None else \
            hb.inputs.replace(image_embeds=self.encoder.cache)
        # numpy straight into the jitted call: its C++ path copies them in faster than a
        # separate jax.device_put of the pytree (~0.1 vs ~0.5 ms a step on CPU).
        hidden, hidden_rows, self.kv_caches = self._forward(
            self.params, self.kv_caches, inputs, hb.logits_indices, self._prev_ids,
            hb.token_src, *self._lora_args)
        self._prev_ids = self._no_prev_ids
        if self.drafter is not None:
            step.hb, step.hidden = hb, hidden

        r = rows.rows
        if batch.want_prompt_logprobs[r].any():
            step.prompt_lps = self._prompt_logprobs_async(rows, hb, hidden)
        if not rows.sample.any():
            step.dispatch_id = batch.mark_in_flight(rows, False)
            return step
        # Penalties are rare and ship a [rows, max_model_len] history: one program for
        # them, at the largest row bucket, rather than one per bucket.
        mode = (PENALTIES if batch.has_penalties[r].any() else
                GREEDY if batch.greedy_only[r].all() else RANDOM)
        num_sampled = hb.num_reqs if rows.num_drafts is None else \
            int(rows.sample.sum() + rows.num_drafts[rows.sample].sum())
        num_rows = (self.row_buckets[-1] if mode == PENALTIES else
                    pick_bucket(self.row_buckets if mode == GREEDY else
                                self.sampling_row_buckets, num_sampled))
        tensors = batch.sampling_tensors(rows, num_rows, penalties=mode == PENALTIES,
                                         penalty_len=self.max_model_len)
        step.sampled, self._prev_ids = self._sample(self.params, hidden_rows, tensors,
                                                    num_rows, mode)
        step.dispatch_id = batch.mark_in_flight(rows, True)
        step.want_logprobs = batch.want_logprobs[r]
        step.logprobs = bool(step.want_logprobs.any())
        return step

    def _prompt_logprobs_async(self, rows: ScheduledRows, hb, hidden):
        """Logprob of each prompt token given its prefix, for the tokens of this chunk:
        (device arrays, spans) or None."""
        targets, spans = self.batch.prompt_logprob_targets(
            rows, hb.inputs.query_start_loc, self._max_tokens)
        if not spans:
            return None
        targets = jax.device_put(targets, self._rep)
        return self._prompt_logprobs(self.params, hidden, targets), spans


def _mrope(vision: VisionParts, model: Any) -> tuple[int, int] | None:
    """(image token id, merge size) when the model rotates by 3-axis positions."""
    if not model.config.mrope_section:
        return None
    return vision.tower.tokens.image, vision.tower.config.spatial_merge_size
