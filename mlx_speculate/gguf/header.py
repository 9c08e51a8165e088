"""The header of a GGUF file: metadata and the place, shape and type of each tensor.

gguf.GGUFReader is slow on a real file (it builds a numpy view per vocabulary entry); walking
the header alone is not. Layout (little-endian, version 2 or 3): magic, version, tensor count,
metadata count, the metadata (key, type, value), then per tensor its name, dimensions
(innermost first), type and offset into the aligned data section.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

_Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # outermost first, as numpy and MLX order it
    type: gguf.GGMLQuantizationType
    offset: int  # absolute, in bytes
    nbytes: int


@dataclass(frozen=True)
class Header:
    metadata: dict[str, Any]  # scalars and strings; arrays only when asked for by key
    tensors: list[TensorInfo]


_SCALAR_FORMATS = {
    gguf.GGUFValueType.UINT8: "<B",
    gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I",
    gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f",
    gguf.GGUFValueType.BOOL: "<?",
    gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
}
_STRING, _ARRAY = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY
_DEFAULT_ALIGNMENT = 32


def read_metadata(path: str | Path, arrays: Collection[str] = ()) -> dict[str, Any]:
    """The file's metadata: scalars and strings, plus the arrays named (a vocabulary, say)."""
    return read_header(Path(path), arrays).metadata


def read_header(path: Path, arrays: Collection[str] = ()) -> Header:
    """The header; a file that is not GGUF, or is cut short, is a ValueError naming it (one
    sentence saying where a truncated file ends: inside its header, or before its data)."""
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _HeaderParser(data, arrays).parse()
    except _Truncated as e:
        raise ValueError(f"{path} is truncated: {e}") from None
    except (ValueError, struct.error, UnicodeDecodeError) as e:  # bad magic, a bad type, ...
        raise ValueError(f"{path} is not a valid GGUF file: {e}") from e


class _Truncated(ValueError):
    """The file ends before its header or its tensor data does."""


class _HeaderParser:
    def __init__(self, data: mmap.mmap, arrays: Collection[str] = ()) -> None:
        self.data, self.pos = data, 0
        self.arrays = set(arrays)  # keys whose array values are kept; others are skipped

    def parse(self) -> Header:
        magic = bytes(self.data[:4])
        if magic != b"GGUF":
            raise ValueError(f"magic {magic!r} is not b'GGUF'")
        self.pos = 4
        version = self.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"version {version} is not supported (supported: 2, 3, little-endian)")
        n_tensors, n_metadata = self.unpack("<Q"), self.unpack("<Q")
        metadata = {}
        for _ in range(n_metadata):
            key = self.string()
            value = self.value(gguf.GGUFValueType(self.unpack("<I")), key in self.arrays)
            if value is not None:
                metadata[key] = value
        infos = []
        for _ in range(n_tensors):
            name = self.string()
            dims = [self.unpack("<Q") for _ in range(self.unpack("<I"))]
            kind = self.unpack("<I")
            if kind not in _Q._value2member_map_:
                raise ValueError(f"tensor {name!r} has unknown GGUF tensor type {kind}")
            infos.append((name, tuple(reversed(dims)), _Q(kind), self.unpack("<Q")))
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        start = -(-self.pos // alignment) * alignment
        if infos and start >= len(self.data):
            raise _Truncated(
                f"it ends after its header, at byte {len(self.data)}, with none of its "
                f"{len(infos)} tensors' data"
            )
        tensors = []
        for name, shape, kind, offset in infos:
            block, size = gguf.GGML_QUANT_SIZES[kind]
            if shape and shape[-1] % block:
                raise ValueError(
                    f"tensor {name!r} of type {kind.name} has rows of {shape[-1]} values, "
                    f"not a multiple of its block size {block}"
                )
            nbytes = math.prod(shape) // block * size
            if start + offset + nbytes > len(self.data):
                raise _Truncated(
                    f"tensor {name!r} ends at byte {start + offset + nbytes}, past the end of "
                    f"the file ({len(self.data)} bytes)"
                )
            tensors.append(TensorInfo(name, shape, kind, start + offset, nbytes))
        return Header(metadata, tensors)

    def unpack(self, fmt: str, many: bool = False) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise self.cut()
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return values if many else values[0]

    def cut(self) -> _Truncated:
        return _Truncated(f"the file ends at byte {len(self.data)}, inside its header")

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = self.data[self.pos : self.pos + n]
        if len(raw) != n:
            raise self.cut()
        self.pos += n
        return raw.decode("utf-8")

    def value(self, kind: gguf.GGUFValueType, keep: bool = False) -> Any:
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            return self.unpack(_SCALAR_FORMATS[kind])
        item, count = gguf.GGUFValueType(self.unpack("<I")), self.unpack("<Q")
        if keep and item == _STRING:
            return [self.string() for _ in range(count)]
        if keep and item in _SCALAR_FORMATS:
            return list(self.unpack(f"<{count}{_SCALAR_FORMATS[item][1:]}", many=True))
        if item in _SCALAR_FORMATS:
            self.pos += count * struct.calcsize(_SCALAR_FORMATS[item])
        elif item == _STRING:
            data, pos = self.data, self.pos
            try:
                for _ in range(count):  # the hot loop: ~100k vocabulary strings and merges
                    pos += 8 + struct.unpack_from("<Q", data, pos)[0]
            except struct.error:
                raise self.cut() from None
            self.pos = pos
        else:
            for _ in range(count):
                self.value(item)
        return None
