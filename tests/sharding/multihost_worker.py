"""One process of the two-process test (test_multihost.py): run as a script.

argv: checkpoint dir, output JSON path. The JAXSERVE_* env names the coordinator,
the process count and this process's id; XLA_FLAGS gives each process 2 CPU devices.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(path: str, out_path: str, prompts_json: str, max_tokens: int) -> None:
    import jax

    from jaxserve import LLM, SamplingParams
    from jaxserve.engine import multihost

    assert multihost.initialize() and jax.device_count() == 4
    llm = LLM(path, dtype="float32", mesh="1x4", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, compilation_cache_dir=None)
    if not multihost.is_leader():
        llm.engine.follow()
        return
    prompts = json.loads(prompts_json)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = llm.engine.num_compilations
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.shutdown()
    with open(out_path, "w") as f:
        json.dump({"tokens": [o.outputs[0].token_ids for o in outs],
                   "devices": jax.device_count(), "processes": jax.process_count(),
                   "compilations_after_warmup": llm.engine.num_compilations - before}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
