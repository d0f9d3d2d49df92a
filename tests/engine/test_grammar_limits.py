"""The grammar compiler against hostile constraints, without a model (the tiny tokenizer
only): chains of rules or $refs that overflowed llguidance's native stack (compiled in a
subprocess: a crash must not take pytest down), limits named in their refusals, error
texts bounded, compiles that time out or whose caller left stopped."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import types

import pytest

from jaxserve.engine import grammar
from jaxserve.errors import InputError
from jaxserve.engine.grammar import GrammarCompiler, short_error
from jaxserve.engine.grammar_worker import Cancelled, CompileWorkers
from jaxserve.structured_outputs import StructuredOutputsParams as SO


def ref_chain(n: int) -> dict:
    """A schema whose $refs chain n deep (an integer at the end)."""
    defs = {f"{i:x}": {"$ref": f"#/$defs/{i + 1:x}"} for i in range(n)}
    defs[f"{n:x}"] = {"type": "integer"}
    return {"$ref": "#/$defs/0", "$defs": defs}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i:x}: r{i + 1:x}\n" for i in range(n)) + f'r{n:x}: "a"\n'


def gbnf_chain(n: int) -> str:
    """GBNF whose conversion to Lark (Python, in llguidance) takes O(n^2) steps."""
    return "root ::= r0\n" + "".join(f"r{i:x} ::= r{i + 1:x}\n" for i in range(n)) + \
        f'r{n:x} ::= "a"\n'


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from jaxserve.checkpoints.tiny_tokenizer import make_tiny_tokenizer
    path = tmp_path_factory.mktemp("tok")
    make_tiny_tokenizer(str(path))
    return str(path)


@pytest.fixture(scope="module")
def compiler(tokenizer_dir):
    from transformers import AutoTokenizer
    return GrammarCompiler(AutoTokenizer.from_pretrained(tokenizer_dir), 256, (2,))


def nested_chain(n: int) -> str:
    """Lark rules chained through 28 nested groups each: the most native stack per
    character of grammar measured."""
    return "start: r0\n" + "".join(f"r{i:x}: {'(' * 28}r{i + 1:x}{')' * 28}\n"
                                   for i in range(n)) + f'r{n:x}: "a"\n'


def test_deep_chains_cannot_kill_the_process(tokenizer_dir):
    """Chains of $refs or Lark rules overflowed an 8 MiB stack (the process died with no
    error). Within the size limit they compile, on the compiler's own threads; past it
    they are refused, naming it."""
    chains = {"refs": {"json": ref_chain(3000)}, "rules": {"grammar": lark_chain(4000)},
              "nested": {"grammar": nested_chain(900)}}
    script = textwrap.dedent(f"""
        import json, sys
        from transformers import AutoTokenizer
        from jaxserve.engine.grammar import GrammarCompiler
        from jaxserve.structured_outputs import StructuredOutputsParams as SO
        compiler = GrammarCompiler(AutoTokenizer.from_pretrained({tokenizer_dir!r}), 256, (2,))
        for name, so in json.load(sys.stdin).items():
            try:
                compiler.compile(SO(**so))
                print(name, "compiled", flush=True)
            except ValueError as e:
                print(name, "refused:", e, flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(chains),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    lines = done.stdout.splitlines()
    assert lines[0].startswith("refs refused:") and \
        f"the limit is {grammar.MAX_CONSTRAINT_CHARS}" in lines[0]
    assert lines[1:] == ["rules compiled", "nested compiled"]


def test_limits_are_named_in_the_refusal(compiler):
    limit = grammar.MAX_CONSTRAINT_CHARS
    for so in (SO(choice=["x" * 10**6]), SO(regex="a" * (limit + 1)),
               SO(json=ref_chain(10_000))):
        with pytest.raises(InputError, match=f"the limit is {limit}") as e:
            compiler.compile(so)
        assert e.value.param == "structured_outputs"
    # JSON text nested 30,000 deep (within the size limit): a RecursionError (500) before
    deep = "[" * 30_000 + "]" * 30_000
    for make in (lambda: SO(json=deep),
                 lambda: SO(json={"items": json.loads("[" * 200 + "]" * 200)})):
        with pytest.raises(InputError, match="MAX_JSON_DEPTH"):
            compiler.compile(make())


@pytest.mark.parametrize("so, match", [
    # a $ref cycle with no way out: no text matches it
    (SO(json={"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"},
                                             "b": {"$ref": "#/$defs/a"}}}), "admits no output"),
    (SO(grammar='start: "x" start\n'), "admits no output"),     # no base case
    (SO(regex="a{1000000}"), "admits no output"),                # past llguidance's fuel
])
def test_constraints_no_output_can_meet_are_refused(compiler, so, match):
    with pytest.raises(InputError, match=match):
        compiler.compile(so)


