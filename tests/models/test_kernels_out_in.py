"""bf16 projection kernels stored [out, in] on CPU (issue 38; models/weights.
store_kernels_out_in, models/layers.Einsum): every narrow projection kernel moves, with
its sharding, and the model computes what it computed on [in, out] kernels, in the
compiled program without a whole-kernel transpose or copy."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax.traverse_util import flatten_dict

from models.config import ModelConfig
from models.layer_stack import cache_shapes
from models.layers import KERNEL_OUT_IN, WEIGHT_LEFT_MAX_ROWS, out_in_dot
from models.param_tree import stacked_axes
from models.registry import build_model
from models.weights import (is_projection_kernel, load_params, param_logical_axes,
                            store_kernels_out_in, widen_params)
from sharding import make_mesh, mesh_rules, param_shardings
from tests.checkpoints import make_tiny_checkpoint
from tests.models.batch_util import make_inputs
from tests.models.test_parity import prompt

PAGE, NUM_PAGES, STATE_SLOTS = 16, 16, 4
T_PAD, R_PAD, P_PAD = 40, 2, 2
LENS = (13, 9)


def _native_bf16(kind: str, tmp, *, scan: bool, mesh=None):
    """(model computing in float32, params with bf16 projection kernels [in, out]): what
    the loader builds on a CPU with native bf16 dots, before the kernels move."""
    path = make_tiny_checkpoint(kind, tmp / kind, dtype=torch.bfloat16)
    cfg = ModelConfig.from_pretrained(path)
    model = build_model(cfg, jnp.bfloat16, scan_layers=scan)
    shardings = (None if mesh is None else
                 param_shardings(param_logical_axes(model), mesh, mesh_rules(cfg, mesh.shape["model"])))
    params = load_params(path, cfg, model, jnp.bfloat16, shardings=shardings)
    model, params = widen_params(model, params, jnp.float32, keep_projections=True)
    return cfg, model, params


def _forward(cfg, model, params):
    """Logits of two prompts in one prefill step, and the step's compiled HLO text."""
    seqs = [(prompt(n, seed=i), 0, [1 + 2 * i, 2 + 2 * i]) for i, n in enumerate(LENS)]
    inputs, spans = make_inputs(seqs, page_size=PAGE, num_tokens=T_PAD, num_rows=R_PAD,
                                pages_per_row=P_PAD,
                                state_slots=[1, 2] if cfg.is_hybrid else None)
    shapes = cache_shapes(cfg, num_pages=NUM_PAGES, page_size=PAGE, kv_dtype=jnp.float32,
                          num_state_slots=STATE_SLOTS if cfg.is_hybrid else 0,
                          conv_state_dtype=jnp.float32)
    caches = {k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.items()}

    def step(p, c, i):
        hidden, _ = model.apply({"params": p}, c, i)
        return model.apply({"params": p}, hidden, method="compute_logits")

    compiled = jax.jit(step).lower(params, caches, inputs).compile()
    logits = np.asarray(compiled(params, caches, inputs))
    return np.concatenate([logits[a:b] for a, b in spans]), compiled.as_text()


def _moved(plain: dict, out_in: dict) -> None:
    """Every bf16 projection kernel is stored [out..., in...] (scanned layers' stack axis
    first) and nothing else changed."""
    plain, out_in = flatten_dict(plain), flatten_dict(out_in)
    kernels = {p: x for p, x in plain.items() if is_projection_kernel(p)}
    assert kernels and all(x.dtype == jnp.bfloat16 for x in kernels.values())
    assert set(out_in) == (set(plain) - set(kernels)) | {(*p[:-1], KERNEL_OUT_IN) for p in kernels}
    for p, x in kernels.items():
        got = out_in[(*p[:-1], KERNEL_OUT_IN)]
        assert sorted(got.shape) == sorted(x.shape) and got.dtype == x.dtype, p
    # o_proj [N, H, E] contracts two axes: it moves to [E, N, H].
    o_proj = next(p for p in kernels if p[-2] == "o_proj")
    n, h, e = kernels[o_proj].shape[-3:]
    assert out_in[(*o_proj[:-1], KERNEL_OUT_IN)].shape[-3:] == (e, n, h)


