"""Prefill/decode disaggregation on real SmolLM2: decode latency under prefill bursts, one run.

    .venv/bin/python bench/pd_mixed.py [--streams 8] [--bursts 6] [--burst-words 2000]

Two cgn-infer engines (SmolLM2-135M, torch, one thread each, each pinned to a
core of its own with `taskset`) behind one cgn-router, in two layouts on the
same hardware, one after the other:

* aggregated: both engines `--role both`; the router places every request;
* disaggregated: one `--role prefill` engine and one `--role decode` engine;
  the router splits long prompts (`pd.min_uncached_tokens` 512) while the
  prefill engine is not busy (`pd.max_prefill_queue`);
* predicted: the same engines, the split decided by predicted time (a `time`
  scorer in the chain; cgn_router/routing/disagg.py, `Costs`).

Load: `--streams` ongoing chat streams (short prompts, 160-token answers,
restarted as they end) and, once they run, `--bursts` long prompts
(~`--burst-words` tokens, each distinct: nothing cached), one every
`--gap` seconds, each answered with 16 tokens. Reported per layout: the
ongoing streams' inter-token latency p50/p99 (client side, between content
chunks, while bursts are in flight or not), the bursts' TTFT p50/p90, and
for the disaggregated layout the TTFT split from the engines' own metrics
(prefill leg on the prefill engine; the decode engine's fetch; its TTFT
from admission). Bytes moved per prompt token: the decode engine's fetched
blocks x block bytes / tokens.

Results: bench/results/pd_mixed.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from cgn_core.bundled_models import smollm2
from cgn_core.etcd.local import free_port
from harness.metrics import metric
from harness.procs import BIN, cgn_router, http_process

MODEL = "smol"
VOCAB = [
    "river",
    "stone",
    "light",
    "market",
    "winter",
    "garden",
    "signal",
    "harbor",
    "copper",
    "lantern",
    "meadow",
    "engine",
    "thunder",
    "velvet",
    "orchard",
]  # each one SmolLM2 token after a space
BLOCK_BYTES = 16 * 46080  # SmolLM2's float32 KV: 46,080 bytes per token


@contextmanager
def engines(tmp: Path, roles: tuple[str, str]) -> Iterator[list[str]]:
    """Two engines, engine i pinned to core i, with the given roles; yields their URLs."""
    with ExitStack() as stack:
        urls = []
        for core, role in enumerate(roles):
            port = free_port()
            argv = [str(BIN / "cgn-infer"), "serve", "--model", str(smollm2()), "--port",
                    str(port), "--threads", "1", "--model-name", MODEL, "--role", role,
                    "--max-batch", "16"]  # fmt: skip
            if shutil.which("taskset"):
                argv = ["taskset", "-c", str(core), *argv]
            url = f"http://127.0.0.1:{port}"
            stack.enter_context(http_process(argv, url + "/health", tmp / f"{role}{core}.log"))
            urls.append(url)
        yield urls


async def stream_chat(
    s: aiohttp.ClientSession, url: str, content: str, max_tokens: int
) -> tuple[float, list[tuple[float, float]]]:
    """(TTFT, [(time of chunk, gap since the previous chunk)]) of one streamed chat."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": True, "temperature": 0.7}  # fmt: skip
    start = time.monotonic()
    first, last, gaps = 0.0, 0.0, []
    async with s.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            delta = json.loads(line[6:])["choices"]
            if not delta:
                continue
            now = time.monotonic()
            if not first and delta[0].get("finish_reason"):
                first = now - start  # an answer without text still had a first token
            if not delta[0].get("delta", {}).get("content"):
                continue
            if not first:
                first = now - start
            else:
                gaps.append((now, now - last))
            last = now
    return first, gaps


async def run_load(url: str, args: Any) -> dict[str, Any]:
    stop = asyncio.Event()
    gaps: list[tuple[float, float]] = []
    bursts: list[tuple[float, float, float]] = []  # (start, end, ttft)

    async def ongoing(s: aiohttp.ClientSession, i: int) -> None:
        n = 0
        while not stop.is_set():
            _, g = await stream_chat(s, url, f"Tell story {i}.{n} about a lighthouse.", 160)
            gaps.extend(g)
            n += 1

    async def burst(s: aiohttp.ClientSession, i: int) -> None:
        rng = random.Random(i)  # one token per word: ~burst_words prompt tokens, distinct
        words = " ".join(rng.choice(VOCAB) for _ in range(args.burst_words))
        start = time.monotonic()
        ttft, _ = await stream_chat(s, url, f"Summarize: {words}", 16)
        bursts.append((start, time.monotonic(), ttft))

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        streams = [asyncio.create_task(ongoing(s, i)) for i in range(args.streams)]
        await asyncio.sleep(args.warmup)
        measured_from = time.monotonic()
        jobs = []
        for i in range(args.bursts):
            jobs.append(asyncio.create_task(burst(s, i)))
            await asyncio.sleep(args.gap)
        await asyncio.gather(*jobs)
        stop.set()
        await asyncio.gather(*streams)
    during = [g for t, g in gaps if t >= measured_from and any(a <= t <= b for a, b, _ in bursts)]
    quiet = [
        g for t, g in gaps if t >= measured_from and not any(a <= t <= b for a, b, _ in bursts)
    ]
    every = during + quiet
    return {
        "itl_ms": {"p50": pct(every, 0.5), "p99": pct(every, 0.99), "n": len(every)},
        "itl_during_bursts_ms": {
            "p50": pct(during, 0.5),
            "p99": pct(during, 0.99),
            "n": len(during),
        },
        "burst_ttft_ms": {
            "p50": pct([b[2] for b in bursts], 0.5),
            "p90": pct([b[2] for b in bursts], 0.9),
        },
    }


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1)


