"""SentencePiece-style (`llama`) vocabularies against llama.cpp, on a tiny generated model.

The model's weights are random F32, so the same file also checks the llama
forward pass against llama.cpp with no quantisation in between.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.tokenizer import GGUFTokenizer
from cgn_infer.backends.torch_backend import TorchBackend
from cgn_infer.models import args_from_gguf
from harness.procs import llamacpp, post
from tests.support.tiny_spm import write_tiny_spm

CORPUS = [
    "Hello world",
    "the and the tion code",
    "  two leading spaces and    four inside",
    "unknown chars: é 日本 ü ß 🤖",
    "line\nbreaks\tand tabs",
    "123 1234 12",
    "Hello<s>world</s> specials",
    "x",
    " ",
    "the theme thesis athens",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_spm(tmp_path_factory.mktemp("spm") / "tiny-spm.gguf")


@pytest.fixture(scope="module")
def reference(tiny: Path) -> Iterator[str]:
    with llamacpp(tiny, ctx=256) as url:
        yield url


@pytest.fixture(scope="module")
def gguf_file(tiny: Path) -> Iterator[GGUFFile]:
    with GGUFFile(tiny) as f:
        yield f


@pytest.mark.parametrize("text", CORPUS)
def test_spm_tokens_match_llamacpp(text: str, gguf_file: GGUFFile, reference: str) -> None:
    tok = GGUFTokenizer(gguf_file)
    ref = post(
        reference + "/tokenize", {"content": text, "parse_special": True, "add_special": True}
    )["tokens"]
    assert tok.encode(text) == ref


def test_spm_decode(gguf_file: GGUFFile) -> None:
    tok = GGUFTokenizer(gguf_file)
    for text in CORPUS:
        if "<s>" not in text:
            assert tok.decode(tok.encode(text)) == " " + text  # the added space prefix


def test_f32_llama_forward_matches_llamacpp(gguf_file: GGUFFile, reference: str) -> None:
    tok = GGUFTokenizer(gguf_file)
    ids = tok.encode("the code and the world")
    backend = TorchBackend(gguf_file, args_from_gguf(gguf_file), threads=2)
    ours = backend.forward(ids, 0, backend.new_cache(len(ids)))
    doc = post(
        reference + "/completion",
        {"prompt": ids, "n_predict": 1, "temperature": 0, "n_probs": tok.vocab_size},
    )
    ref = np.full(tok.vocab_size, -np.inf)
    for e in doc["completion_probabilities"][0]["top_logprobs"]:  # type: ignore[index]
        ref[e["id"]] = e["logprob"]
    ours_lp = ours - ours.max() - np.log(np.exp(ours - ours.max()).sum())
    assert np.corrcoef(ours, ref)[0, 1] > 0.9999
    assert np.abs(ours_lp - ref).max() < 0.05
