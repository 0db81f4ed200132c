"""The MLX backend (mlx[cpu] on Linux) produces the torch backend's greedy tokens on SmolLM2."""

from __future__ import annotations

from typing import Any

import pytest

from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.tokenizer import GGUFTokenizer

pytest.importorskip("cgn_infer.backends.mlx_backend", reason="the mlx extra is not installed")


def greedy(backend: Any, prompt: list[int], n: int) -> list[int]:
    cache = backend.new_cache(len(prompt) + n)
    logits = backend.forward(prompt, 0, cache)
    out = [int(logits.argmax())]
    for i in range(n - 1):
        logits = backend.forward([out[-1]], len(prompt) + i, cache)
        out.append(int(logits.argmax()))
    return out


def test_mlx_greedy_equals_torch(
    smollm2_gguf: GGUFFile, smollm2_torch: Any, smollm2_mlx: Any
) -> None:
    mlx = smollm2_mlx
    tok = GGUFTokenizer(smollm2_gguf)
    for text in (
        "The quick brown fox",
        "<|im_start|>user\nWhat is 7 times 6?<|im_end|>\n<|im_start|>assistant\n",
    ):
        prompt = tok.encode(text)
        assert greedy(mlx, prompt, 24) == greedy(smollm2_torch, prompt, 24)
