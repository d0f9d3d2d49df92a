"""The served model's LoRA targets, and an adapter's matrices in their layout.

A target is one linear projection inside a decoder layer: an Einsum kernel of the
model (models/layers.py), named as the base checkpoint names its module
("layers.0.self_attn.q_proj", from models/weights.hf_names: one owner of the names).
Every family's projections come out of the one rule: attention q/k/v/o and the MLP's
gate/up/down (Llama 3, Qwen3, Gemma 4 and the shared expert of the MoE models), the
Qwen3.5/3.6 DeltaNet's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a / out_proj.
Not targets: the routed experts (stacked, not Einsum kernels: refused by name), the
DeltaNet's depthwise conv1d, the embeddings and lm_head.

With fewer KV heads than the model axis has devices, the loader stores each KV head
repeated (models/weights.py's kv_head_repeat): a k/v projection's B is repeated the
same way, so the adapter's delta lands on every copy of its head.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import PurePath

import flax.linen as nn
import numpy as np
from flax.traverse_util import flatten_dict

from models.config import ModelConfig
from models.lora.adapter import PeftAdapter
from models.lora.ops import projection_split
from models.weight_names import group_by_key_head
from models.param_tree import KVHeadRepeat, contracted_axes, kv_repeat_axes
from models.weights import abstract_params, hf_names, param_logical_axes
from sharding.rules import RULES

# Where a checkpoint keeps the decoder (models/weights.py reads the same two).
_DECODER_PREFIXES = ("model.language_model.", "model.")
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class LoRATarget:
    """One projection an adapter may adapt. in_dim / out_dim: its kernel's contracted and
    output axes, each merged (the op's x [T, in_dim] -> [T, out_dim]). split: how the
    base kernel is split on the model axis (models/lora/ops.py), the delta is split so."""
    name: str       # "layers.3.self_attn.q_proj"
    module: str     # "q_proj"
    layer: int
    in_dim: int
    out_dim: int
    split: str | None
    regroup_qkv: bool = False   # DeltaNet in_proj_qkv: output channels regrouped per key head
    # KV heads stored repeated (a k/v projection on a model axis wider than its heads): each
    # head's kv_inner output channels appear kv_repeat times in a row; out_dim counts them all.
    kv_repeat: int = 1
    kv_inner: int = 1
    # Where its stacks sit (models/lora/slots.py): the Einsum module's path in the params
    # ("layers_3", "self_attn", "q_proj"), and its place on the path's stacked layer axes
    # (a scanned model's block: (3,); () unscanned).
    path: tuple[str, ...] = ()
    index: tuple[int, ...] = ()


def lora_targets(model: nn.Module, cfg: ModelConfig, rules: dict | None = None,
                 kv_head_repeat: KVHeadRepeat = 1) -> dict[str, LoRATarget]:
    """name -> target, for every linear projection of the decoder layers, in layer order.
    rules: logical axis -> mesh axis (sharding/rules.py's table by default);
    kv_head_repeat: how often `model` stores each of the checkpoint's KV heads
    (sharding.kv_head_repeats; the loader's)."""
    rules = RULES if rules is None else rules
    shapes = flatten_dict(abstract_params(model))
    axes = flatten_dict(param_logical_axes(model))
    repeats = kv_repeat_axes(model, kv_head_repeat)
    out: dict[str, LoRATarget] = {}
    for path, sds in shapes.items():
        if path[-1] != "kernel" or path[-2] == "conv1d" or not path[0].startswith("layers"):
            continue
        names = hf_names(path, cfg, prefix="")
        spec = tuple(axes[path])[names.ndim:]      # without a scanned model's layer axis
        inner = sds.shape[names.ndim:]
        n = contracted_axes(spec)
        kv_repeat, kv_inner = 1, 1
        if path in repeats:
            axis, kv_repeat = repeats[path]
            axis -= names.ndim
            if axis != n:   # the heads axis must lead the outputs for B's repeat below
                raise ValueError(f"LoRA on {path}: its KV heads are not its first output axis")
            kv_inner = math.prod(inner[n + 1:])
        for index, name in np.ndenumerate(names):
            module_name = name[:-len(".weight")]
            out[module_name] = LoRATarget(
                name=module_name, module=module_name.rsplit(".", 1)[1],
                layer=int(_LAYER.match(module_name).group(1)), in_dim=math.prod(inner[:n]),
                out_dim=math.prod(inner[n:]), split=projection_split(spec, n, rules),
                regroup_qkv=path[-2] == "in_proj_qkv", kv_repeat=kv_repeat, kv_inner=kv_inner,
                path=tuple(path[:-1]), index=index)
    return dict(sorted(out.items(), key=lambda kv: kv[1].layer))


def _same_model(a: str, b: str) -> bool:
    """A hub id and a local copy of it ("meta-llama/Llama-3.1-8B" vs "/models/Llama-3.1-8B")
    are the same model: compare the last path components."""
    last = lambda s: PurePath(s.rstrip("/")).name.lower()
    return last(a) == last(b)


def adapter_weights(adapter: PeftAdapter, targets: dict[str, LoRATarget], cfg: ModelConfig, *,
                    max_rank: int, base_model: str | None = None
                    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """target name -> (A [r, in_dim], B [r, out_dim]) in the stacks' layout (float32; the
    scaling is not folded in: adapter.scaling). ValueError naming the cause when the
    adapter does not fit: its rank above max_rank, a module the model lacks or does not
    adapt (experts, embeddings), matrices of another model's sizes, or a different base
    model (`base_model`: the served model's name; compared when both are known)."""
    where = repr(adapter.path)
    if adapter.rank > max_rank:
        raise ValueError(f"LoRA adapter {where}: rank {adapter.rank} is above "
                         f"--max-lora-rank {max_rank}")
    if base_model and adapter.base_model and not _same_model(base_model, adapter.base_model):
        raise ValueError(f"LoRA adapter {where} was trained on {adapter.base_model[:200]!r}, "
                         f"not on the served model {base_model[:200]!r}")
    modules = sorted({t.module for t in targets.values()})
    if isinstance(adapter.target_modules, tuple):
        # peft lists a few targets by their full names ("model.layers.0.mlp.up_proj": it
        # shortens the list to module names only past 20 of them)
        lacking = [m for m in adapter.target_modules if m.rsplit(".", 1)[-1] not in modules]
        if lacking:
            raise ValueError(f"LoRA adapter {where}: target module(s) {', '.join(lacking)[:200]} "
                             f"not in the model; its LoRA targets are {', '.join(modules)}")
    out = {}
    for module, (a, b) in adapter.tensors.items():
        name = next((module[len(p):] for p in _DECODER_PREFIXES if module.startswith(p)), module)
        if ".experts." in f".{name}.":
            raise ValueError(f"LoRA adapter {where}: LoRA on MoE experts ({name[:120]!r}) is "
                             f"not supported (attention and the shared-expert MLP are)")
        target = targets.get(name)
        if target is None:
            raise ValueError(f"LoRA adapter {where}: module {module[:120]!r} is not a LoRA "
                             f"target of the model (its targets: {', '.join(modules)} in "
                             f"layers 0-{max(t.layer for t in targets.values())})")
        out_dim = target.out_dim // target.kv_repeat   # the checkpoint's
        if a.shape[1] != target.in_dim or b.shape[0] != out_dim:
            raise ValueError(f"LoRA adapter {where}: {name} maps {a.shape[1]} -> {b.shape[0]} "
                             f"features, the model's {target.in_dim} -> {out_dim}: made "
                             f"for another base model ({adapter.base_model[:200]!r})")
        b_t = np.asarray(b, np.float32).T
        if target.kv_repeat > 1:   # each head's channels repeated, as the loader stores them
            b_t = np.repeat(b_t.reshape(b_t.shape[0], -1, target.kv_inner), target.kv_repeat,
                            axis=1).reshape(b_t.shape[0], -1)
        if target.regroup_qkv:   # the base kernel's [all q | all k | all v] regrouping
            b_t = group_by_key_head(b_t, cfg).reshape(adapter.rank, -1)
        out[name] = (np.asarray(a, np.float32), np.ascontiguousarray(b_t))
    return out


