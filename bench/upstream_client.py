"""The router's upstream client vs aiohttp's ClientSession: CPU per proxied request, one run.

    .venv/bin/python bench/upstream_client.py [--requests 20000] [--concurrency 64]

Both clients POST the same small chat completion to the fake engine
(bench/fake_engine.py, pinned to CPU 1) and read the whole answer, from one
process pinned to CPU 0, `--concurrency` requests at a time; then the same
with `stream: true` (three SSE chunks, a usage chunk, [DONE]) read line by
line, as the proxy does. Reported: this process's CPU time per request and the
requests per second, for each client, and the ratio. The clients alternate
(aiohttp, ours, aiohttp, ours) and each figure is the better of its two runs,
so a noisy neighbour on the VM does not decide the comparison.

Results: bench/results/upstream_client.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from bench.router_overhead import CLIENT_CPU, ROUTER_CPU, pinned, process
from cgn_core.etcd.local import free_port
from cgn_router.upstream import Upstream
from harness.procs import REPO

PATH = "/v1/chat/completions"
HEADERS = {"Content-Type": "application/json"}


def body(stream: bool) -> bytes:
    return json.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 1, "stream": stream}).encode()  # fmt: skip


async def aiohttp_client(base: str, stream: bool, n: int, conc: int) -> dict[str, float]:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    async with aiohttp.ClientSession(
        connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
    ) as session:
        data = body(stream)

        async def one() -> None:
            async with session.post(base + PATH, data=data, headers=HEADERS) as resp:
                assert resp.status == 200
                if stream:
                    while await resp.content.readline():
                        pass
                else:
                    await resp.read()

        return await measure(one, n, conc)


async def our_client(base: str, stream: bool, n: int, conc: int) -> dict[str, float]:
    async with Upstream() as up:
        data = body(stream)

        async def one() -> None:
            with await up.post(base, PATH, data, HEADERS, 3.0) as resp:
                assert resp.status == 200
                if stream:
                    while await resp.readline():
                        pass
                else:
                    await resp.read()

        return await measure(one, n, conc)


async def measure(one: Callable[[], Awaitable[None]], n: int, conc: int) -> dict[str, float]:
    left = n // 10

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one()

    await asyncio.gather(*(worker() for _ in range(conc)))  # warm-up: connections, caches
    left = n
    cpu, wall = time.process_time(), time.monotonic()
    await asyncio.gather(*(worker() for _ in range(conc)))
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    return {"cpu_us_per_request": round(cpu / n * 1e6, 1), "req_s": round(n / wall)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=20000, help="requests per client and run")
    p.add_argument("--concurrency", type=int, default=64)
    args = p.parse_args()
    port = free_port()
    fake = pinned(CLIENT_CPU, [sys.executable, str(REPO / "bench/fake_engine.py"), str(port)])
    base = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {}
    with process(fake, base + "/health"):
        if len(os.sched_getaffinity(0)) > 1:
            os.sched_setaffinity(0, {int(ROUTER_CPU)})
        for stream in (False, True):
            runs: dict[str, list[dict[str, float]]] = {"aiohttp": [], "cognitora": []}
            for _ in range(2):
                for name, client in (("aiohttp", aiohttp_client), ("cognitora", our_client)):
                    r = uvloop.run(client(base, stream, args.requests, args.concurrency))
                    runs[name].append(r)
            best = {k: min(v, key=lambda r: r["cpu_us_per_request"]) for k, v in runs.items()}
            ratio = best["aiohttp"]["cpu_us_per_request"] / best["cognitora"]["cpu_us_per_request"]
            results["stream" if stream else "whole_body"] = {**best, "cpu_ratio": round(ratio, 2)}
            print(json.dumps(results), file=sys.stderr, flush=True)
    command = " ".join([".venv/bin/python bench/upstream_client.py", *sys.argv[1:]])
    write_result("upstream_client", command, results, render(results, args))


def render(r: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        "| answer | aiohttp µs CPU / request | ours | aiohttp req/s | ours | CPU ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, s in r.items():
        a, o = s["aiohttp"], s["cognitora"]
        lines.append(f"| {name} | {a['cpu_us_per_request']} | {o['cpu_us_per_request']} | "
                     f"{a['req_s']} | {o['req_s']} | {s['cpu_ratio']}× |")  # fmt: skip
    lines += [
        "",
        f"{args.requests} requests per run at concurrency {args.concurrency}; client pinned to "
        "CPU 0, the fake engine to CPU 1; the better of two alternating runs per client.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
