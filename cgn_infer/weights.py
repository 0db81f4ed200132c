"""Model weights read from GGUF, fused for speed, converted tensor by tensor.

Fusions: attn_q/attn_k/attn_v become one QKV matrix (and bias), ffn_gate and
ffn_up one gate-up matrix, so a layer runs three weight matmuls plus the
output projection. `convert(array, role)` turns each fused float32 array
into the backend's own type right away (role: "embedding", "matrix" or
"vector"), so peak memory stays near one copy.

With `rope_pairs=True`, the q/k rows of NEOX-layout models (qwen2) are
reordered so that every backend can rotate adjacent pairs: each head's
[x0..x_{h-1}, x_h..x_{2h-1}] becomes [x0, x_h, x1, x_{h+1}, ...]. Attention is
unchanged because q and k are reordered alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

import numpy as np

from cgn_infer.gguf_file import GGUFError, GGUFFile
from cgn_infer.models.args import Args
from cgn_infer.quants import dequantize

T = TypeVar("T")
Role = Literal["embedding", "matrix", "vector"]


@dataclass(slots=True)
class LayerWeights(Generic[T]):
    attn_norm: T  # [D]
    wqkv: T  # [(H + 2*KVH) * hd, D]
    bqkv: T | None  # [(H + 2*KVH) * hd]
    wo: T  # [D, H * hd]
    ffn_norm: T  # [D]
    w_gate_up: T  # [2 * F, D]
    w_down: T  # [D, F]


@dataclass(slots=True)
class ModelWeights(Generic[T]):
    tok_embd: T  # [V, D]
    layers: list[LayerWeights[T]]
    out_norm: T  # [D]
    output: T  # [V, D] (converted from the embedding when tied)


def load_weights(
    gguf: GGUFFile,
    args: Args,
    convert: Callable[[np.ndarray, Role], T],
    progress: Callable[[int, int], None] | None = None,
    *,
    rope_pairs: bool = False,
) -> ModelWeights[T]:
    """Read, fuse and convert every weight; `progress(done, total)` after each layer."""

    def get(name: str) -> np.ndarray:
        if name not in gguf.tensors:
            raise GGUFError(f"{gguf.path}: tensor {name} is missing")
        return dequantize(gguf, name)

    def qkv(p: str, kind: str) -> np.ndarray:
        q, k, v = (get(p + f"attn_{x}.{kind}") for x in "qkv")
        if rope_pairs and args.rope_neox:
            q = neox_to_pairs(q, args.n_heads, args.head_dim)
            k = neox_to_pairs(k, args.n_kv_heads, args.head_dim)
        return np.concatenate([q, k, v])

    total = args.n_layers + 2
    embedding = get("token_embd.weight")
    tok_embd = convert(embedding, "embedding")
    if progress:
        progress(1, total)
    layers: list[LayerWeights[T]] = []
    for i in range(args.n_layers):
        p = f"blk.{i}."
        gate_up = np.concatenate([get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")])
        layers.append(
            LayerWeights(
                attn_norm=convert(get(p + "attn_norm.weight"), "vector"),
                wqkv=convert(qkv(p, "weight"), "matrix"),
                bqkv=convert(qkv(p, "bias"), "vector") if args.qkv_bias else None,
                wo=convert(get(p + "attn_output.weight"), "matrix"),
                ffn_norm=convert(get(p + "ffn_norm.weight"), "vector"),
                w_gate_up=convert(gate_up, "matrix"),
                w_down=convert(get(p + "ffn_down.weight"), "matrix"),
            )
        )
        if progress:
            progress(i + 2, total)
    out_norm = convert(get("output_norm.weight"), "vector")
    output = convert(embedding if args.tied_embeddings else get("output.weight"), "matrix")
    if progress:
        progress(total, total)
    return ModelWeights(tok_embd, layers, out_norm, output)


def neox_to_pairs(w: np.ndarray, n_heads: int, head_dim: int) -> np.ndarray:
    """Reorder each head's rows from halves layout to adjacent-pairs layout."""
    half = head_dim // 2
    order = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
    return w.reshape(n_heads, head_dim, *w.shape[1:])[:, order].reshape(w.shape)
