"""The endpoint picker's own cost per request (#61), measured at its gRPC boundary.

    .venv/bin/python bench/epp_pick.py [--requests 200] [--long-requests 24]

One `cgn-router serve --epp` (one process) over two cgn-infer sim engines. Clients drive
ext_proc streams as Envoy does (harness/gateway_standin.py's ExtProc: headers, then the
body in 64 KiB chunks as FULL_DUPLEX_STREAMED sends it), `--concurrency` of them at once.
A pick's latency runs from the last body chunk sent to the picker's body answer received
(the header mutation comes first): what a gateway waits before it can dial the pod. Each
stream then reports a one-chunk answer and ends (no engine is called: the cost measured is
the picker's). Prompts are chats of ~1k and ~100k tokens, each distinct; and of ~100k
tokens of which 99k are a document every request sends as its first message (RAG over
one document, or a long system prompt: the router's tokenizer caches a message's ids, as
it does a conversation's earlier turns). CPU per request is the router process's user+system time over the run divided by
its requests; throughput per core is its inverse. Results: bench/results/epp_pick.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from cgn_core.bundled_models import smollm2
from harness.gateway_standin import (
    ExtProc,
    body_message,
    headers_message,
    response_headers_message,
)
from harness.procs import cgn_infer_engines, cgn_router

CHAT = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}
WORDS_PER_1K = 560  # ~1,000 SmolLM2 tokens of this text
# a document's vocabulary: 2,000 made-up words, drawn Zipf-like (a text repeats its words;
# the router's tokenizer caches each word's pieces, as a real document's would warm it)
VOCABULARY = [f"{'bcdfglmnprst'[i % 12]}{'aeiou'[i // 12 % 5]}{'nrstl'[i // 60 % 5]}{i // 300}"
              for i in range(2000)]  # fmt: skip


def text(i: int, thousands: int) -> str:
    rng = random.Random(i)
    words = rng.choices(VOCABULARY, [1 / (r + 1) for r in range(len(VOCABULARY))],
                        k=WORDS_PER_1K * thousands)  # fmt: skip
    return f"Request {i}. " + " ".join(words)


def prompt(i: int, thousands: int, shared: int = 0) -> bytes:
    """A chat of ~`thousands`k tokens, distinct from every other `i` from its first block;
    with `shared`, a ~`shared`k-token document every request sends first (its own message:
    the router's tokenizer has its ids cached after the first) and the rest its own."""
    messages = [{"role": "system", "content": text(-1, shared)}] if shared else []
    messages.append({"role": "user", "content": text(i, thousands - shared)})
    return json.dumps({"model": "smol", "messages": messages, "max_tokens": 8}).encode()


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one(target: str, body: bytes) -> float:
    async with ExtProc(target) as ext:
        await ext.send(headers_message(CHAT))
        chunks = [body[i : i + (64 << 10)] for i in range(0, len(body), 64 << 10)]
        for i, chunk in enumerate(chunks):
            if i == len(chunks) - 1:
                started = time.perf_counter()
            await ext.send(body_message(chunk, i == len(chunks) - 1))
        picked = await ext.picked()
        took = time.perf_counter() - started
        assert picked.header, picked
        await ext.send(response_headers_message(200, "application/json", picked.header))
        await ext.receive()
        await ext.send(body_message(b'{"usage": {"prompt_tokens": 1}}', True, response=True))
        await ext.receive()
        return took


async def run(target: str, bodies: list[bytes], concurrency: int) -> list[float]:
    gate = asyncio.Semaphore(concurrency)

    async def bounded(body: bytes) -> float:
        async with gate:
            return await one(target, body)

    return list(await asyncio.gather(*(bounded(b) for b in bodies)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200, help="per 1k-token point")
    ap.add_argument("--long-requests", type=int, default=24, help="per 100k-token point")
    ap.add_argument("--concurrency", default="1,8,64")
    a = ap.parse_args()
    levels = [int(c) for c in a.concurrency.split(",")]
    data: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        sim = ("--backend", "sim", "--engines", "2", "--model-name", "smol")
        with cgn_infer_engines(tmp, 1, *sim) as engines:
            config = {
                "discovery": "static",
                "models": {"smol": {"tokenizer": str(smollm2())}},
                "endpoints": {f"e{i}": {"url": e.url, "model": "smol"} for i, e in enumerate(engines)},
                "epp": {"enabled": True, "port": 0, "health_port": 0},
                "admission": {"enabled": False},
            }  # fmt: skip
            with cgn_router(tmp, config) as router:
                target = f"127.0.0.1:{router.ports['epp']}"
                asyncio.run(run(target, [prompt(-1 - i, 1) for i in range(8)], 4))  # warm up
                points = ((1, 0, a.requests), (100, 0, a.long_requests), (100, 99, a.requests))
                for thousands, shared, count in points:
                    for c in levels:
                        bodies = [prompt(i + 1000 * c, thousands, shared) for i in range(count)]
                        before, wall = cpu_s(router.proc.pid), time.perf_counter()
                        took = asyncio.run(run(target, bodies, c))
                        cpu = (cpu_s(router.proc.pid) - before) / count
                        wall = time.perf_counter() - wall
                        q = statistics.quantiles(took, n=100)
                        what = f", {shared}k of them a shared document" if shared else ""
                        key = f"{thousands}k tokens{what}, {c} streams"
                        data[key] = {
                            "requests": count, "p50_ms": 1e3 * q[49], "p99_ms": 1e3 * q[98],
                            "cpu_ms_per_request": 1e3 * cpu, "per_core_per_s": 1 / cpu,
                            "requests_per_s": count / wall, "body_bytes": len(bodies[0]),
                        }  # fmt: skip
                        print(key, data[key], flush=True)
    rows = [
        f"| {k} | {d['requests']} | {d['p50_ms']:.1f} | {d['p99_ms']:.1f} | "
        f"{d['cpu_ms_per_request']:.1f} | {d['per_core_per_s']:.0f} | {d['requests_per_s']:.0f} |"
        for k, d in data.items()
    ]
    table = "\n".join([
        "| prompt, concurrent streams | requests | pick p50 ms | pick p99 ms | router CPU ms "
        "per request | requests per core-second | requests/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "Targets (#61): p50 <= 2 ms and p99 <= 10 ms per pick at 100k-token prompts.",
    ])  # fmt: skip
    print(table)
    write_result("epp_pick", "python " + " ".join(sys.argv), data, table)


if __name__ == "__main__":
    main()
