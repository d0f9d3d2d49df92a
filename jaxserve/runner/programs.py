"""Program: one jitted program that warmup compiles, with its bucket and arguments.

ModelRunner.warmup_programs lists them; warmup runs each (compiling it), and
`python -m jaxserve.plan --compile` lowers and compiles them for an abstract
TPU mesh instead, so both see the same programs at the same shapes.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxserve.runner.sampler import SamplerVariant

FORWARD, PROMPT_LOGPROBS, SAMPLE = "forward", "prompt_logprobs", "sample"


@dataclass(frozen=True)
class Program:
    kind: str                             # FORWARD, PROMPT_LOGPROBS or SAMPLE
    fn: Any                               # the jitted function (jax.jit(...))
    args: Callable[[], tuple]             # its arguments, built when called: the forward
                                          # takes the KV caches of that moment (donated)
    tokens: int | None = None             # token bucket (forward, prompt logprobs)
    rows: int | None = None               # row bucket (sampler)
    pages: int | None = None              # page-table width (forward)
    variant: SamplerVariant | None = None  # sampler only

    @property
    def name(self) -> str:
        """"forward", "prompt_logprobs" or the sampler with its flags, e.g.
        "sample[random+penalties+logprobs]"."""
        if self.variant is None:
            return self.kind
        v = self.variant
        flags = ["random" if v.do_sample else "greedy"] + [
            f for f, on in (("penalties", v.penalties), ("logprobs", v.logprobs)) if on]
        return f"{self.kind}[{'+'.join(flags)}]"
