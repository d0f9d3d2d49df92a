"""Weights loaded in parallel straight into their shardings: every param equals the
checkpoint tensor in our layout (built here independently from the file with the
safetensors package), whatever the mesh, the dtype cast or the number of threads;
each device reads only its slice; the progress hook counts the file's bytes."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from flax.traverse_util import flatten_dict
from safetensors.torch import load_file, save_file

from models.config import ModelConfig
from models.layer_stack import layer_period
from models.param_placement import place_one
from models.registry import build_model
from models.safetensors_io import SafeTensorsFile
from models.weight_names import to_param_layout as _to_param_layout
from models.weights import checkpoint_tasks, load_params, param_logical_axes
from sharding import kv_head_layout, make_mesh, mesh_rules, param_shardings
from tests.checkpoints import make_tiny_checkpoint

EIGHT_HEADS = dict(num_attention_heads=8, intermediate_size=256)
_LEAF = {"kernel": "weight", "scale": "weight", "offset_scale": "weight", "embedding": "weight"}
NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def _hf_name(path: tuple[str, ...], prefix: str) -> str:
    if path == ("lm_head", "kernel"):
        return "lm_head.weight"
    parts = [p.replace("layers_", "layers.") for p in path[:-1]] + [_LEAF.get(path[-1], path[-1])]
    return prefix + ".".join(parts)


def _key_head_order(mc: ModelConfig) -> np.ndarray:
    """DeltaNet channel order: for each key head its q, its k, then its value heads."""
    hk, dk = mc.linear_num_key_heads, mc.linear_key_head_dim
    v_per_key = mc.linear_num_value_heads * mc.linear_value_head_dim // hk
    order = []
    for h in range(hk):
        order += list(range(h * dk, (h + 1) * dk))
        order += list(range(hk * dk + h * dk, hk * dk + (h + 1) * dk))
        order += list(range(2 * hk * dk + h * v_per_key, 2 * hk * dk + (h + 1) * v_per_key))
    return np.array(order)


def _expected(path: tuple[str, ...], shape: tuple[int, ...], file: dict[str, np.ndarray],
              mc: ModelConfig, prefix: str, kv_axis: int | None, repeat: int) -> np.ndarray:
    """The param, computed from the file's tensors as the loader is specified to."""
    if path[-2] == "experts":   # [X, in, out]: one HF [out, in] tensor per expert
        base = _hf_name(path[:-1], prefix)
        return np.stack([file[f"{base}.{e}.{path[-1]}.weight"].T for e in range(shape[0])])
    w = file[_hf_name(path, prefix)]
    if path[-2:] == ("conv1d", "kernel"):
        w = w[:, 0, :].T[:, _key_head_order(mc)]
    elif path[-2:] == ("in_proj_qkv", "kernel"):
        w = w.T[:, _key_head_order(mc)]
    elif path[-1] == "kernel":
        w = w.T
    if kv_axis is None:
        return w.reshape(shape)
    unrepeated = shape[:kv_axis] + (shape[kv_axis] // repeat,) + shape[kv_axis + 1:]
    return np.repeat(w.reshape(unrepeated), repeat, axis=kv_axis)


def _on_mesh(path: str, mesh_spec: str, scan_layers: bool = False
             ) -> tuple[ModelConfig, object, object, int]:
    """(config, model with the mesh's KV heads, its shardings, kv_head_repeat)."""
    mc = ModelConfig.from_pretrained(path)
    m = int(mesh_spec.split("x")[1])
    stored = kv_head_layout(mc.num_heads, mc.num_kv_heads, m)
    model = build_model(replace(mc, num_kv_heads=stored), "float32", "reference",
                        scan_layers=scan_layers)
    shardings = param_shardings(param_logical_axes(model), make_mesh(mesh_spec), mesh_rules(mc, m))
    return mc, model, shardings, stored // mc.num_kv_heads


@pytest.mark.parametrize("kind,file_dtype,dtype,mesh,overrides", [
    ("llama", torch.bfloat16, "float32", "1x8", dict(EIGHT_HEADS, num_key_value_heads=4)),
    ("qwen3", torch.float32, "bfloat16", "1x8", dict(EIGHT_HEADS, num_key_value_heads=8)),
    ("qwen3_moe", torch.bfloat16, "bfloat16", "1x4",
     dict(EIGHT_HEADS, num_key_value_heads=2, num_experts=8, moe_intermediate_size=32)),
    ("qwen3_5", torch.float32, "float32", "1x2", {}),
])
def test_every_param_equals_the_file_on_a_mesh(tmp_path, kind, file_dtype, dtype, mesh, overrides):
    path = make_tiny_checkpoint(kind, tmp_path, dtype=file_dtype, **overrides)
    mc, model, shardings, repeat = _on_mesh(path, mesh)
    assert (repeat > 1) == (kind in ("llama", "qwen3_moe"))   # the cases cover repeated KV heads
    params = flatten_dict(load_params(path, mc, model, dtype, shardings=shardings,
                                      kv_head_repeat=repeat, workers=3))
    file = {k: (t.float() if t.dtype == torch.bfloat16 else t).numpy()
            for k, t in load_file(str(Path(path) / "model.safetensors")).items()}
    prefix = "model.language_model." if kind == "qwen3_5" else "model."
    axes = flatten_dict(param_logical_axes(model))
    want_shardings = flatten_dict(shardings)
    assert params.keys() == axes.keys()
    for p, x in params.items():
        spec = tuple(axes[p])
        kv_axis = spec.index("kv_heads") if "kv_heads" in spec and repeat > 1 else None
        ref = _expected(p, x.shape, file, mc, prefix, kv_axis, repeat).astype(NP_DTYPES[dtype])
        assert x.dtype == NP_DTYPES[dtype] and x.sharding == want_shardings[p], p
        np.testing.assert_array_equal(np.asarray(x), ref, err_msg=str(p))
        for shard in x.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), ref[shard.index], err_msg=str(p))


