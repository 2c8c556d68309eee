"""A GGUF file's metadata and tensor table, read in one pass of `struct` calls over a
memory map; each tensor's bytes are a numpy view of that map.

gguf-py's `GGUFReader` builds a numpy view for every metadata element: a 49k-token
vocabulary with its merges is ~440k views, about 4 s a read on this project's machines,
and a GGUF model was read three times at start-up. This reader gives the same field values
(`GGUFReader`'s `field.contents()`: strings as `str`, arrays as lists) in ~0.1 s.

Layout (GGUF v2 and v3, little-endian):

    "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata: key (u64 length + UTF-8) | value type u32 | value
              (an array: element type u32 | count u64 | elements)
    tensors:  name | n_dims u32 | dims u64 x n_dims (innermost first) | type u32 | offset u64
    padding to `general.alignment` (default 32), then the tensor data (offsets from there)
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# Metadata value types -> struct format of a scalar (8: string, 9: array are read apart).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# Tensor types stored as plain numpy elements; every other type is read as raw bytes, rows
# of `GGML_QUANT_SIZES` blocks (as gguf-py does, bfloat16 included).
_NUMPY_TYPES: dict[int, type] = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16,
                                 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass(slots=True)
class GGUFTensor:
    """One tensor of the file: `shape` as GGUF stores it (innermost dimension first) and
    `data` a read-only view of its bytes, shaped [outer dims..., row] (quantized types:
    rows of bytes, as `gguf.quants.dequantize` takes them)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # [n_dims] int64, innermost first
    data: np.ndarray


class GGUFFile:
    """The metadata (`fields`: key -> value) and tensors of one GGUF file."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buffer = memoryview(self._map)
        self._at = 0
        if bytes(self._buffer[:4]) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no 'GGUF' magic)")
        self._at = 4
        version, num_tensors, num_fields = self._unpack("<IQQ")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3; a "
                             "big-endian file reads as a huge version)")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            (value_type,) = self._unpack("<I")
            self.fields[key] = self._value(value_type)
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-self._at // alignment) * alignment
        self.tensors = [self._tensor(name, dims, raw_type, data_start + offset)
                        for name, dims, raw_type, offset in infos]

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._buffer, self._at)
        self._at += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = struct.unpack_from("<Q", self._buffer, self._at)
        start = self._at + 8
        self._at = start + length
        return str(self._buffer[start:self._at], "utf-8")

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            element_type, count = self._unpack("<IQ")
            if element_type in _SCALAR_FORMATS and element_type != 7:
                dtype = np.dtype(_SCALAR_FORMATS[element_type])
                values = np.frombuffer(self._buffer, dtype, count, self._at)
                self._at += dtype.itemsize * count
                return values.tolist()
            return [self._value(element_type) for _ in range(count)]
        fmt = _SCALAR_FORMATS.get(value_type)
        if fmt is None:
            raise ValueError(f"GGUF metadata value type {value_type} is not known")
        return self._unpack(fmt)[0]

    def _tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self._string()
        (n_dims,) = self._unpack("<I")
        dims = list(self._unpack(f"<{n_dims}Q"))
        raw_type, offset = self._unpack("<IQ")
        return name, dims, raw_type, offset

    def _tensor(self, name: str, dims: list[int], raw_type: int, start: int) -> GGUFTensor:
        import gguf

        tensor_type = gguf.GGMLQuantizationType(raw_type)
        outer = [int(d) for d in reversed(dims)]  # numpy order: innermost last
        dtype = _NUMPY_TYPES.get(raw_type)
        if dtype is not None:
            count = int(np.prod(outer)) if outer else 1
            data = np.frombuffer(self._buffer, dtype, count, start).reshape(outer)
        else:
            block, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
            if outer[-1] % block:
                raise ValueError(f"GGUF tensor {name!r}: {outer[-1]} columns are not whole "
                                 f"{tensor_type.name} blocks of {block}")
            row_bytes = outer[-1] // block * block_bytes
            count = int(np.prod(outer[:-1])) * row_bytes
            data = np.frombuffer(self._buffer, np.uint8, count, start).reshape(
                [*outer[:-1], row_bytes])
        return GGUFTensor(name, tensor_type, np.array(dims, dtype=np.int64), data)