def hist_mean_ms(url: str, name: str) -> float:
    n = metric(url, name + "_count")
    return round(metric(url, name + "_sum") / n * 1000, 1) if n else float("nan")


def layout(
    tmp: Path, name: str, roles: tuple[str, str], args: Any, routing: dict[str, Any] | None = None
) -> dict[str, Any]:
    with engines(tmp, roles) as urls:
        endpoints = {f"e{i}": {"url": u, "model": MODEL, "role": r}
                     for i, (u, r) in enumerate(zip(urls, roles, strict=True))}  # fmt: skip
        config = {"discovery": "static", "models": {MODEL: {"tokenizer": "smollm2"}},
                  "endpoints": endpoints, "log": {"level": "warning"},
                  "deadlines": {"first_token_s": 300, "total_s": 900}}  # fmt: skip
        if routing:
            config["routing"] = routing
        with cgn_router(tmp, config) as router:
            out = asyncio.run(run_load(router.url, args))
            out["router_pd"] = {
                r: metric(router.admin, "cgn_router_pd_decisions_total", reason=r)
                for r in ("split", "short_prompt", "prefill_busy", "predicted_slower")
            }
            out["pd_fallbacks"] = metric(router.admin, "cgn_router_pd_fallbacks_total")
        if roles[0] == "prefill":
            prefill, decode = urls
            fetched = metric(decode, "cgn_infer_kv_transfer_fetched_blocks_total")
            out["ttft_split_ms"] = {
                "prefill_leg_on_prefill_engine": hist_mean_ms(
                    prefill, "vllm:e2e_request_latency_seconds"),
                "fetch_on_decode_engine": hist_mean_ms(decode, "cgn_infer_kv_transfer_seconds"),
            }  # fmt: skip
            out["fetched_blocks"] = fetched
            out["bytes_per_prompt_token"] = BLOCK_BYTES // 16
    print(name, json.dumps(out), file=sys.stderr, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--bursts", type=int, default=6)
    p.add_argument("--burst-words", type=int, default=2000, help="~ prompt tokens per burst")
    p.add_argument(
        "--gap",
        type=float,
        default=15.0,
        help="seconds between bursts (a 2k prefill takes ~13 s here)",
    )
    p.add_argument("--warmup", type=float, default=5.0)
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        results["aggregated"] = layout(tmp, "aggregated", ("both", "both"), args)
        results["disaggregated"] = layout(tmp, "disaggregated", ("prefill", "decode"), args)
        results["predicted"] = layout(tmp, "predicted", ("prefill", "decode"), args,
                                      {"scorers": [{"type": "time"}]})  # fmt: skip
    results["itl_p99_ratio"] = round(
        results["aggregated"]["itl_ms"]["p99"] / results["disaggregated"]["itl_ms"]["p99"], 2
    )
    command = "python bench/pd_mixed.py " + " ".join(sys.argv[1:])
    write_result("pd_mixed", command.strip(), results, table(results, args))


def table(r: dict[str, Any], args: Any) -> str:
    rows = ["| layout | ITL p50 ms | ITL p99 ms | ITL p99 during bursts | burst TTFT p50 ms | "
            "p90 ms | splits | predicted slower | fallbacks |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name in ("aggregated", "disaggregated", "predicted"):
        x = r[name]
        rows.append(f"| {name} | {x['itl_ms']['p50']} | {x['itl_ms']['p99']} | "
                    f"{x['itl_during_bursts_ms']['p99']} | {x['burst_ttft_ms']['p50']} | "
                    f"{x['burst_ttft_ms']['p90']} | {x['router_pd']['split']:.0f} | "
                    f"{x['router_pd']['predicted_slower']:.0f} | "
                    f"{x['pd_fallbacks']:.0f} |")  # fmt: skip
    d = r["disaggregated"]
    rows += ["", f"Ongoing streams' ITL p99, aggregated / disaggregated: {r['itl_p99_ratio']}x.",
             "", f"Disaggregated TTFT split (means): prefill leg {d['ttft_split_ms']['prefill_leg_on_prefill_engine']} ms "
             f"on the prefill engine, fetch {d['ttft_split_ms']['fetch_on_decode_engine']} ms on the decode "
             f"engine; {d['fetched_blocks']:.0f} blocks fetched, {d['bytes_per_prompt_token']} bytes per prompt "
             "token (SmolLM2 float32 KV: 30 layers x 3 KV heads x 64 dims x 2 x 4 bytes).", "",
             f"{args.streams} ongoing streams (160-token answers), {args.bursts} bursts of "
             f"~{args.burst_words} tokens every {args.gap} s; each engine one thread on its own core."]  # fmt: skip
    return "\n".join(rows)


if __name__ == "__main__":
    main()
