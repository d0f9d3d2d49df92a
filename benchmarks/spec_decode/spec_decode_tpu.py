"""Speculative decoding's programs compiled for a TPU by libtpu on this CPU host, with a
check that none copies a whole cache.

    python -m benchmarks.spec_decode.spec_decode_tpu [--model qwen3.6-27b] [--mesh 1x8] \\
        [--target tpu-v6e] [--speculative-config '{"method": "mtp", ...}'] \\
        [--max-model-len 4096] [--kv-cache-memory-bytes 12GiB] [--output FILE.json]

The engine is built as `python -m jaxserve.plan --compile` builds it (abstract weights,
caches described only, the model drafter too: jaxserve/planning/plan_compile.py), and the
forward and the drafter's program (catch-up and k draft steps) are compiled at the
smallest token bucket and the widest page table. The sampler is the one the plan
compiles, at max_num_seqs x (1 + k) rows. For each compiled program the HLO is searched
for `copy` instructions whose result has the per-device shape of a cache array (the
target's KV, recurrent state, the drafter's KV): a donated cache updated in place has
none. Prints one line per program and cache array.
"""
from __future__ import annotations

import argparse
import json
import re
import time

import jax

from jaxserve.config import EngineConfig
from jaxserve.checkpoints.model_names import load_model_config
from jaxserve.planning.plan_compile import build_abstract_engine
from jaxserve.runner.programs import DRAFT, FORWARD, SAMPLE
from sharding import replica_meshes
from sharding.tpu_targets import abstract_tpu_mesh, tpu_target

_DTYPE = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "int8": "s8"}


def _hlo_shape(x) -> str:
    shape = x.sharding.shard_shape(x.shape)
    name = jax.numpy.dtype(x.dtype).name
    return f"{_DTYPE.get(name, name)}[{','.join(map(str, shape))}]"


def whole_copies(hlo: str, shape: str) -> list[str]:
    """copy instructions in HBM (not a VMEM prefetch, memory space S(..)) whose result has
    `shape`."""
    out = []
    for line in hlo.splitlines():
        if not re.search(r"\s(copy|copy-start)\(", line):
            continue
        result = line.split("=", 1)[1].split(" copy")[0]
        if shape in result and "S(" not in result:
            out.append(line.strip()[:160])
    return out


def run(model: str, mesh: str, target: str, spec: dict, max_model_len: int,
        kv_bytes: int | None) -> list[dict]:
    cfg = EngineConfig(model=model, mesh=mesh, load_format="dummy", compilation_cache_dir=None,
                       max_model_len=max_model_len, kv_cache_memory_bytes=kv_bytes,
                       speculative_config=spec).for_platform("tpu")
    replica = replica_meshes(abstract_tpu_mesh(target, mesh))[0]
    eng = build_abstract_engine(cfg, load_model_config(model), replica,
                                tpu_target(target).usable_hbm_bytes)
    runner = eng.runner
    caches = {k: _hlo_shape(v) for k, v in runner.kv_caches.items()}
    if runner.drafter is not None:
        caches.update({"drafter_" + k: _hlo_shape(v) for k, v in runner.drafter.caches.items()})
    widest, smallest = runner.batch.page_buckets[-1], runner.token_buckets[0]
    picked = [p for p in eng.programs if p.kind in (FORWARD, DRAFT)
              and p.tokens == smallest and p.pages == widest]
    picked += [p for p in eng.programs if p.kind == SAMPLE and p.rows == max(
        q.rows for q in eng.programs if q.kind == SAMPLE) and p.mode == "greedy"]
    results = []
    for prog in picked:
        t0 = time.perf_counter()
        compiled = runner.lower(prog).compile()
        seconds = time.perf_counter() - t0
        hlo = compiled.as_text()
        ma = compiled.memory_analysis()
        copies = {name: len(whole_copies(hlo, shape)) for name, shape in caches.items()}
        results.append(dict(program=prog.name, tokens=prog.tokens, rows=prog.rows,
                            compile_seconds=round(seconds, 1),
                            temp_bytes=ma.temp_size_in_bytes, whole_cache_copies=copies))
        print(f"{prog.name:18} t={prog.tokens} r={prog.rows}: compiled in {seconds:.1f} s, "
              f"temp {ma.temp_size_in_bytes / 2**20:.1f} MiB, whole-cache copies {copies}")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3.6-27b")
    ap.add_argument("--mesh", default="1x8")
    ap.add_argument("--target", default="tpu-v6e")
    ap.add_argument("--speculative-config",
                    default='{"method": "mtp", "num_speculative_tokens": 2}')
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-memory-bytes", type=float, default=12 * 2**30)
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    results = run(a.model, a.mesh, a.target, json.loads(a.speculative_config),
                  a.max_model_len, int(a.kv_cache_memory_bytes))
    if a.output:
        with open(a.output, "w") as f:
            json.dump(dict(model=a.model, mesh=a.mesh, target=a.target,
                           speculative_config=json.loads(a.speculative_config),
                           max_model_len=a.max_model_len, programs=results), f, indent=2)


if __name__ == "__main__":
    main()
