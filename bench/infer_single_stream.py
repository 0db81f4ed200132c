"""cgn-infer (torch, CPU) against llama.cpp's server on the same GGUF, same machine, same run.

    python bench/infer_single_stream.py [--models smollm2 qwen synthetic-1b] [--threads 2]
        [--engines llama.cpp gguf float32 int8] [--prompts 500 1000 3900]

For each model, every engine is started in turn (its load time to /health = 200:
warm, with the kernels built and the files in the page cache; and for cgn-infer's
default also first, a start with an empty kernel cache, which compiles them), then
all stay up and are measured in turn, request by request, never two at once (the
machine's speed drifts by ±25 % over minutes; interleaved, each ratio compares
the same minutes): single-stream decode tokens/s (64 tokens, greedy, EOS ignored,
timed first token to last over SSE), prompt tokens/s (fresh prompts of up to
500, 1,000 and 3,900 tokens of the model's vocabulary, one output token, so no
prefix cache helps; the same texts for every engine), and at the end each one's
peak RSS (cgn-infer's KV pool holds as many tokens as llama.cpp's 4,096-token
context, and the 3,900-token prompts fill both). Results go to
bench/results/infer_single_stream.{json,md} (other models than the default pair:
infer_single_stream_MODEL.{json,md}), with ratios to llama.cpp and each
run's figures in the JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import engine, model_id, peak_rss_mib, stream_completion, write_result
from bench.synthetic_gguf import synthetic
from cgn_core.bundled_models import qwen_coder_05b, smollm2
from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.tokenizer import GGUFTokenizer

MODELS = {"smollm2": smollm2, "qwen": qwen_coder_05b, "synthetic-1b": synthetic}
DEFAULT_MODELS = ["smollm2", "qwen"]  # synthetic-1b: random weights of a 1.1B shape, on request
ENGINES: dict[str, tuple[str, str, tuple[str, ...]]] = {  # --engines name: label, kind, args
    "llama.cpp": ("llama.cpp", "llama.cpp", ()),
    "gguf": ("cgn-infer (default: gguf)", "cgn-infer", ()),
    "float32": ("cgn-infer float32", "cgn-infer", ("--dtype", "float32")),
    "int8": ("cgn-infer int8", "cgn-infer", ("--dtype", "int8")),
}
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
    """A fresh prompt per seed (it starts with the seed, so no cached prefix)."""
    return f"Document {seed}: " + " ".join(
        WORDS[(seed * 7 + i * (seed + 3)) % len(WORDS)] for i in range(words)
    )


def sized_prompt(tokenizer: GGUFTokenizer, seed: int, tokens: int) -> str:
    """long_prompt(seed) with as many words as fit in `tokens` of the model's vocabulary."""
    lo, hi = 1, tokens
    while lo < hi:  # the most words whose text encodes to at most `tokens`
        mid = (lo + hi + 1) // 2
        lo, hi = (
            (mid, hi) if len(tokenizer.encode(long_prompt(seed, mid))) <= tokens else (lo, mid - 1)
        )
    return long_prompt(seed, lo)


