"""A tiny safetensors reader: numpy views into an mmap of the file, bfloat16 included.

File layout: u64 little-endian header length n, n bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the raw little-endian tensor bytes (offsets relative to the data start).
"""
from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype(np.bool_),
}
_MAX_HEADER = 100 * 1024 * 1024


def read_header(path: str | Path) -> tuple[dict[str, Any], int]:
    """(header dict without __metadata__, byte offset of the data section)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{str(path)!r} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise ValueError(f"{str(path)!r}: safetensors header length {n} is implausible")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class SafeTensorsFile:
    """Read-only access to one .safetensors file; `get` returns zero-copy numpy views."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._header, self._data_start = read_header(self.path)
        with open(self.path, "rb") as f:
            size = self.path.stat().st_size
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        self._size = size
        for name, info in self._header.items():
            if info["dtype"] not in DTYPES:
                raise ValueError(f"{self.path.name}: tensor {name!r} has unsupported dtype {info['dtype']!r}")
            begin, end = info["data_offsets"]
            nbytes = int(np.prod(info["shape"], dtype=np.int64)) * DTYPES[info["dtype"]].itemsize
            if end - begin != nbytes or self._data_start + end > size or begin < 0:
                raise ValueError(f"{self.path.name}: tensor {name!r} has bad data_offsets {info['data_offsets']}")

    def keys(self) -> list[str]:
        return list(self._header)

    def __contains__(self, name: str) -> bool:
        return name in self._header

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        return DTYPES[self._header[name]["dtype"]]

    def nbytes(self, name: str) -> int:
        begin, end = self._header[name]["data_offsets"]
        return end - begin

    def get(self, name: str) -> np.ndarray:
        if name not in self._header:
            raise KeyError(f"{self.path.name} has no tensor {name!r}")
        info = self._header[name]
        dtype, shape = DTYPES[info["dtype"]], tuple(info["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if count == 0:
            return np.zeros(shape, dtype)
        begin = info["data_offsets"][0]
        arr = np.frombuffer(self._mmap, dtype=dtype, count=count, offset=self._data_start + begin)
        return arr.reshape(shape)
