"""Weight matrices kept in the GGUF file's own quantized blocks, for the torch backend on CPU.

A `QuantMatrix` is one or more tensors' block rows (a fused QKV may mix types,
e.g. Qwen's Q5_0 q/k with a Q8_0 v), multiplied by cgn_infer/kernels (C, OpenMP)
in one call: the activations are quantized to int8 as llama.cpp quantizes them
for the parts' types, and every part writes its columns of one output. Nothing
is dequantized at load, so the weights cost what the file costs, and memory is
the file's mmap. `rows(ids)` dequantizes just those rows, exactly (the
embedding lookup).

What is exact: the weights, always (every supported type unpacks losslessly).
What is approximated: the activations, to int8 with a scale per 32 or 256
values (as llama.cpp does for these types). Its error against float32 weights
and activations is measured in tests/test_quantized.py (logit correlation
above 0.9999 on random inputs).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from cgn_infer.kernels import KERNEL_TYPES, Kernels
from cgn_infer.weights import RawPart

_GROUP = 32
MAX_PARTS = 4  # kernels/layer.c's MAX_PARTS
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def address(t: Any) -> ctypes.c_void_p:
    """A numpy array's or a torch tensor's data, as the kernels take it (torch is never
    imported here: the C backend runs without it)."""
    return ctypes.c_void_p(t.ctypes.data if isinstance(t, np.ndarray) else t.data_ptr())


_buffers = threading.local()


def _activation_buffers(m: int, k: int) -> tuple[ctypes.c_void_p, ...]:
    """Scratch for one call's quantized activations (int8 [m, k], scales and sums [m, k/32]),
    reused per thread and shape: a decode step makes ~120 calls, and three allocations each
    cost more than the quantization itself."""
    cache: dict[tuple[int, int], tuple[Any, ...]] = _buffers.__dict__.setdefault("c", {})
    bufs = cache.get((m, k))
    if bufs is None:
        if len(cache) > 64:  # prompt chunks of many sizes: keep it bounded
            cache.clear()
        groups = (m, k // _GROUP)
        arrays = (
            np.empty((m, k), np.int8),
            np.empty(groups, np.float32),
            np.empty(groups, np.float32),
        )
        bufs = cache[(m, k)] = (*(address(a) for a in arrays), arrays)  # the arrays stay alive
    return bufs[:3]


class CMatrix(ctypes.Structure):
    """kernels/layer.c's cgn_matrix, field for field: what its products read."""

    _fields_ = (
        ("parts", _i64),
        ("out", _i64),
        ("type", _i64 * MAX_PARTS),
        ("rows", _i64 * MAX_PARTS),
        ("row_bytes", _i64 * MAX_PARTS),
        ("data", _ptr * MAX_PARTS),
    )


class QuantMatrix:
    """[out, in] = the parts' rows stacked; `self(x)` = x @ W.T in float32."""

    __slots__ = ("cols", "desc", "kernels", "out", "parts")

    def __init__(self, kernels: Kernels, parts: list[RawPart]):
        cols = {p.cols for p in parts}
        if len(cols) != 1 or next(iter(cols)) % _GROUP:
            names = [p.name for p in parts]
            raise ValueError(f"parts {names} do not share a width divisible by 32")
        if len(parts) > MAX_PARTS:
            raise ValueError(f"{len(parts)} parts in one matrix (the kernels take {MAX_PARTS})")
        self.kernels = kernels
        self.cols = cols.pop()
        self.parts = []  # (ggml type id, block rows [n, bytes], their address)
        for p in parts:
            rows = np.ascontiguousarray(p.rows)
            self.parts.append((KERNEL_TYPES[p.type_name], rows, address(rows)))
        self.out = sum(rows.shape[0] for _, rows, _ in self.parts)
        self.desc = CMatrix(parts=len(self.parts), out=self.out)  # points into self.parts
        for i, (type_id, rows, ptr) in enumerate(self.parts):
            self.desc.type[i], self.desc.rows[i] = type_id, rows.shape[0]
            self.desc.row_bytes[i], self.desc.data[i] = rows.shape[1], ptr

    @staticmethod
    def supports(parts: list[RawPart]) -> bool:
        return len(parts) <= MAX_PARTS and all(
            p.type_name in KERNEL_TYPES and p.cols % _GROUP == 0 for p in parts
        )

    def __call__(self, x: Any) -> Any:
        """[M, in] float32 -> [M, out] float32: a numpy array for a numpy array, a (CPU)
        torch tensor for a torch tensor."""
        if isinstance(x, np.ndarray):
            return self.product(x)
        import torch  # the caller's: already imported

        return torch.from_numpy(self.product(x.float().contiguous().numpy()))

    def product(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        m, k = x.shape
        y = np.empty((m, self.out), dtype=np.float32)
        qa, da, sa = _activation_buffers(m, k)
        self.kernels.lib.cgn_matrix_product(
            ctypes.byref(self.desc), address(x), m, k, qa, da, sa, address(y)
        )
        return y

    def rows(self, ids: Any) -> Any:
        """Rows `ids` as float32 [len(ids), in] (one part only: an embedding table): a numpy
        array for numpy ids, a torch tensor for torch ids."""
        if isinstance(ids, np.ndarray):
            return self.rows_of(ids)
        import torch  # the caller's: already imported

        return torch.from_numpy(self.rows_of(ids.cpu().numpy()))

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        ((type_id, rows, ptr),) = self.parts
        idx = np.ascontiguousarray(ids, dtype=np.int64)
        if idx.size and not (int(idx.min()) >= 0 and int(idx.max()) < rows.shape[0]):
            raise IndexError(f"row ids must lie in 0..{rows.shape[0] - 1}")
        out = np.empty((idx.shape[0], self.cols), dtype=np.float32)
        self.kernels.lib.cgn_dequantize_rows(
            type_id, ptr, rows.shape[1], self.cols, address(idx), idx.shape[0], address(out)
        )
        return out

    def nbytes(self) -> int:
        return sum(rows.nbytes for _, rows, _ in self.parts)
