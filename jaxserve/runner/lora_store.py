"""The served model's LoRA adapters: read from disk and fitted to the model once
(models/lora: PEFT files -> each target's A and B in the model's layout), kept on the
host (at most max_cpu_loras, least recently used dropped), and turned into one device
slot's rows when the scheduler gives an adapter a slot (SchedulerOutput.lora_loads).

The front door checks an adapter here before its request is admitted (check: every
refusal names its cause); the runner's load reads the same cache. Thread-safe: the
server checks adapters from worker threads while the engine thread loads them."""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve.core.lora_slots import AdapterCache
from jaxserve.lora_request import LoRARequest
from models.lora.adapter import load_peft_adapter
from models.lora.ops import SPLIT_IN, SPLIT_OUT
from models.lora.slots import init_stacks, slot_weights, stack_shapes, stack_shardings
from models.lora.targets import LoRATarget, adapter_weights, lora_targets


@dataclass(frozen=True)
class LoRAConfig:
    """The runner's LoRA settings: max_loras device slots (slot 0, no adapter, besides),
    padded to max_rank, in dtype on the device; max_cpu_loras adapters on the host."""
    max_loras: int
    max_rank: int
    max_cpu_loras: int
    dtype: Any


def served_name(model: str) -> str:
    """The served model's name as an adapter's base_model_name_or_path would give it: a
    Hugging Face cache snapshot (.../models--org--name/snapshots/<rev>) is org/name, any
    other path is itself (targets.adapter_weights compares last path components)."""
    m = re.search(r"models--([^/]+)--([^/]+)/snapshots/", model)
    return f"{m.group(1)}/{m.group(2)}" if m else str(PurePath(model))


@dataclass(frozen=True)
class _Fitted:
    """One adapter fitted to the model: target name -> (A [in, r], B [r, out]), scaling."""
    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    scaling: float


class LoRAStore:
    """model: the model as it runs (its Einsum kernels are the targets); rules: the
    layout's logical axis -> mesh axis table (how each target is split); base_model:
    the served model's path or name (an adapter trained on another is refused);
    kv_head_repeat: how often the model stores each KV head (sharding.kv_head_repeats)."""

    def __init__(self, config: LoRAConfig, model: Any, rules: dict, base_model: str,
                 kv_head_repeat: dict[str, int] | int = 1):
        self.config = config
        self.targets: dict[str, LoRATarget] = lora_targets(model, model.config, rules,
                                                           kv_head_repeat)
        self._model_config = model.config
        self._base_model = served_name(base_model)
        self._cache: AdapterCache[LoRARequest, _Fitted] = AdapterCache(config.max_cpu_loras,
                                                                       self._fit)
        self._lock = threading.Lock()
        self._known: dict[int, LoRARequest] = {}   # lora_int_id -> the adapter it names
        self._stacks = None   # allocated ahead of the runner (allocate)

    def _fit(self, req: LoRARequest) -> _Fitted:
        adapter = load_peft_adapter(req.lora_path)
        weights = adapter_weights(adapter, self.targets, self._model_config,
                                  max_rank=self.config.max_rank, base_model=self._base_model)
        return _Fitted(weights, adapter.scaling)

    def check(self, req: LoRARequest) -> None:
        """ValueError naming the cause unless the engine can serve `req`: its id names
        no other adapter, its files are a PEFT LoRA adapter of this model within
        max_rank. A checked adapter stays cached (the first step using it reads it)."""
        with self._lock:
            known = self._known.get(req.lora_int_id)
            if known is not None and (known.lora_name, known.lora_path) != \
                    (req.lora_name, req.lora_path):
                raise ValueError(f"lora_int_id {req.lora_int_id} is adapter "
                                 f"{known.lora_name!r} ({known.lora_path!r}), not "
                                 f"{req.lora_name!r} ({req.lora_path[:200]!r}): one id per "
                                 f"adapter")
            self._cache.get(req)
            self._known[req.lora_int_id] = req

    def forget(self, lora_int_id: int) -> None:
        """An unloaded adapter: its id may name another one from now on."""
        with self._lock:
            req = self._known.pop(lora_int_id, None)
            if req is not None:
                self._cache.discard(req)

    def slot_rows(self, req: LoRARequest) -> dict:
        """One slot's rows of every stack for `req` (host numpy, slots.slot_weights)."""
        with self._lock:
            fitted = self._cache.get(req)
        return slot_weights(fitted.weights, fitted.scaling, self.targets,
                            self.config.max_rank, np.float32)

    def empty_slot_rows(self) -> dict:
        """A slot's rows with no adapter (zeros): warmup writes it into slot 0."""
        return slot_weights({}, 0.0, self.targets, self.config.max_rank, np.float32)

    def allocate(self, mesh: Mesh) -> None:
        """Allocates the device stacks now (before the KV cache is sized from the memory
        left: build/parts.py); the runner takes them (init_stacks)."""
        self._stacks = self.init_stacks(mesh)

    def init_stacks(self, mesh: Mesh) -> dict:
        """Every slot empty, on `mesh` as stack_shardings places them (those allocate()
        made, the first time)."""
        stacks, self._stacks = self._stacks, None
        if stacks is not None:
            return stacks
        c = self.config
        return init_stacks(self.targets, c.max_loras, c.max_rank, c.dtype,
                           stack_shardings(self.targets, mesh))

    def bytes_per_device(self, m: int) -> int:
        """The stacks' bytes on each device of a model axis of m (the planner's)."""
        return stack_bytes_per_device(self.targets, self.config, m)

    def abstract_stacks(self, mesh: Mesh) -> dict:
        """The stacks as ShapeDtypeStructs with their shardings (an abstract runner)."""
        c = self.config
        shapes = stack_shapes(self.targets, c.max_loras, c.max_rank, c.dtype)
        return jax.tree_util.tree_map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
            stack_shardings(self.targets, mesh))

    def shardings(self, mesh: Mesh) -> dict:
        return stack_shardings(self.targets, mesh)


def stack_bytes_per_device(targets: dict[str, LoRATarget], config: LoRAConfig, m: int) -> int:
    """Bytes the stacks of `targets` take on each device of a model axis of m: A split
    on its input where the base kernel's input is, B on its output where its output is
    (slots.stack_shardings), the rest and the scales on every device."""
    item = np.dtype(config.dtype).itemsize
    s, r = config.max_loras + 1, config.max_rank
    total = 4 * s   # the scales, float32
    for t in targets.values():
        total += s * r * item * (t.in_dim // (m if t.split == SPLIT_IN else 1)
                                 + t.out_dim // (m if t.split == SPLIT_OUT else 1))
    return total
