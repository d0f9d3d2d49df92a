"""The shape of one vLLM setting jaxserve has no knob for (Setting: how the flag spells a
value, the values true of jaxserve, why any other is refused) and the reasons the
tables share (vllm_engine.py, vllm_compat.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

# Kinds of flag (how the command line spells a value): an on/off flag (--enable-x and
# --disable-x, or --x and --no-x), a flag that is on when given (store_true), one value
# read by int / float / str / JSON, several values, or a value that may be left out.
BOOL, SWITCH, INT, FLOAT, STR, JSON, LIST, OPTIONAL = (
    "bool", "switch", "int", "float", "str", "json", "list", "optional")


class _Any:
    """Every value is true of jaxserve (a tuning knob of a part jaxserve does not have)."""

    def __repr__(self) -> str:
        return "any value"


ANY = _Any()


@dataclass(frozen=True)
class Setting:
    kind: str
    # The values that are true of jaxserve: a tuple, ANY, or a test of the value.
    accepted: tuple[Any, ...] | _Any | Callable[[Any], bool]
    why: str
    short: tuple[str, ...] = ()   # vLLM's short spellings (-asc, -dpn, ...)
    sample: Any = None            # an accepted value, where `accepted` is a test

    def holds(self, value: Any) -> bool:
        if self.accepted is ANY:
            return True
        if callable(self.accepted):
            return bool(self.accepted(value))
        return any(_same(value, a) for a in self.accepted)

    @property
    def taken(self) -> Any:
        """A value jaxserve takes, for tests (None where it takes none)."""
        if self.accepted is ANY or callable(self.accepted) or not self.accepted:
            return self.sample
        return self.accepted[0]

    def accepted_text(self) -> str:
        if self.accepted is ANY or callable(self.accepted):
            return "any value" if self.accepted is ANY else f"e.g. {self.sample!r}"
        if not self.accepted:
            return "no value"
        return " or ".join("off" if a is False else "on" if a is True else
                           "unset" if a is None else repr(a) for a in self.accepted)


def _same(value: Any, accepted: Any) -> bool:
    """value == accepted, but a bool only equals a bool (0 is not "off")."""
    if isinstance(value, bool) or isinstance(accepted, bool):
        return value is accepted
    return value == accepted


def parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"not JSON: {text!r}") from None


def guidance_backend(value: Any) -> bool:
    """--structured-outputs-config: unset, or the backend jaxserve has (llguidance)."""
    return not value or (isinstance(value, dict) and set(value) <= {"backend"}
                         and value.get("backend") in ("auto", "guidance"))


# Reasons shared by many settings.
WHY_CUDA = ("jaxserve picks its own kernels (XLA and its Pallas kernels; the choice is logged "
         "at start-up): vLLM's CUDA kernel backends have no meaning here")
WHY_GRAPHS = "no CUDA graphs: XLA compiles one program per batch bucket at warmup"
WHY_COMPILE = "XLA compiles every program; vLLM's torch.compile settings have no meaning here"
WHY_MULTI = ("jaxserve runs one process per host, joined by jax.distributed: give "
          "--coordinator-address, --num-processes and --process-id")
WHY_DP = ("data parallelism is -dp D replicas behind one front door in the same processes; "
       "there are no separate data-parallel ranks, ports or load balancers")
WHY_CP = "no context parallelism: shard with --tensor-parallel-size (--mesh 1xM)"
WHY_EP = "no expert-parallel load balancing, micro-batching or all-to-all kernels"
WHY_TEXT = ("jaxserve takes images (not video or audio) with its own settings only: "
            "--limit-mm-per-prompt, --allowed-local-media-path, --mm-processor-kwargs, "
            "--language-model-only")
WHY_LORA = ("not a part of jaxserve's LoRA (docs/LORA.md: --enable-lora, --lora-modules, "
            "--max-loras, --max-lora-rank, --max-cpu-loras, --lora-dtype)")
WHY_OFFLOAD = "weights and KV pages stay in device memory; nothing is offloaded to the host"
WHY_SLEEP = "sleep mode is not implemented"
WHY_POOL = ("jaxserve generates text; pooling (embedding, classification, scoring) is not "
            "implemented")
WHY_TRACE = "not implemented: the metrics are /metrics' (Prometheus) and the stats log line"
WHY_DISAGG = "disaggregated serving (KV / encoder-cache transfer, KV events) is not implemented"
WHY_HASH = ("prefix-cache pages are keyed by Python's hash of their token ids in one process; "
         "there is no choice of hash")
WHY_MAMBA = ("the hybrids' state is jaxserve's: the conv state in the model dtype, the delta "
          "rule in float32, prefix-cache snapshots at page boundaries")
WHY_PLUGIN = "no plugins are loaded; jaxserve runs only its own code"
WHY_REMOTE = "jaxserve runs only its own model code; checkpoint code is never run"
WHY_LOADER = ("weights are read by jaxserve's safetensors loader (or a converted checkpoint); "
           "vLLM's loader options have no meaning here")
WHY_NOT = "not implemented"
