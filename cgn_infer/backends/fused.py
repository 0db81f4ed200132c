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
from dataclasses import dataclass
from typing import Any

import numpy as np

from cgn_core.kv.blockhash import BLOCK_SIZE
from cgn_infer.backends.paged import BatchLayout
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


# layer.c's KV_F32, KV_F16, KV_BF16: the pool's element type, by its name (a torch
# dtype's without "torch."; the C backend keeps bfloat16 as uint16 bits)
KV_TYPES = {"float32": 0, "float16": 1, "bfloat16": 2}


def _vector(t: Any) -> Any:
    """A float32 contiguous vector (a torch tensor, or the C backend's numpy array)."""
    if isinstance(t, np.ndarray):
        assert t.dtype == np.float32 and t.flags.c_contiguous
    else:
        assert str(t.dtype) == "torch.float32" and t.is_contiguous()
    return t


def rope_pairs(args: Args, max_pos: int) -> np.ndarray:
    """RoPE's rotations for adjacent pairs: [max_pos, hd/2, 2] float32 (cos, sin), from
    float64 angles; the torch backend's complex table is the same numbers."""
    exps = np.arange(0, args.rope_dim, 2, dtype=np.float64) / args.rope_dim
    ang = np.outer(np.arange(max_pos, dtype=np.float64), args.rope_theta**-exps)
    return np.stack((np.cos(ang), np.sin(ang)), axis=-1).astype(np.float32)


@dataclass(frozen=True, slots=True)
class KvPool:
    """Where a KV pool's keys and values are ([layers, blocks, 16, KVH, hd] each, contiguous,
    one element type), as layer.c reads them; the owner keeps the memory alive."""

    k: int  # addresses of layer 0
    v: int
    layer_bytes: int
    blocks: int
    dtype: str  # a KV_TYPES name

    def __post_init__(self) -> None:
        if self.dtype not in KV_TYPES:
            raise ValueError(f"KV pool element type {self.dtype!r}: one of {', '.join(KV_TYPES)}")


class FusedLayers:
    """A part's layers as layer.c descriptors; `run` is `run_layers` for them."""

    def __init__(
        self, kernels: Kernels, args: Args, layers: Sequence[LayerWeights[Any]], rope: np.ndarray
    ):
        """`rope`: [positions, hd/2, 2] float32 (cos, sin), `rope_pairs`."""
        self.lib = kernels.lib
        self.args = args
        self.rope = np.ascontiguousarray(rope, dtype=np.float32)
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
        x: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        paged: tuple[np.ndarray, np.ndarray, np.ndarray],
        pool: KvPool,
        lora: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> np.ndarray:
        """x [T, D] float32 after every layer (a new array); `pool` the KV pool's layers;
        `lora`: each row's adapter slot (-1: none) and scale, None where no row has one."""
        tables, seq, lengths = paged
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        slot = np.ascontiguousarray(slots, dtype=np.int64)
        capacity = pool.blocks * BLOCK_SIZE
        if len(pos) and (pos.min() < 0 or pos.max() >= self.rope.shape[0]):
            raise ValueError(f"positions must lie in 0..{self.rope.shape[0] - 1}")
        if len(slot) and (slot.min() < 0 or slot.max() >= capacity):
            raise ValueError(f"KV slots must lie in 0..{capacity - 1}")
        x = np.array(x, dtype=np.float32, order="C")  # updated in place: never the caller's
        slots_of = scales = None
        if lora is not None:
            slots_of = np.ascontiguousarray(lora[0], dtype=np.int64)
            scales = np.ascontiguousarray(lora[1], dtype=np.float32)
            assert len(slots_of) == len(scales) == x.shape[0]
        step = _Step(
            rows=x.shape[0],
            table_width=tables.shape[1],
            kv_type=KV_TYPES[pool.dtype],
            positions=address(pos),
            slots=address(slot),
            tables=address(tables),
            seq=address(seq),
            lengths=address(lengths),
            rope=address(self.rope),
            lora_slot=None if slots_of is None else address(slots_of),
            lora_scale=None if scales is None else address(scales),
        )
        for i, desc in enumerate(self.layers):
            rc = self.lib.cgn_layer(
                ctypes.byref(desc),
                _ptr(pool.k + i * pool.layer_bytes),
                _ptr(pool.v + i * pool.layer_bytes),
                ctypes.byref(step),
                address(x),
            )
            if rc != 0:
                raise MemoryError("cgn_layer: no memory for the step's scratch")
        return x


def paged_rows(lay: BatchLayout, pool_blocks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The C attention's view of a step: every sequence's block table (padded), the table
    each row reads and how many positions it attends to. Checked here, because the kernel
    trusts them: every block inside the pool, every length inside its table."""
    parts = [(d.rows, np.arange(len(d.rows)), d.lengths, list(d.tables)) for d in lay.decodes]
    parts += [
        (
            np.arange(p.rows.start, p.rows.stop),
            np.zeros(p.length - p.start, np.int64),
            np.arange(p.start + 1, p.length + 1),
            [p.table],
        )
        for p in lay.prefills
    ]
    all_rows = np.concatenate([r for r, *_ in parts])
    order = np.argsort(all_rows, kind="stable")
    tables: list[np.ndarray] = []
    seq_parts, length_parts = [], []
    for _, local, lens, tabs in parts:
        seq_parts.append(local + len(tables))
        length_parts.append(lens)
        tables.extend(tabs)
    seq = np.concatenate(seq_parts)[order]
    lengths = np.concatenate(length_parts)[order].astype(np.int64, copy=False)
    width = max(len(t) for t in tables)
    padded = np.zeros((len(tables), width), dtype=np.int64)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = t
    if padded.min() < 0 or padded.max() >= pool_blocks or lengths.max() > width * BLOCK_SIZE:
        raise ValueError(f"block tables reach outside the KV pool of {pool_blocks} blocks")
    return padded, seq, lengths
