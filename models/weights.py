"""Load HF safetensors checkpoints (or dummy weights) into the model's param tree.

Which tensor feeds which param, and in what layout, is models/weight_names.py's; the
expected tree models/param_tree.py's. Each device gets only its slice of each tensor,
read and cast from the file's mmap by a few threads (models/param_placement.py): the
host never holds more than a few tensors.
"""
from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from models.config import ModelConfig, WeightQuant
from models.layers import KERNEL_OUT_IN
from models.param_placement import Index, ParamTask, Progress, Reader, place_params
# The parameter tree and the name mapping, re-exported: callers import them from here.
from models.param_tree import (COMPUTED_LEAVES, KVHeadRepeat, Path_, abstract_params,
                               contracted_axes, dummy_inputs, kv_repeat_axes, param_bytes,
                               param_logical_axes, placed_abstract_params, quantized_leaves,
                               stacked_axes)
from models.quant_weights import (block_scale_name, dequantize_block, quantize_layout, scale_leaf,
                                  spread_block_scale)
from models.quantization import quantize, storage_dtype
from models.registry import resolve_dtype
from models.safetensors_io import SafeTensorsFile
from models.weight_names import (IGNORED_SUFFIXES, SKIPPED_PREFIXES, VL_TEXT_PREFIX, hf_names,
                                 to_param_layout)

__all__ = ["KVHeadRepeat", "abstract_params", "checkpoint_tasks", "dummy_inputs", "hf_names",
           "load_params", "param_bytes", "param_logical_axes", "placed_abstract_params",
           "is_projection_kernel", "quantized_leaves", "store_kernels_out_in", "untie_lm_head",
           "widen_params"]

logger = logging.getLogger("jaxserve")

# Dummy weights: these are ones (norm weights; Gemma 4's layer and expert scales).
_ONES_LEAVES = ("scale", "layer_scalar", "per_expert_scale")

def _describe(names: set[str], limit: int = 5) -> str:
    first = sorted(names)[:limit]
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return ", ".join(first) + more


# ---- loading --------------------------------------------------------------------

