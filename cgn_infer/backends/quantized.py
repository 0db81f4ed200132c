"""Weight matrices kept in the GGUF file's own quantized blocks, for the torch backend on CPU.

A `QuantMatrix` is one or more tensors' block rows (a fused QKV may mix types,
e.g. Qwen's Q5_0 q/k with a Q8_0 v), multiplied by cgn_infer/kernels (C, OpenMP):
the activations are quantized to int8 per 32 values once per call, and every
part writes its columns of one output. Nothing is dequantized at load, so the
weights cost what the file costs, and memory is the file's mmap. `rows(ids)`
dequantizes just those rows, exactly (the embedding lookup).

What is exact: the weights, always (every supported type unpacks losslessly).
What is approximated: the activations, to int8 with a float scale per 32
values (as llama.cpp does for these types). Its error against float32 weights
and activations is measured in tests/test_quantized.py (logit correlation
above 0.9999 on random inputs).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np
import torch

from cgn_infer.kernels import KERNEL_TYPES, Kernels
from cgn_infer.weights import RawPart

_GROUP = 32


def address(t: torch.Tensor | np.ndarray) -> ctypes.c_void_p:
    """A tensor's or array's data, as the kernels take it."""
    return ctypes.c_void_p(t.data_ptr() if isinstance(t, torch.Tensor) else t.ctypes.data)


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


class QuantMatrix:
    """[out, in] = the parts' rows stacked; `self(x)` = x @ W.T in float32."""

    __slots__ = ("cols", "kernels", "out", "parts")

    def __init__(self, kernels: Kernels, parts: list[RawPart]):
        cols = {p.cols for p in parts}
        if len(cols) != 1 or next(iter(cols)) % _GROUP:
            names = [p.name for p in parts]
            raise ValueError(f"parts {names} do not share a width divisible by 32")
        self.kernels = kernels
        self.cols = cols.pop()
        self.parts = []  # (ggml type id, block rows [n, bytes], their address)
        for p in parts:
            rows = np.ascontiguousarray(p.rows)
            self.parts.append((KERNEL_TYPES[p.type_name], rows, address(rows)))
        self.out = sum(rows.shape[0] for _, rows, _ in self.parts)

    @staticmethod
    def supports(parts: list[RawPart]) -> bool:
        return all(p.type_name in KERNEL_TYPES for p in parts) and all(
            p.cols % _GROUP == 0 for p in parts
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] float32 -> [M, out] float32
        x = x.float().contiguous()
        m, k = x.shape
        lib = self.kernels.lib
        qa, da, sa = _activation_buffers(m, k)
        y = torch.empty((m, self.out), dtype=torch.float32)
        base, col, block = y.data_ptr(), 0, 0
        for type_id, rows, ptr in self.parts:
            n, row_bytes = rows.shape
            if (want := lib.cgn_activation_block(type_id)) != block:  # as layer.c's matmul
                lib.cgn_quantize_rows(address(x), m, k, want, qa, da, sa)
                block = want
            lib.cgn_qmatmul(
                type_id,
                ptr,
                row_bytes,
                n,
                k,
                qa,
                da,
                sa,
                m,
                ctypes.c_void_p(base + 4 * col),
                self.out,
            )
            col += n
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` as float32 [len(ids), in] (one part only: an embedding table)."""
        ((type_id, rows, ptr),) = self.parts
        idx = ids.to(torch.int64).contiguous()
        if idx.numel() and not (int(idx.min()) >= 0 and int(idx.max()) < rows.shape[0]):
            raise IndexError(f"row ids must lie in 0..{rows.shape[0] - 1}")
        out = torch.empty((idx.shape[0], self.cols), dtype=torch.float32)
        self.kernels.lib.cgn_dequantize_rows(
            type_id, ptr, rows.shape[1], self.cols, address(idx), idx.shape[0], address(out)
        )
        return out

    def nbytes(self) -> int:
        return sum(rows.nbytes for _, rows, _ in self.parts)