def _decode_once(client: httpx.Client, url: str, i: int) -> float:
    body = {"model": model_id(url), "prompt": f"Story {i}: once upon a time", "max_tokens": 64,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    _, stamps = stream_completion(client, url, body)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _prompt_once(client: httpx.Client, url: str, llama: bool, prompt: str) -> tuple[float, int]:
    """Prompt tokens/s of one fresh prompt, and its length in the engine's tokens."""
    n = (
        len(client.post(url + "/tokenize", json={"content": prompt}).json()["tokens"])
        if llama
        else 0
    )
    body = {"model": model_id(url), "prompt": prompt, "max_tokens": 1, "temperature": 0}
    # NOTE: cgn-infer refuses fields it does not support, and a fresh prompt misses its
    # prefix cache anyway; llama.cpp's slot cache is turned off by this one
    if llama:
        body["cache_prompt"] = False
    resp = client.post(url + "/v1/completions", json=body, timeout=600)
    resp.raise_for_status()
    tokens = n or resp.json()["usage"]["prompt_tokens"]
    return tokens / resp.elapsed.total_seconds(), tokens


def measure(
    urls: dict[str, tuple[str, bool]], reps: int, prompts: dict[int, list[str]]
) -> dict[str, dict[str, Any]]:
    """Every engine of `urls` (name: url, is llama.cpp) measured in turn, request by request:
    one engine's decode, then the next's, and so on, each prompt sent to every engine before
    the next prompt, the order reversed every round. The machine's speed drifts by ±25 %
    over minutes; interleaved, each ratio compares the same minutes."""
    decode: dict[str, list[float]] = {n: [] for n in urls}
    rates: dict[str, dict[int, list[float]]] = {n: {s: [] for s in prompts} for n in urls}
    tokens: dict[str, dict[int, int]] = {n: {} for n in urls}
    # A fresh connection per request: llama.cpp's server closes idle keep-alive connections,
    # and a reused one then fails with "Server disconnected" (seen in earlier runs).
    with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for url, _ in urls.values():
            stream_completion(client, url, {"model": model_id(url), "prompt": "warm up", "max_tokens": 4})  # fmt: skip
        order = list(urls)
        for i in range(reps):
            for name in order:
                decode[name].append(_decode_once(client, urls[name][0], i))
            order.reverse()
        for size, texts in prompts.items():
            for text in texts:
                for name in order:
                    rate, tokens[name][size] = _prompt_once(client, *urls[name], text)
                    rates[name][size].append(rate)
                order.reverse()
    return {
        name: {
            "decode_tok_s": statistics.median(decode[name]),
            "decode_runs": decode[name],
            "prompt": {
                str(s): {"tok_s": statistics.median(r), "runs": r, "tokens": tokens[name][s]}
                for s, r in rates[name].items()
            },
        }
        for name in urls
    }


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
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--prompts", nargs="+", type=int, default=[500, 1000, 3900],
                    help="prompt sizes in tokens, about (at most ~4,000: the context is 4,096)")  # fmt: skip
    opts = ap.parse_args()
    if max(opts.prompts) > 4000 or min(opts.prompts) < 1:
        ap.error("--prompts: sizes from 1 to 4000 tokens")
    results: dict[str, Any] = {}
    sizes = " | ".join(f"prompt ~{n} tok/s (× llama.cpp)" for n in opts.prompts)
    rows = [f"| model | engine | load s (first / warm) | decode tok/s | × llama.cpp | {sizes} | peak RSS MiB |",
            "|---|---|---|---|---|" + "---|" * len(opts.prompts) + "---|"]  # fmt: skip
    for model in opts.models:
        path = MODELS[model]()
        results[model] = {}
        with GGUFFile(path) as gguf:  # the same texts for every engine, sized in its tokens
            tokenizer = GGUFTokenizer(gguf)
            prompts = {
                n: [sized_prompt(tokenizer, i + 100 * n, n) for i in range(opts.reps)]
                for n in opts.prompts
            }
        with ExitStack() as up:  # every engine up at once, measured in turn (measure())
            started: dict[str, dict[str, Any]] = {}
            for name in opts.engines:
                label, kind, extra = ENGINES[name]
                try:
                    first = first_load_s(path, opts.threads) if name == "gguf" else None
                    started[name] = up.enter_context(engine(kind, path, opts.threads, *extra))
                    started[name]["first_load_s"] = first
                except (httpx.HTTPError, RuntimeError, TimeoutError) as exc:  # report the rest
                    rows.append(f"| {model} | {label} | failed: {exc} |" + " |" * (4 + len(opts.prompts)))  # fmt: skip
                    print(rows[-1], flush=True)
            urls = {n: (e["url"], ENGINES[n][1] == "llama.cpp") for n, e in started.items()}
            measured = measure(urls, opts.reps, prompts)
            for name, r in measured.items():
                e = started[name]
                r["load_s"], r["first_load_s"] = e["load_s"], e["first_load_s"]
                r["peak_rss_mib"] = peak_rss_mib(e["pid"])
        for name, r in measured.items():
            label, first = ENGINES[name][0], r["first_load_s"]
            results[model][label] = r
            base = measured.get("llama.cpp")
            r["decode_ratio"] = r["decode_tok_s"] / base["decode_tok_s"] if base else None
            cells = []
            for size, p in r["prompt"].items():
                p["ratio"] = p["tok_s"] / base["prompt"][size]["tok_s"] if base else None
                cells.append(f"{p['tok_s']:.0f} ({_ratio(p['ratio'])})")
            load = f"{r['load_s']:.1f}" if first is None else f"{first:.1f} / {r['load_s']:.1f}"
            rows.append(f"| {model} | {label} | {load} | {r['decode_tok_s']:.1f} | {_ratio(r['decode_ratio'])} | "
                        f"{' | '.join(cells)} | {r['peak_rss_mib']:.0f} |")  # fmt: skip
            print(rows[-1], flush=True)
    command = "python bench/infer_single_stream.py " + " ".join(sys.argv[1:])
    # other models than the default pair go to their own file (e.g. _synthetic-1b)
    name = "infer_single_stream" + (
        "" if opts.models == DEFAULT_MODELS else "_" + "_".join(opts.models)
    )
    write_result(name, command.strip(), results, "\n".join(rows))


if __name__ == "__main__":
    main()
