"""Hyper-parameters of a decoder-only transformer of the llama family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cgn_core.text.gguf_file import GGUFFile


@dataclass(frozen=True, slots=True)
class Args:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    rope_dim: int
    # RoPE pairing: llama GGUFs rotate adjacent pairs (x[2i], x[2i+1]) because the
    # converter permuted q/k; qwen2 rotates halves (x[i], x[i + d/2]), "NEOX" style.
    rope_neox: bool
    qkv_bias: bool
    ctx_len: int
    tied_embeddings: bool

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token at 2 bytes per value (fp16/bf16)."""
        return 2 * self.n_layers * self.kv_size * 2


def read_common(gguf: GGUFFile, arch: str, *, rope_neox: bool, qkv_bias: bool) -> Args:
    """Args from the `<arch>.*` metadata keys shared by the llama family."""

    def key(name: str) -> Any:
        return gguf.require(f"{arch}.{name}")

    dim, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(gguf.get(f"{arch}.attention.key_length", dim // n_heads))
    vocab = gguf.get(f"{arch}.vocab_size") or len(gguf.require("tokenizer.ggml.tokens"))
    return Args(
        arch=arch,
        vocab_size=int(vocab),
        dim=dim,
        n_layers=int(key("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(gguf.get(f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(key("feed_forward_length")),
        norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(gguf.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_dim=int(gguf.get(f"{arch}.rope.dimension_count", head_dim)),
        rope_neox=rope_neox,
        qkv_bias=qkv_bias,
        ctx_len=int(key("context_length")),
        tied_embeddings="output.weight" not in gguf.tensors,
    )
