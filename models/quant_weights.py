"""Checkpoint tensors -> quantized parameters, at load (models/weights.py calls these).

Three cases per linear-layer tensor, decided by the checkpoint and the model:
  - the checkpoint stores it in float8 with block scales (`<name>_scale_inv`, the
    multiplier, despite its name, of each [block_out, block_in] block: an FP8
    checkpoint's quantization_config) and the model keeps it so: the float8 values are
    read as they are, the scales spread to one per output channel and block of rows
    (models/quantization.py) -- no float round trip;
  - the checkpoint stores it in float8 but the model keeps that layer unquantized (say
    the MoE router): dequantized on the host;
  - the checkpoint stores floats and the model quantizes the layer: quantized on the host,
    one tensor at a time, in the loading thread.
A parameter's kernel and scale are separate loading tasks that each read the tensor;
quantizing needs all of a column (its absmax), so each reads the whole tensor.
"""
from __future__ import annotations

import numpy as np

from models.config import WeightQuant
from models.quantization import SCALE_SUFFIX, quantize

BLOCK_SCALE_SUFFIX = "_scale_inv"   # HF FP8 checkpoints: "<...>.weight_scale_inv"


def scale_leaf(name: str) -> str:
    return name + SCALE_SUFFIX


def block_scale_name(name: str) -> str:
    return name + BLOCK_SCALE_SUFFIX


def spread_block_scale(scale_inv: np.ndarray, out_features: int, block_out: int) -> np.ndarray:
    """[ceil(out / block_out), B] block scales -> [out, B]: each output row its block's."""
    if scale_inv.ndim != 2 or scale_inv.shape[0] != -(-out_features // block_out):
        raise ValueError(f"block scale of shape {scale_inv.shape} does not fit {out_features} "
                         f"output features in blocks of {block_out}")
    return np.repeat(np.asarray(scale_inv, np.float32), block_out, axis=0)[:out_features]


def dequantize_block(w: np.ndarray, scale_inv: np.ndarray, quant: WeightQuant) -> np.ndarray:
    """An FP8 checkpoint tensor [out, in] with its block scales -> float32 [out, in]."""
    out_features, in_features = w.shape
    rows = spread_block_scale(scale_inv, out_features, quant.block_out)        # [out, Bi]
    if rows.shape[1] != -(-in_features // quant.block_in):
        raise ValueError(f"block scale of shape {scale_inv.shape} does not fit {in_features} "
                         f"input features in blocks of {quant.block_in}")
    per_elem = np.repeat(rows, quant.block_in, axis=1)[:, :in_features]
    return np.asarray(w, np.float32) * per_elem


def quantize_layout(w: np.ndarray, kernel_shape: tuple[int, ...], scale_shape: tuple[int, ...],
                    quant: WeightQuant, dtype: np.dtype, lead: int = 0
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(q, scale) of a float kernel already in the param layout [lead..., in..., out...];
    the scale param's shape [lead..., blocks, out...] says where the contraction axes end.
    lead: leading axes of kernels quantized each on its own (Gemma 4's experts, one
    tensor for all of a layer's)."""
    num_contract = len(kernel_shape) - (len(scale_shape) - 1)
    w = np.asarray(w, np.float32).reshape(kernel_shape)
    if not lead:
        return quantize(w, dtype, num_contract, quant.block_in)
    pairs = [quantize(x, dtype, num_contract, quant.block_in)
             for x in w.reshape(-1, *kernel_shape[lead:])]
    return (np.stack([q for q, _ in pairs]).reshape(kernel_shape),
            np.stack([s for _, s in pairs]).reshape(scale_shape))
