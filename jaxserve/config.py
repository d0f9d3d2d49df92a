"""EngineConfig: every engine knob in one frozen, validated dataclass."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
_POLICIES = ("fcfs", "priority")
# "auto": chosen by platform (pallas_kernels' resolve_backend owns the rule); "reference": the
# simple jnp oracle; "pallas_interpret": the Pallas kernel body in interpret mode on CPU
# (tests; slow).
_ATTENTION_BACKENDS = ("auto", "xla", "reference", "pallas", "pallas_interpret")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None          # defaults to the model directory
    dtype: str = "auto"                   # "auto" = the checkpoint's dtype
    kv_cache_dtype: str = "auto"          # "auto" = the model dtype
    max_model_len: int | None = None      # None = the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None = max(2048, max_num_seqs)
    page_size: int = 16
    seed: int = 0
    enable_prefix_caching: bool = True
    load_format: str = "auto"
    scheduling_policy: str = "fcfs"
    num_pages: int | None = None          # explicit KV page count (includes the null page)
    hbm_utilization: float = 0.9          # accelerators: fraction of free memory after weights
    kv_cache_memory_bytes: int | None = None  # explicit KV cache budget in bytes
    mesh: str | None = None               # "DxM": D data-parallel replicas x M-way tensor parallel
    attention_backend: str = "auto"       # one of _ATTENTION_BACKENDS
    # Layers under jax.lax.scan (one compiled layer body whatever the depth) or a Python
    # loop; None = scan on accelerators, loop on CPU (XLA:CPU copies scanned weights).
    scan_layers: bool | None = None
    compilation_cache_dir: str | None = dataclasses.field(
        default_factory=lambda: os.environ.get(
            "JAXSERVE_COMPILATION_CACHE", os.path.expanduser("~/.cache/jaxserve/xla")))

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"{field}={getattr(self, field)!r}: {why}")

        if not self.model:
            raise ValueError("model must name a checkpoint directory")
        if self.dtype not in _DTYPES:
            raise bad("dtype", f"must be one of {_DTYPES}")
        if self.kv_cache_dtype not in _DTYPES:
            raise bad("kv_cache_dtype", f"must be one of {_DTYPES}")
        if self.load_format not in _LOAD_FORMATS:
            raise bad("load_format", f"must be one of {_LOAD_FORMATS}")
        if self.scheduling_policy not in _POLICIES:
            raise bad("scheduling_policy", f"must be one of {_POLICIES}")
        if self.attention_backend not in _ATTENTION_BACKENDS:
            raise bad("attention_backend", f"must be one of {_ATTENTION_BACKENDS}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise bad("page_size", "must be a positive power of two")
        if self.max_num_seqs < 1:
            raise bad("max_num_seqs", "must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise bad("max_model_len", "must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 16:
            raise bad("max_num_batched_tokens", "must be >= 16")
        if self.num_pages is not None and self.num_pages < 2:
            raise bad("num_pages", "must be >= 2 (page 0 is the reserved null page)")
        if not 0.0 < self.hbm_utilization <= 1.0:
            raise bad("hbm_utilization", "must be in (0, 1]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise bad("kv_cache_memory_bytes", "must be > 0")
        if self.num_batched_tokens < self.max_num_seqs:
            raise bad("max_num_batched_tokens", f"must be >= max_num_seqs ({self.max_num_seqs})")
        if self.mesh is not None:
            # sharding owns the "DxM" format; imported here so that importing this
            # module needs no jax.
            from sharding.mesh import parse_mesh
            parse_mesh(self.mesh)

    @property
    def num_batched_tokens(self) -> int:
        """The per-step token budget (max_num_batched_tokens with its default)."""
        return self.max_num_batched_tokens or max(2048, self.max_num_seqs)
