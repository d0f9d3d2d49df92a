"""compile_all: results in order, errors raised, and a program it compiled is the one
jit then runs (no second compilation)."""
import threading

import jax
import jax.numpy as jnp
import pytest

from jaxserve.runner import compile_counter
from jaxserve.runner.parallel_compile import compile_all, default_compile_workers


def test_results_in_item_order_and_every_item_reported():
    seen = []
    out = compile_all([3, 1, 2], lambda n: n * 10, workers=3,
                      on_done=lambda item, result, seconds: seen.append((item, result)))
    assert out == [30, 10, 20]
    assert sorted(seen) == [(1, 10), (2, 20), (3, 30)]


def test_runs_on_several_threads_and_reports_on_the_caller():
    barrier = threading.Barrier(2, timeout=10)   # both items must be running at once
    callers = set()
    compile_all(["a", "b"], lambda _: barrier.wait(), workers=2,
                on_done=lambda *_: callers.add(threading.get_ident()))
    assert callers == {threading.get_ident()}


def test_prepare_runs_on_the_caller_in_item_order_while_the_pool_compiles():
    """What a multi-host run needs of lowering: the same order in every process."""
    caller, prepared, compiled_on = threading.get_ident(), [], set()

    def prepare(n):
        assert threading.get_ident() == caller
        prepared.append(n)
        return n * 10

    def compile_one(x):
        compiled_on.add(threading.get_ident())
        return x + 1
    assert compile_all([5, 3, 4, 1], compile_one, workers=2, prepare=prepare) == \
        [51, 31, 41, 11]
    assert prepared == [5, 3, 4, 1] and caller not in compiled_on


def test_first_error_is_raised():
    def boom(n):
        if n == 2:
            raise RuntimeError("compiler said no")
        return n
    with pytest.raises(RuntimeError, match="compiler said no"):
        compile_all([1, 2, 3], boom, workers=2)


def test_worker_count_from_environment(monkeypatch):
    monkeypatch.setenv("JAXSERVE_COMPILE_WORKERS", "3")
    assert default_compile_workers() == 3
    monkeypatch.setenv("JAXSERVE_COMPILE_WORKERS", "0")
    with pytest.raises(ValueError, match="JAXSERVE_COMPILE_WORKERS"):
        default_compile_workers()
    monkeypatch.delenv("JAXSERVE_COMPILE_WORKERS")
    assert 1 <= default_compile_workers() <= 8


def test_a_call_after_compile_all_compiles_nothing():
    f = jax.jit(lambda x: jnp.tanh(x) @ x.T + 1.5)
    shapes = [(4, 8), (8, 8), (16, 8)]
    args = [jnp.ones(s, jnp.float32) for s in shapes]
    before = compile_counter.counts()
    compile_all(args, lambda x: f.lower(x).compile(), workers=3)
    compiled = compile_counter.counts() - before
    assert compiled.backend == 3
    before = compile_counter.counts()
    for x in args:
        jax.block_until_ready(f(x))
    after = compile_counter.counts() - before
    assert (after.lowered, after.backend) == (0, 0)
