"""How a model's linear layers store their weights quantized: the config side (host only).

A checkpoint may come quantized (its config.json quantization_config: fp8 with block
scales), or the engine quantizes an unquantized one at load (--quantization). The
arithmetic is models/quantization.py's; reading and cutting the tensors
models/quant_weights.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Weight quantization methods (--quantization) -> the dtype the linear layers' kernels
# are stored in (models/quantization.py does the arithmetic).
WEIGHT_QUANT_DTYPES = {"fp8": "float8_e4m3fn", "int8": "int8"}


@dataclass(frozen=True)
class WeightQuant:
    """How the linear layers' kernels are stored: in `method`'s dtype with float32 scales,
    one per output channel and per `block_in` rows of the contraction (None: one block of
    all rows, i.e. per output channel). An FP8 block checkpoint (quantization_config
    weight_block_size [block_out, block_in]) keeps its blocks; block_out only says how to
    read its scales (each output channel gets its block's)."""
    method: str                   # a key of WEIGHT_QUANT_DTYPES
    block_in: int | None = None
    block_out: int | None = None  # a checkpoint's; None when quantized at load
    # True: activations quantized per token to the same dtype in the step and the matmul
    # run in it (w8a8); False: activations stay in the model dtype (w8a16).
    dynamic_activations: bool = False

    def __post_init__(self) -> None:
        if self.method not in WEIGHT_QUANT_DTYPES:
            raise ValueError(f"quantization {self.method!r}: expected one of "
                             f"{tuple(WEIGHT_QUANT_DTYPES)}")
        for name in ("block_in", "block_out"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")

    @property
    def dtype_name(self) -> str:
        return WEIGHT_QUANT_DTYPES[self.method]


def resolve_weight_quant(method: str | None, checkpoint: WeightQuant | None,
                         activations: str | None = None) -> WeightQuant | None:
    """How the engine stores the weights: a quantized checkpoint's own quantization
    (`method` may only repeat it, as vLLM requires), else `method` per output channel
    (None: unquantized). activations "dynamic": w8a8 (per-channel weights only)."""
    if checkpoint is not None:
        if method not in (None, checkpoint.method):
            raise ValueError(f"quantization={method!r}: the checkpoint is already "
                             f"{checkpoint.method}-quantized (its config.json "
                             f"quantization_config); omit the flag or pass {checkpoint.method}")
        if activations is not None:
            raise ValueError(f"activation_quantization={activations!r}: the checkpoint's "
                             f"{checkpoint.method} block scales are applied per weight block; "
                             f"quantized activations need per-output-channel weights (serve "
                             f"an unquantized checkpoint with --quantization)")
        return checkpoint
    if method is None:
        if activations is not None:
            raise ValueError(f"activation_quantization={activations!r} needs --quantization "
                             f"(fp8 or int8): the activations take the weights' dtype")
        return None
    if activations not in (None, "dynamic"):
        raise ValueError(f"activation_quantization={activations!r}: expected 'dynamic' or none")
    return WeightQuant(method, dynamic_activations=activations == "dynamic")


def parse_quantization(q: dict[str, Any] | None) -> WeightQuant | None:
    """A checkpoint's quantization_config: FP8 with dynamic activation scales and block
    weight scales (DeepSeek / Qwen "-FP8" checkpoints) is served as it is; anything else
    is refused by name rather than read as if it were unquantized."""
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(f"checkpoint quantization_config quant_method={method!r} is not "
                         f"supported: jaxserve reads fp8 block-quantized checkpoints, or "
                         f"quantizes an unquantized one at load (--quantization fp8|int8)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"fp8 checkpoint with activation_scheme="
                         f"{q['activation_scheme']!r}: only dynamic activation scales are "
                         f"supported")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"fp8 checkpoint with fmt={q['fmt']!r}: only e4m3 weights are supported")
    block = q.get("weight_block_size")
    if not block or len(block) != 2:
        raise ValueError(f"fp8 checkpoint with weight_block_size={block!r}: expected "
                         f"[block_out, block_in] (per-tensor fp8 checkpoints are not supported)")
    return WeightQuant("fp8", block_in=int(block[1]), block_out=int(block[0]))
