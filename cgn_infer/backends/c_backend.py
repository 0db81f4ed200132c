"""The C backend: a GGUF model whose every matrix has a kernel, run by cgn-infer's C
kernels alone, with no torch in the process.

What the torch backend does with `--dtype gguf` on CPU when every matrix has a kernel
(the one-call C layers of fused.py, the embedding rows and the LM head in C) needs none of
torch's operators: the step's only other work is its final RMS norm, in C here too. So
where that holds (`applies`, decided from the GGUF's tensor types before anything loads),
`backends/build.py` builds this one and torch is never imported: `import torch` was about
half of an engine's start (1.1-1.7 s) and ~190 MiB of its memory. Anything else (a matrix
type without a kernel, `--dtype float32`, a GPU, a pipeline stage) keeps the torch backend.

The KV pool, its block format and the layers' arithmetic are the torch backend's on CPU,
so blocks move between the two (the node's store, prefill/decode transfers) and a layer
computes the same bits in both; the final norm differs from torch's `rms_norm` in rounding
(its sum is in double, as llama.cpp's is). tests/test_c_backend.py compares the two.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cgn_core.kv.blockhash import BLOCK_SIZE
from cgn_core.text.gguf_file import GGUFError, GGUFFile
from cgn_infer.backends.base import SingleSequence
from cgn_infer.backends.fused import FusedLayers, KvPool, paged_rows, rope_pairs
from cgn_infer.backends.paged import BatchItem, BatchLayout, layout
from cgn_infer.backends.quantized import QuantMatrix, address
from cgn_infer.kernels import KERNEL_TYPES, Kernels
from cgn_infer.models.args import Args
from cgn_infer.weights import RawPart, Role, load_weights

# the pool's element type: numpy's, bfloat16 kept as its 16 bits
_KV = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


class NoKernel(ValueError):
    """A matrix this backend cannot run (the torch backend takes the model)."""


def applies(gguf: GGUFFile, args: Args) -> bool:
    """Whether every matrix of the model (the LM head too) is of a type with a kernel and a
    width the kernels take, from the file's tensor table (nothing is read)."""
    names = [
        f"blk.{i}.{t}.weight"
        for i in range(args.n_layers)
        for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    ]
    names.append("token_embd.weight" if args.tied_embeddings else "output.weight")
    for name in names:
        info = gguf.tensors.get(name)
        if info is None or info.type_name not in KERNEL_TYPES or info.shape[-1] % 32:
            return False
    return True


