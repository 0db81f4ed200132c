"""Model weights read from GGUF, fused for speed, converted tensor by tensor.

Fusions: attn_q/attn_k/attn_v become one QKV matrix (and bias), ffn_gate and
ffn_up one gate-up matrix, so a layer runs three weight matmuls plus the
output projection. `convert(array, role, groups)` turns each fused float32
array into the backend's own type right away (role: "embedding", "matrix" or
"vector"), so peak memory stays near one copy. For matrices stored as Q4_0 or
Q4_1, `groups` carries each 32-value group's exact (scale, min), so a 4-bit
backend format can hold the very same values.

A backend that computes on the file's own quantized blocks passes `raw`: each
matrix and the embedding are then offered to it first as `RawPart`s (the
tensors' block rows, straight from the mmap, never dequantized); where it
returns None (a type it has no kernel for), that tensor takes the dequantized
path above instead.

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

from cgn_core.text.gguf_file import GGUFError, GGUFFile, TensorInfo
from cgn_infer.models.args import Args
from cgn_infer.quants import dequantize, q4_groups

T = TypeVar("T")
Role = Literal["embedding", "matrix", "vector"]


@dataclass(frozen=True, slots=True)
class RawPart:
    """One GGUF tensor's rows as stored: `rows` [N, bytes per row] of `type_name` blocks."""

    name: str
    type_name: str
    rows: np.ndarray  # uint8 [N, row bytes], a view of the mmap (a copy when reordered)
    cols: int  # values per row


RawConvert = Callable[[Role, list[RawPart]], T | None]


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
    """The weights of layers [first, first + len(layers)); the ends (embedding, final norm,
    LM head) are None in a pipeline stage, which holds only its layers."""

    tok_embd: T | None  # [V, D]
    layers: list[LayerWeights[T]]
    out_norm: T | None  # [D]
    output: T | None  # [V, D] (converted from the embedding when tied)
    first: int = 0


def load_weights(
    gguf: GGUFFile,
    args: Args,
    convert: Callable[[np.ndarray, Role, np.ndarray | None], T],
    progress: Callable[[int, int], None] | None = None,
    *,
    rope_pairs: bool = False,
    raw: RawConvert[T] | None = None,
    layers: tuple[int, int] | None = None,
    ends: bool = True,
) -> ModelWeights[T]:
    """Read, fuse and convert every weight; `progress(done, total)` after each layer.

    `layers` (first, end) loads only those layers and `ends=False` skips the embedding, the
    final norm and the LM head (a pipeline stage): tensors not loaded are never read, so
    their pages of the mmap never become resident."""
    first, end = layers if layers is not None else (0, args.n_layers)
    if not 0 <= first <= end <= args.n_layers:
        raise GGUFError(f"{gguf.path}: layers {first}:{end} are outside 0:{args.n_layers}")
    r = _Reader(gguf, args, convert, rope_pairs, raw)
    total = end - first + 2
    embd = "token_embd.weight"
    tok_embd = None
    if ends:
        tok_embd = r.weight("embedding", (embd,), lambda: convert(r.get(embd), "embedding", None))
    if progress:
        progress(1, total)
    loaded: list[LayerWeights[T]] = []
    for i in range(first, end):
        p = f"blk.{i}."
        loaded.append(
            LayerWeights(
                attn_norm=r.vector(p + "attn_norm.weight"),
                wqkv=r.matrix(*(p + f"attn_{x}.weight" for x in "qkv")),
                bqkv=convert(r.qkv(p, "bias")[0], "vector", None) if args.qkv_bias else None,
                wo=r.matrix(p + "attn_output.weight"),
                ffn_norm=r.vector(p + "ffn_norm.weight"),
                w_gate_up=r.matrix(p + "ffn_gate.weight", p + "ffn_up.weight"),
                w_down=r.matrix(p + "ffn_down.weight"),
            )
        )
        if progress:
            progress(i - first + 2, total)
    out_norm = output = None
    if ends:
        out_norm = r.vector("output_norm.weight")
        output = r.matrix(embd if args.tied_embeddings else "output.weight")
    if progress:
        progress(total, total)
    return ModelWeights(tok_embd, loaded, out_norm, output, first)


