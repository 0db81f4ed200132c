"""Single-stream decode speed of a served cgn-infer by decode threads: 1 against all.

    python bench/infer_decode_threads.py [--threads 2] [--rounds 2]

A lone stream's decode steps run with `--decode-threads` OpenMP threads. One
thread was the default once, from a measurement (on another machine) where a
2-thread team shared its cores with the server's event loop and stalled at
every barrier. This bench re-measures it: per model and weight format, one
engine per setting, alternating for `--rounds`, 64 greedy tokens streamed over
HTTP after a warm-up answer; tokens/s from first to last token.
Results: bench/results/infer_decode_threads.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import engine, model_id, stream_completion, write_result
from cgn_core.bundled_models import qwen_coder_05b, smollm2

CASES = [("smollm2", smollm2, "float32"), ("smollm2", smollm2, "int4"),
         ("qwen", qwen_coder_05b, "int8")]  # fmt: skip


def decode_tok_s(url: str) -> float:
    body = {"model": model_id(url), "prompt": "Once upon a time", "max_tokens": 64,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    with httpx.Client() as client:
        stream_completion(client, url, body)  # warm-up
        _, stamps = stream_completion(client, url, body)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    results: dict[str, Any] = {"threads": args.threads, "rounds": args.rounds, "cases": {}}
    for name, path, weights in CASES:
        runs: dict[str, list[float]] = {"1": [], str(args.threads): []}
        for _ in range(args.rounds):
            for dt in runs:
                with engine("cgn-infer", path(), args.threads, "--dtype", weights,
                            "--decode-threads", dt) as e:  # fmt: skip
                    runs[dt].append(round(decode_tok_s(e["url"]), 1))
        results["cases"][f"{name} {weights}"] = runs
        print(name, weights, runs, file=sys.stderr, flush=True)
    command = "python bench/infer_decode_threads.py " + " ".join(sys.argv[1:])
    write_result("infer_decode_threads", command.strip(), results, table(results))


def table(r: dict[str, Any]) -> str:
    n = str(r["threads"])
    rows = [
        f"| model, weights | 1 thread tok/s | {n} threads tok/s | {n} / 1 |",
        "|---|---:|---:|---:|",
    ]
    for case, runs in r["cases"].items():
        one, many = statistics.median(runs["1"]), statistics.median(runs[n])
        rows.append(f"| {case} | {one:.1f} | {many:.1f} | {many / one:.2f}x |")
    rows += ["", f"Medians of {r['rounds']} alternating rounds; each run a fresh served engine "
             f"with --threads {n}, one stream of 64 greedy tokens."]  # fmt: skip
    return "\n".join(rows)


if __name__ == "__main__":
    main()