def cores() -> int:
    """The physical cores among the CPUs this process may run on (torch's default thread
    count): hyperthread siblings count once."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    seen = set()
    for cpu in cpus:
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(topo + "physical_package_id") as pkg, open(topo + "core_id") as core:
                seen.add((pkg.read(64).strip(), core.read(64).strip()))
        except OSError:
            seen.add(("cpu", str(cpu)))
    return len(seen) or len(cpus) or os.cpu_count() or 1


@dataclass(slots=True)
class CKV:
    """The KV pool: [layers, blocks, BLOCK_SIZE, KVH, hd] for keys and for values."""

    k: np.ndarray
    v: np.ndarray


class CBackend(SingleSequence):
    """A llama-family model on the C kernels (module docstring)."""

    name = "c"

    def __init__(
        self,
        gguf: GGUFFile,
        args: Args,
        lib: Kernels,
        *,
        kv_dtype: str = "float16",
        threads: int = 0,
        decode_threads: int = 0,
        progress: Callable[[int, int], None] | None = None,
    ):
        """NoKernel where a matrix has no kernel after all (check `applies` first)."""
        if args.rope_dim != args.head_dim:
            raise GGUFError(
                f"{gguf.path}: partial RoPE (rope_dim {args.rope_dim}) is not supported"
            )
        if kv_dtype not in _KV:
            raise ValueError(f"kv_dtype must be one of {', '.join(_KV)}")
        self.lib = lib
        self.args = args
        self.kv_dtype = kv_dtype
        self.threads = threads if threads > 0 else cores()
        self.decode_threads = decode_threads if decode_threads > 0 else self.threads
        self._threads = self.threads
        lib.lib.cgn_set_threads(self.threads)  # this (the loading, later stepping) thread's

        def convert(a: np.ndarray, role: Role, groups: np.ndarray | None) -> Any:
            if role == "matrix":
                raise NoKernel(f"{gguf.path.name}: a matrix without a kernel")
            return np.ascontiguousarray(a, dtype=np.float32)  # a vector, or the embedding

        def raw(role: Role, parts: list[RawPart]) -> Any:
            return QuantMatrix(lib, parts) if QuantMatrix.supports(parts) else None

        self.w = load_weights(gguf, args, convert, progress, rope_pairs=True, raw=raw)
        self._fused = FusedLayers(lib, args, self.w.layers, rope_pairs(args, args.ctx_len))
        assert isinstance(self.w.output, QuantMatrix) and self.w.out_norm is not None

    def set_lora(self, tables: Sequence[Any]) -> None:
        """The loaded LoRA adapters' tables, per layer (cgn_infer/adapters.py)."""
        self._fused.set_lora(tables)

    def kv_bytes_per_token(self) -> int:
        a = self.args
        return 2 * a.n_layers * a.n_kv_heads * a.head_dim * np.dtype(_KV[self.kv_dtype]).itemsize

    def new_kv(self, num_blocks: int) -> CKV:
        a = self.args
        shape = (a.n_layers, num_blocks, BLOCK_SIZE, a.n_kv_heads, a.head_dim)
        # NOTE: np.zeros is calloc: pages become resident only once a block is written
        return CKV(np.zeros(shape, _KV[self.kv_dtype]), np.zeros(shape, _KV[self.kv_dtype]))

    def kv_nbytes(self, kv: CKV) -> int:
        return int(kv.k.nbytes + kv.v.nbytes)

    def kv_layout(self) -> tuple[str, int, int, int]:
        a = self.args
        return self.kv_dtype, a.n_layers, a.n_kv_heads, a.head_dim

    def _ids(self, kv: CKV, ids: Sequence[int]) -> np.ndarray:
        idx = np.asarray(list(ids), dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= kv.k.shape[1]):
            raise IndexError(f"block ids must lie in 0..{kv.k.shape[1] - 1}")
        return idx

    def read_blocks(self, kv: CKV, ids: Sequence[int]) -> np.ndarray:
        idx = self._ids(kv, ids)
        out = np.empty((len(idx), 2, kv.k.shape[0], *kv.k.shape[2:]), dtype=kv.k.dtype)
        out[:, 0] = kv.k[:, idx].swapaxes(0, 1)  # [n, L, 16, KVH, hd]
        out[:, 1] = kv.v[:, idx].swapaxes(0, 1)
        return out.view(np.uint8).reshape(len(idx), -1)

    def write_blocks(self, kv: CKV, ids: Sequence[int], data: np.ndarray) -> None:
        idx = self._ids(kv, ids)
        src = data.view(kv.k.dtype).reshape(len(idx), 2, kv.k.shape[0], *kv.k.shape[2:])
        kv.k[:, idx] = src[:, 0].swapaxes(0, 1)
        kv.v[:, idx] = src[:, 1].swapaxes(0, 1)

    def forward_batch(
        self, items: Sequence[BatchItem], kv: CKV, *, all_logits: bool = False
    ) -> np.ndarray:
        lay = layout(items)
        x = self.run_layers(self.embed(lay), lay, kv)
        return self.logits(x, None if all_logits else lay.last_rows)

    def embed(self, lay: BatchLayout) -> np.ndarray:
        """The step's token embeddings [T, D] float32."""
        table = self.w.tok_embd
        if isinstance(table, QuantMatrix):
            return table.rows_of(lay.ids)
        assert isinstance(table, np.ndarray)
        if lay.ids.size and not (lay.ids.min() >= 0 and lay.ids.max() < len(table)):
            raise IndexError(f"token ids must lie in 0..{len(table) - 1}")
        rows: np.ndarray = table[lay.ids]
        return rows

    def run_layers(self, x: np.ndarray, lay: BatchLayout, kv: CKV) -> np.ndarray:
        """Every layer over the residual stream `x` [T, D]; K/V into `kv`."""
        want = self.decode_threads if len(lay.ids) == 1 else self.threads
        if want != self._threads:
            self.lib.lib.cgn_set_threads(want)
            self._threads = want
        pool = KvPool(
            kv.k.ctypes.data,
            kv.v.ctypes.data,
            kv.k.strides[0],
            kv.k.shape[1],
            self.kv_dtype,
        )
        paged = paged_rows(lay, kv.k.shape[1])
        return self._fused.run(x, lay.positions, lay.slots, paged, pool, lay.lora)

    def logits(self, x: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
        """float32 logits [len(rows) or T, V] of `x`'s `rows` (all when None)."""
        a, w = self.args, self.w
        if rows is not None:
            x = x[rows]
        x = np.ascontiguousarray(x, dtype=np.float32)
        h = np.empty_like(x)
        norm = w.out_norm
        assert isinstance(norm, np.ndarray) and isinstance(w.output, QuantMatrix)
        self.lib.lib.cgn_rms_norm(
            address(x), address(norm), x.shape[0], a.dim, a.norm_eps, address(h)
        )
        return w.output.product(h)
