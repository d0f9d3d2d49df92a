"""The runner's warmup: every program serving can call, listed with the arguments it
will get, compiled several at a time and run once, so nothing compiles after it (and the
planner lowers the same list for a TPU, planning/plan_compile.py)."""
from __future__ import annotations

import itertools
import logging
import time
from functools import partial
from typing import Any, Callable

import jax
import numpy as np

from jaxserve.runner.layer_caches import cache_allocator
from jaxserve.runner.parallel_compile import compile_all, default_compile_workers
from jaxserve.runner.programs import (DRAFT, ENCODE, FORWARD, GREEDY, LORA_SLOT, PENALTIES,
                                      PROMPT_LOGPROBS, RANDOM, SAMPLE, Program)
from jaxserve.runner.sampling_tensors import make_sampling_tensors
from jaxserve.runner.step_rows import state_copy_inputs
from jaxserve.runner.warmup_report import OnProgram, WarmupReport
from models.inputs import ModelInputs

logger = logging.getLogger("jaxserve")

# Alternate idle and attending calls _time_attention times (the fastest of each counts).
TIMING_ROUNDS = 3


class RunnerWarmup:
    """ModelRunner's warmup (a mixin: it lists and compiles the runner's own programs)."""
    # Seconds per token of the largest token bucket's forward, timed at warmup (0: none).
    prefill_s_per_token: float = 0.0
    # Attention's seconds per (query, key) pair on top of that, timed at warmup with a host
    # tier (its restore-or-recompute cost model; 0: not timed).
    attention_s_per_pair: float = 0.0

    def warmup_programs(self) -> list[Program]:
        """Every program warmup compiles, in its order: the forward per token bucket and
        page-table width, prompt logprobs, the sampler per row bucket and the penalties
        sampler at the largest. Arguments as serving passes them: numpy batch inputs
        (device arrays would compile other programs), device arrays for what serving takes from the
        forward's outputs (ShapeDtypeStructs when abstract)."""
        r_max = self.batch.max_num_seqs
        sliding = self.batch.sliding_page_table is not None

        def forward_args(t: int, p: int) -> tuple:
            z = np.zeros(t, np.int32)
            # A hybrid's slot copies, as InputBatch.build pads them (no pair, count 0).
            copies = state_copy_inputs([], [], self.batch.max_state_copies) \
                if self.num_state_slots else {}
            inputs = ModelInputs(
                token_ids=z, positions=z, slot_mapping=z,
                query_start_loc=np.zeros(r_max + 1, np.int32), seq_lens=np.zeros(r_max, np.int32),
                page_table=np.zeros((r_max, p), np.int32), num_seqs=np.zeros(1, np.int32),
                state_slots=np.zeros(r_max, np.int32),
                sliding_slot_mapping=z if sliding else None,
                sliding_page_table=np.zeros((r_max, p), np.int32) if sliding else None,
                lora_slot_ids=z if self.lora is not None else None,
                **copies, **self._image_inputs(t))
            return (self.params, self.kv_caches, inputs,
                    np.zeros(self.batch.max_sample_rows, np.int32),
                    self._put(np.zeros(self.batch.max_sample_rows, np.int32)),
                    np.full(t, -1, np.int32), *self._lora_args)

        def hidden(rows: int) -> Any:
            """Hidden states [rows, E] as the forward returns them."""
            if self._hidden_spec is None:
                t, p = self.token_buckets[0], self.batch.page_buckets[-1]
                self._hidden_spec = jax.eval_shape(self._forward, *forward_args(t, p))[1]
            return self._put(np.zeros((rows, self._hidden_spec.shape[-1]),
                                      self._hidden_spec.dtype))

        def logprobs_args(t: int) -> tuple:
            return self.params, hidden(t), self._put(np.full(t, -1, np.int32))

        def sample_args(rows: int, mode: str) -> tuple:
            tensors = make_sampling_tensors([], rows, self.vocab_size,
                                            penalties=mode == PENALTIES,
                                            penalty_len=self.max_model_len)
            return self.params, hidden(self.batch.max_sample_rows), tensors, rows, mode

        progs = [Program(FORWARD, self._forward, partial(forward_args, t, p), tokens=t, pages=p)
                 for t, p in itertools.product(self.token_buckets, self.batch.page_buckets)]
        if self.encoder is not None:
            progs += self.encoder.programs()
        progs.append(Program(PROMPT_LOGPROBS, self._prompt_logprobs,
                             partial(logprobs_args, self._max_tokens), tokens=self._max_tokens))
        if self.drafter is not None:
            def draft_args(t: int, p: int) -> tuple:
                return self.drafter.warmup_args(self.params, hidden(self._max_tokens),
                                                forward_args(t, p)[2])
            progs += [Program(DRAFT, self.drafter.program, partial(draft_args, t, p), tokens=t,
                              pages=p)
                      for t, p in itertools.product(self.token_buckets, self.batch.page_buckets)]
        modes = [(GREEDY, rows) for rows in self.row_buckets] + \
            [(RANDOM, rows) for rows in self.sampling_row_buckets] + \
            [(PENALTIES, self.row_buckets[-1])]
        progs += [Program(SAMPLE, self._sample, partial(sample_args, rows, mode), rows=rows,
                          mode=mode) for mode, rows in modes]
        if self.lora is not None:   # slot 0 (no adapter) written with its own zeros
            progs.append(Program(LORA_SLOT, self._write_lora, lambda: (
                self.lora_stacks, np.int32(0), self.lora.empty_slot_rows())))
        return progs

    def _image_inputs(self, t: int) -> dict[str, Any]:
        """A forward's image fields as InputBatch.build and dispatch fill them (no image
        token), or none when the runner serves no images."""
        if self.encoder is None:
            return {}
        out = {"image_rows": np.full(t, -1, np.int32), "image_embeds": self.encoder.cache}
        if self.batch.images.mrope is not None:
            out["mrope_positions"] = np.zeros((3, t), np.int32)
        if self.batch.images.horizon:
            out["image_horizon"] = np.zeros(t, np.int32)
        return out

    def _put(self, x: np.ndarray) -> Any:
        """x replicated on the mesh, as the forward's outputs are (abstract: its shape)."""
        if self.abstract:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._rep)
        return jax.device_put(x, self._rep)

    def lower(self, program: Program) -> Any:
        """The program lowered for this runner's mesh (jax.stages.Lowered)."""
        with jax.set_mesh(self.mesh):
            return program.fn.lower(*program.args())

    def _time_attention(self, prog: Program) -> float:
        """Attention's cost per (query, key) pair: the forward `prog` (the largest token
        bucket, the widest page table) run as one sequence's chunk of all its tokens after
        as long a context as its pages and max_model_len allow, against its time as warmup
        ran it (no row: nothing attended); the difference over the pairs. The attending
        call runs once untimed (its first call read pages no request has touched yet and
        ran 3.5-8x longer than the next on the test engines: their first touch), then the
        idle and the attending one TIMING_ROUNDS times each, alternately, the fastest of
        each kept (one pair of calls on a busy 2-core CI machine once timed the idle one
        longer). The same program: nothing compiles. Its KV writes go to the null page.
        0 when the difference is not positive (noise: the caller keeps the nominal
        figure)."""
        t, page_size = prog.tokens, self.config.page_size
        context = max(0, min(prog.pages * page_size, self.max_model_len) - t)
        params, caches, inputs, *rest = prog.args()
        r = inputs.seq_lens.shape[0]
        def table(num_pages: int) -> np.ndarray:   # row 0: real pages (not the null one)
            pages = np.zeros((r, prog.pages), np.int32)
            pages[0] = np.arange(prog.pages) % max(1, num_pages - 1) + 1
            return pages
        attend = inputs.replace(
            positions=np.arange(context, context + t, dtype=np.int32),
            query_start_loc=np.minimum(np.arange(r + 1), 1).astype(np.int32) * t,
            seq_lens=np.asarray([context + t] + [0] * (r - 1), np.int32),
            page_table=table(self.config.num_pages), num_seqs=np.ones(1, np.int32))
        if attend.sliding_page_table is not None:   # Gemma 4's own, smaller, sliding pool
            attend = attend.replace(sliding_page_table=table(
                self.config.num_sliding_pages or self.config.num_pages))
        fastest = [float("inf"), float("inf")]   # idle, attending
        for i, attending in enumerate((True,) + (False, True) * TIMING_ROUNDS):
            t0 = time.perf_counter()
            out = prog.fn(params, caches, attend if attending else inputs, *rest)
            caches = out[2]         # the old ones were donated
            jax.block_until_ready(out)
            if i:                   # the first: untimed
                fastest[attending] = min(fastest[attending], time.perf_counter() - t0)
        self.kv_caches = caches
        extra = fastest[True] - fastest[False]
        return extra / (t * context + t * (t + 1) / 2) if extra > 0 else 0.0

    def allocate_caches(self, allocate: Callable[[], dict] | None = None) -> None:
        """Allocates the caches if they are only described (ModelRunner's
        caches_after_compile): warmup does after compiling, so that XLA:GPU autotunes the
        gemms in the memory the caches then take (the second H100 session ran out of
        memory compiling llama-3.1-8b's lm_head with the caches allocated)."""
        if self._caches_pending:
            self.kv_caches = (allocate or cache_allocator(self.kv_caches))()
            self._caches_pending = False

    def warmup(self, on_program: OnProgram | None = None) -> None:
        """Compile every program of warmup_programs now.
        on_program(done, total): called before the first program and after each."""
        if self.abstract:
            raise ValueError("an abstract runner cannot run: lower its warmup_programs instead")
        with jax.set_mesh(self.mesh):
            self._warmup(on_program)

    def _warmup(self, on_program: OnProgram | None = None) -> None:
        programs = self.warmup_programs()
        # (the caches' zero-filling program compiles outside warmup's count, as it did
        # when the runner allocated them at construction: serving never runs it)
        allocate = cache_allocator(self.kv_caches) if self._caches_pending else None
        report = WarmupReport(len(programs), on_program)
        # Compile them all, several at a time (nothing runs yet, so no cache is donated
        # while another program is lowered with it), lowered one by one in this thread
        # (lowering puts arrays on the mesh, which a multi-host run checks across
        # processes, so every process must lower in the same order) ...
        compile_all(programs, lambda lowered: lowered.compile(), prepare=self.lower,
                    workers=default_compile_workers(),
                    on_done=lambda prog, _, seconds: report.program_done(prog, seconds))
        self.allocate_caches(allocate)   # compiled for them; now they may take the memory
        # ... then run each once, from jax's in-memory caches: the calls serving makes.
        forward_s: dict[int, float] = {}   # token bucket -> its fastest forward's seconds
        for prog in programs:
            t0 = time.perf_counter()
            out = prog.fn(*prog.args())
            if prog.kind == FORWARD:
                self.kv_caches = out[2]     # the old ones were donated
            elif prog.kind == DRAFT:
                self.drafter.caches = out[1]
            elif prog.kind == LORA_SLOT:
                self.lora_stacks = out      # the old ones were donated
            elif prog.kind == ENCODE:
                self.encoder.cache = out
            jax.block_until_ready(out)
            if prog.kind == FORWARD:
                seconds = time.perf_counter() - t0
                forward_s[prog.tokens] = min(forward_s.get(prog.tokens, seconds), seconds)
        # The largest bucket's time per token: a prefill's (the host tier's cost model).
        self.prefill_s_per_token = forward_s[max(forward_s)] / max(forward_s) \
            if forward_s else 0.0
        if self.host_tier is not None:   # its offload and restore programs
            self.adopt_host_tier_caches(self.host_tier.warmup(self.host_tier_caches()))
            largest = max((p for p in programs if p.kind == FORWARD),
                          key=lambda p: (p.tokens, p.pages), default=None)
            if largest is not None:
                self.attention_s_per_pair = self._time_attention(largest)
        summary = report.finish()
        self.warmup_seconds = summary.seconds
        self.warmup_compilations = summary.counts.lowered
        # XLA compilations during warmup: from the persistent compilation cache, and fresh.
        self.warmup_cache_hits = summary.counts.cache_hits
        self.warmup_fresh_compilations = summary.counts.fresh
        logger.info("warmup: token buckets %s, page-table widths %s, row buckets %s (greedy), "
                    "%s (sampling)", list(self.token_buckets), list(self.batch.page_buckets),
                    list(self.row_buckets), list(self.sampling_row_buckets))
