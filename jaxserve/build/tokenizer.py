"""The engine's tokenizer, loaded in a background thread while the rest is built, and the
ids that end a sequence."""
from __future__ import annotations

import json
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from models.config import ModelConfig

logger = logging.getLogger("jaxserve")


def start_loading_tokenizer(path: str) -> Future:
    """Importing transformers takes ~2 s of a 2-core CPU start: loading in a thread
    overlaps the mesh, the model, its weights and the compilation; `.result()` awaits
    it once they are done (None: no tokenizer at `path`)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
    loaded = pool.submit(load_tokenizer, path)
    pool.shutdown(wait=False)
    return loaded


def load_tokenizer(path: str) -> Any:
    # (transformers imported here: only the engine's tokenizer thread pays for it)
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        logger.warning("no tokenizer at %s (%s): prompts must be token ids and outputs "
                       "carry no text", path, e)
        return None


def eos_token_ids(tokenizer: Any, mc: ModelConfig, model_dir: str) -> tuple[int, ...]:
    """Every id that ends a sequence (as vLLM): the tokenizer's eos first, then the
    config's and generation_config.json's (Gemma 4: <eos> and <turn|>; Llama 3.1:
    <|eot_id|> and <|eom_id|>)."""
    ids = [tokenizer.eos_token_id] if tokenizer is not None and \
        tokenizer.eos_token_id is not None else []
    ids += mc.eos_token_ids
    gen = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen):
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
        ids += [eos] if isinstance(eos, int) else list(eos or ())
    return tuple(dict.fromkeys(int(i) for i in ids))
