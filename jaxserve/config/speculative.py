"""SpeculativeConfig: vLLM's `--speculative-config` / `LLM(speculative_config=...)`.

A step verifies each decoding request's proposed tokens (drafts) with one target forward:
the drafts are ordinary query tokens after the request's last token, the sampler draws a
token at every one of those positions, and the drafts are accepted while they equal what
was drawn (jaxserve/runner/spec_decode.py says why that is exact). Proposers:

- ngram: prompt lookup. The last n tokens (prompt_lookup_max down to prompt_lookup_min)
  are looked up earlier in the request's own tokens; the tokens that followed their most
  recent earlier occurrence are the drafts.
- mtp: Qwen3.5/3.6's multi-token-prediction layer (the checkpoint's mtp.* tensors,
  models/mtp.py), k greedy steps of it (jaxserve/runner/drafter.py).
- draft_model: a smaller model with the target's vocabulary (`model`), k greedy steps.

The other methods vLLM names (eagle, medusa, ...) are refused by name.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

NGRAM, MTP, DRAFT_MODEL = "ngram", "mtp", "draft_model"
METHODS = (NGRAM, MTP, DRAFT_MODEL)
# vLLM's names for the MTP of Qwen's hybrids.
METHOD_ALIASES = {"qwen3_next_mtp": MTP, "qwen3_5_mtp": MTP}
# vLLM's other methods, refused with what jaxserve does instead.
NOT_IMPLEMENTED = {
    "eagle": "EAGLE heads are not implemented; use method 'ngram'",
    "eagle3": "EAGLE-3 heads are not implemented; use method 'ngram'",
    "medusa": "Medusa heads are not implemented; use method 'ngram'",
    "mlp_speculator": "MLP speculators are not implemented; use method 'ngram'",
    "suffix": "suffix decoding is not implemented; use method 'ngram'",
}
# Most drafts per request and step: each one is a sampler row (runner/buckets.py).
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = NGRAM
    num_speculative_tokens: int = 3
    # draft_model: the draft's checkpoint (a directory, a hub id or a jaxserve alias).
    model: str | None = None
    # vLLM's: the draft runs on the target's mesh here (None, or the target's M).
    draft_tensor_parallel_size: int | None = None
    # ngram: the longest and shortest suffix looked up.
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 2
    # vLLM's: no drafts once more than this many requests run (None: always draft).
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", METHOD_ALIASES.get(self.method, self.method))
        if self.method in NOT_IMPLEMENTED:
            raise ValueError(f"speculative_config method {self.method!r}: "
                             f"{NOT_IMPLEMENTED[self.method]}")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method {self.method!r}: must be one of "
                             f"{METHODS}")
        if self.method == DRAFT_MODEL and not self.model:
            raise ValueError("speculative_config method 'draft_model' needs 'model': the "
                             "draft's checkpoint")
        if self.method == NGRAM and self.model:
            raise ValueError(f"speculative_config model={self.model!r}: method 'ngram' takes "
                             f"no model (give method 'draft_model' to draft with one)")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "disable_by_batch_size", "draft_tensor_parallel_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"speculative_config {name}={v!r}: must be an int >= 1")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens="
                             f"{self.num_speculative_tokens}: at most {MAX_SPECULATIVE_TOKENS}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min={self.prompt_lookup_min} "
                             f"> prompt_lookup_max={self.prompt_lookup_max}")

    @staticmethod
    def parse(value: Any) -> SpeculativeConfig | None:
        """From a dict (LLM), a JSON object's text (the flag), a SpeculativeConfig or None.
        Keys vLLM has that jaxserve does not take are refused by name."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(SpeculativeConfig)}
        value = dict(value)
        if value.get("model") in ("[ngram]", "ngram") and "method" not in value:
            value.pop("model")   # vLLM's older spelling of the method
            value["method"] = NGRAM
        elif value.get("model") and "method" not in value:
            value["method"] = DRAFT_MODEL   # vLLM: a model without a method drafts with it
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: {', '.join(map(repr, unknown))} not "
                             f"supported (jaxserve takes {', '.join(sorted(known))})")
        if "prompt_lookup_max" in value and "prompt_lookup_min" not in value:
            value["prompt_lookup_min"] = min(2, value["prompt_lookup_max"])
        if "prompt_lookup_min" in value and "prompt_lookup_max" not in value:
            value["prompt_lookup_max"] = max(5, value["prompt_lookup_min"])
        return SpeculativeConfig(**value)

    @property
    def num_lookahead_tokens(self) -> int:
        """Positions past a step's tokens a drafter writes KV at (the scheduler allocates
        their pages ahead): the model drafters' k steps; ngram writes none."""
        return 0 if self.method == NGRAM else self.num_speculative_tokens

    def describe(self) -> str:
        how = {NGRAM: f"n-grams of {self.prompt_lookup_min}..{self.prompt_lookup_max} tokens",
               MTP: "the checkpoint's MTP layer", DRAFT_MODEL: f"draft model {self.model}"}
        return (f"speculative decoding: {self.method}, {self.num_speculative_tokens} tokens "
                f"per step ({how[self.method]})")
