"""Structured outputs under load: what constrained decoding costs per token, and the schema
corpus against llama.cpp's server, one run, same GGUF, same threads.

1. Overhead: cgn-infer (default flags) decodes 96 tokens per stream at 1 and 8 streams,
   free (`ignore_eos`) and under a JSON schema whose one string must be 2,000 characters
   long (so no answer ends early either): aggregate tokens/s and the per-token overhead,
   medians of 9 interleaved rounds.
   Then the first request of a new schema against the same schema again (compile vs
   cache hit), as time to the whole 1-token answer.
2. Corpus: the 56 schemas of tests/fixtures/json_schemas.json, 8 requests in flight,
   greedy, `max_tokens` 160, through `response_format: json_schema` on cgn-infer and on
   llama.cpp (xllamacpp, `--parallel 8`): answers that finish, answers that validate
   (jsonschema), refusals, and completion tokens per second of wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import jsonschema  # noqa: E402

from bench.common import engine, model_id, write_result  # noqa: E402
from cgn_core.bundled_models import smollm2  # noqa: E402

CORPUS = json.loads((REPO / "tests" / "fixtures" / "json_schemas.json").read_text())
ROUNDS, TOKENS = 9, 96
LONG = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}},
        "required": ["story"], "additionalProperties": False}  # fmt: skip
PROMPT = "Tell me a long story about a lighthouse keeper."
V = jsonschema.Draft202012Validator


def fmt(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def chat(client: httpx.Client, url: str, model: str, prompt: str, **kw: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            **kw}  # fmt: skip
    resp = client.post(url + "/v1/chat/completions", json=body, timeout=600)
    return {"status": resp.status_code, **(resp.json() if resp.content else {})}


def overhead(url: str, streams: int, rounds: int = ROUNDS) -> dict[str, float]:
    """Aggregate tokens/s free and constrained, rounds interleaved (this machine's speed
    drifts within minutes), each the median of its rounds."""
    model = model_id(url)
    modes = {"free": {"ignore_eos": True}, "constrained": {"response_format": fmt("long", LONG)}}
    runs: dict[str, list[float]] = {label: [] for label in modes}
    with httpx.Client() as client, ThreadPoolExecutor(streams) as pool:
        for extra in modes.values():
            chat(client, url, model, PROMPT, max_tokens=2, **extra)  # warm (and compile)
        for _ in range(rounds):
            for label, extra in modes.items():
                start = time.perf_counter()
                answers = list(pool.map(
                    lambda _, kw=extra: chat(client, url, model, PROMPT, max_tokens=TOKENS, **kw),
                    range(streams)))  # fmt: skip
                wall = time.perf_counter() - start
                assert all(a["choices"][0]["finish_reason"] == "length" for a in answers), answers
                runs[label].append(sum(a["usage"]["completion_tokens"] for a in answers) / wall)
    out = {label: statistics.median(r) for label, r in runs.items()}
    out["overhead"] = out["free"] / out["constrained"] - 1
    return out


def compile_cost(url: str) -> dict[str, float]:
    model = model_id(url)
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "array", "items": {
        "type": "object", "properties": {"k": {"type": "string"}, "v": {"type": "number"}}}}
        for i in range(12)}}  # fmt: skip
    times = []
    with httpx.Client() as client:
        for _ in range(2):
            start = time.perf_counter()
            chat(client, url, model, "Hi", max_tokens=1, response_format=fmt("c", schema))
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        chat(client, url, model, "Hi", max_tokens=1)
        free = time.perf_counter() - start
    return {"first_s": times[0], "cached_s": times[1], "free_s": free}


def corpus(url: str) -> dict[str, Any]:
    model = model_id(url)

    def one(case: dict[str, Any]) -> tuple[str, int]:
        r = chat(client, url, model, case["prompt"], max_tokens=160,
                 response_format=fmt(case["name"], case["schema"]))  # fmt: skip
        if r["status"] != 200:
            return "refused", 0
        choice, tokens = r["choices"][0], r["usage"]["completion_tokens"]
        if choice["finish_reason"] != "stop":
            return "unfinished", tokens
        try:
            V(case["schema"], format_checker=V.FORMAT_CHECKER).validate(
                json.loads(choice["message"]["content"])
            )
        except (ValueError, jsonschema.ValidationError):
            return "invalid", tokens
        return "valid", tokens

    with httpx.Client() as client, ThreadPoolExecutor(8) as pool:
        start = time.perf_counter()
        answers = list(pool.map(one, CORPUS))
        wall = time.perf_counter() - start
    counts = {k: sum(1 for a, _ in answers if a == k)
              for k in ("valid", "invalid", "unfinished", "refused")}  # fmt: skip
    which = {k: [c["name"] for c, (a, _) in zip(CORPUS, answers, strict=True) if a == k]
             for k in ("invalid", "unfinished", "refused")}  # fmt: skip
    return {**counts, "which": which, "tok_s": sum(t for _, t in answers) / wall, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = smollm2()
    results: dict[str, Any] = {}
    with engine("cgn-infer", model, args.threads, "--max-batch", "8", parallel=8, ctx=2048) as e:
        for streams in (1, 8):
            results[f"overhead_{streams}"] = overhead(e["url"], streams)
            print(streams, results[f"overhead_{streams}"], flush=True)
        results["compile"] = compile_cost(e["url"])
        results["corpus/cgn-infer"] = corpus(e["url"])
        print(results["compile"], results["corpus/cgn-infer"], flush=True)
    with engine("llama.cpp", model, args.threads, parallel=8, ctx=2048) as e:
        results["corpus/llama.cpp"] = corpus(e["url"])
        print(results["corpus/llama.cpp"], flush=True)
    o1, o8, c = results["overhead_1"], results["overhead_8"], results["compile"]
    rows = "\n".join(
        f"| {name} | {r['valid']} | {r['invalid']} | {r['unfinished']} | {r['refused']} | "
        f"{r['tok_s']:.1f} | {r['wall_s']:.1f} |"
        for name, r in (
            (n.split("/")[1], results[n]) for n in ("corpus/cgn-infer", "corpus/llama.cpp")
        )
    )
    table = (
        "SmolLM2-135M Q4_1, default flags, greedy.\n\n"
        "| streams | free tok/s | constrained tok/s | overhead per token |\n|---|---|---|---|\n"
        f"| 1 | {o1['free']:.1f} | {o1['constrained']:.1f} | {100 * o1['overhead']:+.1f} % |\n"
        f"| 8 | {o8['free']:.1f} | {o8['constrained']:.1f} | {100 * o8['overhead']:+.1f} % |\n\n"
        f"A new 12-property schema, 1-token answer: first request {1e3 * c['first_s']:.0f} ms "
        f"(compile), same schema again {1e3 * c['cached_s']:.0f} ms (cached), no schema "
        f"{1e3 * c['free_s']:.0f} ms.\n\n"
        f"Schema corpus ({len(CORPUS)} schemas, 8 in flight, max_tokens 160):\n\n"
        "| engine | valid | invalid | unfinished (max_tokens) | refused | completion tok/s | wall s |\n"
        "|---|---|---|---|---|---|---|\n"
        + rows
        + "\n\n"
        + "\n".join(
            f"- {name.split('/')[1]} {kind}: {', '.join(names)}"
            for name in ("corpus/cgn-infer", "corpus/llama.cpp")
            for kind, names in results[name]["which"].items()
            if names
        )
    )
    write_result("structured_outputs", "python bench/structured_outputs.py", results, table)


if __name__ == "__main__":
    main()
