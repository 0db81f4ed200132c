"""Write a tiny `llama` GGUF with a SentencePiece-style vocabulary and random F32 weights.

No SPM model ships on PyPI as a GGUF, so the SPM tokenizer is checked against
llama.cpp on this one: llama.cpp loads it like any Llama-2-style file.
"""

from __future__ import annotations

import string
from pathlib import Path

import gguf
import numpy as np

MERGES = [
    "▁t", "th", "he", "▁th", "▁the", "in", "ng", "ing", "▁a", "an", "▁an", "nd", "▁and",
    "er", "re", "on", "▁o", "▁w", "or", "ld", "▁wo", "▁wor", "▁worl", "▁world", "▁H", "▁He",
    "el", "ll", "lo", "▁Hel", "▁Hell", "▁Hello", "▁▁", "▁▁▁▁", "is", "▁is", "it", "▁it",
    "12", "123", "es", "st", "▁s", "ti", "tio", "tion", "▁c", "▁co", "▁cod", "▁code",
]  # fmt: skip
CHARS = ["▁", *string.ascii_letters, *string.digits, *".,!?'-:;()=+*/\"\n\t", "é", "日", "本"]


def write_tiny_spm(path: Path, seed: int = 0) -> Path:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for i, ch in enumerate(CHARS):
        if ch in ("\n", "\t"):
            continue  # only reachable through byte fallback, as in Llama 2's vocabulary
        tokens.append(ch), types.append(1), scores.append(-1000.0 - i)
    for rank, piece in enumerate(MERGES):
        tokens.append(piece), types.append(1), scores.append(-float(rank))
    vocab, dim, ffn, heads = len(tokens), 64, 128, 4
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(dim)
    w.add_block_count(1)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(dim // heads)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
    rng = np.random.default_rng(seed)

    def t(name: str, *shape: int, scale: float = 0.2) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    t("token_embd.weight", vocab, dim, scale=1.0)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(dim, dtype=np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        t(f"blk.0.{name}.weight", dim, dim)
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(dim, dtype=np.float32))
    t("blk.0.ffn_gate.weight", ffn, dim)
    t("blk.0.ffn_up.weight", ffn, dim)
    t("blk.0.ffn_down.weight", dim, ffn)
    w.add_tensor("output_norm.weight", np.ones(dim, dtype=np.float32))
    t("output.weight", vocab, dim)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