def _no_kernel_copies(hlo: str, model, params: dict, *, scanned: bool) -> None:
    """No op of the program writes an array of a bf16 kernel's shape (each device's
    shard; in a layer scan's body one layer's too): the dots read the kernels in place.
    A scan's body takes its layer's kernel from the stack by a slice fusion, so there
    only transposes and copies are refused."""
    stacked = stacked_axes(model)
    shapes = set()
    for p, x in flatten_dict(params).items():
        if p[-1] == KERNEL_OUT_IN:
            shard = x.sharding.shard_shape(x.shape)
            shapes |= {",".join(map(str, shard[k:])) for k in {0, stacked[(*p[:-1], "kernel")]}}
    allowed = ("parameter", "bitcast", "get-tuple-element", "fusion" if scanned else "")
    for line in hlo.splitlines():
        m = re.search(r"= bf16\[([\d,]+)\]\{[\d,]*\} ([\w-]+)\(", line)
        assert not (m and m.group(1) in shapes and m.group(2) not in allowed), line.strip()


def test_hybrid_scanned_layers_same_logits(tmp_path):
    """Qwen3.5: DeltaNet projections (out_proj contracts two axes), attention and MLP
    kernels stacked by the layer scan."""
    cfg, model, params = _native_bf16("qwen3_5", tmp_path, scan=True)
    want, _ = _forward(cfg, model, params)
    moved = store_kernels_out_in(model, jax.tree_util.tree_map(jnp.copy, params))
    _moved(params, moved)
    got, hlo = _forward(cfg, model, moved)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, np.abs(want).max()))
    _no_kernel_copies(hlo, model, moved, scanned=True)


def test_tensor_parallel_kernels_keep_their_sharding(tmp_path):
    """Llama on a 1x2 mesh: each moved kernel is split over the model axis along the
    same logical axis as before, and the sharded model gives the same logits."""
    mesh = make_mesh("1x2", jax.devices()[:2])
    cfg, model, params = _native_bf16("llama", tmp_path, scan=False, mesh=mesh)
    with jax.set_mesh(mesh):
        want, _ = _forward(cfg, model, params)
        moved = store_kernels_out_in(model, jax.tree_util.tree_map(jnp.copy, params))
        got, hlo = _forward(cfg, model, moved)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, np.abs(want).max()))
    _moved(params, moved)
    _no_kernel_copies(hlo, model, moved, scanned=False)
    leaves = flatten_dict(moved)

    def spec(*path: str) -> tuple:
        x = leaves[(*path, KERNEL_OUT_IN)]
        return (*x.sharding.spec, *(None,) * (x.ndim - len(x.sharding.spec)))
    assert spec("layers_0", "self_attn", "q_proj") == ("model", None, None)   # [N, H, E]
    assert spec("layers_0", "self_attn", "o_proj") == (None, "model", None)   # [E, N, H]
    assert spec("layers_0", "mlp", "up_proj") == ("model", None)              # [F, E]
    assert spec("layers_0", "mlp", "down_proj") == (None, "model")            # [E, F]


def test_decode_sized_dots_take_the_kernel_as_left_operand():
    """Up to WEIGHT_LEFT_MAX_ROWS rows the compiled dot is W x^T (result [out, rows]: XLA:CPU
    packs only x), above it x W^T; both give x W^T's numbers."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((96, 48)), jnp.bfloat16)
    for rows in (1, 16, WEIGHT_LEFT_MAX_ROWS, WEIGHT_LEFT_MAX_ROWS + 1, 200):
        x = jnp.asarray(rng.standard_normal((rows, 48)), jnp.bfloat16)
        compiled = jax.jit(lambda a, b: out_in_dot(a, b, jnp.float32)).lower(x, w).compile()
        got = np.asarray(compiled(x, w))
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
        dots = re.findall(r"= f32\[(\d+),(\d+)\]\{[\d,]*\} dot\(", compiled.as_text())
        left = rows <= WEIGHT_LEFT_MAX_ROWS
        assert dots == [("96", str(rows)) if left else (str(rows), "96")], (rows, dots)
