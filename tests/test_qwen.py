"""Qwen2.5-Coder-0.5B (the `qwen2` architecture, Q4_K_M) against llama.cpp: slower, CI runs it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cgn_core.bundled_models import QWEN_SHA256, qwen_coder_05b
from cgn_core.text.chat_template import ChatTemplate
from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.tokenizer import GGUFTokenizer
from cgn_infer.backends.torch_backend import TorchBackend
from cgn_infer.models import args_from_gguf
from harness.parity import CONVERSATIONS, CORPUS, reference_logprobs, reference_top2
from harness.procs import llamacpp, post

pytestmark = pytest.mark.slow

PROMPTS = [
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot =",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWrite hello world in C.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def qwen_path() -> Path:
    return qwen_coder_05b()


@pytest.fixture(scope="module")
def qwen(qwen_path: Path) -> Iterator[GGUFFile]:
    with GGUFFile(qwen_path) as f:
        yield f


@pytest.fixture(scope="module")
def reference(qwen_path: Path) -> Iterator[str]:
    with llamacpp(qwen_path) as url:
        yield url


def test_assembled_file_is_verified(qwen_path: Path) -> None:
    import hashlib

    assert hashlib.sha256(qwen_path.read_bytes()).hexdigest() == QWEN_SHA256


def test_tokens_and_template_match_llamacpp(qwen: GGUFFile, reference: str) -> None:
    tok = GGUFTokenizer(qwen)
    for text in CORPUS:
        assert (
            tok.encode(text)
            == post(reference + "/tokenize", {"content": text, "parse_special": True})["tokens"]
        ), text
    template = ChatTemplate(qwen.get("tokenizer.chat_template"))
    for messages in CONVERSATIONS:
        assert (
            template.render(messages)
            == post(reference + "/apply-template", {"messages": messages})["prompt"]
        )


def test_logits_match_llamacpp(qwen: GGUFFile, reference: str) -> None:
    tok = GGUFTokenizer(qwen)
    backend: Any = TorchBackend(qwen, args_from_gguf(qwen), threads=2)
    corr: list[float] = []
    agree = total = decisive = decisive_agree = 0
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ours = backend.forward(ids, 0, backend.new_cache(len(ids)), all_logits=True)
        for k in range(2, len(ids) + 1):
            if (ref := reference_top2(reference, ids[:k])) is None:
                continue
            same = int(ours[k - 1].argmax() == ref[0])
            agree, total = agree + same, total + 1
            if ref[1] >= 0.15:
                decisive, decisive_agree = decisive + 1, decisive_agree + same
            if k % 8 == 0:
                dist = reference_logprobs(reference, ids[:k], tok.vocab_size)
                assert dist is not None
                finite = np.isfinite(dist)
                corr.append(float(np.corrcoef(ours[k - 1][finite], dist[finite])[0, 1]))
    print(
        f"qwen top-1 {agree}/{total}; decisive {decisive_agree}/{decisive}; corr {np.mean(corr):.5f}"
    )
    assert total >= 40 and decisive_agree == decisive
    assert agree / total >= 0.93
    assert np.mean(corr) >= 0.998
