"""The llama-family transformer in MLX (Apple silicon; `mlx[cpu]` runs it, slowly, on Linux).

mlx-lm style: weights as mx.arrays, mx.fast kernels for RMSNorm and
attention, the paged KV pool and the block tables passed in explicitly (the
same BatchLayout as the torch backend). q/k rows arrive in adjacent-pair order
(weights.load_weights(rope_pairs=True)), so RoPE rotates adjacent pairs, from
a cos/sin table indexed by each token's own position (a batch mixes
positions, which mx.fast.rope's single offset cannot express).

NOTE: MLX arrays are functional; writing new K/V into the pool is a scatter
that MLX performs in place only when nothing else holds the pool array. Not
tuned for Apple GPUs yet.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from cgn_core.kv.blockhash import BLOCK_SIZE
from cgn_core.text.gguf_file import GGUFFile
from cgn_infer.backends.base import SingleSequence
from cgn_infer.backends.paged import BatchItem, BatchLayout, layout
from cgn_infer.models.args import Args
from cgn_infer.weights import LayerWeights, ModelWeights, Role, load_weights


def default_dtype() -> mx.Dtype:
    # Apple GPUs run float16 fast; the Linux CPU build is most accurate and no slower in float32.
    return mx.float16 if platform.system() == "Darwin" else mx.float32


@dataclass(slots=True)
class MlxPagedKV:
    """The KV pool, per layer [blocks * BLOCK_SIZE, KVH, hd] for keys and for values."""

    k: list[mx.array]
    v: list[mx.array]


@dataclass(slots=True)
class MlxStep:
    """A BatchLayout as MLX index arrays and masks, built once per step for every layer."""

    slots: mx.array  # [T]
    decodes: list[tuple[mx.array, mx.array, mx.array]]  # rows [B], slots [B, S], mask
    prefills: list[tuple[slice, mx.array, mx.array]]  # rows, slots [S], causal mask [n, S]

    @classmethod
    def build(cls, lay: BatchLayout) -> MlxStep:
        step = cls(mx.array(lay.slots), [], [])
        for d in lay.decodes:
            b, width = d.tables.shape[0], d.tables.shape[1] * BLOCK_SIZE
            idx = (d.tables[:, :, None] * BLOCK_SIZE + np.arange(BLOCK_SIZE)).reshape(b, width)
            mask = (mx.arange(width)[None, :] < mx.array(d.lengths)[:, None])[:, None, None]
            step.decodes.append((mx.array(d.rows), mx.array(idx), mask))
        for p in lay.prefills:
            idx = (p.table[:, None] * BLOCK_SIZE + np.arange(BLOCK_SIZE)).reshape(-1)[: p.length]
            q_pos = mx.arange(p.start, p.length)[:, None]
            step.prefills.append((p.rows, mx.array(idx), mx.arange(p.length)[None, :] <= q_pos))
        return step


class MlxBackend(SingleSequence):
    name = "mlx"

    def __init__(
        self,
        gguf: GGUFFile,
        args: Args,
        *,
        dtype: mx.Dtype | None = None,
        progress: Callable[[int, int], None] | None = None,
        layers: tuple[int, int] | None = None,
        ends: bool = True,
    ):
        """`layers` and `ends` as in `load_weights` (a pipeline part)."""
        self.args = args
        self.dtype = dtype or default_dtype()

        def convert(a: np.ndarray, role: Role, groups: np.ndarray | None) -> mx.array:
            arr = mx.array(np.ascontiguousarray(a))
            return arr.astype(self.dtype) if role == "matrix" else arr.astype(mx.float32)

        self.w: ModelWeights[mx.array] = load_weights(
            gguf, args, convert, progress, rope_pairs=True, layers=layers, ends=ends
        )
        self.first, self.end = self.w.first, self.w.first + len(self.w.layers)
        self.n_local = len(self.w.layers)
        exps = np.arange(0, args.rope_dim, 2, dtype=np.float64) / args.rope_dim
        ang = np.outer(np.arange(args.ctx_len, dtype=np.float64), args.rope_theta**-exps)
        self.cos, self.sin = mx.array(np.cos(ang), mx.float32), mx.array(np.sin(ang), mx.float32)
        mx.eval(*(t for t in (self.w.tok_embd, self.w.output) if t is not None))

    def weight_bytes(self) -> int:
        """Bytes held by the weight matrices."""
        mats = [
            m
            for layer in self.w.layers
            for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)
        ]
        return sum(m.nbytes for m in mats) + (
            self.w.output.nbytes if self.w.output is not None else 0
        )

    def kv_bytes_per_token(self) -> int:
        a = self.args
        return 2 * self.n_local * a.n_kv_heads * a.head_dim * self.dtype.size

    def new_kv(self, num_blocks: int) -> MlxPagedKV:
        a = self.args
        shape = (num_blocks * BLOCK_SIZE, a.n_kv_heads, a.head_dim)
        return MlxPagedKV(
            [mx.zeros(shape, dtype=self.dtype) for _ in range(self.n_local)],
            [mx.zeros(shape, dtype=self.dtype) for _ in range(self.n_local)],
        )

    def kv_nbytes(self, kv: MlxPagedKV) -> int:
        return sum(a.nbytes for a in (*kv.k, *kv.v))

    def kv_layout(self) -> tuple[str, int, int, int]:
        a = self.args
        return (
            {mx.float16: "float16", mx.bfloat16: "bfloat16"}.get(self.dtype, "float32"),
            self.n_local,
            a.n_kv_heads,
            a.head_dim,
        )

    def read_blocks(self, kv: MlxPagedKV, ids: Sequence[int]) -> np.ndarray:
        slots = mx.array(_block_slots(ids))
        per = [mx.stack([layer[slots] for layer in side]) for side in (kv.k, kv.v)]
        blocks = mx.stack(per).reshape(2, len(kv.k), len(ids), BLOCK_SIZE, *kv.k[0].shape[1:])
        out = blocks.transpose(2, 0, 1, 3, 4, 5).view(mx.uint8)  # [n, 2, L, 16, KVH, hd] bytes
        return np.array(out).reshape(len(ids), -1)

    def write_blocks(self, kv: MlxPagedKV, ids: Sequence[int], data: np.ndarray) -> None:
        a = self.args
        shape = (len(ids), 2, self.n_local, BLOCK_SIZE, a.n_kv_heads, a.head_dim)
        src = mx.array(np.ascontiguousarray(data)).view(self.dtype).reshape(shape)
        slots = mx.array(_block_slots(ids))
        flat = (len(ids) * BLOCK_SIZE, a.n_kv_heads, a.head_dim)
        for i in range(self.n_local):
            kv.k[i][slots] = src[:, 0, i].reshape(flat)
            kv.v[i][slots] = src[:, 1, i].reshape(flat)
        mx.eval(*kv.k, *kv.v)

    def forward_batch(
        self, items: Sequence[BatchItem], kv: MlxPagedKV, *, all_logits: bool = False
    ) -> np.ndarray:
        lay = layout(items)
        x = self.run_layers(self.embed(lay), lay, kv)
        return self.logits(x, None if all_logits else lay.last_rows, kv)

    # The three parts of a step, which a pipeline runs in different processes.

    def embed(self, lay: BatchLayout) -> mx.array:
        """The step's token embeddings [T, D] float32 (a part with the ends only)."""
        assert self.w.tok_embd is not None
        return self.w.tok_embd[mx.array(lay.ids)]

    def run_layers(self, x: mx.array, lay: BatchLayout, kv: MlxPagedKV) -> mx.array:
        """This part's layers over the residual stream `x` [T, D]; K/V into `kv`."""
        a = self.args
        if not self.w.layers:
            return x
        pos = mx.array(lay.positions)
        rot = (self.cos[pos][:, None, :], self.sin[pos][:, None, :])  # [T, 1, hd/2] each
        step = MlxStep.build(lay)
        for i, layer in enumerate(self.w.layers):
            h = mx.fast.rms_norm(x, layer.attn_norm, a.norm_eps)
            x = x + self._attention(layer, i, h, rot, step, kv)
            h = mx.fast.rms_norm(x, layer.ffn_norm, a.norm_eps)
            gate, up = mx.split(h.astype(self.dtype) @ layer.w_gate_up.T, 2, axis=-1)  # [T, F]
            x = x + ((gate * mx.sigmoid(gate)) * up @ layer.w_down.T).astype(mx.float32)
        mx.eval(x, *kv.k, *kv.v)
        return x

    def logits(self, x: mx.array, rows: np.ndarray | None, kv: MlxPagedKV) -> np.ndarray:
        """float32 logits [len(rows) or T, V] of `x`'s `rows` (all when None)."""
        a, w = self.args, self.w
        assert w.out_norm is not None and w.output is not None
        if rows is not None:
            x = x[mx.array(rows)]  # [N, D]
        h = mx.fast.rms_norm(x, w.out_norm, a.norm_eps).astype(self.dtype)
        logits = (h @ w.output.T).astype(mx.float32)  # [N|T, V]
        mx.eval(logits, *kv.k, *kv.v)
        return np.array(logits)

    # The numpy boundary a pipeline crosses (wire format: float32 [rows, D]).

    def from_numpy(self, x: np.ndarray) -> mx.array:
        return mx.array(x)

    def to_numpy(self, x: mx.array, rows: np.ndarray | None = None) -> np.ndarray:
        return np.array(x if rows is None else x[mx.array(rows)], dtype=np.float32)

    def _attention(
        self,
        layer: LayerWeights[mx.array],
        index: int,
        h: mx.array,
        rot: tuple[mx.array, mx.array],
        step: MlxStep,
        kv: MlxPagedKV,
    ) -> mx.array:
        a = self.args
        n = h.shape[0]
        qkv = h.astype(self.dtype) @ layer.wqkv.T  # [T, (H+2KVH)*hd]
        if layer.bqkv is not None:
            qkv = qkv + layer.bqkv.astype(self.dtype)
        q, k, v = mx.split(qkv, [a.q_size, a.q_size + a.kv_size], axis=-1)
        q = _rope(q.reshape(n, a.n_heads, a.head_dim), *rot).astype(self.dtype)  # [T, H, hd]
        k = _rope(k.reshape(n, a.n_kv_heads, a.head_dim), *rot).astype(self.dtype)
        kv.k[index][step.slots] = k
        kv.v[index][step.slots] = v.reshape(n, a.n_kv_heads, a.head_dim)
        pool_k, pool_v = kv.k[index], kv.v[index]  # [NB*16, KVH, hd]
        out = mx.zeros((n, a.n_heads, a.head_dim), dtype=self.dtype)
        scale = a.head_dim**-0.5
        for rows, idx, mask in step.decodes:
            keys = pool_k[idx].transpose(0, 2, 1, 3)  # [B, KVH, S, hd]
            values = pool_v[idx].transpose(0, 2, 1, 3)
            dec = mx.fast.scaled_dot_product_attention(
                q[rows][:, :, None], keys, values, scale=scale, mask=mask
            )  # [B, H, 1, hd]
            out[rows] = dec[:, :, 0]
        for prows, idx, mask in step.prefills:
            keys = pool_k[idx].transpose(1, 0, 2)[None]  # [1, KVH, S, hd]
            values = pool_v[idx].transpose(1, 0, 2)[None]
            pre = mx.fast.scaled_dot_product_attention(
                q[prows].transpose(1, 0, 2)[None], keys, values, scale=scale, mask=mask
            )  # [1, H, n, hd]
            out[prows] = pre[0].transpose(1, 0, 2)
        return (out.reshape(n, a.q_size) @ layer.wo.T).astype(mx.float32)  # [T, D]


def _block_slots(ids: Sequence[int]) -> np.ndarray:
    """The pool slots of blocks `ids`, block by block."""
    return (np.asarray(ids, dtype=np.int64)[:, None] * BLOCK_SIZE + np.arange(BLOCK_SIZE)).ravel()


def _rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate adjacent pairs of x [T, heads, hd] by per-row angles (cos/sin [T, 1, hd/2])."""
    pairs = x.astype(mx.float32).reshape(*x.shape[:-1], -1, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    return mx.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(x.shape)