class _Reader(Generic[T]):
    """Reads a GGUF's tensors for `load_weights`: dequantized and fused, or in the backend's
    raw form where it takes them (`raw`), converted by `convert`."""

    def __init__(
        self,
        gguf: GGUFFile,
        args: Args,
        convert: Callable[[np.ndarray, Role, np.ndarray | None], T],
        rope_pairs: bool,
        raw: RawConvert[T] | None,
    ):
        self.gguf, self.args, self.convert = gguf, args, convert
        self.rope_pairs, self.raw = rope_pairs, raw
        # A tied embedding, once dequantized, is kept for the LM head, which converts it again.
        self.kept: dict[str, np.ndarray] = {}

    def info(self, name: str) -> TensorInfo:
        if name not in self.gguf.tensors:
            raise GGUFError(f"{self.gguf.path}: tensor {name} is missing")
        return self.gguf.tensors[name]

    def get(self, name: str) -> np.ndarray:
        if name in self.kept:
            return self.kept.pop(name)
        self.info(name)
        a = dequantize(self.gguf, name)
        if name == "token_embd.weight" and self.args.tied_embeddings:
            self.kept[name] = a
        return a

    def fused(self, *names: str) -> tuple[np.ndarray, np.ndarray | None]:
        """Rows of `names` stacked, with their Q4 groups when every part has them."""
        groups = [g for n in names if (g := q4_groups(self.gguf, n)) is not None]
        joined = np.concatenate(groups) if len(groups) == len(names) else None
        return np.concatenate([self.get(n) for n in names]), joined

    def qkv(self, p: str, kind: str) -> tuple[np.ndarray, np.ndarray | None]:
        a, groups = self.fused(*(p + f"attn_{x}.{kind}" for x in "qkv"))
        if self.rope_pairs and self.args.rope_neox:
            a = _qk_to_pairs(a, self.args)
            groups = None if groups is None else _qk_to_pairs(groups, self.args)
        return a, groups

    def raw_parts(self, *names: str) -> list[RawPart]:
        args, parts = self.args, []
        for n in names:
            t = self.info(n)
            rows = self.gguf.raw(n).reshape(int(np.prod(t.shape[:-1])), -1)
            if (
                self.rope_pairs
                and args.rope_neox
                and n.endswith(("attn_q.weight", "attn_k.weight"))
            ):
                heads = args.n_heads if n.endswith("attn_q.weight") else args.n_kv_heads
                rows = neox_to_pairs(rows, heads, args.head_dim)  # whole rows: blocks unchanged
            parts.append(RawPart(n, t.type_name, rows, t.shape[-1]))
        return parts

    def weight(self, role: Role, names: tuple[str, ...], dense: Callable[[], T]) -> T:
        """The backend's raw form of `names` where it takes them, else `dense()`."""
        if self.raw is not None:
            done = self.raw(role, self.raw_parts(*names))
            if done is not None:
                return done
        return dense()

    def matrix(self, *names: str) -> T:
        def dense() -> T:
            if names[0].endswith("attn_q.weight"):
                a, groups = self.qkv(names[0].removesuffix("attn_q.weight"), "weight")
            else:
                a, groups = self.fused(*names)
            return self.convert(a, "matrix", groups)

        return self.weight("matrix", names, dense)

    def vector(self, name: str) -> T:
        return self.convert(self.get(name), "vector", None)


def _qk_to_pairs(a: np.ndarray, args: Args) -> np.ndarray:
    q, k, v = np.split(a, [args.q_size, args.q_size + args.kv_size])
    q = neox_to_pairs(q, args.n_heads, args.head_dim)
    k = neox_to_pairs(k, args.n_kv_heads, args.head_dim)
    return np.concatenate([q, k, v])


def neox_to_pairs(w: np.ndarray, n_heads: int, head_dim: int) -> np.ndarray:
    """Reorder each head's rows from halves layout to adjacent-pairs layout."""
    half = head_dim // 2
    order = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
    return w.reshape(n_heads, head_dim, *w.shape[1:])[:, order].reshape(w.shape)
