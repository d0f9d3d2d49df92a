"""Safetensors files, read lazily: the `safetensors` package parses and checks each
file; a tensor is a numpy view into one mmap of the file (bfloat16 and float8 included).

The package's own reads (`safe_open(path, framework="numpy").get_slice(name)[...]`)
are not used for the tensor bytes, because
- its numpy framework cannot return float8 (it looks the type up as
  `numpy.float8_e4m3fn`, which numpy lacks), and FP8 checkpoints need it;
- each read is a copy into a fresh buffer, in the file's layout, while models/weights.py
  slices each device's share in the param's layout (transposed, axes split) straight
  from a view, and hands a device an uncopied view where the layout allows. Reading
  each device's slice through `get_slice` loaded as fast on an 8-device mesh but
  ~10-15 % slower onto one device in the checkpoint's dtype (benchmarks/README.md,
  "Safetensors reading").
Safe to view without parsing anything here: opening a file, the package checks that
its tensors tile the data section exactly in offset order (no hole, no overlap, the
file fully covered), so a tensor starts where the one before it in `offset_keys()`
ends and the data section is the file's last sum(sizes) bytes.
"""
from __future__ import annotations

import math
import mmap
import os
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype(np.bool_),
}


class SafeTensorsFile:
    """Read-only access to one .safetensors file; `get` returns zero-copy numpy views,
    so slicing one reads only the slice's pages."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            handle = safe_open(str(self.path), framework="numpy")
        except SafetensorError as e:
            raise ValueError(f"{str(self.path)!r} is not a safetensors file: {e}") from None
        self._metadata = handle.metadata() or {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, np.dtype] = {}
        self._offsets: dict[str, int] = {}   # from the data section's start
        offset = 0
        for name in handle.offset_keys():
            info = handle.get_slice(name)
            if info.get_dtype() not in DTYPES:
                raise ValueError(f"{self.path.name}: tensor {name!r} has unsupported dtype "
                                 f"{info.get_dtype()!r}")
            self._shapes[name] = tuple(info.get_shape())
            self._dtypes[name] = DTYPES[info.get_dtype()]
            self._offsets[name] = offset
            offset += self.nbytes(name)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._data_start = size - offset

    def keys(self) -> list[str]:
        return list(self._shapes)

    def __contains__(self, name: str) -> bool:
        return name in self._shapes

    def metadata(self) -> dict[str, str]:
        """The header's __metadata__ (e.g. {"format": "pt"}); {} when it has none."""
        return dict(self._metadata)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> np.dtype:
        return self._dtypes[name]

    def nbytes(self, name: str) -> int:
        return math.prod(self._shapes[name]) * self._dtypes[name].itemsize

    def get(self, name: str) -> np.ndarray:
        if name not in self._shapes:
            raise KeyError(f"{self.path.name} has no tensor {name!r}")
        dtype, shape = self._dtypes[name], self._shapes[name]
        if math.prod(shape) == 0:
            return np.zeros(shape, dtype)
        return np.frombuffer(self._mmap, dtype, math.prod(shape),
                             self._data_start + self._offsets[name]).reshape(shape)
