"""The runner's persistent batch: one row per request it holds, kept between steps.

The scheduler sends diffs (jaxserve/core/sched_output.py): new requests whole,
running ones as the pages appended and the tokens to compute. A row keeps its
request's page-table row (appended to, never rebuilt), its tokens (prompt, then the
outputs this runner sampled: the history penalties and prompt logprobs read) and its
sampling settings, all as numpy columns. A step is then a few vectorised gathers over
the scheduled rows into fixed-shape arrays (a token bucket; padding rows use the null
page 0 and the null state slot 0), not a rebuild from per-request copies.

Rows of finished / preempted requests are freed and the last rows moved into the
holes, so the held rows stay 0..num_rows-1.

Async scheduling: runner/in_flight.py (rows whose next token a dispatched step samples).

A model whose sliding-window layers have a KV group of their own (sliding=True) has a
second page-table row per request, for those layers' pages: it keeps the ids of pages
the scheduler gave back as they left the window (jaxserve/core/sched_output.py says
why that is safe).

A hybrid runner (num_state_slots > 0) also carries the step's recurrent-state slot
copies (prefix caching: SchedulerOutput.state_restores / state_saves) into the inputs,
padded to max_state_copies pairs with a count (ModelInputs.state_restores ...): one per
row, two with speculative decoding (a rejection's rollback and the next backup).
"""
from __future__ import annotations

import numpy as np

from jaxserve.core.sched_output import NewRequestData, SchedulerOutput
from jaxserve.runner.batch_sampling import BatchSampling
from jaxserve.runner.buckets import pick_bucket
from jaxserve.runner.image_rows import ImageRows
from jaxserve.runner.in_flight import InFlightRows
from jaxserve.runner.sampler import only_greedy
from jaxserve.runner.sampling_tensors import PARAM_COLUMNS, mask_words, seed_to_key_data
from jaxserve.runner.step_rows import HostBatch, ScheduledRows, state_copy_inputs
from jaxserve.runner.token_constraints import (ALL_ALLOWED, DynamicConstraints, bias_row,
                                               static_mask)
from jaxserve.sampling_params import MAX_BANNED_TOKENS, MAX_LOGIT_BIAS
from models.inputs import ModelInputs


