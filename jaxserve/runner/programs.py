"""Program: one jitted program that warmup compiles, with its bucket and arguments.

ModelRunner.warmup_programs lists them; warmup runs each (compiling it), and
`python -m jaxserve.plan --compile` lowers and compiles them for an abstract
TPU mesh instead, so both see the same programs at the same shapes.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FORWARD, PROMPT_LOGPROBS, SAMPLE = "forward", "prompt_logprobs", "sample"
# Speculative decoding's model drafter: its catch-up and k draft steps (runner/drafter.py).
DRAFT = "draft"
# LoRA: an adapter's weights written into its device slot (models/lora/slots.py).
LORA_SLOT = "lora_slot"
# Images: the vision tower on one bucket, into the encoder cache (runner/image_encoder.py).
ENCODE = "encode"
# The sampler's programs: greedy rows only; any rows; any rows with penalties.
GREEDY, RANDOM, PENALTIES = "greedy", "random", "penalties"


@dataclass(frozen=True)
class Program:
    kind: str                             # FORWARD, PROMPT_LOGPROBS, SAMPLE, DRAFT, LORA_SLOT
                                          # or ENCODE
    fn: Any                               # the jitted function (jax.jit(...))
    args: Callable[[], tuple]             # its arguments, built when called: the forward
                                          # takes the KV caches of that moment (donated)
    tokens: int | None = None             # token bucket (forward, prompt logprobs; encode:
                                          # its patch or image bucket)
    rows: int | None = None               # row bucket (sampler)
    pages: int | None = None              # page-table width (forward)
    mode: str | None = None               # sampler: GREEDY, RANDOM or PENALTIES

    @property
    def name(self) -> str:
        """"forward", "prompt_logprobs", "sample[greedy]", "sample" or "sample[penalties]"."""
        return self.kind if self.mode in (None, RANDOM) else f"{self.kind}[{self.mode}]"
