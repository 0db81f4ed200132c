"""Tenants' shares of engine work under mixed prompt sizes (#58): tokens, not requests.

Two tenants in one band keep requests waiting at a router with admission on, in front of
one sim engine of batch 2 (the router's capacity for it: 2): tenant `long` sends 8,192-token
prompts, tenant `short` 1,024-token ones, each with 64 tokens of output, `--concurrency`
of each in flight at once (closed loop, fresh random token ids: no cache hits). After a
warm-up, for `--seconds`, it counts each tenant's tokens served (prompt and completion, from
the answers' usage) and its TTFT (to the first streamed chunk). Setups, one after another
in one run (the counted window ends at a request's end):

* equal weights, 1 router worker: each should get half the tokens (requests turn by turn
  would give `long` 8/9 of them);
* weights 2:1 (`short` 2), 1 worker: `short` should get two thirds;
* equal weights, 2 router workers: the workers share their admission (its ceiling, the
  virtual times and tags, and which worker's head goes next: cgn_router/gate.py). Before
  they did (2026-12-06, first run) `long` got 0.84 of the tokens: the two together
  admitted past the engine's batch, and the engine serves first come, first served.

* two routers (one worker each) in front of the engine: `long`'s requests go through both,
  `short`'s through the first only, with the usage ledger off (`budgets.enabled: false`:
  each router shares by what it serves itself) and on (each router charges a tenant what
  the others served it, cgn_router/ledger.py, about a second late, and holds a tenant's
  head while another router waits with a tenant that had less: cgn_router/fleetshare.py;
  before that hold, 2026-12-06, `short` got 0.12 with the ledger on).

Target: shares within 10 % of the weights' in every setup.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import private_etcd, put_key, until_served, write_result
from harness.procs import cgn_infer, cgn_router, etcd_put

PROMPTS = {"long": 8192, "short": 1024}
OUTPUT = 64
EQUAL = {"long": 1.0, "short": 1.0}
BOTH, FIRST = {"long": (0, 1), "short": (0,)}, {"long": (0,), "short": (0,)}
SETUPS = {  # name: (weights, router workers, routers each tenant's requests go through, ledger)
    "equal weights, 1 worker": (EQUAL, 1, FIRST, True),
    "short weighs 2, 1 worker": ({"long": 1.0, "short": 2.0}, 1, FIRST, True),
    "equal weights, 2 workers": (EQUAL, 2, FIRST, True),
    "two routers, long through both, ledger off": (EQUAL, 1, BOTH, False),
    "two routers, long through both, ledger on": (EQUAL, 1, BOTH, True),
}


async def tenant_loop(
    session: aiohttp.ClientSession, url: str, key: str, tokens: int, window: tuple[float, float],
    served: list[float], ttfts: list[float], rng: random.Random,
) -> None:  # fmt: skip
    """Send requests back to back until the window ends; count those that end in it (with
    both tenants backlogged throughout, what ends in a long window is what was served)."""
    start_at, end_at = window
    headers = {"Authorization": f"Bearer {key}"}
    while time.monotonic() < end_at:
        prompt = [rng.randrange(100, 40_000) for _ in range(tokens)]
        body = {"model": "sim", "prompt": prompt, "max_tokens": OUTPUT, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        sent = time.monotonic()
        first = None
        usage: dict[str, Any] = {}
        async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                raise RuntimeError(f"{r.status}: {(await r.text())[:200]}")
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                if first is None:
                    first = time.monotonic() - sent
                if b'"usage"' in line:
                    doc = json.loads(line[6:])
                    usage = doc.get("usage") or usage
        if start_at <= time.monotonic() <= end_at and usage:  # ended in the window
            served.append(usage["prompt_tokens"] + usage["completion_tokens"])
            ttfts.append(first or 0.0)


async def measure(
    urls: list[str], routes: dict[str, tuple[int, ...]], keys: dict[str, str],
    args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """Each tenant's requests in flight spread over the routers `routes` names for it."""
    now = time.monotonic()
    window = (now + args.warmup, now + args.warmup + args.seconds)
    served: dict[str, list[float]] = {t: [] for t in PROMPTS}
    ttfts: dict[str, list[float]] = {t: [] for t in PROMPTS}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(
            tenant_loop(session, urls[routes[t][i % len(routes[t])]], keys[t], PROMPTS[t],
                        window, served[t], ttfts[t], random.Random(f"{t}{i}"))
            for t in PROMPTS for i in range(args.concurrency)
        ))  # fmt: skip
    total = sum(sum(v) for v in served.values())
    out: dict[str, Any] = {}
    for t in PROMPTS:
        ms = sorted(x * 1000 for x in ttfts[t])
        out[t] = {
            "requests": len(served[t]),
            "tokens": sum(served[t]),
            "share": sum(served[t]) / total if total else 0.0,
            "ttft_p50_ms": statistics.median(ms) if ms else None,
            "ttft_p90_ms": ms[len(ms) * 9 // 10] if ms else None,
        }
    return out


def run_setup(
    weights: dict[str, float], workers: int, routes: dict[str, tuple[int, ...]], ledger: bool,
    args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with private_etcd(tmp) as etcd:
            keys = {tenant: put_key(etcd, tenant, weight=w) for tenant, w in weights.items()}
            sim = ("--backend", "sim", "--model-name", "sim", "--speed", str(args.speed),
                   "--max-batch", "2", "--ctx", "16384", "--kv-pool-tokens", "65536")  # fmt: skip
            with cgn_infer(tmp, *sim) as engine:
                etcd_put(etcd.endpoint, "/cognitora/endpoints/sim/e1",
                         {"url": engine, "engine": "cgn-infer"})  # fmt: skip
                config = {"etcd": {"endpoints": [etcd.endpoint]}, "auth": {"enabled": True},
                          "reconciler": {"enabled": False}, "workers": workers,
                          "admission": {"default_capacity": 2},
                          "budgets": {"enabled": ledger}}  # fmt: skip
                n = 1 + max(max(r) for r in routes.values())
                with contextlib.ExitStack() as stack:
                    routers = [stack.enter_context(cgn_router(tmp, config)) for _ in range(n)]
                    for router in routers:
                        for _ in range(4 * workers):  # a new connection lands on any worker
                            for key in keys.values():
                                until_served(router.url, key, "sim")
                    urls = [r.url for r in routers]
                    return asyncio.run(measure(urls, routes, keys, args))


def render(results: dict[str, Any], args: argparse.Namespace) -> str:
    rows = [
        f"One sim engine (batch 2, --speed {args.speed:g}) behind routers with admission; "
        f"`long` sends {PROMPTS['long']}-token prompts, `short` {PROMPTS['short']}, each "
        f"{OUTPUT} output tokens, {args.concurrency} of each in flight; {args.seconds:g} s "
        f"counted after {args.warmup:g} s of warm-up.",
        "",
        "| setup | long: requests / token share / TTFT p90 ms | short: requests / token share "
        "/ TTFT p90 ms | short's share, wanted |",
        "|---|---|---|---|",
    ]
    for setup, r in results.items():
        weights = SETUPS[setup][0]
        want = weights["short"] / sum(weights.values())
        cells = [
            f"{r[t]['requests']} / {r[t]['share']:.3f} / {r[t]['ttft_p90_ms'] or 0:.0f}"
            for t in ("long", "short")
        ]
        rows.append(f"| {setup} | {cells[0]} | {cells[1]} | {want:.3f} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=40.0, help="the counted window per setup")
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=6, help="requests in flight per tenant")
    p.add_argument("--speed", type=float, default=40.0, help="the sim engine's --speed")
    p.add_argument("--result", default="tenant_fairness", help="bench/results/ file name")
    p.add_argument("--only", default="", help="run the setups whose name holds this")
    args = p.parse_args()
    results = {}
    for setup, (weights, workers, routes, ledger) in SETUPS.items():
        if args.only and args.only not in setup:
            continue
        print(f"{setup} ...", file=sys.stderr, flush=True)
        results[setup] = run_setup(weights, workers, routes, ledger, args)
        print(results[setup], file=sys.stderr, flush=True)
    command = shlex.join([".venv/bin/python", "bench/tenant_fairness.py", *sys.argv[1:]])
    write_result(args.result, command, results, render(results, args))
    print(render(results, args))


if __name__ == "__main__":
    main()
