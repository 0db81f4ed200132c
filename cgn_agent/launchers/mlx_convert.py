"""A GGUF model as an MLX model directory, which `mlx_lm.server` loads from local files.

    python -m cgn_agent.launchers.mlx_convert MODEL.gguf OUT_DIR

mlx_lm loads Hugging Face-style directories (config.json, safetensors weights,
tokenizer.json); the catalog's models are GGUF files. The directory is built
from the GGUF alone, nothing downloaded:

* weights: MLX reads Q4_0, Q4_1 and Q8_0 blocks itself (`mx.load`) as its own
  affine quantization (groups of 32), the same numbers, not re-rounded. A file
  with other types (K-quants: Q4_K_M) is dequantized with the `gguf` package
  and its matrices re-quantized to 8 bits in groups of 32 (about 8.5 bits per
  weight: larger than the GGUF, close to its values); norms stay float.
* names: llama.cpp's (`blk.N.attn_q`) back to Hugging Face's
  (`model.layers.N.self_attn.q_proj`); llama's q/k rows un-permuted (its
  converter interleaves the rotary halves).
* config.json from the GGUF's `<arch>.*` metadata, with a per-layer
  `quantization` table; tokenizer.json from the file's own vocabulary
  (cgn_core.text, byte-level BPE only) and tokenizer_config.json with its chat
  template and special tokens.

Architectures: llama (SmolLM2, Llama 3) and qwen2. `ensure()` converts once per
file into a cache directory keyed by the file's path, size and mtime, written
to a temporary directory and renamed into place, so concurrent replicas and a
crash mid-way never leave a half-written model.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from cgn_core.errors import ConfigError
from cgn_core.text.gguf_file import GGUFError, GGUFFile, dequantize
from cgn_core.text.tokenizer import GGUFTokenizer

FORMAT = 1  # bump when the directory's layout changes: older conversions are redone
ARCHITECTURES = ("llama", "qwen2")
GROUP = 32  # MLX's group size for GGUF's 32-value blocks
REQUANT_BITS = 8  # what a tensor MLX cannot read quantized is re-quantized to

_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_NAME = re.compile(r"^(?:blk\.(\d+)\.)?([a-z_]+)\.(weight|bias|scales|biases)$")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor (with MLX's .scales/.biases suffixes);
    None for tensors the MLX model has no place for (rope_freqs)."""
    m = _NAME.match(gguf_name)
    if not m:
        return None
    layer, part, suffix = m.groups()
    module = _LAYER.get(part) if layer is not None else _TOP.get(part)
    if module is None:
        return None
    return f"model.layers.{layer}.{module}.{suffix}" if layer is not None else f"{module}.{suffix}"


def unpermute(rows: Any, heads: int) -> Any:
    """Undo llama.cpp's interleaving of a q/k projection's rows (per head, the two rotary
    halves); works on weights, MLX's packed quantized rows, scales, biases and bias vectors."""
    n = rows.shape[0]
    rest = rows.shape[1:]
    return rows.reshape(heads, n // heads // 2, 2, *rest).swapaxes(1, 2).reshape(n, *rest)


def cache_key(path: Path) -> str:
    st = path.stat()
    ident = f"{os.path.realpath(path)}\0{st.st_size}\0{st.st_mtime_ns}\0{FORMAT}"
    return f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def ensure(gguf_path: Path, cache_dir: Path) -> Path:
    """The MLX directory of `gguf_path` under `cache_dir`, converted on first use."""
    dest = cache_dir / cache_key(gguf_path)
    if (dest / "config.json").is_file():
        return dest
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=cache_dir))
    try:
        convert(gguf_path, tmp)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "config.json").is_file():  # not a concurrent conversion that won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def convert(gguf_path: Path, out: Path) -> None:
    """Write the MLX model directory of `gguf_path` into the existing directory `out`."""
    import mlx.core as mx

    with GGUFFile(gguf_path) as g:
        arch = str(g.require("general.architecture"))
        if arch not in ARCHITECTURES:
            raise GGUFError(
                f"{gguf_path}: architecture {arch!r} has no MLX conversion "
                f"(supported: {', '.join(ARCHITECTURES)})"
            )
        tok = GGUFTokenizer(g)
        config = _config(g, arch, tok)
        weights, bits = _weights(g, gguf_path, arch, config)
        config["quantization"] = _quantization(bits)
        config["tie_word_embeddings"] = "lm_head.weight" not in weights
        (out / "tokenizer.json").write_text(tok.hf_json())
        _tokenizer_config(out, g, tok, config["max_position_embeddings"])
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1))


