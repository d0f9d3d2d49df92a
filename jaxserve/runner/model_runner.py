"""The jitted model step: pads a SchedulerOutput into a bucket, runs, samples.

Three jitted functions, each compiled for a small fixed set of shapes at
warmup: the forward pass (one per token bucket, KV caches donated so every
write is in place), the sampler (one per row bucket and sampler variant) and
prompt logprobs (one per token bucket). Nothing compiles after warmup.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runner import compile_counter
from jaxserve.runner.input_batch import (InputBatchBuilder, pick_bucket,
                                         power_of_two_buckets)
from jaxserve.runner.sampler import (SamplerVariant, SamplingRow, choose_variant,
                                     compute_prompt_logprobs, make_sampling_tensors, sample)
from models.inputs import ModelInputs
from pallas_kernels.ragged_paged_attention import make_kv_cache

logger = logging.getLogger("jaxserve")


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    # req_id -> (token ids [1+MAX], logprobs [1+MAX], rank of the sampled token)
    logprobs: dict[str, tuple[np.ndarray, np.ndarray, int]] = field(default_factory=dict)
    # req_id -> (first position, target logprob [n], rank [n], top ids [n, MAX], top lps [n, MAX])
    prompt_logprobs: dict[str, tuple] = field(default_factory=dict)


def capped_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """Powers of two from `smallest`, then exactly `largest`."""
    return tuple(b for b in power_of_two_buckets(smallest, largest) if b < largest) + (largest,)


def row_buckets(max_num_seqs: int) -> tuple[int, ...]:
    return capped_buckets(8, max_num_seqs)


class ModelRunner:
    def __init__(self, *, model, params, num_layers: int, num_kv_heads: int, head_dim: int,
                 vocab_size: int, num_pages: int, page_size: int, max_num_seqs: int,
                 max_model_len: int, max_num_batched_tokens: int, kv_dtype,
                 eos_token_id: int | None = None, context_buckets: bool = True):
        self.model = model
        self.params = params
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.token_buckets = power_of_two_buckets(16, max_num_batched_tokens)
        self.row_buckets = row_buckets(max_num_seqs)
        pages_per_req = -(-max_model_len // page_size)
        # The jnp reference attention reads whole page-table rows: bucket their width.
        page_buckets = capped_buckets(4, pages_per_req) if context_buckets else None
        self.builder = InputBatchBuilder(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                         page_size=page_size, token_buckets=self.token_buckets,
                                         page_buckets=page_buckets)
        self.kv_caches = [make_kv_cache(num_pages, page_size, num_kv_heads, head_dim, kv_dtype)
                          for _ in range(num_layers)]
        self._forward = jax.jit(self._forward_fn, donate_argnums=(1,))
        self._sample = jax.jit(self._sample_fn, static_argnames=("num_rows", "variant"))
        self._prompt_logprobs = jax.jit(self._prompt_logprobs_fn)
        self.warmup_seconds = 0.0
        self.warmup_compilations = 0

    # ---- jitted bodies -------------------------------------------------------------
    def _forward_fn(self, params, kv_caches, inputs: ModelInputs, logits_indices):
        hidden, kv_caches = self.model.apply({"params": params}, kv_caches, inputs)
        return hidden, hidden[logits_indices], kv_caches

    def _sample_fn(self, params, hidden_rows, tensors, *, num_rows: int, variant: SamplerVariant):
        logits = self.model.apply({"params": params}, hidden_rows[:num_rows],
                                  method="compute_logits")
        return sample(logits, tensors, variant)

    def _prompt_logprobs_fn(self, params, hidden, targets):
        logits = self.model.apply({"params": params}, hidden, method="compute_logits")
        return compute_prompt_logprobs(logits, targets)

    # ---- one step ------------------------------------------------------------------
    def execute(self, scheduler_output) -> ModelRunnerOutput:
        reqs = scheduler_output.requests
        out = ModelRunnerOutput()
        if not reqs:
            return out
        hb = self.builder.build(reqs)
        inputs, logits_indices = jax.device_put((hb.inputs, hb.logits_indices))
        hidden, hidden_rows, self.kv_caches = self._forward(
            self.params, self.kv_caches, inputs, logits_indices)

        if any(r.sampling_params.prompt_logprobs is not None for r in reqs):
            self._collect_prompt_logprobs(reqs, hb, hidden, out)
        if not any(r.sample for r in reqs):
            return out
        num_rows = pick_bucket(self.row_buckets, hb.num_reqs)
        variant = choose_variant([r.sampling_params for r in reqs])
        rows = [SamplingRow(r.sampling_params, r.num_output_tokens,
                            prompt_token_ids=r.prompt_token_ids,
                            output_token_ids=r.output_token_ids,
                            banned_token_ids=self._banned(r)) for r in reqs]
        tensors = make_sampling_tensors(rows, num_rows, self.vocab_size,
                                        penalties=variant.penalties,
                                        penalty_len=self.max_model_len)
        result = self._sample(self.params, hidden_rows, tensors, num_rows=num_rows,
                              variant=variant)
        result = jax.device_get(result)
        for i, r in enumerate(reqs):
            if not r.sample:
                continue
            out.sampled[r.req_id] = int(result.token_ids[i])
            if r.sampling_params.logprobs is not None:
                out.logprobs[r.req_id] = (result.logprob_token_ids[i], result.logprobs[i],
                                          int(result.sampled_rank[i]))
        return out

    def _banned(self, r) -> tuple[int, ...]:
        """Stop tokens may not be sampled among the first min_tokens outputs (as vLLM)."""
        sp = r.sampling_params
        if r.num_output_tokens >= sp.min_tokens:
            return ()
        eos = () if sp.ignore_eos or self.eos_token_id is None else (self.eos_token_id,)
        return eos + tuple(sp.stop_token_ids)

    def _collect_prompt_logprobs(self, reqs, hb, hidden, out: ModelRunnerOutput) -> None:
        """Logprob of each prompt token given its prefix, for the tokens of this chunk."""
        t = hb.inputs.token_ids.shape[0]
        targets = np.full(t, -1, np.int32)
        spans = []
        cu = hb.inputs.query_start_loc
        for i, r in enumerate(reqs):
            if r.sampling_params.prompt_logprobs is None:
                continue
            n_prompt = len(r.prompt_token_ids)
            lo, hi = r.start_pos, min(r.start_pos + len(r.token_ids), n_prompt - 1)
            if hi <= lo:
                continue  # this chunk holds no position whose next token is a prompt token
            targets[cu[i]:cu[i] + hi - lo] = r.prompt_token_ids[lo + 1:hi + 1]
            spans.append((r.req_id, cu[i], hi - lo, lo))
        if not spans:
            return
        lp, rank, top_lp, top_ids = jax.device_get(
            self._prompt_logprobs(self.params, hidden, jax.device_put(targets)))
        for req_id, a, n, first in spans:
            out.prompt_logprobs[req_id] = (first, lp[a:a + n], rank[a:a + n],
                                           top_ids[a:a + n], top_lp[a:a + n])

    # ---- warmup --------------------------------------------------------------------
    def warmup(self) -> None:
        """Compile every token bucket, row bucket and sampler variant now."""
        start, before = time.perf_counter(), compile_counter.num_compilations()
        r_max = self.builder._seq_lens.shape[0]
        for t, p in itertools.product(self.token_buckets, self.builder.page_buckets):
            z = np.zeros(t, np.int32)
            inputs = ModelInputs(
                token_ids=z, positions=z, slot_mapping=z,
                query_start_loc=np.zeros(r_max + 1, np.int32), seq_lens=np.zeros(r_max, np.int32),
                page_table=np.zeros((r_max, p), np.int32), num_seqs=np.zeros(1, np.int32))
            inputs, li = jax.device_put((inputs, np.zeros(r_max, np.int32)))
            hidden, hidden_rows, self.kv_caches = self._forward(self.params, self.kv_caches,
                                                                inputs, li)
        for t in self.token_buckets:
            hidden = jnp.zeros((t, hidden_rows.shape[-1]), hidden_rows.dtype)
            jax.block_until_ready(self._prompt_logprobs(self.params, hidden,
                                                        jnp.full(t, -1, jnp.int32)))
        for rows in self.row_buckets:
            for flags in itertools.product((False, True), repeat=3):
                variant = SamplerVariant(*flags)
                tensors = make_sampling_tensors([], rows, self.vocab_size,
                                                penalties=variant.penalties,
                                                penalty_len=self.max_model_len)
                jax.block_until_ready(self._sample(self.params, hidden_rows, tensors,
                                                   num_rows=rows, variant=variant))
        self.warmup_seconds = time.perf_counter() - start
        self.warmup_compilations = compile_counter.num_compilations() - before
        logger.info("warmup: %d compilations in %.1f s (token buckets %s, page-table widths %s, "
                    "row buckets %s)", self.warmup_compilations, self.warmup_seconds,
                    list(self.token_buckets), list(self.builder.page_buckets),
                    list(self.row_buckets))
