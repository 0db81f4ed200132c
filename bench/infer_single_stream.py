"""cgn-infer (torch, CPU) against llama.cpp's server on the same GGUF, same machine, same run.

    python bench/infer_single_stream.py [--models smollm2 qwen] [--threads 2]

For each model and engine (one at a time, never concurrently): load time to
/health = 200 (warm: the kernels built and the files in the page cache; and for
cgn-infer's default, first: a start with an empty kernel cache, which compiles
them), single-stream decode tokens/s (64 tokens, greedy, EOS ignored,
timed first token to last over SSE), prompt tokens/s (a fresh ~500-token
prompt, one output token, so no prefix cache helps), and peak RSS (cgn-infer's
KV pool holds as many tokens as llama.cpp's context). Results go to
bench/results/infer_single_stream.{json,md}, with ratios to llama.cpp.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import engine, model_id, peak_rss_mib, stream_completion, write_result
from cgn_core.bundled_models import qwen_coder_05b, smollm2

MODELS = {"smollm2": smollm2, "qwen": qwen_coder_05b}
ENGINES: list[tuple[str, str, tuple[str, ...]]] = [
    ("llama.cpp", "llama.cpp", ()),
    ("cgn-infer (default: gguf)", "cgn-infer", ()),
    ("cgn-infer float32", "cgn-infer", ("--dtype", "float32")),
    ("cgn-infer int8", "cgn-infer", ("--dtype", "int8")),
]
WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
]


def long_prompt(seed: int, words: int = 420) -> str:
    """A fresh ~500-token prompt per seed (it starts with the seed, so no cached prefix)."""
    return f"Document {seed}: " + " ".join(
        WORDS[(seed * 7 + i * (seed + 3)) % len(WORDS)] for i in range(words)
    )


def measure(url: str, reps: int, llama: bool) -> dict[str, float]:
    name = model_id(url)
    # A fresh connection per request: llama.cpp's server closes idle keep-alive connections,
    # and a reused one then fails with "Server disconnected" (seen in earlier runs).
    with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as client:
        stream_completion(client, url, {"model": name, "prompt": "warm up", "max_tokens": 4})
        decode = []
        for i in range(reps):
            body = {"model": name, "prompt": f"Story {i}: once upon a time", "max_tokens": 64,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            _, stamps = stream_completion(client, url, body)
            decode.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
        prefill = []
        for i in range(reps):
            prompt = long_prompt(i)
            n = (
                len(httpx.post(url + "/tokenize", json={"content": prompt}).json()["tokens"])
                if llama
                else None
            )
            body = {"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            # NOTE: cgn-infer refuses fields it does not support, and a fresh prompt misses
            # its prefix cache anyway; llama.cpp's slot cache is turned off by this one
            if llama:
                body["cache_prompt"] = False
            resp = client.post(url + "/v1/completions", json=body, timeout=600)
            elapsed = resp.elapsed.total_seconds()
            tokens = resp.json()["usage"]["prompt_tokens"] if n is None else n
            prefill.append(tokens / elapsed)
    return {"decode_tok_s": statistics.median(decode), "prompt_tok_s": statistics.median(prefill),
            "prompt_tokens": tokens}  # fmt: skip


def first_load_s(path: Path, threads: int) -> float:
    """cgn-infer's start on a machine that has not built its kernels yet (an empty cache)."""
    with (
        tempfile.TemporaryDirectory() as cache,
        engine("cgn-infer", path, threads, env={"CGN_KERNEL_CACHE": cache}) as e,
    ):
        return float(e["load_s"])


def _ratio(x: float | None) -> str:
    return "n/a (no llama.cpp figure)" if x is None else f"{x:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    opts = ap.parse_args()
    results: dict[str, Any] = {}
    rows = ["| model | engine | load s (first / warm) | decode tok/s | × llama.cpp | prompt tok/s | × llama.cpp | peak RSS MiB |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for model in opts.models:
        path = MODELS[model]()
        results[model] = {}
        for label, kind, extra in ENGINES:
            try:
                first = first_load_s(path, opts.threads) if label == ENGINES[1][0] else None
                with engine(kind, path, opts.threads, *extra) as e:
                    r = measure(e["url"], opts.reps, kind == "llama.cpp")
                    r["load_s"], r["first_load_s"] = e["load_s"], first
                    r["peak_rss_mib"] = peak_rss_mib(e["pid"])
            except (httpx.HTTPError, RuntimeError, TimeoutError) as exc:  # report, keep measuring
                rows.append(f"| {model} | {label} | failed: {exc} | | | | | |")
                print(rows[-1], flush=True)
                continue
            results[model][label] = r
            base = results[model].get("llama.cpp")
            r["decode_ratio"] = r["decode_tok_s"] / base["decode_tok_s"] if base else None
            r["prompt_ratio"] = r["prompt_tok_s"] / base["prompt_tok_s"] if base else None
            load = f"{r['load_s']:.1f}" if first is None else f"{first:.1f} / {r['load_s']:.1f}"
            rows.append(f"| {model} | {label} | {load} | {r['decode_tok_s']:.1f} | {_ratio(r['decode_ratio'])} | "
                        f"{r['prompt_tok_s']:.0f} | {_ratio(r['prompt_ratio'])} | {r['peak_rss_mib']:.0f} |")  # fmt: skip
            print(rows[-1], flush=True)
    command = "python bench/infer_single_stream.py " + " ".join(sys.argv[1:])
    write_result("infer_single_stream", command.strip(), results, "\n".join(rows))


if __name__ == "__main__":
    main()