@pytest.mark.parametrize("kind,mesh,overrides", [
    ("llama", "1x8", dict(EIGHT_HEADS, num_key_value_heads=4)),
    ("qwen3_moe", "1x4", dict(EIGHT_HEADS, num_key_value_heads=2, num_experts=8,
                              moe_intermediate_size=32)),
    ("qwen3_5", "1x2", {}),
    ("qwen3_5_moe", "1x2", {}),
])
def test_scanned_params_stack_the_layer_loops_params(tmp_path, kind, mesh, overrides):
    """Scanned layers hold the same tensors as the Python loop's layers_i, stacked by
    block: sublayer j of block g is layer g * period + j (repeated KV heads, experts and
    DeltaNet's regrouped channels included), each shard in its place on the mesh."""
    path = make_tiny_checkpoint(kind, tmp_path, dtype=torch.bfloat16, **overrides)
    mc, loop_model, loop_sh, repeat = _on_mesh(path, mesh)
    _, scan_model, scan_sh, _ = _on_mesh(path, mesh, scan_layers=True)
    loop = flatten_dict(load_params(path, mc, loop_model, "float32", shardings=loop_sh,
                                    kv_head_repeat=repeat, workers=3))
    scanned = flatten_dict(load_params(path, mc, scan_model, "float32", shardings=scan_sh,
                                       kv_head_repeat=repeat, workers=3))
    want_sh = flatten_dict(scan_sh)
    stacked = [p for p in scanned if p[0] == "layers"]
    assert stacked and {p for p in scanned if p[0] != "layers"} == \
        {p for p in loop if not p[0].startswith("layers_")}
    period = layer_period(mc)
    blocks = mc.num_layers // period
    assert sum(len({p[1:] for p in stacked if p[1] == f"layers_{j}"}) for j in range(period)) * \
        blocks == sum(p[0].startswith("layers_") for p in loop)
    for p, x in scanned.items():
        assert x.sharding == want_sh[p], p
        if p[0] != "layers":
            np.testing.assert_array_equal(np.asarray(x), np.asarray(loop[p]), err_msg=str(p))
            continue
        assert x.shape[0] == blocks, p
        j = int(p[1][len("layers_"):])
        want = np.stack([np.asarray(loop[(f"layers_{g * period + j}",) + p[2:]])
                         for g in range(blocks)])
        np.testing.assert_array_equal(np.asarray(x), want, err_msg=str(p))
        for shard in x.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index], err_msg=str(p))