def test_a_constraint_too_costly_to_follow_is_refused(compiler, monkeypatch):
    """The compile thread times one mask after the first token: a constraint slower than
    MAX_MASK_S per token (the engine thread's cost, per row) is refused, naming it."""
    monkeypatch.setattr(grammar, "MAX_MASK_S", 0.0)
    with pytest.raises(InputError, match=r"ms per token to follow; the limit is 0 ms"):
        compiler.compile(SO(regex="[0-9]{4}"))


def test_error_texts_are_bounded(compiler):
    with pytest.raises(InputError) as e:
        compiler.compile(SO(regex="[" + "a" * 5000))    # llguidance quotes the regex whole
    assert "invalid regex" in str(e.value) and len(str(e.value)) < 300
    panic = "panic: index out of bounds\n<backtrace>\n  0: std::backtrace\n" + \
        "  1: llguidance::x\n" * 500 + "</backtrace>"
    assert short_error(panic) == "panic: index out of bounds"
    assert short_error("err\n<non-verbose/>") == "err"


def test_a_compile_past_its_deadline_fails_and_stops(compiler, monkeypatch):
    """A GBNF grammar converting for longer than COMPILE_TIMEOUT_S: a 400 naming the
    limit, and the conversion (Python) stops: the compiler compiles the next one."""
    monkeypatch.setattr(grammar, "COMPILE_TIMEOUT_S", 0.2)
    for _ in range(grammar.COMPILE_THREADS + 1):   # more than the threads it has
        with pytest.raises(InputError, match="took more than 0.2 s to compile"):
            compiler.compile(SO(grammar=gbnf_chain(3500)))
    assert compiler.compile(SO(grammar='root ::= "yes" | "no"')).first_mask.any()


def test_cancelled_jobs_never_start_and_python_sections_stop():
    workers = CompileWorkers(1, 1 << 20)
    release, ran = threading.Event(), []

    def spin(tag: str) -> str:
        ran.append(tag)
        with workers.interruptible():
            while not release.is_set():     # Python bytecode: interruptible
                pass
        return tag

    first, queued = workers.submit(spin, "first"), workers.submit(spin, "queued")
    while not ran:
        pass
    workers.cancel(queued)
    workers.cancel(first)
    with pytest.raises(Cancelled):
        first.future.result(timeout=60)
    assert queued.future.cancelled() and ran == ["first"]
    # Nothing of the interrupt is left for the thread's next job.
    assert workers.submit(sum, range(10**6)).future.result(timeout=60) == sum(range(10**6))
    release.set()


def test_an_interrupt_that_lands_in_a_finalizer_is_dropped_quietly(monkeypatch):
    """The collector runs __del__ and weakref callbacks in whatever thread allocates: an
    interrupt that lands there reaches no hook (a test runner's would report it as an
    error of whatever test ran), and the job still stops."""
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    workers = CompileWorkers(1, 1 << 20)     # wraps the hook it finds
    in_finalizer, landed = threading.Event(), []

    class Slow:
        def __del__(self) -> None:
            in_finalizer.set()
            try:
                while True:
                    pass
            except Cancelled:
                landed.append(1)
                raise

    def section() -> None:
        with workers.interruptible():
            Slow()                        # its __del__ runs here, in the section
            while True:
                pass

    job = workers.submit(section)
    assert in_finalizer.wait(60)
    workers.cancel(job)
    with pytest.raises(Cancelled):
        job.future.result(timeout=60)
    assert landed == [1] and reported == []
    sys.unraisablehook(types.SimpleNamespace(exc_type=ValueError))   # others pass on
    assert len(reported) == 1


def test_an_interrupt_dropped_on_the_way_is_sent_again():
    """An interrupt can land in a weakref callback or __del__ the collector runs in the
    job's thread, which prints and drops it: the job is interrupted again until it stops."""
    workers = CompileWorkers(1, 1 << 20)
    started, dropped = threading.Event(), []

    def stubborn() -> None:
        with workers.interruptible():
            started.set()
            while True:
                try:
                    while True:
                        pass
                except Cancelled:
                    if dropped:
                        raise
                    dropped.append(1)

    job = workers.submit(stubborn)
    started.wait(60)
    workers.cancel(job)
    with pytest.raises(Cancelled):
        job.future.result(timeout=60)
    assert dropped == [1]
    assert workers.submit(sum, range(10)).future.result(timeout=60) == 45
