"""The llama-family transformer in PyTorch (CPU here, CUDA where present).

Weights are stored per `weights`. `gguf` (the default on CPU) keeps every
matrix, the embedding and the LM head in the file's own quantized blocks and
multiplies them with cgn_infer/kernels (backends/quantized.py); a tensor whose
type has no kernel is dequantized to float32 instead, with a log line. The
others dequantize everything once at load: `int8` (per-row symmetric int8 +
scale, through torch's int8 weight-only GEMM), `int4` (Q4_0/Q4_1 only),
`auto`, `bfloat16`, `float16` or `float32`.
Activations, norms, RoPE and the residual stream run in float32 on CPU. K/V
live in one paged pool (`new_kv`, float32, float16 or bfloat16). With the gguf
kernels, each layer is one C call (backends/fused.py) that writes the new
tokens' K/V into their slots and attends over the pool in place, every row by
the same code (so results are batch-invariant); op by op, attention is that same
C kernel. Without kernels, each step writes K/V with one index_copy per layer and
reads each sequence's context through its block table (a gather of whole 16-token
blocks, padded and masked for decode rows, grouped by context width:
backends/paged.py), then runs SDPA.

RoPE always rotates adjacent pairs (one complex multiply): for NEOX-layout
models (qwen2) the q/k rows are permuted at load so that halves become
pairs. Attention scores are unchanged, since q and k are permuted alike.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from cgn_core.errors import ConfigError
from cgn_core.kv.blockhash import BLOCK_SIZE
from cgn_core.text.gguf_file import GGUFError, GGUFFile
from cgn_infer import kernels
from cgn_infer.backends.base import SingleSequence
from cgn_infer.backends.fused import KV_TYPES, FusedLayers, KvPool, paged_rows, rope_pairs
from cgn_infer.backends.paged import BatchItem, BatchLayout, layout
from cgn_infer.backends.quantized import QuantMatrix, address
from cgn_infer.kernels import KERNEL_TYPES
from cgn_infer.models.args import Args
from cgn_infer.weights import LayerWeights, ModelWeights, RawPart, Role, load_weights

log = logging.getLogger(__name__)

WEIGHT_FORMATS = ("gguf", "auto", "int4", "int8", "bfloat16", "float16", "float32")
_INT4_GROUP = 32  # the block size of GGUF's Q4/Q5/Q8 formats
_FLOAT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ONEDNN: bool = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]


class Linear:
    """One weight matrix [out, in] in the chosen storage format; `self(x)` = x @ W.T."""

    __slots__ = ("kind", "scale", "w")
    scale: torch.Tensor | None

    def __init__(self, w: torch.Tensor, kind: str, groups: np.ndarray | None = None):
        # int4 holds Q4_0/Q4_1 weights exactly (their own per-32 scale and min); anything
        # else would be re-quantized, so it takes int8 instead. torch's int4 GEMM is CPU-only.
        # auto: int4 where that is exact, float32 elsewhere. An int8 LM head
        # (SmolLM2's Q8_0 embedding re-quantized per row) is what broke parity with
        # llama.cpp at its bars; a bfloat16 one missed the top-1 bar too (92.9 % < 93 %).
        if kind == "auto":
            kind = "int4" if groups is not None and w.device.type == "cpu" else "float32"
        if kind == "int4" and (groups is None or w.device.type != "cpu"):
            kind = "int8"
        self.kind = kind
        if kind == "int4":
            assert groups is not None
            self.w, self.scale = _pack_int4(w, torch.from_numpy(groups))
        elif kind == "int8":
            scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [out]
            self.w = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
            self.scale = scale.to(torch.bfloat16)
        elif kind == "float32" and w.device.type == "cpu" and _ONEDNN:
            # NOTE: oneDNN's prepacked layout runs batched steps 1.5-2.5x faster than
            # F.linear on CPU (bench/results/infer_batching.md), and a row's result does not
            # depend on the rows batched with it, so batching cannot change greedy output.
            self.kind = "onednn"
            self.w = torch.ops.mkldnn._reorder_linear_weight(w.float())
            self.scale = None
        else:
            self.w = w.to(_FLOAT[kind])
            self.scale = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] float32 -> [T, out] float32
        if self.kind == "int4":
            assert self.scale is not None
            y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), self.w, _INT4_GROUP, self.scale
            )
            return y.float()
        if self.kind == "int8":
            assert self.scale is not None
            # NOTE: at every batch size: the old float path for more than 8 rows dequantized
            # the whole matrix per call (12x slower at 16 rows, bench/results/infer_profile.md),
            # and one kernel keeps a row's result independent of the rows batched with it
            return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.w, self.scale).float()
        if self.kind == "onednn":
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.w, None, "none", [], "")
            return out
        return F.linear(x.to(self.w.dtype), self.w).float()

    def nbytes(self) -> int:
        extra = self.scale.numel() * self.scale.element_size() if self.scale is not None else 0
        return self.w.numel() * self.w.element_size() + extra


def _pack_int4(w: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4 weights (value = scale * q + min per group of 32 along `in`) in torch's CPU int4
    GEMM format: w = (q - 8) * scale + zero, scales/zeros [in/32, out, 2] in bf16."""
    out, inp = w.shape
    values = w.float().view(out, inp // _INT4_GROUP, _INT4_GROUP)
    scale, lo = groups[..., 0], groups[..., 1]  # [out, in/32] each
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = ((values - lo[..., None]) / safe[..., None]).round().clamp(0, 15).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(out, inp), 2)
    scales_zeros = torch.stack([scale.t(), (lo + 8 * scale).t()], dim=-1).to(torch.bfloat16)
    return packed, scales_zeros.contiguous()


