"""The `llama` architecture (Llama 2/3, SmolLM2, Mistral GGUFs): RMSNorm, GQA, SwiGLU.

GGUF's llama converter permutes the rows of attn_q/attn_k so that llama.cpp can
rotate *adjacent* pairs; reading those tensors as stored, we must do the same.
"""

from __future__ import annotations

from cgn_core.text.gguf_file import GGUFFile
from cgn_infer.models.args import Args, read_common


def args_from_gguf(gguf: GGUFFile) -> Args:
    return read_common(gguf, "llama", rope_neox=False, qkv_bias=False)
