"""The llama.cpp references that cgn-infer's parity tests and the parity-noise bench share:
texts to tokenize, conversations to template, prompts to continue, and llama.cpp's own
next-token distribution read from its server."""

from __future__ import annotations

import numpy as np

from harness.procs import post

CORPUS = [
    "Hello world",
    "Hello world  123 <|im_start|>",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\n\n\nx",
    "unicode: héllo wörld 日本語 🤖 ñ",
    "code: def f(x):\n    return x**2 + 1_000_000\n",
    "numbers 3.14159 1234567 -42",
    "I'm you're they've it'll he'd DON'T",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "   ",
    "a" * 300,
    "emoji 👩‍👩‍👧 zwj, mixed😀text",
    "Ωmega ∑ ∫ √ ≠",
    "\r\n windows \r\n line endings",
    "<|endoftext|> special in the middle <|im_end|>",
]

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c  \n d"},
    ],
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "é 日本"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "y"},
    ],
]

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The dog was not amused, and it",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "<|im_start|>user\nName three colours of the rainbow.<|im_end|>\n<|im_start|>assistant\n",
]


def reference_logprobs(url: str, prefix: list[int], vocab: int) -> np.ndarray | None:
    """llama.cpp's full next-token log-distribution after `prefix` (n_probs = vocab);
    None where llama.cpp reports none (it omits them when the next token is EOS)."""
    doc = post(url + "/completion", {"prompt": prefix, "n_predict": 1, "temperature": 0,
                                     "n_probs": vocab, "cache_prompt": True})  # fmt: skip
    if "completion_probabilities" not in doc:
        return None
    out = np.full(vocab, -np.inf)
    for entry in doc["completion_probabilities"][0]["top_logprobs"]:  # type: ignore[index]
        out[entry["id"]] = entry["logprob"]
    return out


def reference_top2(url: str, prefix: list[int]) -> tuple[int, float] | None:
    """llama.cpp's greedy next token after `prefix` and its margin over the runner-up (nats).
    None where llama.cpp reports no probabilities: when it stops on EOS, and when the token
    is half of a UTF-8 character (its server holds such output back)."""
    doc = post(url + "/completion", {"prompt": prefix, "n_predict": 1, "temperature": 0,
                                     "n_probs": 2, "cache_prompt": True})  # fmt: skip
    if not doc.get("completion_probabilities"):
        return None
    top = doc["completion_probabilities"][0]["top_logprobs"]  # type: ignore[index]
    return int(top[0]["id"]), float(top[0]["logprob"] - top[1]["logprob"])
