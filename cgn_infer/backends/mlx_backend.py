"""The llama-family transformer in MLX (Apple silicon; `mlx[cpu]` runs it, slowly, on Linux).

mlx-lm style: weights as mx.arrays, mx.fast kernels for RMSNorm, RoPE and
attention, the KV cache passed in explicitly. q/k rows arrive in adjacent-
pair order (weights.load_weights(rope_pairs=True)), so RoPE is always the
"traditional" variant.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from cgn_infer.gguf_file import GGUFFile
from cgn_infer.models.args import Args
from cgn_infer.weights import LayerWeights, ModelWeights, Role, load_weights


def default_dtype() -> mx.Dtype:
    # Apple GPUs run float16 fast; the Linux CPU build is most accurate and no slower in float32.
    return mx.float16 if platform.system() == "Darwin" else mx.float32


@dataclass(slots=True)
class MlxKVCache:
    """One sequence's keys and values: per layer [1, KVH, max_tokens, hd]."""

    k: list[mx.array]
    v: list[mx.array]


class MlxBackend:
    name = "mlx"

    def __init__(
        self,
        gguf: GGUFFile,
        args: Args,
        *,
        dtype: mx.Dtype | None = None,
        progress: Callable[[int, int], None] | None = None,
    ):
        self.args = args
        self.dtype = dtype or default_dtype()

        def convert(a: np.ndarray, role: Role, groups: np.ndarray | None) -> mx.array:
            arr = mx.array(np.ascontiguousarray(a))
            return arr.astype(self.dtype) if role == "matrix" else arr.astype(mx.float32)

        self.w: ModelWeights[mx.array] = load_weights(
            gguf, args, convert, progress, rope_pairs=True
        )
        mx.eval(self.w.tok_embd, self.w.output)

    def new_cache(self, max_tokens: int) -> MlxKVCache:
        a = self.args
        shape = (1, a.n_kv_heads, max_tokens, a.head_dim)
        return MlxKVCache(
            [mx.zeros(shape, dtype=self.dtype) for _ in range(a.n_layers)],
            [mx.zeros(shape, dtype=self.dtype) for _ in range(a.n_layers)],
        )

    def forward(
        self, tokens: Sequence[int], start_pos: int, cache: MlxKVCache, *, all_logits: bool = False
    ) -> np.ndarray:
        a, w = self.args, self.w
        n = len(tokens)
        x = w.tok_embd[mx.array(list(tokens))]  # [T, D]
        mask = None
        if n > 1:  # causal within the chunk, full view of the cached past
            q_pos = mx.arange(start_pos, start_pos + n)[:, None]
            mask = mx.arange(start_pos + n)[None, :] <= q_pos  # [T, S]
        for i, layer in enumerate(w.layers):
            h = mx.fast.rms_norm(x, layer.attn_norm, a.norm_eps)
            x = x + self._attention(layer, i, h, mask, start_pos, cache)
            h = mx.fast.rms_norm(x, layer.ffn_norm, a.norm_eps)
            gate, up = mx.split(h.astype(self.dtype) @ layer.w_gate_up.T, 2, axis=-1)  # [T, F]
            x = x + ((gate * mx.sigmoid(gate)) * up @ layer.w_down.T).astype(mx.float32)
        x = x if all_logits else x[-1:]
        h = mx.fast.rms_norm(x, w.out_norm, a.norm_eps).astype(self.dtype)
        logits = (h @ w.output.T).astype(mx.float32)  # [T, V]
        mx.eval(logits, *cache.k, *cache.v)
        out = np.array(logits)
        return out if all_logits else out[0]

    def _attention(
        self,
        layer: LayerWeights[mx.array],
        index: int,
        h: mx.array,
        mask: mx.array | None,
        start_pos: int,
        cache: MlxKVCache,
    ) -> mx.array:
        a = self.args
        n = h.shape[0]
        qkv = h.astype(self.dtype) @ layer.wqkv.T  # [T, (H+2KVH)*hd]
        if layer.bqkv is not None:
            qkv = qkv + layer.bqkv.astype(self.dtype)
        q, k, v = mx.split(qkv, [a.q_size, a.q_size + a.kv_size], axis=-1)
        q = q.reshape(1, n, a.n_heads, a.head_dim).transpose(0, 2, 1, 3)  # [1, H, T, hd]
        k = k.reshape(1, n, a.n_kv_heads, a.head_dim).transpose(0, 2, 1, 3)  # [1, KVH, T, hd]
        v = v.reshape(1, n, a.n_kv_heads, a.head_dim).transpose(0, 2, 1, 3)
        q = mx.fast.rope(
            q, a.rope_dim, traditional=True, base=a.rope_theta, scale=1.0, offset=start_pos
        )
        k = mx.fast.rope(
            k, a.rope_dim, traditional=True, base=a.rope_theta, scale=1.0, offset=start_pos
        )
        end = start_pos + n
        cache.k[index][:, :, start_pos:end, :] = k
        cache.v[index][:, :, start_pos:end, :] = v
        keys, values = cache.k[index][:, :, :end, :], cache.v[index][:, :, :end, :]
        out = mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=a.head_dim**-0.5, mask=mask
        )  # [1, H, T, hd]
        return (out.transpose(0, 2, 1, 3).reshape(n, a.q_size) @ layer.wo.T).astype(mx.float32)