def _open_checkpoint(model_dir: Path) -> dict[str, SafeTensorsFile]:
    """tensor name -> the file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {str(model_dir)!r}")
    where: dict[str, SafeTensorsFile] = {}
    for fname in files:
        if not (model_dir / fname).is_file():
            raise ValueError(f"checkpoint shard {fname!r} listed in the index is missing from {str(model_dir)!r}")
        st = SafeTensorsFile(model_dir / fname)
        for name in st.keys():
            if name in where:
                raise ValueError(f"tensor {name!r} appears in both {where[name].path.name} and {fname}")
            where[name] = st
    return where


def _sharding_for(shardings: dict[Path_, Any], path: Path_) -> Any:
    return shardings.get(path) if shardings else None



def load_params(model_dir: str | Path | None, cfg: ModelConfig, model: nn.Module, dtype: Any = "auto", *,
                load_format: str = "auto", seed: int = 0, shardings: Any = None,
                kv_head_repeat: KVHeadRepeat = 1, workers: int | None = None,
                progress: Progress | None = None, prefix: str | None = None) -> dict:
    """Params for `model` from `model_dir`, cast to `dtype` ("auto" = checkpoint dtype).

    shardings: optional tree (same structure as the params) of jax.sharding.Sharding
    per param; None = the default device. Each device reads, casts and receives only
    its own slice of each tensor (models/param_placement.py).
    kv_head_repeat: `model` has this many times the checkpoint's KV heads (KV heads
    replicated for tensor parallelism, sharding.kv_head_layout); each KV head's
    weights are repeated that often, consecutively (a dict: per KV-heads logical axis). load_format "dummy" needs no files.
    workers: threads loading tensors (None: param_placement.default_workers()).
    progress: optional hook `progress(bytes_done, bytes_total)` over the checkpoint
    bytes to read, called from the calling thread: (0, total) before the first read,
    then after each param, the last call with bytes_done == bytes_total (for a
    loading-progress report, e.g. on /health). Not called for dummy weights.
    prefix: load a part of the checkpoint (the MTP layer: "mtp.") whose tensors are named
    under it; the checkpoint's other tensors are left alone.
    """
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {load_format!r}")
    dtype = resolve_dtype(dtype, cfg)
    if load_format == "dummy":
        expected = flatten_dict(abstract_params(model))
        shard_flat = flatten_dict(shardings) if shardings is not None else {}
        return _dummy_params(expected, dtype, seed, shard_flat, kv_repeat_axes(model, kv_head_repeat),
                             model.config.weight_quant, stacked_axes(model))
    tasks = checkpoint_tasks(model_dir, cfg, model, dtype, shardings=shardings,
                             kv_head_repeat=kv_head_repeat, prefix=prefix)
    return unflatten_dict(place_params(tasks, workers=workers, progress=progress,
                                       what=Path(str(model_dir)).name))


def checkpoint_tasks(model_dir: str | Path | None, cfg: ModelConfig, model: nn.Module, dtype: Any, *,
                     shardings: Any = None, kv_head_repeat: KVHeadRepeat = 1,
                     prefix: str | None = None) -> list[ParamTask]:
    """One ParamTask per param of `model` (see load_params), after checking that the
    checkpoint holds exactly the tensors the model needs. Nothing is read yet."""
    if model_dir is None or not Path(model_dir).is_dir():
        raise ValueError(f"model directory {str(model_dir)!r} does not exist")
    expected = flatten_dict(abstract_params(model))
    shard_flat = flatten_dict(shardings) if shardings is not None else {}
    repeat_axes = kv_repeat_axes(model, kv_head_repeat)
    where = _open_checkpoint(Path(model_dir))

    part = prefix is not None   # a part of the checkpoint (load_params' prefix)
    if not part:
        prefix = VL_TEXT_PREFIX if any(n.startswith(VL_TEXT_PREFIX) for n in where) \
            else "model."
    computed = {path for path in expected if path[-1] in COMPUTED_LEAVES}
    sources = {path: hf_names(path, cfg, prefix) for path in expected if path not in computed}
    wanted = {n for names in sources.values() for n in names.flat}
    block_scales = {block_scale_name(n) for n in wanted} & where.keys()
    if block_scales and cfg.weight_quant is None:
        raise ValueError(f"checkpoint {str(model_dir)!r} has fp8 block scales "
                         f"({_describe(block_scales)}) but its config.json has no "
                         f"quantization_config saying their block size")
    missing = wanted - where.keys()
    skipped = {n for n in where if not n.startswith(prefix)} if part else \
        {n for n in where if n.startswith(SKIPPED_PREFIXES)}
    if skipped and not part:
        logger.info("serving the text model: skipping %d vision / MTP tensors (%s)", len(skipped),
                    ", ".join(sorted({p for n in skipped for p in SKIPPED_PREFIXES if n.startswith(p)})))
    ignored = skipped | {n for n in where if n.endswith(IGNORED_SUFFIXES)}
    if cfg.tie_word_embeddings and not part:
        ignored.add("lm_head.weight")   # some tied checkpoints still store a copy
        ignored.add(block_scale_name("lm_head.weight"))
    unexpected = where.keys() - wanted - block_scales - ignored
    if missing:
        raise ValueError(f"checkpoint {str(model_dir)!r} lacks {len(missing)} tensors: {_describe(missing)}")
    if unexpected:
        raise ValueError(f"checkpoint {str(model_dir)!r} has {len(unexpected)} unexpected tensors: "
                         f"{_describe(unexpected)}")

    np_dtype = np.dtype(dtype)
    quant = quantized_leaves(expected)
    model_quant = model.config.weight_quant
    stacked = stacked_axes(model) if quant else {}

    def task(path: Path_, sds: Any) -> ParamTask:
        if path in computed:
            ones = np.ones(sds.shape, np.dtype(sds.dtype))
            return ParamTask(path=path, shape=sds.shape, dtype=np.dtype(sds.dtype),
                             sharding=_sharding_for(shard_flat, path), nbytes=0, num_tensors=0,
                             open=lambda: lambda index: ones[index])
        role, kernel_path = quant.get(path, ("param", path))
        names = sources[path]
        if role != "scale":
            nbytes = sum(where[n].nbytes(n) for n in names.flat)
        else:   # the scale: its own tensor when the checkpoint has one, else nothing new read
            nbytes = sum(where[block_scale_name(n)].nbytes(block_scale_name(n))
                         for n in names.flat if block_scale_name(n) in where)
        kernel_inner = expected[kernel_path].shape[names.ndim:]
        scale_path = kernel_path[:-1] + (scale_leaf(kernel_path[-1]),)
        scale_inner = expected[scale_path].shape[names.ndim:] if role != "param" else None
        leaf_dtype = np.dtype(sds.dtype) if role != "param" else np_dtype
        return ParamTask(path=path, shape=sds.shape, dtype=leaf_dtype,
                         sharding=_sharding_for(shard_flat, path), nbytes=nbytes,
                         num_tensors=names.size if role != "scale" else 0,
                         open=partial(_open_param, path, sds.shape, names, where, cfg, leaf_dtype,
                                      *repeat_axes.get(path, (None, 1)), role=role,
                                      kernel_path=kernel_path, kernel_inner=kernel_inner,
                                      scale_inner=scale_inner, model_quant=model_quant,
                                      lead=stacked.get(kernel_path, 0) - names.ndim))

    return [task(path, sds) for path, sds in expected.items()]


def _open_param(path: Path_, shape: tuple[int, ...], names: np.ndarray, where: dict[str, SafeTensorsFile],
                cfg: ModelConfig, np_dtype: np.dtype, repeat_axis: int | None,
                kv_head_repeat: int, *, role: str = "param", kernel_path: Path_ = (),
                kernel_inner: tuple[int, ...] = (), scale_inner: tuple[int, ...] | None = None,
                model_quant: WeightQuant | None = None, lead: int = 0) -> Reader:
    """Prepares one param on the host (in a loading thread); returns its slice reader.
    names: hf_names(path), one tensor per entry of the param's stacked leading axes.
    role: "param" (a plain one), or a quantized "kernel" / its "scale"
    (models/quant_weights.py). lead: stacked kernels inside one tensor (Gemma 4's experts)."""
    stacked = names.ndim
    inner = shape[stacked:]

    def checkpoint_float(name: str) -> np.ndarray:
        """The tensor as stored, or float32 dequantized when stored in fp8 with block scales."""
        w = where[name].get(name)
        scale = block_scale_name(name)
        return dequantize_block(w, where[scale].get(scale), cfg.weight_quant) if scale in where else w

    def as_stored(name: str, at: tuple[int, ...]) -> np.ndarray:
        """`role`'s array for one checkpoint tensor in the param layout with shape `at`."""
        if role == "param":
            return to_param_layout(checkpoint_float(name), path, at, name, cfg)
        scale_name = block_scale_name(name)
        if model_quant.block_out is not None and scale_name in where:
            # An FP8 checkpoint's own values and block scales, as they are.
            if role == "kernel":
                return to_param_layout(where[name].get(name), kernel_path, at, name, cfg)
            out_features = where[name].shape(name)[0]
            spread = spread_block_scale(where[scale_name].get(scale_name), out_features,
                                        model_quant.block_out)
            return to_param_layout(spread, kernel_path, at, scale_name, cfg)
        k_at, s_at = ((at, _shrunk_like(scale_inner, kernel_inner, at)) if role == "kernel"
                      else (_shrunk_like(kernel_inner, scale_inner, at), at))
        w = to_param_layout(checkpoint_float(name), kernel_path, k_at, name, cfg)
        q, scale = quantize_layout(w, k_at, s_at, model_quant,
                                   np.dtype(np_dtype if role == "kernel" else
                                            storage_dtype(model_quant)), lead)
        return q if role == "kernel" else scale

    def element(name: str) -> np.ndarray:
        """One checkpoint tensor in the param's layout: a view of the file's mmap where
        it can be (a transpose and split axes are), so a slice of it reads only that."""
        if repeat_axis is None:
            return as_stored(name, inner)
        # Replicated KV heads: built whole (small K/V projections), each head repeated.
        axis = repeat_axis - stacked
        return np.repeat(as_stored(name, _unrepeated(inner, axis, kv_head_repeat)),
                         kv_head_repeat, axis=axis)

    if stacked == 0:
        view = element(names.item())
        return lambda index: _contiguous(view[index], np_dtype)

    def read(index: Index) -> np.ndarray:
        # Stacked layers / experts: each entry's slice read on its own, so the host never
        # holds more than this device's share (DeltaNet's regrouping and repeated KV
        # heads copy one entry at a time).
        outer = [range(*sl.indices(n)) for sl, n in zip(index[:stacked], names.shape)]
        pieces = [_contiguous(element(names[idx])[index[stacked:]], np_dtype)
                  for idx in itertools.product(*outer)]
        return np.stack(pieces).reshape(*(len(r) for r in outer), *pieces[0].shape)
    return read


def _shrunk_like(other: tuple[int, ...], mine: tuple[int, ...], at: tuple[int, ...]
                 ) -> tuple[int, ...]:
    """A quantized kernel and its scale share their output axes. With KV heads repeated
    (k_proj / v_proj: one contraction axis, so the two have the same rank), this role's
    shape `mine` is built as `at`, one output axis smaller: the other's shrunk the same way."""
    if at == mine:
        return other
    return tuple(o * a // m for o, m, a in zip(other, mine, at, strict=True))


def _contiguous(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """x as a C-contiguous array of `dtype`. An uncast bfloat16 / float8 copy goes through
    an unsigned-integer view: numpy's strided copy of ml_dtypes' types is slower (a
    transposed 8192x4096 bfloat16: 1.6 s as bfloat16, 1.05 s as uint16, on this CPU)."""
    if x.dtype == dtype and dtype.kind == "V" and not x.flags.c_contiguous:
        return np.ascontiguousarray(x.view(f"u{dtype.itemsize}")).view(dtype)
    return np.ascontiguousarray(x, dtype=dtype)


def _unrepeated(shape: tuple[int, ...], axis: int, repeat: int) -> tuple[int, ...]:
    return shape[:axis] + (shape[axis] // repeat,) + shape[axis + 1:]


# Up to this many bytes of weights, dummy weights are drawn on the host with numpy: the
# on-device program takes XLA:CPU ~2.5 s to compile for the tiny default model (a tenth
# of its cold start), numpy 0.1 s to run; larger models are drawn on their devices.
_HOST_DUMMY_BYTES = 256 * 2**20


def _dummy_params(expected: dict[Path_, jax.ShapeDtypeStruct], dtype: jnp.dtype, seed: int,
                  shard_flat: dict[Path_, Any], repeat_axes: dict[Path_, tuple[int, int]],
                  quant: WeightQuant | None = None,
                  stacked_axes: dict[Path_, int] | None = None) -> dict:
    """Normal(0, 0.02) weights, ones for norms (zeros for (1 + w) norms), zeros for
    biases, made on device (on the host for small models); a quantized model's kernels
    are drawn so and quantized (models/quantization.py).
    Replicated KV heads are repeats, as from a checkpoint: any mesh gives the same model."""
    qleaves = quantized_leaves(expected)
    paths = sorted(p for p in expected if qleaves.get(p, ("kernel",))[0] != "scale")

    def drawn_shape(path: Path_) -> tuple[int, ...] | None:
        """The shape to draw at random (before KV-head repeats); None: a constant."""
        if path[-1] in (*_ONES_LEAVES, "bias", "offset_scale", *COMPUTED_LEAVES):
            return None
        shape = expected[path].shape
        return shape if path not in repeat_axes else _unrepeated(shape, *repeat_axes[path])

    def finish(path: Path_, w: Any, xp: Any) -> dict[Path_, Any]:
        """The drawn weight repeated per KV head (quantized: and its scale), or the constant
        (xp: numpy or jnp)."""
        shape = expected[path].shape
        if path[-1] in COMPUTED_LEAVES:
            return {path: xp.ones(shape, expected[path].dtype)}
        if path[-1] in _ONES_LEAVES:
            return {path: xp.ones(shape, dtype)}
        if path[-1] in ("bias", "offset_scale"):
            return {path: xp.zeros(shape, dtype)}
        if path in repeat_axes:
            axis, repeat = repeat_axes[path]
            w = xp.repeat(w, repeat, axis)
        if path not in qleaves:
            return {path: w.astype(dtype)}
        scale_path = path[:-1] + (scale_leaf(path[-1]),)
        lead = stacked_axes.get(path, 0)
        q, scale = _quantize_stacked(w, expected[path], expected[scale_path], lead, quant, xp)
        return {path: q, scale_path: scale}

    total = sum(math.prod(expected[p].shape) for p in paths) * jnp.dtype(dtype).itemsize
    if total <= _HOST_DUMMY_BYTES:
        rng = np.random.default_rng(seed)
        out = {}
        for path in paths:
            shape = drawn_shape(path)
            w = None if shape is None else (0.02 * rng.standard_normal(shape, np.float32)).astype(dtype)
            for leaf, value in finish(path, w, np).items():
                out[leaf] = jax.device_put(value, _sharding_for(shard_flat, leaf))
        return unflatten_dict(out)

    def make_all(key: jax.Array) -> dict:
        out = {}
        for i, path in enumerate(paths):
            shape = drawn_shape(path)
            w = None if shape is None else (
                0.02 * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)).astype(dtype)
            out.update(finish(path, w, jnp))
        return out

    # One program for every leaf: a jit per leaf compiled once per shape (56 compilations
    # before the tiny default model's first warmup program).
    shardings = {path: _sharding_for(shard_flat, path) for path in expected}
    kw = {"out_shardings": shardings} if all(v is not None for v in shardings.values()) else {}
    return unflatten_dict(jax.jit(make_all, **kw)(jax.random.key(seed)))


def _quantize_stacked(w: Any, kernel: Any, scale: Any, lead: int, quant: WeightQuant, xp: Any
                      ) -> tuple[Any, Any]:
    """quantize() each of the `lead` stacked axes' kernels (layers, experts) on its own."""
    n = len(kernel.shape) - len(scale.shape) + 1
    inner_k, inner_s = kernel.shape[lead:], scale.shape[lead:]
    flat = w.reshape(-1, *inner_k)
    if xp is np:
        pairs = [quantize(x, kernel.dtype, n, quant.block_in, np) for x in flat]
        q, s = np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])
    else:
        q, s = jax.vmap(lambda x: quantize(x, kernel.dtype, n, quant.block_in, jnp))(flat)
    return q.reshape(kernel.shape), s.reshape(*kernel.shape[:lead], *inner_s)


def untie_lm_head(model: nn.Module, params: dict,
                  shardings_of: Callable[[nn.Module], dict] | None = None
                  ) -> tuple[nn.Module, dict]:
    """A tied-embedding model as an untied one whose lm_head kernel is the embedding
    transposed ([E, V], a copy). For XLA CPU: its matmul with a [E, V] kernel is faster
    than with the [V, E] embedding at decode batch sizes (logits + greedy sampling of
    the small CPU benchmark model: 3.3 -> 2.1 ms at 8 rows, 5.6 -> 4.4 ms at 32, the
    same at 64). Same logits. shardings_of(model) gives a model's param shardings
    (the copy is placed as the untied model's lm_head is)."""
    untied = model.clone(config=replace(model.config, tie_word_embeddings=False))
    sharding = shardings_of(untied)["lm_head"]["kernel"] if shardings_of else None
    kernel = jax.jit(jnp.transpose, out_shardings=sharding)(params["embed_tokens"]["embedding"])
    return untied, {**params, "lm_head": {"kernel": kernel}}


def is_projection_kernel(path: tuple[str, ...]) -> bool:
    """A linear layer's weight (models/layers.Einsum's "kernel"; not the DeltaNet conv's)."""
    return path[-1] == "kernel" and (len(path) < 2 or path[-2] != "conv1d")


def widen_params(model: nn.Module, params: dict, dtype: Any,
                 keep_projections: bool = False) -> tuple[nn.Module, dict]:
    """The model computing in `dtype` (registry.compute_dtype: float32 on CPU) on its
    16-bit float weights upcast to it, exactly; quantized weights and their scales as
    they are. keep_projections: the linear layers' kernels stay narrow, their dots take
    narrow operands (registry.matmul_dtype; models/layers.Einsum). Each leaf keeps its
    sharding; the narrow copies are freed."""
    narrow = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

    def widen(path: tuple, x: jax.Array) -> jax.Array:
        names = tuple(str(getattr(k, "key", k)) for k in path)
        if jnp.dtype(x.dtype) not in narrow or (keep_projections and is_projection_kernel(names)):
            return x
        return x.astype(dtype)

    shardings = jax.tree_util.tree_map(lambda x: x.sharding, params)
    params = jax.jit(lambda p: jax.tree_util.tree_map_with_path(widen, p),
                     out_shardings=shardings, donate_argnums=0)(params)
    return model.clone(dtype=dtype), params


def store_kernels_out_in(model: nn.Module, params: dict) -> dict:
    """`params` with each float (not quantized) projection kernel [stacked..., in...,
    out...] stored as models/layers.KERNEL_OUT_IN [stacked..., out..., in...], a copy
    placed as the kernel was (its sharding's axes permuted alike); the old one is freed.
    For XLA:CPU, whose dot packs its right operand on every call: stored so, the weight
    goes on the left at decode batch sizes (models/layers.out_in_dot; 12 layers of the
    benchmark llama's projections at 16 / 48 rows: bf16 on AMX 1.27x / 1.09x, float32 on
    an AVX2 EPYC 3.3x / 1.7x) and prefill sizes read it about as fast (benchmarks/
    README.md). Same results: the dot contracts the same axes. `model`: the one `params`
    belongs to (its logical axes say which axes contract)."""
    axes = flatten_dict(param_logical_axes(model))
    stacked = stacked_axes(model)
    floats = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    out = {}
    for path, x in flatten_dict(params).items():
        if not is_projection_kernel(path) or jnp.dtype(x.dtype) not in floats:
            out[path] = x
            continue
        s = stacked[path]
        n = contracted_axes(tuple(axes[path])[s:])
        perm = (*range(s), *range(s + n, x.ndim), *range(s, s + n))
        out[(*path[:-1], KERNEL_OUT_IN)] = _permuted(x, perm)
    return unflatten_dict(out)


def _permuted(x: jax.Array, perm: tuple[int, ...]) -> jax.Array:
    """x transposed by `perm` into a new buffer placed alike (x donated)."""
    sharding = x.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = (*sharding.spec, *(None,) * (x.ndim - len(sharding.spec)))
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
            *(spec[i] for i in perm)))
    return _transpose(x, perm, sharding)


@partial(jax.jit, static_argnums=(1, 2), donate_argnums=0)
def _transpose(x: jax.Array, perm: tuple[int, ...], sharding: Any) -> jax.Array:
    return jax.lax.with_sharding_constraint(jnp.transpose(x, perm), sharding)
