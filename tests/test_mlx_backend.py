"""The MLX backend (mlx[cpu] on Linux) agrees with the torch backend on SmolLM2."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.tokenizer import GGUFTokenizer

pytest.importorskip("cgn_infer.backends.mlx_backend", reason="the mlx extra is not installed")


# Below this top-2 margin (nats, in torch's logits) the two backends' different arithmetic
# decides the order as much as the model does: torch multiplies the file's blocks by int8
# activations, MLX dequantized weights by float ones (the gap llama.cpp's flash attention on
# vs off shows on the same model is 0.36 nats: tests/test_llamacpp_parity.py).
NEAR_TIE_NATS = 0.4


def greedy(backend: Any, prompt: list[int], n: int) -> list[int]:
    cache = backend.new_cache(len(prompt) + n)
    logits = backend.forward(prompt, 0, cache)
    out = [int(logits.argmax())]
    for i in range(n - 1):
        logits = backend.forward([out[-1]], len(prompt) + i, cache)
        out.append(int(logits.argmax()))
    return out


@pytest.mark.slow
def test_mlx_agrees_with_torch_teacher_forced(
    smollm2_gguf: GGUFFile, smollm2_torch: Any, smollm2_mlx: Any
) -> None:
    """MLX and torch read the same text (a prompt and torch's own greedy answer) and must
    pick the same next token wherever torch's choice is decisive, with logits that track.
    Free-running greedy text is not compared: one near-tie decided the other way (which
    depends on the CPU's vector width) sends the two answers apart for good."""
    tok = GGUFTokenizer(smollm2_gguf)
    decisive = agree = 0
    corr: list[float] = []
    for text in (
        "The quick brown fox",
        "<|im_start|>user\nWhat is 7 times 6?<|im_end|>\n<|im_start|>assistant\n",
    ):
        prompt = tok.encode(text)
        ids = prompt + greedy(smollm2_torch, prompt, 24)
        ours = smollm2_torch.forward(ids, 0, smollm2_torch.new_cache(len(ids)), all_logits=True)
        theirs = np.asarray(smollm2_mlx.forward(ids, 0, smollm2_mlx.new_cache(len(ids)),
                                                all_logits=True))  # fmt: skip
        for k in range(len(prompt) - 1, len(ids)):
            a, b = np.asarray(ours[k], np.float64), theirs[k].astype(np.float64)
            top2 = np.sort(a)[-2:]
            if top2[1] - top2[0] >= NEAR_TIE_NATS:
                decisive += 1
                agree += int(a.argmax() == b.argmax())
            corr.append(float(np.corrcoef(a, b)[0, 1]))
    assert decisive >= 30, decisive  # the check has something to check
    assert agree == decisive, f"{decisive - agree} decisive positions disagree"
    assert min(corr) >= 0.99, min(corr)
