"""spec_decode's code-editing workload: seeded Python modules, each with an instruction to
rename one identifier and the start of the answer (text for the tests' byte-level
tokenizer)."""
from __future__ import annotations

import random
from typing import Any

NAMES = ("items", "total", "price", "count", "value", "result", "index", "record", "buffer",
         "offset", "limit", "weight", "scale", "name", "path", "size", "width", "height",
         "cache", "key", "entry", "node", "parent", "child", "depth", "score", "rate")
FUNCS = ("compute", "update", "load", "parse", "merge", "filter", "render", "collect")
NOUNS = ("totals", "records", "config", "tree", "table", "scores", "rows", "batch")


def code_module(rng: random.Random, num_lines: int) -> tuple[str, str, str]:
    """A seeded Python module of about num_lines statements -> (code, an identifier it
    uses, the name to rename it to)."""
    lines, stmts = [], 0
    while stmts < num_lines:
        fn = f"{rng.choice(FUNCS)}_{rng.choice(NOUNS)}"
        args = rng.sample(NAMES, 2)
        lines.append(f"def {fn}({args[0]}, {args[1]}):")
        local = list(args)
        for _ in range(rng.randint(3, 6)):
            a, b = rng.sample(local, 2)
            new = rng.choice(NAMES)
            form = rng.randrange(4)
            if form == 0:
                lines.append(f"    {new} = {a} + {b} * {rng.randint(2, 9)}")
            elif form == 1:
                lines.append(f"    for {new} in {a}:")
                lines.append(f"        {b} += {new}")
                stmts += 1
            elif form == 2:
                lines.append(f"    if {a} > {b}:")
                lines.append(f"        {new} = {a} - {b}")
                stmts += 1
            else:
                lines.append(f"    {new} = {fn}({a}, {b} + 1)")
            local.append(new)
            stmts += 1
        lines.append(f"    return {rng.choice(local)}")
        lines.append("")
        stmts += 1
    code = "\n".join(lines)
    old = rng.choice(sorted({w for w in NAMES if w in code}))
    return code, old, f"{old}_{rng.choice(('new', 'v2', 'fixed'))}"


def code_prompts(tok: Any, n: int, num_lines: int, seed: int) -> list[list[int]]:
    """n code-editing prompts (token ids)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        code, old, new = code_module(rng, num_lines)
        first = code.split("\n", 1)[0].replace(old, new)
        text = (f"```python\n{code}```\n# Rewrite the code above with `{old}` renamed to "
                f"`{new}`; keep everything else the same.\n```python\n{first}\n")
        out.append(tok.encode(text, add_special_tokens=False))
    return out

