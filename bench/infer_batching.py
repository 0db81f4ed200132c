"""Continuous batching and prefix reuse: cgn-infer against llama.cpp's server, same run.

    .venv/bin/python bench/infer_batching.py [--model smollm2] [--threads 2] [--tokens 128]

Engines run one at a time, each configured for 16 concurrent sequences
(llama.cpp: 16 parallel slots, continuous batching, 2,048 tokens per slot;
cgn-infer: --max-batch 16). For each engine:

* aggregate decode throughput at 1, 4, 8 and 16 concurrent streams: every
  stream asks for `--tokens` tokens (greedy, EOS ignored, a short distinct
  prompt); aggregate = all generated tokens / wall time of the round, and
  decode-only = tokens after each stream's first / (last token - first
  first-token) over the round;
* TTFT with a ~1,024-token system prompt, cold (a system prompt never seen
  before) and cached (the same system prompt, a different question), median
  of three pairs;
* peak RSS, and for cgn-infer the KV pool's bytes per token, predicted from
  the model shape and measured from the pool's tensors (`cgn_infer_kv_pool_bytes`).

Results: bench/results/infer_batching.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import engine, model_id, peak_rss_mib, stream_completion, write_result
from cgn_core import bundled_models
from cgn_core.text.gguf_file import GGUFFile
from cgn_infer.models import args_from_gguf
from cgn_infer.settings import KV_DTYPE_BYTES, InferSettings

CONCURRENCY = (1, 4, 8, 16)
SLOT_CTX = 2048
ENGINES: list[tuple[str, str, tuple[str, ...]]] = [
    ("llama.cpp", "llama.cpp", ()),
    ("cgn-infer (default: gguf)", "cgn-infer", ()),
    ("cgn-infer float32", "cgn-infer", ("--dtype", "float32")),
]
TOPICS = ["rivers", "bridges", "glaciers", "volcanoes", "forests", "deserts", "harbours",
          "islands", "canyons", "meadows", "lighthouses", "orchards", "caves", "lagoons",
          "prairies", "reefs"]  # fmt: skip


def system_prompt(seed: int, words: int = 420) -> str:
    """~1,024 tokens; `seed` first, so two seeds share no leading block."""
    body = " ".join(f"{TOPICS[(seed + i) % len(TOPICS)]} {i}" for i in range(words // 2))
    return f"Briefing {seed}. Read these notes before you answer: {body}."


def one_stream(url: str, model: str, prompt: str, tokens: int) -> tuple[float, list[float]]:
    """A fresh connection per request (llama.cpp closes idle keep-alive connections)."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    with httpx.Client() as client:
        return stream_completion(client, url, body)


def throughput(url: str, model: str, streams: int, tokens: int) -> dict[str, float]:
    prompts = [
        f"Write a long story about {TOPICS[i % len(TOPICS)]} number {i}." for i in range(streams)
    ]
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(one_stream, url, model, p, tokens) for p in prompts]
        results = [f.result() for f in futures]
    wall = time.perf_counter() - start
    # Arrival times are relative to each request's own start; requests start together.
    # EOS is ignored, so every stream gets exactly `tokens` (some SSE chunks carry no text).
    total = streams * tokens
    first = min(ttft for ttft, _ in results)
    last = max(stamps[-1] for _, stamps in results)
    decode_tokens = total - len(results)
    return {
        "streams": streams,
        "tokens": total,
        "wall_s": wall,
        "aggregate_tok_s": total / wall,
        "decode_tok_s": decode_tokens / (last - first) if last > first else float("nan"),
        "median_ttft_s": statistics.median(ttft for ttft, _ in results),
    }


def ttft_pairs(url: str, model: str, trials: int = 3) -> dict[str, float]:
    cold, warm = [], []
    for trial in range(trials):
        system = system_prompt(seed=1000 + trial + int(time.time()) % 1000 * 10)
        for question, bucket in (("Which topic comes first?", cold), ("Which comes last?", warm)):
            ttft, _ = one_stream(url, model, f"{system}\nQuestion: {question}\nAnswer:", 4)
            bucket.append(ttft)
    c, w = statistics.median(cold), statistics.median(warm)
    return {"cold_ttft_s": c, "cached_ttft_s": w, "cold_over_cached": c / w}