class InputBatch(BatchSampling, InFlightRows):
    """`page_buckets` are the page-table widths a step may use: the narrowest one that
    holds the longest request is passed, so attention that reads whole page-table
    rows (the jnp reference) reads no more context than the batch needs.
    sliding: the sliding-window layers' KV group has its own pages (the scheduler sends
    two page lists per request); the step's inputs then carry their slots and table.
    num_state_slots: recurrent-state slots per layer, null slot included (0: not a
    hybrid); the step's inputs then carry its state-slot copies.
    num_speculative_tokens: most drafts a row verifies (spec_decode.py); each is one more
    sampler row, so logits_indices has max_num_seqs * (1 + it) entries.
    images: the rows' image side (runner/image_rows.py) when the engine serves images; the
    step's inputs then carry each token's encoder-cache row (and Qwen's 3-axis positions)."""

    def __init__(self, *, max_num_seqs: int, max_model_len: int, page_size: int,
                 token_buckets: tuple[int, ...], vocab_size: int,
                 page_buckets: tuple[int, ...] | None = None, sliding: bool = False,
                 num_state_slots: int = 0, num_speculative_tokens: int = 0,
                 lora: bool = False, images: ImageRows | None = None):
        self.max_num_seqs = r = max_num_seqs
        # The sampler's rows at most: every row with all its drafts.
        self.max_sample_rows = max_num_seqs * (1 + num_speculative_tokens)
        # State-slot copies of one step, each list: a prefix hit's restore per new row; with
        # speculative decoding also a rollback and a backup per running row.
        self.max_state_copies = max_num_seqs * (2 if num_speculative_tokens else 1)
        self.num_state_slots = num_state_slots
        self.images = images
        self.max_model_len = max_model_len
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.token_buckets = token_buckets
        self.pages_per_req = -(-max_model_len // page_size)
        self.page_buckets = page_buckets or (self.pages_per_req,)
        if self.page_buckets[-1] != self.pages_per_req:
            raise ValueError(f"the widest page bucket must be {self.pages_per_req}")
        # Held requests: row -> id and back; rows 0..num_rows-1 are held.
        self.req_ids: list[str | None] = [None] * r
        self.row_of: dict[str, int] = {}
        self.num_rows = 0
        # Rows past a request's pages stay 0 (the null page): freed rows are zeroed.
        self.page_table = np.zeros((r, self.pages_per_req), np.int32)
        self.sliding_page_table = np.zeros_like(self.page_table) if sliding else None
        # One per KV group, as the scheduler sends their pages (equally many in each).
        self._page_tables = (self.page_table,) if not sliding else \
            (self.page_table, self.sliding_page_table)
        self.num_pages = np.zeros(r, np.int32)
        # Prompt then outputs. np.zeros maps untouched memory lazily, so the resident
        # size follows the tokens held, not max_model_len. +1: a request whose prompt
        # fills max_model_len still samples (and stores) one token.
        self.tokens = np.zeros((r, max_model_len + 1), np.int32)
        self.num_tokens = np.zeros(r, np.int32)
        self.num_prompt = np.zeros(r, np.int32)
        self.state_slots = np.zeros(r, np.int32)
        self._init_in_flight(r)
        # LoRA: each row's adapter slot (0 = none); None when LoRA is off.
        self.lora_slots = np.zeros(r, np.int32) if lora else None
        for name, dtype, fill in PARAM_COLUMNS:
            setattr(self, name, np.full(r, fill, dtype))
        self.want_logprobs = np.zeros(r, np.bool_)
        self.keys = np.zeros((r, 2), np.uint32)
        self.seeded = np.ones(r, np.bool_)       # False: a fresh random key every step
        self.min_tokens = np.zeros(r, np.int32)
        self.banned = np.full((r, MAX_BANNED_TOKENS), vocab_size, np.int32)  # stop tokens
        self.has_penalties = np.zeros(r, np.bool_)
        self.greedy_only = np.zeros(r, np.bool_)  # greedy, no logprobs, no penalties
        self.want_prompt_logprobs = np.zeros(r, np.bool_)
        # Token constraints (runner/token_constraints.py): the fixed mask and logit bias of
        # each row, and the host objects of rows whose mask changes every step.
        self.token_mask = np.full((r, mask_words(vocab_size)), ALL_ALLOWED, np.uint32)
        self.has_mask = np.zeros(r, np.bool_)
        self.bias_ids = np.full((r, MAX_LOGIT_BIAS), vocab_size, np.int32)
        self.bias = np.zeros((r, MAX_LOGIT_BIAS), np.float32)
        self.has_bias = np.zeros(r, np.bool_)
        self.dynamic: list[DynamicConstraints | None] = [None] * r
        self.has_dynamic = np.zeros(r, np.bool_)   # dynamic[row] is set: a numpy test per step
        # Every per-row array but the two wide ones: what moving a row copies.
        self._row_arrays = [self.num_pages, self.num_tokens, self.num_prompt, self.state_slots,
                            self.in_flight,
                            self.want_logprobs, self.keys, self.seeded, self.min_tokens,
                            self.banned, self.has_penalties, self.greedy_only,
                            self.want_prompt_logprobs, self.has_mask, self.has_bias,
                            self.has_dynamic, *([self.lora_slots] if lora else []),
                            *(getattr(self, name) for name, _, _ in PARAM_COLUMNS)]
        # The unconstrained mask and bias of each padded row count a step may use.
        self._free_mask: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._rng = np.random.default_rng()
        # Step buffers, reused (the device call gets copies).
        t_max = token_buckets[-1]
        self._token_ids = np.zeros(t_max, np.int32)
        self._positions = np.zeros(t_max, np.int32)
        self._slots = np.zeros(t_max, np.int32)
        self._sliding_slots = np.zeros(t_max, np.int32)
        self._qsl = np.zeros(r + 1, np.int32)

    # ---- the scheduler's diff --------------------------------------------------------
    def update(self, sched_out: SchedulerOutput, eos_token_ids: tuple[int, ...]) -> ScheduledRows:
        """Applies one step's diff: drops finished and preempted rows, extends running
        ones, adds new ones. -> the rows this step computes."""
        c = sched_out.cached_reqs
        # Checked before the batch changes: a refused step leaves it as it was.
        self._check_state_copies(sched_out, len(c.req_ids) + len(sched_out.new_reqs))
        self.remove(sched_out.finished_req_ids + sched_out.preempted_req_ids)
        row_of = self.row_of
        try:
            rows = [row_of[rid] for rid in c.req_ids]
        except KeyError as e:
            raise ValueError(f"request {e.args[0]!r} is not in the runner's batch") from None
        tables, num_pages = self._page_tables, self.num_pages
        for row, ids in zip(rows, c.new_page_ids):
            if ids[0]:   # a new page: every page_size tokens of a decode
                n, k = num_pages[row], len(ids[0])
                for pt, group_ids in zip(tables, ids, strict=True):
                    pt[row, n:n + k] = group_ids
                num_pages[row] = n + k
        req_ids = c.req_ids
        starts, lens = c.num_computed_tokens, c.num_new_tokens
        if sched_out.new_reqs:
            req_ids = req_ids + [r.req_id for r in sched_out.new_reqs]
            rows = rows + [self._add(r, eos_token_ids) for r in sched_out.new_reqs]
            starts = starts + [r.num_computed_tokens for r in sched_out.new_reqs]
            lens = lens + [r.num_new_tokens for r in sched_out.new_reqs]
        n = len(rows)
        rows_a = np.fromiter(rows, np.int32, n)
        starts_a = np.fromiter(starts, np.int32, n)
        lens_a = np.fromiter(lens, np.int32, n)
        ends, known = starts_a + lens_a, self.num_tokens[rows_a]
        if self.any_in_flight:
            known = known + (self.in_flight[rows_a] >= 0)
        drafts = self._put_drafts(sched_out.spec_token_ids, c.req_ids, rows_a) \
            if sched_out.spec_token_ids else None
        if drafts is not None:
            known = known + drafts
        if (ends > known).any():
            i = int(np.argmax(ends > known))
            raise ValueError(f"request {req_ids[i]!r}: asked to compute up to token "
                             f"{ends[i]}, the runner knows {known[i]}")
        return ScheduledRows(req_ids, rows_a, starts_a, lens_a, ends == known,
                             int(lens_a.sum()), sched_out.state_restores, sched_out.state_saves,
                             drafts)

    def _put_drafts(self, spec: dict[str, list[int]], cached_ids: list[str],
                    rows: np.ndarray) -> np.ndarray:
        """Writes each row's drafts after its known tokens (where the step reads its
        tokens; the tokens accepted are written there again) -> int32[n] their counts."""
        counts = np.zeros(len(rows), np.int32)
        for i, rid in enumerate(cached_ids):
            d = spec.get(rid)
            if d:
                row = rows[i]
                at = self.num_tokens[row]
                if at + len(d) > self.tokens.shape[1]:
                    raise ValueError(f"request {rid!r}: {len(d)} drafts past max_model_len")
                self.tokens[row, at:at + len(d)] = d
                counts[i] = len(d)
        if counts.sum() != sum(len(d) for d in spec.values()):
            raise ValueError("drafts for a request that is not a running row of this step")
        return counts

    def _check_state_copies(self, sched_out: SchedulerOutput, num_scheduled: int) -> None:
        """ValueError unless every slot copy fits the step's fixed-shape arrays and names
        real slots: an out-of-range slot would be clamped on device into another layer's
        rows, and the null slot 0 holds only padding rows' garbage."""
        for what, pairs in (("state_restores", sched_out.state_restores),
                            ("state_saves", sched_out.state_saves)):
            if not pairs:
                continue
            if not self.num_state_slots:
                raise ValueError(f"{what}: the model has no recurrent state")
            if not num_scheduled:
                raise ValueError(f"{what} in a step that computes no rows (no forward runs)")
            if len(pairs) > self.max_state_copies:
                raise ValueError(f"{len(pairs)} {what} in one step, at most "
                                 f"{self.max_state_copies}")
            for src, dst in pairs:
                if not (0 < src < self.num_state_slots and 0 < dst < self.num_state_slots):
                    raise ValueError(f"{what}: slot pair {(src, dst)} outside 1.."
                                     f"{self.num_state_slots - 1}")

    def remove(self, req_ids: list[str]) -> None:
        """Frees the rows of these requests (unknown ids are ignored) and moves the last
        held rows into the holes."""
        holes = []
        for rid in req_ids:
            row = self.row_of.pop(rid, None)
            if row is not None:
                self.req_ids[row] = None
                self.dynamic[row] = None
                for pt in self._page_tables:
                    pt[row, :self.num_pages[row]] = 0
                self.num_pages[row] = 0
                if self.images is not None:
                    self.images.clear(row)
                holes.append(row)
        if not holes:
            return
        self.generation += 1
        held = self.num_rows - len(holes)
        movers = (r for r in range(held, self.num_rows) if self.req_ids[r] is not None)
        for dst, src in zip(sorted(h for h in holes if h < held), movers):
            self._move(src, dst)
        self.num_rows = held

    def _move(self, src: int, dst: int) -> None:
        rid = self.req_ids[src]
        self.req_ids[dst], self.req_ids[src] = rid, None
        self.row_of[rid] = dst
        n = self.num_pages[src]
        for pt in self._page_tables:
            pt[dst, :n] = pt[src, :n]
            pt[src, :n] = 0
        self.tokens[dst, :self.num_tokens[src]] = self.tokens[src, :self.num_tokens[src]]
        for a in self._row_arrays:
            a[dst] = a[src]
        if self.has_mask[src]:
            self.token_mask[dst] = self.token_mask[src]
        if self.has_bias[src]:
            self.bias_ids[dst], self.bias[dst] = self.bias_ids[src], self.bias[src]
        self.dynamic[dst], self.dynamic[src] = self.dynamic[src], None
        self.num_pages[src] = 0
        if self.images is not None:
            self.images.move(src, dst)

    def _add(self, r: NewRequestData, eos_token_ids: tuple[int, ...]) -> int:
        if r.req_id in self.row_of:
            raise ValueError(f"request {r.req_id!r} is already in the runner's batch")
        row = self.num_rows
        if row == self.max_num_seqs:
            raise ValueError(f"more than max_num_seqs={self.max_num_seqs} requests held")
        self.num_rows += 1
        self.req_ids[row] = r.req_id
        self.row_of[r.req_id] = row
        n_p, n_o = len(r.prompt_token_ids), len(r.output_token_ids)
        self.tokens[row, :n_p] = r.prompt_token_ids
        self.tokens[row, n_p:n_p + n_o] = r.output_token_ids
        self.num_prompt[row], self.num_tokens[row] = n_p, n_p + n_o
        if len(r.page_ids) != len(self._page_tables):
            raise ValueError(f"request {r.req_id!r} has pages in {len(r.page_ids)} KV "
                             f"groups, the runner keeps {len(self._page_tables)}")
        for pt, ids in zip(self._page_tables, r.page_ids):
            pt[row, :len(ids)] = ids
        self.num_pages[row] = len(r.page_ids[0])
        self.state_slots[row] = r.state_slot
        self.in_flight[row] = -1
        if self.lora_slots is not None:
            self.lora_slots[row] = r.lora_slot
        elif r.lora_slot:
            raise ValueError(f"request {r.req_id!r} has LoRA slot {r.lora_slot}; LoRA is off")
        if self.images is not None:
            self.images.add(row, r.prompt_token_ids, r.multi_modal)
        sp = r.sampling_params
        for name, _, _ in PARAM_COLUMNS:
            getattr(self, name)[row] = getattr(sp, name)
        self.want_logprobs[row] = sp.logprobs is not None
        self.want_prompt_logprobs[row] = sp.prompt_logprobs is not None
        self.has_penalties[row] = sp.has_penalties
        self.greedy_only[row] = only_greedy([sp])
        self.seeded[row] = sp.seed is not None
        self.keys[row] = seed_to_key_data(sp.seed) if sp.seed is not None else (0, 0)
        # Stop tokens may not be sampled among the first min_tokens outputs (as vLLM).
        self.min_tokens[row] = sp.min_tokens
        stops = () if not sp.min_tokens else (
            (() if sp.ignore_eos else tuple(eos_token_ids))
            + tuple(sp.stop_token_ids))
        if len(stops) > MAX_BANNED_TOKENS:
            raise ValueError(f"at most {MAX_BANNED_TOKENS} stop tokens can be held back "
                             f"by min_tokens, got {len(stops)}")
        self.banned[row] = self.vocab_size
        self.banned[row, :len(stops)] = stops
        self.has_mask[row] = static_mask(sp, self.token_mask[row])
        self.has_bias[row] = bias_row(sp, self.vocab_size, self.bias_ids[row], self.bias[row])
        self.has_dynamic[row] = DynamicConstraints.wanted(sp)
        self.dynamic[row] = (DynamicConstraints(sp, r.output_token_ids)
                             if self.has_dynamic[row] else None)
        return row

    def append_sampled(self, step: ScheduledRows, token_ids: np.ndarray,
                       generation: int | None = None) -> dict[int, str]:
        """Stores the tokens sampled for `step` (token_ids[i]: batch row i; rows that did
        not sample, or are no longer held, are skipped): they are the next step's input and
        the history. generation: the batch's at the step's dispatch (None: now).
        -> {batch row: why} for rows whose grammar failed on its token (see
        DynamicConstraints.accept)."""
        now = step.rows if generation is None else self.rows_now(step, generation)
        picked = np.flatnonzero(step.sample & (now >= 0))
        rows = now[picked]
        at = self.num_tokens[rows]
        sampled = token_ids[:step.num_reqs][picked]
        self.tokens[rows, at] = sampled
        self.num_tokens[rows] = at + 1
        failed = {}
        for i in np.flatnonzero(self.has_dynamic[rows]):
            if not self.dynamic[rows[i]].accept(int(sampled[i])):
                failed[int(picked[i])] = self.dynamic[rows[i]].grammar.error
        return failed

    def append_verified(self, row: int, tokens: list[int]) -> str | None:
        """Stores a row's accepted drafts and the token sampled after them. -> why its
        grammar failed on one of them, or None."""
        at = self.num_tokens[row]
        self.tokens[row, at:at + len(tokens)] = tokens
        self.num_tokens[row] = at + len(tokens)
        if self.has_dynamic[row]:
            for t in tokens:
                if not self.dynamic[row].accept(t):
                    return self.dynamic[row].grammar.error
        return None

    # ---- one step's arrays -------------------------------------------------------------
    def build(self, step: ScheduledRows) -> HostBatch:
        """The padded device inputs of a step."""
        num_reqs, num_tokens = step.num_reqs, step.num_tokens
        rows, starts, lens = step.rows, step.starts, step.lens
        t = pick_bucket(self.token_buckets, num_tokens)
        r_max, ps = self.max_num_seqs, self.page_size
        cu = self._qsl
        cu[0] = 0
        np.cumsum(lens, out=cu[1:num_reqs + 1])
        cu[num_reqs + 1:] = num_tokens
        if num_tokens == num_reqs:   # decodes only: one token per row
            row_of_token, positions_real = rows, starts
        else:
            batch_row = np.repeat(np.arange(num_reqs, dtype=np.int32), lens)
            row_of_token = rows[batch_row]
            positions_real = (np.arange(num_tokens, dtype=np.int32) - cu[batch_row]
                              + starts[batch_row])
        token_ids = self._token_ids[:t]
        token_ids[num_tokens:] = 0
        token_ids[:num_tokens] = self.tokens[row_of_token, positions_real]
        token_src = self.token_sources(row_of_token, positions_real, t)
        positions = self._positions[:t]
        positions[num_tokens:] = 0
        positions[:num_tokens] = positions_real
        page_of_token, offset = positions_real // ps, positions_real % ps
        slots = self._slots[:t]
        slots[num_tokens:] = 0  # padding tokens write into the null page
        slots[:num_tokens] = self.page_table[row_of_token, page_of_token] * ps + offset
        sliding = self.sliding_page_table is not None
        if sliding:
            sliding_slots = self._sliding_slots[:t]
            sliding_slots[num_tokens:] = 0
            sliding_slots[:num_tokens] = (self.sliding_page_table[row_of_token, page_of_token]
                                          * ps + offset)

        seq_lens = np.zeros(r_max, np.int32)
        seq_lens[:num_reqs] = starts + lens
        longest = int(seq_lens[:num_reqs].max(initial=1))
        width = pick_bucket(self.page_buckets, -(-longest // ps))
        page_table = np.zeros((r_max, width), np.int32)
        page_table[:num_reqs] = self.page_table[rows, :width]
        if sliding:
            sliding_table = np.zeros((r_max, width), np.int32)
            sliding_table[:num_reqs] = self.sliding_page_table[rows, :width]
        state_slots = np.zeros(r_max, np.int32)
        state_slots[:num_reqs] = self.state_slots[rows]
        logits_idx = np.zeros(self.max_sample_rows, np.int32)
        if step.num_drafts is None:
            logits_idx[:num_reqs] = cu[1:num_reqs + 1] - 1
        else:   # each sampling row's last 1 + k tokens: its known one and its k drafts
            batch_row, offset = step.sample_rows()
            logits_idx[:len(batch_row)] = (cu[batch_row + 1] - 1 - step.num_drafts[batch_row]
                                           + offset)
        lora_ids = None
        if self.lora_slots is not None:   # padding tokens: slot 0, no adapter
            lora_ids = np.zeros(t, np.int32)
            lora_ids[:num_tokens] = self.lora_slots[row_of_token]
        copies = (state_copy_inputs(step.state_restores, step.state_saves,
                                    self.max_state_copies)
                  if self.num_state_slots else {})
        if self.images is not None:
            copies.update(self.images.step_inputs(rows, cu, row_of_token, positions_real, t))
        inputs = ModelInputs(
            token_ids=token_ids.copy(), positions=positions.copy(), slot_mapping=slots.copy(),
            query_start_loc=cu.copy(), seq_lens=seq_lens, page_table=page_table,
            num_seqs=np.array([num_reqs], np.int32), state_slots=state_slots,
            sliding_slot_mapping=sliding_slots.copy() if sliding else None,
            sliding_page_table=sliding_table if sliding else None, lora_slot_ids=lora_ids,
            **copies)
        return HostBatch(inputs, logits_idx, num_tokens, num_reqs, token_src)

    def prompt_logprob_targets(self, step: ScheduledRows, cu: np.ndarray,
                               size: int) -> tuple[np.ndarray, list]:
        """Next prompt token of each position of this step whose next token is a prompt
        token, for rows that want prompt logprobs: (targets int32[size], -1 elsewhere;
        spans [(req_id, first token in the batch, count, first position)])."""
        targets = np.full(size, -1, np.int32)
        spans = []
        for i in np.flatnonzero(self.want_prompt_logprobs[step.rows]):
            row, lo = step.rows[i], int(step.starts[i])
            hi = min(lo + int(step.lens[i]), int(self.num_prompt[row]) - 1)
            if hi <= lo:
                continue  # this chunk holds no position whose next token is a prompt token
            targets[cu[i]:cu[i] + hi - lo] = self.tokens[row, lo + 1:hi + 1]
            spans.append((step.req_ids[i], int(cu[i]), hi - lo, lo))
        return targets, spans
