"""vLLM's block-aligned rule for a hybrid's prefix cache (`mamba_cache_mode="align"`),
simulated on hybrid_prefix_cache's token sequences, and the block B it would pick for a
cache plan's sizes: this run's model and Qwen3.6-27B's (from the planner's JSON)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any

VLLM_ALIGN = 16                     # vLLM rounds B up to its attention kernel's block
PLAN_27B = ["--model", "qwen3.6-27b", "--mesh", "1x8", "--hbm", "96GiB"]


def simulate_align(rounds: list[list[tuple[list[int], list[int]]]], block: int) -> dict[str, Any]:
    """Hits under "state only at multiples of `block`", unlimited cache, the requests
    in the order they were sent: a request's hit is its longest cached B-multiple prefix
    of at most len(prompt) - 1 tokens; then each B-multiple prefix of its prompt +
    output[:-1] (the tokens whose KV was computed) is cached. A request sent together
    with others sees theirs too: the rule's best case."""
    cached: set[tuple[int, ...]] = set()
    hits, given = [], 0
    for prompt, output in (x for rnd in rounds for x in rnd):
        n = (len(prompt) - 1) // block * block
        while n and tuple(prompt[:n]) not in cached:
            n -= block
        hits.append(n)
        given += len(prompt)
        seq = prompt + output[:-1]
        for n in range(block, len(seq) + 1, block):
            cached.add(tuple(seq[:n]))
    return {"block": block, "hit_rate": sum(hits) / given, "cached_tokens": sum(hits),
            "hits_each": hits}


def align_blocks(plan: dict[str, Any], page_size: int) -> dict[str, Any]:
    """vLLM's block for a cache plan's sizes: per layer (as vLLM sizes it) and over all
    layers (the plan's state per sequence / KV bytes per token)."""
    kv_token = plan["bytes_per_page"] / page_size             # every attention layer
    state = plan["bytes_per_state_slot"]                        # every DeltaNet layer
    per_layer = (state / plan["num_state_layers"]) / (kv_token / plan["num_kv_layers"])
    all_layers = state / kv_token

    def up(x: float) -> int:   # vLLM: align * cdiv(state bytes, align * KV bytes/token)
        return VLLM_ALIGN * max(1, math.ceil(x / VLLM_ALIGN))
    return {"kv_bytes_per_token": kv_token, "state_bytes_per_seq": state,
            "tokens_per_state_per_layer": per_layer, "tokens_per_state_all_layers": all_layers,
            "block_per_layer": up(per_layer), "block_all_layers": up(all_layers)}


def plan_27b() -> dict[str, Any] | None:
    """Qwen3.6-27B's cache figures from the planner's JSON (None if it cannot run)."""
    try:
        out = subprocess.run([sys.executable, "-m", "jaxserve.plan", *PLAN_27B, "--json"],
                             capture_output=True, text=True, timeout=300, check=True,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
        doc = json.loads(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        print(f"WARNING: jaxserve.plan for Qwen3.6-27B failed: {e}", file=sys.stderr)
        return None
    cache = doc["cache"]
    return {"command": "python -m jaxserve.plan " + " ".join(PLAN_27B),
            "state_layout": doc.get("state_layout"),
            "kv_bytes_per_token_per_device": doc.get("kv_bytes_per_token_per_device"),
            "state_bytes_per_seq_per_device": doc.get("state_bytes_per_seq_per_device"),
            "num_snapshot_slots": cache.get("num_snapshot_slots"),
            "num_kv_layers": cache["num_kv_layers"], "num_state_layers": cache["num_state_layers"],
            **align_blocks(cache, cache["page_size"])}