def test_more_threads_give_identical_params(tmp_path):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path, dtype=torch.bfloat16, **EIGHT_HEADS,
                                num_key_value_heads=2, num_experts=8, moe_intermediate_size=32)
    mc, model, shardings, repeat = _on_mesh(path, "1x4")
    one, four = (flatten_dict(load_params(path, mc, model, "float32", shardings=shardings,
                                          kv_head_repeat=repeat, workers=w)) for w in (1, 4))
    assert one.keys() == four.keys()
    for p in one:
        assert one[p].sharding == four[p].sharding, p
        np.testing.assert_array_equal(np.asarray(one[p]), np.asarray(four[p]), err_msg=str(p))


def test_progress_counts_the_files_bytes(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path, max_shard_size="100KB")
    mc = ModelConfig.from_pretrained(path)
    model = build_model(mc, "float32")
    calls: list[tuple[int, int]] = []
    params = load_params(path, mc, model, "float32", progress=lambda d, t: calls.append((d, t)))
    files = [SafeTensorsFile(f) for f in sorted(Path(path).glob("*.safetensors"))]
    assert len(files) > 1
    total = sum(int(np.prod(f.shape(n))) * f.dtype(n).itemsize for f in files for n in f.keys())
    assert all(t == total for _, t in calls)
    done = [d for d, _ in calls]
    assert done[0] == 0 and done[-1] == total
    assert all(a < b for a, b in zip(done, done[1:]))
    assert len(calls) == len(jax.tree_util.tree_leaves(params)) + 1


def test_each_device_reads_only_its_slice(tmp_path):
    path = make_tiny_checkpoint("qwen3", tmp_path, **EIGHT_HEADS, num_key_value_heads=8)
    mc, model, shardings, repeat = _on_mesh(path, "1x8")
    task = next(t for t in checkpoint_tasks(path, mc, model, "float32", shardings=shardings)
                if t.path == ("layers_0", "mlp", "down_proj", "kernel"))
    asked: list[tuple] = []

    def recording_open():
        read = task.open()
        return lambda index: (asked.append(index), read(index))[1]

    x = place_one(replace(task, open=recording_open))
    shards = task.sharding.addressable_devices_indices_map(task.shape).values()
    assert sorted(map(str, asked)) == sorted(map(str, shards)) and len(asked) == 8
    assert x.shape == task.shape
    # The layout change (transpose, split axes) copies nothing: slices come from the mmap.
    st = SafeTensorsFile(Path(path) / "model.safetensors")
    for proj, shape in [("mlp.down_proj", (256, 64)), ("self_attn.q_proj", (64, 8, 16)),
                        ("self_attn.o_proj", (8, 16, 64))]:
        name = f"model.layers.0.{proj}.weight"
        view = st.get(name)
        path_ = ("layers_0", *proj.split("."), "kernel")
        assert np.shares_memory(_to_param_layout(view, path_, shape, name, mc), view), proj


def test_an_error_in_a_thread_is_raised(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "ok", num_hidden_layers=2)
    tensors = load_file(str(Path(path) / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(7, 64)
    save_file(tensors, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
    mc = ModelConfig.from_pretrained(path)
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_params(path, mc, build_model(mc, "float32"), "float32", workers=4)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        load_params(path, mc, build_model(mc, "float32"), "float32", workers=0)
