"""The offline worker's workload file and its output check (`vllm_cpu_run.py`), apart from
the worker: the worker imports vLLM inside its own venv, and the tests read these without
it. Only the standard library: the vLLM venv has no jax.
"""
from __future__ import annotations

import json
from typing import Any


def read_workload(path: str) -> list[dict[str, Any]]:
    """[{"prompt_token_ids": [...], "max_tokens": n}, ...]"""
    with open(path, encoding="utf-8") as f:
        items = json.load(f)["items"]
    return [{"prompt_token_ids": list(it["prompt_token_ids"]), "max_tokens": int(it["max_tokens"])}
            for it in items]


def check_lengths(outputs: list[list[int]], items: list[dict[str, Any]], system: str) -> None:
    for i, (out, it) in enumerate(zip(outputs, items)):
        if len(out) != it["max_tokens"]:
            raise RuntimeError(f"{system}: request {i} produced {len(out)} tokens, "
                               f"wanted {it['max_tokens']}")
