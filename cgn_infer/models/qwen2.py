"""The `qwen2` architecture (Qwen2, Qwen2.5, Qwen2.5-Coder).

Qwen2 is the llama block with two differences: q/k/v projections carry a
bias, and RoPE rotates halves of each head ("NEOX" layout, no permutation in
the converter). Everything else, including GQA and SwiGLU, is shared.
"""

from __future__ import annotations

from cgn_core.text.gguf_file import GGUFFile
from cgn_infer.models.args import Args, read_common


def args_from_gguf(gguf: GGUFFile) -> Args:
    return read_common(gguf, "qwen2", rope_neox=True, qkv_bias=True)
