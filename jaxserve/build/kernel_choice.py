"""Which implementation runs each part of the model, decided once at start-up and logged
per layer group ("attention: pallas-gpu for 32 layers (...)").

The dispatchers (pallas_kernels) pick a kernel per platform when a program is lowered,
and a kernel that cannot take a shape or a cache dtype falls back to the jnp reference
there: silently, so a figure could measure another path than it says. The engine
decides here instead, before anything is compiled: a combination no kernel takes is an
error naming the fix when the user asked for the kernel (attention_backend="pallas", or
a quantized cache, whose only fast path is the kernel), and a logged fallback when the
engine chose ("auto": a float32 cache on a GPU then runs the XLA page loop, the GPU
kernel reading 16-bit and quantized caches only).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from models.config import LINEAR_ATTENTION, SLIDING_ATTENTION, ModelConfig, WeightQuant
from pallas_kernels.gated_delta import gpu as gdn_gpu
from pallas_kernels.ragged_paged_attention import is_quantized, kv_cache_dtype_error

GPU_PLATFORMS = ("gpu", "cuda")
# resolve_backend's names -> what runs, per platform for "pallas"
_FIXED = {"reference": "jnp reference", "xla": "xla page loop",
          "pallas_interpret": "pallas interpret (the TPU kernel body, on CPU)"}


@dataclass(frozen=True)
class KernelChoice:
    part: str          # "attention", "linear attention" or "matmul"
    impl: str          # what runs: "pallas-gpu", "pallas-tpu", "xla page loop", ...
    layers: int
    detail: str        # the group: head dims, heads, dtypes
    note: str = ""     # why not the kernel (a fallback), or what the impl leaves to another
    fallback: bool = False

    def describe(self) -> str:
        s = f"{self.part}: {self.impl} for {self.layers} layers ({self.detail})"
        return f"{s}; {self.note}" if self.note else s


def attention_groups(mc: ModelConfig) -> dict[tuple[str, int, int], list[int]]:
    """Attention layers (not the hybrid's linear ones) by (layer type, head dim, KV heads),
    in layer order. mc: the run config (KV heads as stored)."""
    groups: dict[tuple[str, int, int], list[int]] = {}
    for i in range(mc.num_layers):
        if mc.layer_type(i) != LINEAR_ATTENTION:
            key = (mc.layer_type(i), mc.layer_head_dim(i), mc.layer_num_kv_heads(i))
            groups.setdefault(key, []).append(i)
    return groups


def _pallas_attention(platform: str) -> str:
    if platform == "tpu":
        return "pallas-tpu"
    return "pallas-gpu" if platform in GPU_PLATFORMS else "jnp reference"


def choose_attention(mc: ModelConfig, *, platform: str, requested: str, backend: str,
                     kv_dtype: Any, page_size: int, num_heads: int, refuse: bool = True
                     ) -> tuple[str, tuple[KernelChoice, ...]]:
    """(the backend the model runs, one choice per attention layer group). requested: the
    config's attention_backend ("auto" or a name); backend: it resolved for `platform`.
    ValueError when no kernel takes a combination the user asked for (see module doc);
    with refuse=False (the memory planner) the choice says so instead."""
    groups = attention_groups(mc)
    cache = getattr(kv_dtype, "name", None) or str(kv_dtype)
    note = ""
    why = {key: kv_cache_dtype_error(kv_dtype, platform=platform, backend=backend,
                                     head_dim=key[1], num_heads=num_heads, num_kv_heads=key[2],
                                     page_size=page_size) for key in groups}
    refused = next((w for w in why.values() if w), None)
    if refused and (is_quantized(kv_dtype) or requested != "auto"):
        flag = "kv_cache_dtype" if is_quantized(kv_dtype) else "attention_backend"
        if refuse:
            raise ValueError(f"{flag}={requested if flag == 'attention_backend' else cache}: "
                             f"{refused}")
        note = f"the engine refuses this: {refused}"
    elif refused:   # "auto" on a GPU with a cache the kernel does not read
        backend = "xla"
        note = f"fallback from pallas-gpu: {refused.split('; impl=')[0]}"
    impl = _FIXED.get(backend) or _pallas_attention(platform)
    if backend == "pallas" and platform not in ("tpu", *GPU_PLATFORMS):
        note = f"no Pallas attention kernel for {platform}: the dispatcher runs the jnp reference"
    def detail(kind: str, hd: int, kv: int) -> str:
        window = f" {mc.sliding_window}" if kind == SLIDING_ATTENTION else ""
        return (f"{kind.replace('_attention', '')}{window}, head_dim {hd}, {kv} KV heads, "
                f"{cache} cache")

    choices = tuple(KernelChoice("attention", impl, len(layers), detail(*key), note,
                                 fallback=bool(note)) for key, layers in groups.items())
    return backend, choices


def choose_linear_attention(mc: ModelConfig, *, platform: str, backend: str
                            ) -> tuple[KernelChoice, ...]:
    """The hybrid's Gated DeltaNet layers: the decode step's kernel; prefill chunks always
    take the jnp chunked loop (pallas_kernels/gated_delta/dispatch.py)."""
    n = len(mc.linear_attention_layers)
    if not n:
        return ()
    dk, dv = mc.linear_key_head_dim, mc.linear_value_head_dim
    detail = f"decode step, Dk {dk}, Dv {dv}; prefill chunks: the jnp chunked loop"
    note = ""
    if backend == "pallas" and platform == "tpu":
        impl = "pallas-tpu"
    elif backend == "pallas" and platform in GPU_PLATFORMS and gdn_gpu.supports(dk, dv):
        impl = "pallas-gpu"
    elif backend == "pallas_interpret":
        impl = _FIXED[backend]
    else:
        impl = "jnp reference"
        if backend == "pallas":
            note = (f"fallback: the Mosaic GPU decode step needs Dk % 64 == 0 and Dv % "
                    f"{gdn_gpu.COL_BLOCK} == 0" if platform in GPU_PLATFORMS else
                    f"no Pallas decode-step kernel for {platform}")
    return (KernelChoice("linear attention", impl, n, detail, note, fallback=bool(note)),)


def choose_matmul(mc: ModelConfig, *, dtype: Any, compute_dtype: Any,
                  weight_quant: WeightQuant | None,
                  matmul_dtype: Any = None) -> tuple[KernelChoice, ...]:
    """The linear layers: XLA's dot (cuBLAS / the MXU), on the weights as stored."""
    name = getattr(dtype, "name", None) or str(dtype)
    compute = getattr(compute_dtype, "name", None) or str(compute_dtype)
    if weight_quant is None:
        detail = f"{name} weights"
    else:
        scales = (f"{weight_quant.block_in}-row block scales" if weight_quant.block_in
                  else "per-channel scales")
        mode = (f"activations quantized per token, {weight_quant.dtype_name} x "
                f"{weight_quant.dtype_name} dot (w8a8)" if weight_quant.dynamic_activations
                else f"dequantized into a {name} dot (w8a16)")
        detail = f"{weight_quant.dtype_name} weights with {scales}, {mode}"
    dot = getattr(matmul_dtype, "name", None) or str(matmul_dtype or compute)
    note = f"computed in {compute} (no {name} arithmetic here)" if compute != name else ""
    if note and weight_quant is None and dot == name:
        note = (f"{name} x {name} dots with {compute} results (native {name} dot), "
                f"the rest in {compute}")
    return (KernelChoice("matmul", "xla dot", mc.num_layers, detail, note),)
