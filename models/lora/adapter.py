"""Read a PEFT LoRA checkpoint: adapter_config.json + adapter_model.safetensors.

Only the file format lives here (no model): the config's scaling and the tensors, by
the name of the module they adapt. PEFT saves module M's matrices as
`base_model.model.M.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]; the delta
of M's output is scaling * x @ A.T @ B.T with scaling = lora_alpha / r (rsLoRA:
lora_alpha / sqrt(r)). Which of those modules the served model has is targets.py's job.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.safetensors_io import SafeTensorsFile

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"
ALL_LINEAR = "all-linear"
# PEFT features that change what the adapter computes; refused by name unless unset.
_UNSUPPORTED = {
    "use_dora": "DoRA adapters",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "rank_pattern": "rank_pattern (per-module ranks)",
    "alpha_pattern": "alpha_pattern (per-module alphas)",
    "layer_replication": "layer_replication",
    "target_parameters": "target_parameters (LoRA on raw parameters, e.g. MoE experts)",
    "trainable_token_indices": "trainable_token_indices",
}


@dataclass(frozen=True)
class PeftAdapter:
    """One LoRA adapter as saved by PEFT. tensors: module name as the base checkpoint
    names it ("model.layers.0.self_attn.q_proj") -> (lora_A [r, in], lora_B [out, r])."""
    path: str
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str   # names, ALL_LINEAR, or a PEFT regex
    base_model: str
    tensors: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def _field(cfg: dict, name: str, kind: type | tuple[type, ...], where: str):
    value = cfg.get(name)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"LoRA adapter {where}: {CONFIG_FILE} field {name!r} is missing or "
                         f"not a number")
    return value


def read_adapter_config(path: str | Path) -> dict:
    path = Path(path)
    where = repr(str(path))
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise ValueError(f"LoRA adapter {where}: no {CONFIG_FILE} (not a PEFT adapter directory)")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {where}: cannot read {CONFIG_FILE}: {type(e).__name__}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {where}: {CONFIG_FILE} is not a JSON object")
    return cfg


def load_peft_adapter(path: str | Path) -> PeftAdapter:
    """The adapter in directory `path`; ValueError naming the cause when it is not one
    jaxserve can serve."""
    path = Path(path)
    where = repr(str(path))
    cfg = read_adapter_config(path)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {where}: peft_type {str(cfg.get('peft_type'))[:40]!r} "
                         f"is not LORA")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {where}: {what} are not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {where}: bias {str(cfg['bias'])[:20]!r} is not supported "
                         f"(only 'none')")
    rank = _field(cfg, "r", int, where)
    alpha = _field(cfg, "lora_alpha", (int, float), where)
    if rank < 1:
        raise ValueError(f"LoRA adapter {where}: r must be at least 1, got {rank}")
    targets = cfg.get("target_modules")
    if isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        targets = tuple(targets)
    elif not isinstance(targets, str):
        raise ValueError(f"LoRA adapter {where}: target_modules must be a list of names, "
                         f"'{ALL_LINEAR}' or a regex")
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"LoRA adapter {where}: no {WEIGHTS_FILE}")
    return PeftAdapter(path=str(path), rank=rank, alpha=float(alpha),
                       use_rslora=bool(cfg.get("use_rslora", False)), target_modules=targets,
                       base_model=str(cfg.get("base_model_name_or_path") or ""),
                       tensors=_read_tensors(SafeTensorsFile(weights), rank, where))


def _read_tensors(st: SafeTensorsFile, rank: int, where: str
                  ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for name in st.keys():
        if not name.startswith(_PREFIX) or not name.endswith((_A, _B)):
            raise ValueError(f"LoRA adapter {where}: unexpected tensor {name[:120]!r} (only "
                             f"lora_A / lora_B weights are supported)")
        module, which = name[len(_PREFIX):-len(_A)], name[-len(_A):]
        pairs.setdefault(module, {})[which] = st.get(name)
    out = {}
    for module, pair in pairs.items():
        if set(pair) != {_A, _B}:
            raise ValueError(f"LoRA adapter {where}: module {module[:120]!r} has only "
                             f"{next(iter(pair))[1:]}")
        a, b = pair[_A], pair[_B]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"LoRA adapter {where}: module {module[:120]!r} has lora_A "
                             f"{a.shape} and lora_B {b.shape}; rank r={rank} needs [r, in] "
                             f"and [out, r]")
        out[module] = (a, b)
    if not out:
        raise ValueError(f"LoRA adapter {where}: {WEIGHTS_FILE} holds no LoRA weights")
    return out
