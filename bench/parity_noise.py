"""How far apart numerically equivalent runs of SmolLM2 land: the yardstick for parity.

    python bench/parity_noise.py

Teacher-forced over the parity test's prompts (tests/test_llamacpp_parity.py),
it collects each run's top-10 next-token log-probabilities at every position:

* llama.cpp (xllamacpp) with its defaults, and with flash attention off;
* cgn-infer's torch backend in float32;
* cgn-infer with K/V stored in float16;
* cgn-infer with every matmul input quantised as llama.cpp quantises it
  (8 bits per 32-value block, scale amax/127 kept in fp16, round half to even).

and reports, for each pair, top-1 agreement and the RMS difference of the
log-probabilities on the first run's top-10 tokens. Results go to
bench/results/parity_noise.{json,md}.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from cgn_core.bundled_models import smollm2
from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.tokenizer import GGUFTokenizer
from cgn_infer.backends import torch_backend
from cgn_infer.backends.torch_backend import Linear, TorchBackend
from cgn_infer.models import args_from_gguf
from harness.parity import CORPUS, PROMPTS
from harness.procs import llamacpp, post

TOP = 10
Run = list[dict[int, float]]  # per position: token id -> log-probability


def q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x as llama.cpp's Q8_0/Q8_1 activations hold it: per 32 values, q = round(x * 127 /
    amax) and a scale amax / 127 stored in fp16."""
    rows, cols = x.shape
    blocks = x.view(rows, cols // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    scale = (amax / 127).half().float()
    return (torch.round(blocks * inverse) * scale).view(rows, cols)


@contextmanager
def quantised_activations() -> Iterator[None]:
    original = Linear.__call__

    def call(self: Linear, x: torch.Tensor) -> torch.Tensor:
        return original(self, q8_blocks(x))

    torch_backend.Linear.__call__ = call  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch_backend.Linear.__call__ = original  # type: ignore[method-assign]


def llamacpp_run(url: str, sequences: list[list[int]]) -> Run:
    out: Run = []
    for ids in sequences:
        for k in range(2, len(ids) + 1):
            doc: Any = post(url + "/completion", {"prompt": ids[:k], "n_predict": 1,
                            "temperature": 0, "n_probs": TOP, "cache_prompt": True})  # fmt: skip
            probs = doc.get("completion_probabilities")
            out.append({e["id"]: e["logprob"] for e in probs[0]["top_logprobs"]} if probs else {})
    return out


def ours_run(model: TorchBackend, sequences: list[list[int]]) -> Run:
    out: Run = []
    for ids in sequences:
        logits = model.forward(ids, 0, model.new_cache(len(ids)), all_logits=True)
        logprobs = torch.log_softmax(torch.from_numpy(logits).double(), -1).numpy()
        out += [_Full(logprobs[k - 1]) for k in range(2, len(ids) + 1)]
    return out


class _Full(dict[int, float]):
    """A whole log-distribution that answers any token id."""

    def __init__(self, row: np.ndarray):
        super().__init__({int(t): float(row[t]) for t in np.argsort(row)[::-1][:TOP]})
        self.row = row

    def __missing__(self, token: int) -> float:
        return float(self.row[token])


def compare(a: Run, b: Run) -> dict[str, float]:
    """Top-1 agreement, and RMS log-probability difference on `a`'s top tokens."""
    agree = total = 0
    diffs: list[float] = []
    for ra, rb in zip(a, b, strict=True):
        if not ra or not rb:
            continue
        top_a, top_b = max(ra, key=ra.__getitem__), max(rb, key=rb.__getitem__)
        agree, total = agree + int(top_a == top_b), total + 1
        diffs += [ra[t] - rb[t] for t in list(ra)[:TOP] if t in rb or isinstance(rb, _Full)]
    return {"agree": agree, "total": total, "rms_nats": float(np.sqrt(np.mean(np.square(diffs))))}


def main() -> None:
    path = smollm2()
    with GGUFFile(path) as gguf:
        tokenizer = GGUFTokenizer(gguf)
        sequences = [tokenizer.encode(p) for p in PROMPTS + CORPUS[:6]]
        args = args_from_gguf(gguf)
        runs: dict[str, Run] = {}
        for name, fa in (("llama.cpp", "auto"), ("llama.cpp, flash attention off", "off")):
            with llamacpp(path, flash_attn=fa) as url:
                runs[name] = llamacpp_run(url, sequences)
        f32 = TorchBackend(gguf, args, threads=2)
        runs["cgn-infer float32"] = ours_run(f32, sequences)
        runs["cgn-infer, K/V in float16"] = ours_run(
            TorchBackend(gguf, args, threads=2, kv_dtype="float16"), sequences
        )
        with quantised_activations():
            runs["cgn-infer, Q8 activations"] = ours_run(f32, sequences)
    pairs: list[tuple[str, str]] = [
        ("llama.cpp", "llama.cpp, flash attention off"),
        ("llama.cpp", "cgn-infer float32"),
        ("llama.cpp, flash attention off", "cgn-infer float32"),
        ("llama.cpp", "cgn-infer, Q8 activations"),
        ("cgn-infer float32", "cgn-infer, Q8 activations"),
        ("cgn-infer float32", "cgn-infer, K/V in float16"),
    ]
    results: list[dict[str, Any]] = []
    lines = ["| run A | run B | top-1 agreement | RMS Δ log-prob (nats) |", "|---|---|---|---|"]
    for a, b in pairs:
        r = compare(runs[a], runs[b])
        results.append({"a": a, "b": b, **r})
        pct = r["agree"] / r["total"]
        lines.append(f"| {a} | {b} | {r['agree']}/{r['total']} ({pct:.1%}) | {r['rms_nats']:.3f} |")
    table = "\n".join(lines)
    print(table)
    write_result("parity_noise", "python bench/parity_noise.py", {"pairs": results}, table)


if __name__ == "__main__":
    main()