@dataclass(slots=True)
class PagedKV:
    """The KV pool: [layers, blocks, BLOCK_SIZE, KVH, hd] for keys and for values."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass(slots=True)
class StepTensors:
    """A BatchLayout as tensors, built once per step and read by every layer."""

    slots: torch.Tensor  # [T]
    decodes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # rows [B], tables, mask
    only_decode: bool  # one group of every row, in order: the batch is the group
    prefills: list[tuple[slice, torch.Tensor, torch.Tensor]]  # rows, table [NB], mask [n, S]
    # for the C attention instead of the above: tables [G, NB], each row's table [T], lengths [T]
    paged: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def rope_table(args: Args, max_pos: int, device: torch.device) -> torch.Tensor:
    """Complex rotations [max_pos, hd/2] for adjacent-pair RoPE (`fused.rope_pairs`)."""
    return torch.view_as_complex(torch.from_numpy(rope_pairs(args, max_pos))).to(device)


def _load(
    gguf: GGUFFile,
    args: Args,
    device: torch.device,
    weights: str,
    lib: kernels.Kernels | None,
    progress: Callable[[int, int], None] | None,
    layers: tuple[int, int] | None,
    ends: bool,
) -> ModelWeights[Weight]:
    """The model's weights on `device`: matrices the kernels `lib` take stay quantized
    (QuantMatrix), the rest dense (`weights`' format; float32 for a GGUF's)."""
    dense = "float32" if weights == "gguf" else weights
    unsupported: Counter[str] = Counter()

    def convert(a: np.ndarray, role: Role, groups: np.ndarray | None) -> Weight:
        t = torch.from_numpy(a if a.flags.writeable else a.copy()).to(device)
        # The embedding is looked up by row, so it stays float32 like the vectors.
        return Linear(t, dense, groups) if role == "matrix" else t.float()

    def raw(role: Role, parts: list[RawPart]) -> Weight | None:
        if lib is None:
            return None
        if not QuantMatrix.supports(parts):  # the whole fused matrix goes dense
            unsupported.update(p.type_name for p in parts if p.type_name not in KERNEL_TYPES)
            return None
        return QuantMatrix(lib, parts)

    loaded: ModelWeights[Weight] = load_weights(
        gguf, args, convert, progress, rope_pairs=True, raw=raw, layers=layers, ends=ends
    )
    if unsupported:
        types = ", ".join(f"{t} ({n} parts)" for t, n in sorted(unsupported.items()))
        log.info(
            "%s: no quantized kernel for %s; those tensors (and any fused with them) are "
            "dequantized to float32",
            gguf.path.name,
            types,
        )
    return loaded


class TorchBackend(SingleSequence):
    """A llama-family model on torch."""

    name = "torch"

    def __init__(
        self,
        gguf: GGUFFile,
        args: Args,
        *,
        device: str = "cpu",
        weights: str = "gguf",
        kv_dtype: str = "float16",
        threads: int = 0,
        decode_threads: int = 0,
        progress: Callable[[int, int], None] | None = None,
        layers: tuple[int, int] | None = None,
        ends: bool = True,
        fused: bool = True,
    ):
        """`layers` (first, end) and `ends` as in `load_weights`: a pipeline part (the head
        with its first layers and both ends, or a stage with a middle range and no ends).
        `fused=False` keeps the op-by-op torch layers where the one-call C layers
        (backends/fused.py) would apply: the benchmark and tests compare the two."""
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}")
        if args.rope_dim != args.head_dim:
            raise GGUFError(
                f"{gguf.path}: partial RoPE (rope_dim {args.rope_dim}) is not supported"
            )
        # NOTE: a single-stream decode step uses every thread too: served, 2 threads decode
        # 1.3-1.5x faster than 1 on 2 cores (bench/results/infer_decode_threads.md). An older
        # measurement on another machine had the team stalling behind the event loop.
        self.threads = threads if threads > 0 else torch.get_num_threads()
        self.decode_threads = decode_threads if decode_threads > 0 else self.threads
        torch.set_num_threads(self.threads)
        self.args = args
        self.device = torch.device(device)
        self.kv_dtype = _FLOAT[kv_dtype]
        self.kv_name = kv_dtype  # the pool's element type by name (fused.KV_TYPES, kv_layout)

        lib = None
        if weights == "gguf":
            lib = kernels.load() if self.device.type == "cpu" else None
            if lib is None:
                why = kernels.failure() if self.device.type == "cpu" else f"on {device}"
                log.warning("no quantized kernels (%s): weights dequantized to float32", why)
        self.w = _load(gguf, args, self.device, weights, lib, progress, layers, ends)
        self.first, self.end = self.w.first, self.w.first + len(self.w.layers)
        self.weights = weights if lib is not None or weights != "gguf" else "float32"
        # With the kernels, attention reads the pool in place (C); without, it gathers for SDPA.
        self._attend = lib
        self.rope = rope_table(args, args.ctx_len, self.device)
        self._fused = (
            FusedLayers(self._attend, args, self.w.layers, torch.view_as_real(self.rope).numpy())
            if fused and self._attend is not None and FusedLayers.applies(self.w.layers)
            else None
        )
        if self._fused is None and self._attend is not None and self.w.layers:
            log.info("layers run op by op in torch (a matrix without a kernel, or fused=False)")

    def set_lora(self, tables: Sequence[Any]) -> None:
        """The loaded LoRA adapters' tables, per layer (cgn_infer/adapters.py); ConfigError
        where the layers do not run in C (adapters run there only)."""
        if self._fused is None or len(tables) != len(self.w.layers):
            raise ConfigError(
                "LoRA adapters need the one-call C layers: GGUF weights with a kernel for "
                "every matrix (--dtype gguf) and every layer in this process"
            )
        self._fused.set_lora(tables)

    def weight_bytes(self) -> int:
        """Bytes held by the weight matrices (what a decode step streams from memory)."""
        total = 0
        for layer in self.w.layers:
            for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down):
                total += _l(m).nbytes()
        return total + (_l(self.w.output).nbytes() if self.w.output is not None else 0)

    def kv_bytes_per_token(self) -> int:
        a = self.args
        return 2 * len(self.w.layers) * a.n_kv_heads * a.head_dim * self.kv_dtype.itemsize

    def new_kv(self, num_blocks: int) -> PagedKV:
        a = self.args
        shape = (len(self.w.layers), num_blocks, BLOCK_SIZE, a.n_kv_heads, a.head_dim)
        if self.device.type != "cpu":
            return PagedKV(
                torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
            )
        # NOTE: numpy's zeros come from calloc, i.e. fresh zero pages for a pool this size: memory
        # is resident only once a block is written, so an idle 16k-token pool costs nothing.
        # torch.zeros writes every page at start.
        raw = np.dtype(np.float32 if self.kv_dtype == torch.float32 else np.uint16)

        def pool() -> torch.Tensor:
            return torch.from_numpy(np.zeros(shape, dtype=raw)).view(self.kv_dtype)

        return PagedKV(pool(), pool())

    @staticmethod
    def kv_pool(kv: PagedKV) -> KvPool:
        """The pool as the one-call C layers read it."""
        assert kv.k.is_contiguous() and kv.v.is_contiguous() and kv.k.dtype == kv.v.dtype
        layer_bytes = kv.k.stride(0) * kv.k.element_size()
        dtype = str(kv.k.dtype).removeprefix("torch.")
        return KvPool(kv.k.data_ptr(), kv.v.data_ptr(), layer_bytes, kv.k.shape[1], dtype)

    def kv_nbytes(self, kv: PagedKV) -> int:
        return kv.k.nbytes + kv.v.nbytes

    def kv_layout(self) -> tuple[str, int, int, int]:
        a = self.args
        return self.kv_name, len(self.w.layers), a.n_kv_heads, a.head_dim

    @torch.inference_mode()
    def read_blocks(self, kv: PagedKV, ids: Sequence[int]) -> np.ndarray:
        idx = torch.tensor(list(ids), dtype=torch.int64, device=self.device)
        out = torch.empty((len(idx), 2, *kv.k.shape[:1], *kv.k.shape[2:]), dtype=self.kv_dtype)
        out[:, 0] = kv.k.index_select(1, idx).transpose(0, 1).cpu()  # [n, L, 16, KVH, hd]
        out[:, 1] = kv.v.index_select(1, idx).transpose(0, 1).cpu()
        raw: np.ndarray = out.view(torch.uint8).reshape(len(idx), -1).numpy()
        return raw

    @torch.inference_mode()
    def write_blocks(self, kv: PagedKV, ids: Sequence[int], data: np.ndarray) -> None:
        idx = torch.tensor(list(ids), dtype=torch.int64, device=self.device)
        with warnings.catch_warnings():  # NOTE: a read-only mapping; it is only read from
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(data)
        src = raw.view(self.kv_dtype).view(len(idx), 2, kv.k.shape[0], *kv.k.shape[2:])
        kv.k.index_copy_(1, idx, src[:, 0].transpose(0, 1).to(self.device))
        kv.v.index_copy_(1, idx, src[:, 1].transpose(0, 1).to(self.device))

    @torch.inference_mode()
    def forward_batch(
        self, items: Sequence[BatchItem], kv: PagedKV, *, all_logits: bool = False
    ) -> np.ndarray:
        lay = layout(items)
        x = self.run_layers(self.embed(lay), lay, kv)
        return self.logits(x, None if all_logits else lay.last_rows, kv)

    # The three parts of a step, which a pipeline runs in different processes.

    @torch.inference_mode()
    def embed(self, lay: BatchLayout) -> torch.Tensor:
        """The step's token embeddings [T, D] float32 (a part with the ends only)."""
        ids = torch.from_numpy(lay.ids).to(self.device)
        table = self.w.tok_embd
        return table.rows(ids) if isinstance(table, QuantMatrix) else _t(table)[ids]

    @torch.inference_mode()
    def run_layers(self, x: torch.Tensor, lay: BatchLayout, kv: PagedKV) -> torch.Tensor:
        """This part's layers over the residual stream `x` [T, D]; K/V into `kv`."""
        a = self.args
        want = self.decode_threads if len(lay.ids) == 1 else self.threads
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
        if not self.w.layers:
            return x
        if self._fused is not None:
            paged = paged_rows(lay, kv.k.shape[1])
            rows = x.float().contiguous().numpy()
            out = self._fused.run(rows, lay.positions, lay.slots, paged, self.kv_pool(kv), lay.lora)
            return torch.from_numpy(out)
        if lay.lora is not None:  # Adapters refuses to load where the layers are not fused
            raise RuntimeError("LoRA adapters run on the fused C layers only")
        step = self._step_tensors(lay, kv.k.shape[1])
        rot = self.rope[torch.from_numpy(lay.positions).to(self.device)][:, None, :]  # [T, 1, hd/2]
        for i, layer in enumerate(self.w.layers):
            h = F.rms_norm(x, (a.dim,), _t(layer.attn_norm), a.norm_eps)
            x = x + self._attention(layer, i, h, rot, step, kv)
            h = F.rms_norm(x, (a.dim,), _t(layer.ffn_norm), a.norm_eps)
            gate, up = _l(layer.w_gate_up)(h).chunk(2, dim=-1)  # [T, F] each
            x = x + _l(layer.w_down)(F.silu(gate) * up)  # [T, D]
        return x

    # The numpy boundary a pipeline crosses (wire format: float32 [rows, D]).

    def from_numpy(self, x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(x).to(self.device)

    def to_numpy(self, x: torch.Tensor, rows: np.ndarray | None = None) -> np.ndarray:
        if rows is not None:
            x = x[torch.from_numpy(rows).to(self.device)]
        out: np.ndarray = x.float().cpu().numpy()
        return out

    @torch.inference_mode()
    def logits(
        self, x: torch.Tensor, rows: np.ndarray | None, kv: PagedKV | None = None
    ) -> np.ndarray:
        """float32 logits [len(rows) or T, V] of `x`'s `rows` (all when None)."""
        a, w = self.args, self.w
        if rows is not None:
            x = x[torch.from_numpy(rows).to(self.device)]  # [N, D]
        logits = _l(w.output)(F.rms_norm(x, (a.dim,), _t(w.out_norm), a.norm_eps))  # [N|T, V]
        out: np.ndarray = logits.cpu().numpy()
        return out

    def _step_tensors(self, lay: BatchLayout, pool_blocks: int) -> StepTensors:
        dev = self.device

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dev)

        only = len(lay.decodes) == 1 and len(lay.decodes[0].rows) == len(lay.ids)
        step = StepTensors(t(lay.slots), [], only, [])
        if self._attend is not None:  # every row: one kernel, one way (module docstring)
            step.paged = tuple(t(a) for a in paged_rows(lay, pool_blocks))  # type: ignore[assignment]
            return step
        for d in lay.decodes:
            width = d.tables.shape[1] * BLOCK_SIZE
            mask = torch.arange(width, device=dev)[None, :] < t(d.lengths)[:, None]  # [B, S]
            step.decodes.append((t(d.rows), t(d.tables), mask[:, None, None]))  # mask [B,1,1,S]
        for p in lay.prefills:  # causal within the chunk, full view of the cached past
            q_pos = torch.arange(p.start, p.length, device=dev)[:, None]
            mask = torch.arange(p.length, device=dev)[None, :] <= q_pos  # [n, S]
            step.prefills.append((p.rows, t(p.table), mask))
        return step

    def _attention(
        self,
        layer: LayerWeights[Weight],
        index: int,
        h: torch.Tensor,
        rot: torch.Tensor,
        step: StepTensors,
        kv: PagedKV,
    ) -> torch.Tensor:
        a = self.args
        n = h.shape[0]
        qkv = _l(layer.wqkv)(h)  # [T, (H+2KVH)*hd]
        if layer.bqkv is not None:
            qkv = qkv + _t(layer.bqkv)
        qk = qkv[:, : a.q_size + a.kv_size].reshape(n, a.n_heads + a.n_kv_heads, -1, 2)
        qk = torch.view_as_real(torch.view_as_complex(qk.contiguous()) * rot).flatten(-2)
        q, k = torch.split(qk, [a.n_heads, a.n_kv_heads], dim=1)  # [T, H, hd], [T, KVH, hd]
        v = qkv[:, a.q_size + a.kv_size :].view(n, a.n_kv_heads, a.head_dim)
        pool_k, pool_v = kv.k[index], kv.v[index]  # [NB, 16, KVH, hd]
        flat = (-1, a.n_kv_heads, a.head_dim)
        pool_k.view(flat).index_copy_(0, step.slots, k.to(self.kv_dtype))
        pool_v.view(flat).index_copy_(0, step.slots, v.to(self.kv_dtype))
        if step.paged is not None and self._attend is not None:
            att = self._attend_paged(q, pool_k, pool_v, step.paged, self._attend)
            return _l(layer.wo)(att.view(n, a.q_size))  # [T, D]
        return _l(layer.wo)(self._attend_sdpa(q, pool_k, pool_v, step))  # [T, D]

    def _attend_paged(
        self,
        q: torch.Tensor,
        pool_k: torch.Tensor,
        pool_v: torch.Tensor,
        paged: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        lib: kernels.Kernels,
    ) -> torch.Tensor:
        """Attention in C, reading the pool in place: [T, H, hd] float32."""
        a, n = self.args, q.shape[0]
        tables, seq, lengths = paged
        q = q.float().contiguous()
        att = torch.empty_like(q)
        rc = lib.lib.cgn_attend(
            address(q),
            address(pool_k),
            address(pool_v),
            KV_TYPES[self.kv_name],
            address(tables),
            tables.shape[1],
            address(seq),
            address(lengths),
            n,
            a.n_heads,
            a.n_kv_heads,
            a.head_dim,
            a.head_dim**-0.5,
            address(att),
        )
        if rc != 0:
            raise MemoryError("cgn_attend: no memory for the attention scores")
        return att

    def _attend_sdpa(
        self, q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, step: StepTensors
    ) -> torch.Tensor:
        """Attention with torch's SDPA over the gathered blocks: [T, H * hd] float32."""
        a, n = self.args, q.shape[0]
        flat = (-1, a.n_kv_heads, a.head_dim)
        q = q.to(self.kv_dtype)
        out = torch.empty(n, a.n_heads, a.head_dim, dtype=self.kv_dtype, device=self.device)
        for dec_rows, tables, mask in step.decodes:
            b = dec_rows.shape[0]
            keys = pool_k[tables].view(b, -1, *flat[1:]).transpose(1, 2)  # [B, KVH, S, hd]
            values = pool_v[tables].view(b, -1, *flat[1:]).transpose(1, 2)
            dec = F.scaled_dot_product_attention(
                (q if step.only_decode else q[dec_rows])[:, :, None],  # [B, H, 1, hd]
                keys,
                values,
                attn_mask=mask,
                enable_gqa=True,
            )  # [B, H, 1, hd]
            if step.only_decode:
                return dec.reshape(n, a.q_size).float()
            out[dec_rows] = dec[:, :, 0]
        for rows, table, mask in step.prefills:
            s = mask.shape[1]
            keys = pool_k[table].view(flat)[:s].transpose(0, 1)[None]  # [1, KVH, S, hd]
            values = pool_v[table].view(flat)[:s].transpose(0, 1)[None]
            pre = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], keys, values, attn_mask=mask, enable_gqa=True
            )  # [1, H, n, hd]
            out[rows] = pre[0].transpose(0, 1)
        return out.reshape(n, a.q_size).float()


Weight = torch.Tensor | Linear | QuantMatrix


def _t(x: Weight | None) -> torch.Tensor:
    assert isinstance(x, torch.Tensor)
    return x


def _l(x: Weight | None) -> Linear | QuantMatrix:
    assert isinstance(x, (Linear, QuantMatrix))
    return x