def kv_pool_bytes(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("cgn_infer_kv_pool_bytes{"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--engines", nargs="*", help="engine labels to run (default: all)")
    opts = ap.parse_args()
    path = bundled_models.resolve(Path(opts.model))
    args = args_from_gguf(GGUFFile(path))
    pool_tokens = 16 * SLOT_CTX
    results: dict[str, Any] = {}
    for label, kind, extra in ENGINES:
        if opts.engines and label not in opts.engines:
            continue
        flags = (*extra, "--max-batch", "16", "--kv-pool-tokens", str(pool_tokens))
        with engine(
            kind, path, opts.threads, *(flags if kind == "cgn-infer" else ()),
            parallel=16, ctx=SLOT_CTX if kind == "llama.cpp" else 4096,
        ) as eng:  # fmt: skip
            model = model_id(eng["url"])
            one_stream(eng["url"], model, "Warm up.", 8)
            rows = []
            for n in CONCURRENCY:
                rows.append(throughput(eng["url"], model, n, opts.tokens))
                print(label, rows[-1], file=sys.stderr, flush=True)
            entry: dict[str, Any] = {"throughput": rows, **ttft_pairs(eng["url"], model)}
            entry["peak_rss_mib"] = peak_rss_mib(eng["pid"])
            if kind == "cgn-infer":
                entry["kv_bytes_per_token_measured"] = kv_pool_bytes(eng["url"]) / pool_tokens
            results[label] = entry
            print(label, {k: v for k, v in entry.items() if k != "throughput"}, file=sys.stderr)
    kv_dtype = InferSettings().kv_dtype  # cgn-infer's default KV pool
    predicted = 2 * args.n_layers * args.n_kv_heads * args.head_dim * KV_DTYPE_BYTES[kv_dtype]
    results["kv_bytes_per_token_predicted"] = predicted
    results["kv_dtype"] = kv_dtype
    write_result(  # one result per model: smollm2's keeps the historical name
        "infer_batching" if opts.model == "smollm2" else f"infer_batching_{opts.model}",
        "python bench/infer_batching.py " + " ".join(sys.argv[1:]),
        results,
        render(results, opts.tokens),
    )


def render(results: dict[str, Any], tokens: int) -> str:
    engines = [k for k in results if isinstance(results[k], dict) and "throughput" in results[k]]
    ref = results.get("llama.cpp")
    lines = [
        f"Aggregate tokens/s, {tokens} tokens per stream (greedy, EOS ignored); "
        "in brackets: ratio to llama.cpp at the same concurrency, and to the engine's own "
        "single stream.",
        "",
        "| engine | " + " | ".join(f"{n} streams" for n in CONCURRENCY) + " |",
        "|---|" + "---|" * len(CONCURRENCY),
    ]
    for name in engines:
        rows = results[name]["throughput"]
        cells = []
        for i, row in enumerate(rows):
            vs_ref = row["aggregate_tok_s"] / ref["throughput"][i]["aggregate_tok_s"] if ref else 1
            vs_one = row["aggregate_tok_s"] / rows[0]["aggregate_tok_s"]
            cells.append(f"{row['aggregate_tok_s']:.1f} ({vs_ref:.2f}×, {vs_one:.1f}× own)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| engine | TTFT cold (1k-token system prompt) | TTFT cached | cold / cached | peak RSS MiB |",
              "|---|---|---|---|---|"]  # fmt: skip
    for name in engines:
        e = results[name]
        lines.append(
            f"| {name} | {e['cold_ttft_s'] * 1000:.0f} ms | {e['cached_ttft_s'] * 1000:.0f} ms "
            f"| {e['cold_over_cached']:.1f}× | {e['peak_rss_mib']:.0f} |"
        )
    dtype = results.get("kv_dtype", "float32")
    lines += ["", f"KV pool bytes per token: predicted {results['kv_bytes_per_token_predicted']} "
              f"(2 × layers × KV heads × head dim × {KV_DTYPE_BYTES[dtype]} bytes, {dtype})"]  # fmt: skip
    for name in engines:
        if "kv_bytes_per_token_measured" in results[name]:
            lines[-1] += f"; {name} measured {results[name]['kv_bytes_per_token_measured']:.0f}"
    return "\n".join(lines)


if __name__ == "__main__":
    main()