def _config(g: GGUFFile, arch: str, tok: GGUFTokenizer) -> dict[str, Any]:
    def key(name: str) -> Any:
        return g.require(f"{arch}.{name}")

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    return {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(key("block_count")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(g.get(f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(g.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g.get(f"{arch}.context_length", 4096)),
        "vocab_size": tok.vocab_size,
        "bos_token_id": tok.special.bos,
        "eos_token_id": sorted(tok.stop_ids),
    }


def _weights(
    g: GGUFFile, path: Path, arch: str, config: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """MLX arrays by Hugging Face name, and the bits of each quantized layer."""
    import mlx.core as mx

    loaded: dict[str, Any] | None
    try:
        loaded = dict(mx.load(str(path)))  # type: ignore[arg-type]  # Q4_0/Q4_1/Q8_0
    except RuntimeError:  # a type MLX does not read (K-quants): dequantized below
        loaded = None
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out: dict[str, Any] = {}
    bits: dict[str, int] = {}
    for name in g.tensors:
        base, suffix = name.rsplit(".", 1)
        if hf_name(name) is None:
            continue
        if loaded is not None:  # the tensor and, when quantized, its scales and biases
            parts: dict[str, Any] = {suffix: loaded[name]}
            if suffix == "weight":
                parts.update(
                    {
                        s: loaded[f"{base}.{s}"]
                        for s in ("scales", "biases")
                        if f"{base}.{s}" in loaded
                    }
                )
        else:
            values = mx.array(_dequantized(g, name))
            parts = {suffix: values}
            if suffix == "weight" and values.ndim == 2 and values.shape[1] % GROUP == 0:
                w, scales, biases = mx.quantize(values, group_size=GROUP, bits=REQUANT_BITS)
                parts = {"weight": w, "scales": scales, "biases": biases}
        part = base.rsplit(".", 1)[-1]
        if arch == "llama" and part in heads:
            parts = {s: unpermute(a, heads[part]) for s, a in parts.items()}
        for s, array in parts.items():
            out[str(hf_name(f"{base}.{s}"))] = array
        if "scales" in parts:  # bits per value: packed uint32 columns against groups
            packed, groups = parts["weight"].shape[-1], parts["scales"].shape[-1]
            bits[str(hf_name(name)).rsplit(".", 1)[0]] = packed * 32 // (groups * GROUP)
    return out, bits


def _quantization(bits: dict[str, int]) -> dict[str, Any]:
    """config.json's `quantization`: the commonest bits for all, and each layer that differs
    (MLX quantizes a layer exactly where the weights hold its `.scales`)."""
    common = Counter(bits.values()).most_common(1)[0][0] if bits else 4
    table: dict[str, Any] = {"group_size": GROUP, "bits": common}
    for layer, b in bits.items():
        if b != common:
            table[layer] = {"group_size": GROUP, "bits": b}
    return table


def _dequantized(g: GGUFFile, name: str) -> np.ndarray:
    """A tensor's values as float16 (float32 for 1-D tensors: norms and biases)."""
    values = dequantize(g, name)
    return values if values.ndim == 1 else values.astype(np.float16)


def _tokenizer_config(out: Path, g: GGUFFile, tok: GGUFTokenizer, ctx: int) -> None:
    def piece(token_id: int | None) -> str | None:
        return None if token_id is None else tok.pieces[token_id]

    doc = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": piece(tok.special.bos),
        "eos_token": piece(tok.special.eot if tok.special.eot is not None else tok.special.eos),
        "add_bos_token": tok.special.add_bos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": ctx,
    }
    if template := g.get("tokenizer.chat_template"):
        doc["chat_template"] = str(template)
    (out / "tokenizer_config.json").write_text(json.dumps(doc, indent=1))


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        sys.exit("usage: python -m cgn_agent.launchers.mlx_convert MODEL.gguf OUT_DIR")
    out = Path(args[1])
    out.mkdir(parents=True, exist_ok=True)
    try:
        convert(Path(args[0]), out)
    except (GGUFError, ConfigError, OSError) as exc:
        sys.exit(f"mlx_convert: {exc}")
    print(out)


if __name__ == "__main__":
    main()
