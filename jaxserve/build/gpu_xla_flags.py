"""XLA:GPU flags the engine sets by default, before JAX makes its backends.

`--xla_gpu_enable_triton_gemm=false`: the model's layers run as one jax.lax.scan over
stacked weights, and XLA's Triton gemms cannot read a layer's slice of the stack in
place, so every step copied each layer's weights out first (read + write of all the
weights beside the gemm's own read). cuBLAS gemms read the slice where it lies. First
H100 measurements (benchmarks/README.md, "The GPU session"): a Llama-3.1-8B-shaped
layer stack at batch 1, 16.1 ms a step with Triton, 7.2 ms with cuBLAS, 7.2 ms unrolled;
the engine's batch-1 TPOT on llama-3.1-8b bf16, 25.5 → 16.7 ms.

Not for quantized weights (--quantization, or a checkpoint's own quantization_config):
their dequantization fuses into Triton's gemm, where cuBLAS would need the weights
converted to 16 bits first, a copy of every weight each step (cuBLAS for them is not
measured yet). A flag the user's XLA_FLAGS already names is left as given; on a host
without JAX's CUDA plugin (or with JAX_PLATFORMS naming no GPU) nothing is set.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pkgutil

from jaxserve.build.device_pool import backends_ready
from jaxserve.checkpoints.model_names import builtin_config

# (flag, value): the engine's defaults on a GPU
GPU_DEFAULTS = (("xla_gpu_enable_triton_gemm", "false"),)


def _cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA plugin is there (found, not imported: nor is jax)."""
    spec = importlib.util.find_spec("jax_plugins")   # the plugins' namespace package
    locations = spec.submodule_search_locations if spec is not None else None
    return any(m.name.startswith("xla_cuda") for m in pkgutil.iter_modules(locations or []))


def _gpu_wanted() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    return _cuda_plugin_installed()


def set_gpu_xla_flags(quantized_weights: bool = False) -> str | None:
    """Adds GPU_DEFAULTS to XLA_FLAGS (the ones it does not name already) unless the
    weights are quantized; a line for the log, or None where there is nothing to say (no
    GPU). Once JAX has made its backends XLA_FLAGS is read already: then only a warning
    is left to give."""
    if not _gpu_wanted():
        return None
    if quantized_weights:
        return ("XLA:GPU keeps its Triton gemms: the weights are quantized (their "
                "dequantization fuses into Triton's gemm)")
    given = os.environ.get("XLA_FLAGS", "")
    missing = [f"--{name}={value}" for name, value in GPU_DEFAULTS if f"--{name}" not in given]
    if not missing:
        return f"XLA_FLAGS has the engine's GPU flags (or the user's values of them): {given}"
    if backends_ready():
        return (f"JAX started before the engine: its XLA flags stay as they were, without the "
                f"engine's GPU defaults {' '.join(missing)} (jaxserve/build/gpu_xla_flags.py "
                f"says why)")
    os.environ["XLA_FLAGS"] = " ".join([given, *missing]).strip()
    return (f"XLA:GPU flags: {' '.join(missing)} (cuBLAS gemms read each layer's weights in "
            f"place in the scanned layer loop; XLA_FLAGS naming the flag overrides it)")


def quantized_weights(quantization: str | None, model: str | None) -> bool:
    """Whether the engine will hold quantized weights: --quantization, or the checkpoint's
    quantization_config when its config is at hand (a local directory or a built-in
    alias; a hub id's config is not fetched here, and a config that cannot be read
    counts as unquantized: the engine's own loading reports it)."""
    if quantization is not None:
        return True
    if not model:   # the built-in default model
        return False
    config = builtin_config(model)
    if config is None:
        path = os.path.join(os.path.expanduser(model), "config.json")
        if not os.path.isfile(path):
            return False
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            return False
    return bool(config.get("quantization_config"))
