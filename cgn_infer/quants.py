"""Dequantization of GGUF tensors to float32 (numpy), with a clear error for unknown types.

The block formats are ggml's; the arithmetic is the `gguf` package's numpy
implementation (cgn_core.text.gguf_file.dequantize), used one tensor at a time
straight from the mmap so peak memory is one float32 tensor beyond the loaded model.
"""

from __future__ import annotations

import numpy as np

from cgn_core.text import gguf_file
from cgn_core.text.gguf_file import GGUFError, GGUFFile

# Types this engine loads; every one is dequantized once at load time.
SUPPORTED = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)


def dequantize(gguf: GGUFFile, name: str) -> np.ndarray:
    """Tensor `name` as a float32 array of its (numpy-order) shape; a type this engine does
    not load is a GGUFError naming it."""
    info = gguf.tensors[name]
    if info.type_name not in SUPPORTED:
        raise GGUFError(
            f"{gguf.path}: tensor {name} is {info.type_name}, which cgn-infer cannot load "
            f"(supported: {', '.join(SUPPORTED)})"
        )
    return gguf_file.dequantize(gguf, name)


def q4_groups(gguf: GGUFFile, name: str) -> np.ndarray | None:
    """For Q4_0/Q4_1 tensors, each 32-value group's (scale, min) so that a value is
    exactly scale * q + min with q in 0..15: float32 [rows, cols / 32, 2]. None for
    other types (a 4-bit repacking of them is an approximation)."""
    info = gguf.tensors[name]
    if info.type_name not in ("Q4_0", "Q4_1"):
        return None
    size = 18 if info.type_name == "Q4_0" else 20
    blocks = gguf.raw(name).reshape(-1, size)
    scale = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    if info.type_name == "Q4_0":  # value = scale * (q - 8)
        low = -8.0 * scale
    else:  # value = scale * q + min
        low = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    rows = int(np.prod(info.shape[:-1]))
    return np.stack([scale, low], axis=-1).reshape(rows, info.shape[-1] // 32, 2)
