"""RunnerWarmup._time_attention: the attending call's extra time over the idle one's,
over the (query, key) pairs it attends; the fastest of several calls of each counts, and a
difference that is not positive gives 0."""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from jaxserve.runner import runner_warmup
from jaxserve.runner.programs import FORWARD, Program
from jaxserve.runner.runner_warmup import RunnerWarmup
from models.inputs import ModelInputs

T, PAGES, PAGE_SIZE, ROWS = 8, 6, 4, 3
CONTEXT = PAGES * PAGE_SIZE - T          # max_model_len does not bound it
PAIRS = T * CONTEXT + T * (T + 1) / 2


def idle_inputs() -> ModelInputs:
    z = np.zeros(T, np.int32)
    return ModelInputs(token_ids=z, positions=z, slot_mapping=z,
                       query_start_loc=np.zeros(ROWS + 1, np.int32),
                       seq_lens=np.zeros(ROWS, np.int32),
                       page_table=np.zeros((ROWS, PAGES), np.int32),
                       num_seqs=np.zeros(1, np.int32), state_slots=np.zeros(ROWS, np.int32))


def timed(seconds_for) -> tuple[RunnerWarmup, Program, list]:
    """A runner and a forward whose call sleeps seconds_for(batch, call number)."""
    calls = []

    def fn(params, caches, batch, *rest):
        calls.append(batch)
        time.sleep(seconds_for(batch, len(calls)))
        return None, None, caches
    runner = SimpleNamespace(config=SimpleNamespace(page_size=PAGE_SIZE, num_pages=10,
                                                    num_sliding_pages=0),
                             max_model_len=1024, kv_caches=None)
    prog = Program(FORWARD, fn, lambda: ({}, "caches", idle_inputs()), tokens=T, pages=PAGES)
    return runner, prog, calls


def test_the_attending_calls_extra_time_over_the_pairs():
    per_pair = 2e-5                     # 0.0028 s over PAIRS = 140 pairs

    def seconds(batch, n):
        attends = int(batch.seq_lens[0]) > 0
        first = 0.2 if n == 1 else 0.0  # the first touch: not timed
        return 0.002 + first + (per_pair * PAIRS if attends else 0.0)
    runner, prog, calls = timed(seconds)
    got = RunnerWarmup._time_attention(runner, prog)
    assert len(calls) == 1 + 2 * runner_warmup.TIMING_ROUNDS
    attend = calls[0]                   # one sequence: all T tokens after CONTEXT
    assert list(attend.seq_lens) == [CONTEXT + T, 0, 0] and int(attend.num_seqs[0]) == 1
    assert list(attend.positions) == list(range(CONTEXT, CONTEXT + T))
    assert list(attend.query_start_loc) == [0, T, T, T]
    assert (attend.page_table[0] > 0).all() and not attend.page_table[1:].any()
    assert runner.kv_caches == "caches"  # the donated caches come back to the runner
    assert got == pytest.approx(per_pair, rel=0.3)


def test_the_fastest_call_of_each_counts():
    def seconds(batch, n):              # one idle call slowed (a busy machine)
        return 0.05 if n == 2 else 0.002 + (0.01 if int(batch.seq_lens[0]) else 0.0)
    runner, prog, _ = timed(seconds)
    assert RunnerWarmup._time_attention(runner, prog) == pytest.approx(0.01 / PAIRS, rel=0.3)


def test_no_extra_time_gives_0():
    runner, prog, _ = timed(lambda batch, n: 0.0 if int(batch.seq_lens[0]) else 0.01)
    assert RunnerWarmup._time_attention(runner, prog) == 0.0
