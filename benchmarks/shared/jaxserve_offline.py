"""jaxserve offline: `LLM.generate` on token-id prompts, greedy, eos ignored.

Start-up (weights, KV cache, warmup compilation) and one short warmup request are
outside the timing; the number of compilations during the timed run is recorded,
since a compile there would be counted as serving time. With repeats the workload
runs again on the same engine, its prefix cache reset first (else the repeat would
find every prompt cached), and the median time counts.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.shared.common import Item


@dataclass
class JaxRun:
    seconds: float = 0.0                  # the median of seconds_each
    seconds_each: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    startup_s: float = 0.0
    compiles_during_run: int = 0
    engine_args: dict[str, Any] = field(default_factory=dict)


def split_cpu(num_devices: int | None) -> None:
    """Splits the host CPU into num_devices XLA devices (jax_num_cpu_devices) for a
    --mesh over them. XLA CPU runs the small ops of the attention loop on one thread
    at a time; the shards of a mesh run concurrently, so each core gets its share of
    the kv heads. Must run before JAX starts its backends (jax raises otherwise)."""
    if num_devices:
        import jax
        jax.config.update("jax_num_cpu_devices", num_devices)


def make_llm(path: str, **engine_args: Any) -> tuple[Any, float]:
    from jaxserve import LLM
    t0 = time.perf_counter()
    llm = LLM(model=path, **engine_args)
    return llm, time.perf_counter() - t0


def greedy(max_tokens: int) -> Any:
    from jaxserve import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate(llm: Any, items: list[Item], progress: bool = True) -> list[list[int]]:
    prompts = [{"prompt_token_ids": it.prompt_token_ids} for it in items]
    outs = llm.generate(prompts, [greedy(it.max_tokens) for it in items], use_tqdm=progress)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    for toks, it in zip(tokens, items):
        if len(toks) != it.max_tokens:
            raise RuntimeError(f"jaxserve produced {len(toks)} tokens, wanted {it.max_tokens}")
    return tokens


def run_jaxserve(path: str, items: list[Item], progress: bool = True, repeats: int = 1,
                 **engine_args: Any) -> JaxRun:
    llm, startup = make_llm(path, **engine_args)
    generate(llm, [Item(items[0].prompt_token_ids[:8], 2)], progress=False)   # warmup
    before = llm.engine.num_compilations
    seconds, outputs = [], []
    for _ in range(repeats):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        got = generate(llm, items, progress)
        seconds.append(time.perf_counter() - t0)
        if outputs and got != outputs:
            raise RuntimeError("a repeat of the workload gave other greedy tokens")
        outputs = got
    return JaxRun(statistics.median(seconds), seconds, outputs, startup,
                  llm.engine.num_compilations - before, engine_args)
