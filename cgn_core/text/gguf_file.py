"""A small, direct GGUF reader: header, metadata and tensor views over one mmap.

GGUF layout (version 2 and 3): magic "GGUF", uint32 version, uint64 tensor
count, uint64 metadata count; then the metadata key/values; then one info
record per tensor (name, dims innermost-first, ggml type, offset); then the
tensor data, aligned to `general.alignment` (32 by default). Numeric arrays are
read with numpy in one go, so a 150k-entry vocabulary parses in a fraction of
a second; tensor data is never copied here: each tensor is a numpy view of
the mmap, paged in from the page cache only when dequantized.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cgn_core.errors import InvalidRequest
from cgn_core.files import open_regular

GGUF_MAGIC = b"GGUF"

# GGUF metadata value types -> (struct format, numpy dtype) for fixed-size scalars.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "?"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9

# ggml tensor types: name, elements per block, bytes per block.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    30: ("BF16", 1, 2),
}


class GGUFError(InvalidRequest):
    """The file is not a GGUF file we can read, or uses something we do not support."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: outermost first (GGUF stores innermost first)
    ggml_type: int
    offset: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, (f"type#{self.ggml_type}", 0, 0))[0]

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


class GGUFFile:
    """An open GGUF file: `metadata`, `tensors` (by name) and `raw(name)` views."""

    def __init__(self, path: Path):
        self.path = path
        try:
            fd, _ = open_regular(path)  # NOTE: a FIFO or a device is refused, never waited on
            self._fh = os.fdopen(fd, "rb")
        except OSError as exc:
            raise GGUFError(f"cannot open model file {path}: {exc.strerror}") from None
        try:
            self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            self._fh.close()
            raise GGUFError(f"{path}: empty file, not a GGUF model") from None
        self._pos = 0
        try:
            self.metadata, self.tensors = self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, ValueError) as exc:
            self.close()
            raise GGUFError(f"{path}: truncated or corrupt GGUF header ({exc})") from None
        except GGUFError:
            self.close()
            raise

    def close(self) -> None:
        """Close the file; a mapping that `raw` views still use (a backend computing on
        the quantized blocks in place) stays mapped until the last of them is gone."""
        with contextlib.suppress(BufferError):
            self._mm.close()
        self._fh.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes (quantized blocks, or F32/F16 values) as a uint8 view of the mmap."""
        info = self.tensors[name]
        return np.frombuffer(self._mm, dtype=np.uint8, count=info.n_bytes, offset=info.offset)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return self.metadata[key]

    # ---- parsing ---------------------------------------------------------------

    def _read(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self._mm, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._read("<Q")
        raw = self._mm[self._pos : self._pos + n]
        self._pos += n
        return raw.decode("utf-8", errors="surrogateescape")

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._read(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            itype, count = self._read("<I"), self._read("<Q")
            if itype in _SCALARS:
                dtype = np.dtype(_SCALARS[itype][1])
                arr = np.frombuffer(self._mm, dtype=dtype, count=count, offset=self._pos)
                self._pos += dtype.itemsize * count
                return arr.copy()
            return [self._value(itype) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype}")

    def _parse(self) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
        if self._mm[:4] != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {bytes(self._mm[:4])!r})")
        self._pos = 4
        version = self._read("<I")
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported (2, 3 are)")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            metadata[key] = self._value(self._read("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._read("<Q") for _ in range(self._read("<I"))]
            infos.append((name, tuple(reversed(dims)), self._read("<I"), self._read("<Q")))
        align = int(metadata.get("general.alignment", 32))
        data_start = (self._pos + align - 1) // align * align
        tensors = {}
        for name, shape, gtype, rel in infos:
            if gtype not in GGML_TYPES:
                raise GGUFError(
                    f"{self.path}: tensor {name} has ggml type #{gtype}, which this reader "
                    f"does not know (known: {', '.join(t[0] for t in GGML_TYPES.values())})"
                )
            _, block, size = GGML_TYPES[gtype]
            n = int(np.prod(shape)) if shape else 1
            info = TensorInfo(name, shape, gtype, data_start + rel, n // block * size)
            if info.offset + info.n_bytes > len(self._mm):
                raise GGUFError(f"{self.path}: tensor {name} runs past the end of the file")
            tensors[name] = info
        return metadata, tensors


def dequantize(gguf: GGUFFile, name: str) -> np.ndarray:
    """Tensor `name` as a float32 array of its (numpy-order) shape: F32 and F16 as stored,
    every other type through the `gguf` package's numpy implementation of ggml's block
    formats (imported here: a dependency only of what loads weights: cgn-infer, the MLX
    conversion), one tensor at a time straight from the mmap."""
    info = gguf.tensors[name]
    raw = gguf.raw(name)
    if info.type_name == "F32":
        return raw.view(np.float32).reshape(info.shape)
    if info.type_name == "F16":
        return raw.view(np.float16).astype(np.float32).reshape(info.shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    rows = raw.reshape(-1, raw.size // (info.n_elements // info.shape[-1]))
    out = gguf_dequantize(rows, GGMLQuantizationType(info.ggml_type))
    return np.asarray(out, dtype=np.float32).reshape(info.shape)
