"""The torch backend's layers in one C call each (cgn_infer/kernels/layer.c).

Taken when every matrix of every layer is a `QuantMatrix` (the `gguf` weights with a
kernel for each type), whatever the KV pool's type (float16, bfloat16 or float32): norms,
the QKV product and its bias, RoPE, the KV write, attention over the paged pool, the output
product, the residuals and the gated MLP run in C, with no torch op or Python between them.
Anything else (a tensor dequantized for want of a kernel, another device) keeps the torch
path.

The descriptors below mirror layer.c's structs field for field; each layer's is built once
at load and points into what the backend keeps alive (its QuantMatrix descriptors, the norm
vectors, the bias). A step's descriptor is built per step and checked here, because the
kernel trusts it: every position inside the RoPE table, every slot inside the pool.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from cgn_core.kv.blockhash import BLOCK_SIZE
from cgn_infer.backends.quantized import CMatrix, QuantMatrix, address
from cgn_infer.kernels import Kernels
from cgn_infer.models.args import Args
from cgn_infer.weights import LayerWeights

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Layer(ctypes.Structure):
    _fields_ = (
        ("dim", _i64),
        ("heads", _i64),
        ("kv_heads", _i64),
        ("head_dim", _i64),
        ("ffn", _i64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("attn_norm", _ptr),
        ("ffn_norm", _ptr),
        ("bqkv", _ptr),
        ("wqkv", CMatrix),
        ("wo", CMatrix),
        ("w_gate_up", CMatrix),
        ("w_down", CMatrix),
        ("lora", _ptr),
        ("lora_slots", _i64),
    )


class _Step(ctypes.Structure):
    _fields_ = (
        ("rows", _i64),
        ("table_width", _i64),
        ("kv_type", _i64),
        ("positions", _ptr),
        ("slots", _ptr),
        ("tables", _ptr),
        ("seq", _ptr),
        ("lengths", _ptr),
        ("rope", _ptr),
        ("lora_slot", _ptr),
        ("lora_scale", _ptr),
    )


# layer.c's KV_F32, KV_F16, KV_BF16: the pool's element type
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _vector(t: object) -> torch.Tensor:
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.is_contiguous()
    return t


class FusedLayers:
    """A part's layers as layer.c descriptors; `run` is `run_layers` for them."""

    def __init__(
        self, kernels: Kernels, args: Args, layers: Sequence[LayerWeights[Any]], rope: torch.Tensor
    ):
        self.lib = kernels.lib
        self.args = args
        self.rope = torch.view_as_real(rope).contiguous()  # [positions, hd/2, 2] float32
        self.layers = []
        for layer in layers:
            assert isinstance(layer.wqkv, QuantMatrix) and isinstance(layer.w_down, QuantMatrix)
            assert isinstance(layer.wo, QuantMatrix) and isinstance(layer.w_gate_up, QuantMatrix)
            bias = None if layer.bqkv is None else _vector(layer.bqkv)
            self.layers.append(
                _Layer(
                    dim=args.dim,
                    heads=args.n_heads,
                    kv_heads=args.n_kv_heads,
                    head_dim=args.head_dim,
                    ffn=layer.w_down.cols,
                    eps=args.norm_eps,
                    scale=args.head_dim**-0.5,
                    attn_norm=address(_vector(layer.attn_norm)),
                    ffn_norm=address(_vector(layer.ffn_norm)),
                    bqkv=None if bias is None else address(bias),
                    wqkv=layer.wqkv.desc,
                    wo=layer.wo.desc,
                    w_gate_up=layer.w_gate_up.desc,
                    w_down=layer.w_down.desc,
                )
            )

    def set_lora(self, tables: Sequence[ctypes.Array[Any]]) -> None:
        """Each layer's table of the loaded adapters' pairs by slot (cgn_infer/adapters.py);
        the caller keeps them alive. Only between steps (the worker thread reads them)."""
        assert len(tables) == len(self.layers)
        for desc, table in zip(self.layers, tables, strict=True):
            desc.lora = ctypes.cast(table, _ptr) if len(table) else None
            desc.lora_slots = len(table)

    @staticmethod
    def applies(layers: Sequence[LayerWeights[Any]]) -> bool:
        """Whether every layer's matrices have kernels (then the layers run in C)."""
        return all(
            isinstance(m, QuantMatrix)
            for lw in layers
            for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)
        )

    def run(
        self,
        x: torch.Tensor,
        positions: np.ndarray,
        slots: np.ndarray,
        paged: tuple[np.ndarray, np.ndarray, np.ndarray],
        pool_k: torch.Tensor,
        pool_v: torch.Tensor,
        lora: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> torch.Tensor:
        """x [T, D] after every layer; pool_k/pool_v [layers, blocks, 16, KVH, hd], float32,
        float16 or bfloat16 (both alike); `lora`: each row's adapter slot (-1: none) and
        scale, None where no row has one."""
        tables, seq, lengths = paged
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        slot = np.ascontiguousarray(slots, dtype=np.int64)
        capacity = pool_k.shape[1] * BLOCK_SIZE
        if len(pos) and (pos.min() < 0 or pos.max() >= self.rope.shape[0]):
            raise ValueError(f"positions must lie in 0..{self.rope.shape[0] - 1}")
        if len(slot) and (slot.min() < 0 or slot.max() >= capacity):
            raise ValueError(f"KV slots must lie in 0..{capacity - 1}")
        assert pool_k.is_contiguous() and pool_v.is_contiguous() and pool_k.dtype == pool_v.dtype
        x = x.float().contiguous().clone()  # updated in place: never the caller's buffer
        slots_of = scales = None
        if lora is not None:
            slots_of = np.ascontiguousarray(lora[0], dtype=np.int64)
            scales = np.ascontiguousarray(lora[1], dtype=np.float32)
            assert len(slots_of) == len(scales) == x.shape[0]
        step = _Step(
            rows=x.shape[0],
            table_width=tables.shape[1],
            kv_type=KV_TYPES[pool_k.dtype],
            positions=address(pos),
            slots=address(slot),
            tables=address(tables),
            seq=address(seq),
            lengths=address(lengths),
            rope=address(self.rope),
            lora_slot=None if slots_of is None else address(slots_of),
            lora_scale=None if scales is None else address(scales),
        )
        per_layer = pool_k.stride(0) * pool_k.element_size()
        k0, v0 = pool_k.data_ptr(), pool_v.data_ptr()
        for i, desc in enumerate(self.layers):
            rc = self.lib.cgn_layer(
                ctypes.byref(desc),
                _ptr(k0 + i * per_layer),
                _ptr(v0 + i * per_layer),
                ctypes.byref(step),
                address(x),
            )
            if rc != 0:
                raise MemoryError("cgn_layer: no memory for the step's scratch")
        return x
