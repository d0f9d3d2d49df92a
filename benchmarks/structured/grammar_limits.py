"""Where llguidance's compiler overflows its thread's stack, per grammar shape: the facts
behind jaxserve/engine/grammar.py's MAX_CONSTRAINT_CHARS and COMPILE_STACK_BYTES.

For each shape (chains of Lark rules or JSON-schema $refs, the recursion a hostile
grammar can drive), bisects the deepest chain that compiles, with its first mask, in a
thread of --stack-mib; each try runs in a subprocess, since an overflow kills it. Prints
stack bytes per chain level and per character of the constraint's text (the limit's
unit); the per-level figure does not depend on the stack size (16 and 64 MiB agree).

--step-costs instead: what constraints within the limits cost the engine thread per
step (a matcher's mask fill and consume, native code no fuel limit bounds for every
shape), through jaxserve's GrammarCompiler, with the 32k BPE of grammar_tokenizer.py.

    python -m benchmarks.structured.grammar_limits --stack-mib 16
    python -m benchmarks.structured.grammar_limits --step-costs
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import time

SHAPES = {
    "lark rule chain": 'r{i}: r{j}',
    "lark rules, 28 nested groups each": 'r{i}: ' + '(' * 28 + 'r{j}' + ')' * 28,
    "json $ref chain": '{{"$ref": "#/$defs/{j}"}}',
    "json $ref through properties":
        '{{"properties": {{"a": {{"$ref": "#/$defs/{j}"}}}}, "required": ["a"]}}',
}


def constraint(shape: str, n: int) -> dict:
    """{kind: value} of a chain n deep (hex names, as short as they come)."""
    rule = SHAPES[shape]
    if shape.startswith("lark"):
        lines = [rule.format(i=f"{i:x}", j=f"{i + 1:x}") for i in range(n)]
        return {"grammar": "start: r0\n" + "\n".join(lines) + f'\nr{n:x}: "a"\n'}
    defs = {f"{i:x}": json.loads(rule.format(j=f"{i + 1:x}")) for i in range(n)}
    defs[f"{n:x}"] = {"type": "integer"}
    return {"json": {"$ref": "#/$defs/0", "$defs": defs}}


PROBE = textwrap.dedent("""
    import json, sys, threading
    import llguidance, llguidance.hf
    from llguidance import LLMatcher, LLParserLimits
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
    from transformers import AutoTokenizer
    tok_dir, stack = sys.argv[1], int(sys.argv[2])
    so = json.load(sys.stdin)
    tok = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(tok_dir), n_vocab=256)
    def build():
        if "json" in so:
            grammar = LLMatcher.grammar_from_json_schema(so["json"])
        else:
            grammar = LLMatcher.grammar_from_lark(so["grammar"])
        m = LLMatcher(tok, grammar, log_level=0, limits=LLParserLimits(verbose_errors=False))
        fill_next_token_bitmask(m, allocate_token_bitmask(1, 256), 0)
    threading.stack_size(stack)
    t = threading.Thread(target=build)
    t.start()
    t.join()
""")


def survives(tok_dir: str, shape: str, n: int, stack: int) -> bool:
    done = subprocess.run([sys.executable, "-c", PROBE, tok_dir, str(stack)],
                          input=json.dumps(constraint(shape, n)), capture_output=True,
                          text=True, timeout=600)
    return done.returncode == 0


def deepest(tok_dir: str, shape: str, stack: int) -> int:
    """The deepest chain that compiles, within 1/64 (doubling, then bisecting)."""
    lo, hi = 0, 64
    while survives(tok_dir, shape, hi, stack):
        lo, hi = hi, hi * 2
    while hi - lo > max(hi // 64, 1):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if survives(tok_dir, shape, mid, stack) else (lo, mid)
    return hi


STEP_CASES = {
    "JSON object": {"json_object": True},
    "regex a{300}": {"regex": "a{300}"},
    "regex a{3000}": {"regex": "a{3000}"},
    "regex a{1000000}": {"regex": "a{1000000}"},
    "choice of 'x' * 1,000": {"choice": ["x" * 1000]},
    "choice of 'x' * 10,000": {"choice": ["x" * 10_000]},
    "choice of 60,000 characters of words": {"choice": [" ".join(["hello world"] * 5000)]},
    "string of exactly 30,000 characters": {"json": {"type": "string", "minLength": 30_000,
                                                     "maxLength": 30_000}},
}


def step_costs(steps: int = 20) -> None:
    import numpy as np
    from benchmarks.structured.grammar_tokenizer import make_bpe_tokenizer, tokenizer_dir
    from jaxserve.engine.grammar import GrammarCompiler
    from jaxserve.structured_outputs import StructuredOutputsParams
    hf = make_bpe_tokenizer(tokenizer_dir(32_000), 32_000)
    compiler = GrammarCompiler(hf, len(hf), (hf.eos_token_id,))
    print(f"| constraint (32k BPE) | compile | mask + consume per step: median / max over "
          f"{steps} |")
    print("|---|---|---|")
    for name, kw in STEP_CASES.items():
        t0 = time.perf_counter()
        try:
            compiled = compiler.compile(StructuredOutputsParams(**kw))
        except ValueError as e:
            print(f"| {name} | refused: {str(e)[:90]} | |", flush=True)
            continue
        compile_s = time.perf_counter() - t0
        m, row, times = compiled.matcher(), np.empty_like(compiled.first_mask), []
        for _ in range(steps):
            t0 = time.perf_counter()
            row[:] = 0xFFFFFFFF
            m.fill(row)
            ids = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
            ids = ids[ids != hf.eos_token_id]
            if not len(ids) or not m.accept(int(ids[len(ids) // 2])):
                break
            times.append(time.perf_counter() - t0)
        ms = np.array(times or [0.0]) * 1e3
        print(f"| {name} | {compile_s:.2f} s | {np.median(ms):.1f} / {ms.max():.1f} ms |",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stack-mib", type=int, default=16)
    ap.add_argument("--step-costs", action="store_true")
    args = ap.parse_args()
    if args.step_costs:
        step_costs()
        return
    from jaxserve.checkpoints.tiny_tokenizer import make_tiny_tokenizer
    from jaxserve.structured_outputs import StructuredOutputsParams
    stack = args.stack_mib << 20
    with tempfile.TemporaryDirectory() as tok_dir:
        make_tiny_tokenizer(tok_dir)
        print(f"| shape ({args.stack_mib} MiB stack) | overflows at depth | stack bytes per "
              f"level | characters at that depth | stack bytes per character |")
        print("|---|---|---|---|---|")
        for shape in SHAPES:
            n = deepest(tok_dir, shape, stack)
            chars = len(StructuredOutputsParams(**constraint(shape, n)).key())
            print(f"| {shape} | {n:,} | {stack // n:,} | {chars:,} | {stack // chars:,} |",
                  flush=True)


if __name__ == "__main__":
    main()
