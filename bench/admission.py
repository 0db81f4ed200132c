"""Admission under load: does a batch job starve interactive traffic? One run, side by side.

    .venv/bin/python -m bench.admission [--bronze 500] [--probes 20] [--workers 1]

A private etcd, two sim engines (max batch 16) registered as endpoints, and
three routers on them: one with admission (the default bands), one with
admission and engine priorities switched off (no protection at all), and one
with engine priorities only (no admission: every request goes straight to
the engines, tagged with its band's priority). API keys: a platinum key for
the probes, bronze keys for the load. Phases, each on a fresh load:

1. idle: platinum probes alone (the baseline);
2. admission on: `--bronze` concurrent bronze streams without pause, then the
   same platinum probes through the router with admission;
3. admission off: the same load and probes through the unprotected router;
4. engine priority only: the same through the third router;
5. two routers (`--two-routers`): a fourth router with admission on in front of
   the same engines; the bronze load is split evenly between it and the first,
   the probes go through the first. Admission counts what the engines run
   beyond a router's own requests as the other router's, so platinum should
   keep the one-router ratio. With `--two-routers` only phases 1, 2 and 5 run.

A probe is a streaming completion of a 1000-token prompt of its own (no
prefix-cache hits), timed to its first token (TTFT, measured by the client);
bronze requests are short prompts with 16-token outputs, re-sent as soon as
they finish. Reported: platinum TTFT p50/p99 per phase and the ratios to idle,
bronze completions per second, and a fairness check: two bronze tenants, one
sending 20× more requests at once, with the completion ranks of the small
tenant's requests (alternation puts them early).

`--workers N` runs every router with N worker processes (each worker counts
the others' requests on an engine as another router's, as in phase 5).

Results: bench/results/admission.{json,md} (admission_workers<N> with --workers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import put_key
from cgn_core.etcd.local import LocalEtcd
from harness.metrics import metric
from harness.procs import Router, cgn_infer_engines, cgn_router, etcd_put

MODEL = "sim"
SIM = ("--backend", "sim", "--max-batch", "16", "--kv-pool-tokens", "65536",
       "--model-name", MODEL, "--ctx", "2048")  # fmt: skip
SPEED = 4.0  # the sim engines run this many times faster than the model they stand for
VOCAB = 40000
REPO_ROOT = str(Path(__file__).resolve().parents[1])


@dataclass
class Fleet:
    etcd: LocalEtcd
    with_admission: Router
    without_admission: Router  # and without engine priorities
    priority_only: Router  # engine priorities, no admission
    keys: dict[str, str]  # name -> API key
    twin: Router | None = None  # a second router with admission on, same engines
    engines: tuple[str, ...] = ()  # the engines' base URLs


@contextmanager
def fleet(tmp: Path, twin: bool = False, speed: float = SPEED, workers: int = 1) -> Iterator[Fleet]:
    """etcd, two sim engines, two routers (admission on / off) and the keys; all stopped after."""
    with ExitStack() as stack:
        etcd = LocalEtcd(tmp / "etcd")
        etcd.start()
        stack.callback(etcd.stop)
        engines = stack.enter_context(cgn_infer_engines(tmp, 2, *SIM, "--speed", str(speed)))
        for i, e in enumerate(engines):
            etcd_put(etcd.endpoint, f"/cognitora/endpoints/{MODEL}/e{i}",
                     {"url": e.url, "engine": "cgn-infer", "node": f"n{i}"})  # fmt: skip
        base = {"etcd": {"endpoints": [etcd.endpoint]}, "auth": {"enabled": True},
                "reconciler": {"enabled": False}, "scrape": {"interval_s": 0.25},
                "log": {"level": "warning"}, "deadlines": {"first_token_s": 600.0},
                "workers": workers}  # fmt: skip
        on = stack.enter_context(cgn_router(tmp, base))
        off = stack.enter_context(
            cgn_router(tmp, {**base, "admission": {"enabled": False, "engine_priority": False}})
        )
        prio = stack.enter_context(cgn_router(tmp, {**base, "admission": {"enabled": False}}))
        keys = {"platinum": put_key(etcd, "interactive", "platinum"),
                "bronze": put_key(etcd, "batch", "bronze"),
                "bronze-big": put_key(etcd, "big-tenant", "bronze"),
                "bronze-small": put_key(etcd, "small-tenant", "bronze")}  # fmt: skip
        second = stack.enter_context(cgn_router(tmp, base)) if twin else None
        yield Fleet(etcd, on, off, prio, keys, second, tuple(e.url for e in engines))


async def completion(session: aiohttp.ClientSession, url: str, key: str, prompt: list[int],
                     max_tokens: int) -> float | None:  # fmt: skip
    """Stream one completion; seconds to its first token, or None if it failed."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    start = time.monotonic()
    first: float | None = None
    try:
        async with session.post(url + "/v1/completions", json=body,
                                headers={"Authorization": f"Bearer {key}"}) as resp:  # fmt: skip
            if resp.status != 200:
                await resp.read()
                return None
            async for line in resp.content:
                if first is None and line.startswith(b"data: {"):
                    first = time.monotonic() - start
                if line.startswith(b"data: [DONE]"):
                    break
    except (aiohttp.ClientError, TimeoutError):
        return None
    return first


def long_prompt(rng: random.Random, n: int = 1000) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(n)]  # unique: no prefix-cache help


async def probes(url: str, key: str, n: int, rng: random.Random) -> list[float]:
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        for _ in range(n):
            ttft = await completion(s, url, key, long_prompt(rng), 4)
            if ttft is not None:
                out.append(ttft)
            await asyncio.sleep(0.05)
    return out


async def bronze_load(
    url: str, key: str, n: int, seed: int, stop: asyncio.Event
) -> tuple[int, int]:
    """`n` bronze streams re-sent as soon as they finish, until `stop`; (done, failed)."""
    done = failed = 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=900)) as s:

        async def worker(i: int) -> None:
            nonlocal done, failed
            wrng = random.Random(seed * 1000 + i)
            while not stop.is_set():
                prompt = [wrng.randrange(100, VOCAB) for _ in range(24)]
                if await completion(s, url, key, prompt, 16) is None:
                    failed += 1
                else:
                    done += 1

        tasks = [asyncio.create_task(worker(i)) for i in range(n)]
        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return done, failed


def _load_process(url: str, key: str, n: int, seed: int) -> None:
    """Entry point of the load generator's own process: runs until SIGTERM, prints the counts."""
    import signal

    async def go() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        started = time.monotonic()
        done, failed = await bronze_load(url, key, n, seed, stop)
        print(json.dumps({"done": done, "failed": failed, "seconds": time.monotonic() - started}))

    asyncio.run(go())


async def under_load(url: str, keys: dict[str, str], n_bronze: int, n_probes: int, seed: int,
                     load_urls: tuple[str, ...] = (), settle_s: float = 4.0) -> dict[str, Any]:  # fmt: skip
    """Platinum probes through `url` while `n_bronze` bronze streams run without pause, split
    evenly over `load_urls` (default: `url`), each share in its own process as other users'
    traffic would be (the probes' timings are not the load generator's)."""
    urls = load_urls or (url,)
    procs = []
    for i, load_url in enumerate(urls):
        n = n_bronze // len(urls) + (1 if i < n_bronze % len(urls) else 0)
        code = (
            "from bench.admission import _load_process; "
            f"_load_process({load_url!r}, {keys['bronze']!r}, {n}, {seed * 10 + i})"
        )
        procs.append(await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE, cwd=REPO_ROOT
        ))  # fmt: skip
    try:
        await asyncio.sleep(settle_s)  # the load settles: engines busy, queues filled
        ttfts = await probes(url, keys["platinum"], n_probes, random.Random(seed))
    finally:
        outs = []
        for proc in procs:
            proc.terminate()
            outs.append((await asyncio.wait_for(proc.communicate(), timeout=120))[0])
    counts = [json.loads(out.decode().strip().splitlines()[-1]) for out in outs]
    return {"ttft": ttfts,
            "bronze_per_s": sum(c["done"] / c["seconds"] for c in counts),
            "bronze_failed": sum(c["failed"] for c in counts)}  # fmt: skip


async def fairness(
    router: Router, keys: dict[str, str], big: int = 200, small: int = 10
) -> dict[str, Any]:
    """One bronze tenant's burst of `big` requests is queued, then another's `small` arrive:
    where do the small one's requests finish among what completes from then on? Alternation
    puts them early; first come, first served would put them after the whole queue.

    NOTE: the small tenant is sent once the queue holds half the burst, not in the same
    instant: how many of the burst a router takes in before the small requests arrive
    depends on its machine's speed against the sim engines' clock (on a slow CI machine
    ~100 were admitted and served first), which is not what this measures."""
    order: list[str] = []
    sent = -1  # completions before the small tenant's requests were sent
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=900)) as s:

        async def one(who: str, i: int) -> None:
            r = await completion(s, router.url, keys[f"bronze-{who}"],
                                 [100 + i, 200 + i, 300 + i] * 8, 16)  # fmt: skip
            if r is not None:
                order.append(who)

        burst = [asyncio.create_task(one("big", i)) for i in range(big)]
        deadline = time.monotonic() + 60
        while await asyncio.to_thread(queued, router) < big // 2:
            if time.monotonic() > deadline:
                raise RuntimeError("the big tenant's burst never queued")
            await asyncio.sleep(0.02)
        sent = len(order)
        await asyncio.gather(*burst, *(one("small", i) for i in range(small)))
    ranks = [i - sent for i, who in enumerate(order) if who == "small"]
    return {"completed": len(order) - sent, "before_small": sent, "small_ranks": ranks,
            "small_last_rank": max(ranks) if ranks else None}  # fmt: skip


def queued(router: Router) -> float:
    return metric(router.admin, "cgn_router_queue_depth", band="bronze")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


async def measure_two_routers(f: Fleet, n_bronze: int, n_probes: int) -> dict[str, Any]:
    """Idle, one router with admission, then two routers sharing the bronze load."""
    assert f.twin is not None
    rng = random.Random(7)
    await probes(f.with_admission.url, f.keys["platinum"], 3, rng)  # warm-up
    idle = await probes(f.with_admission.url, f.keys["platinum"], n_probes, rng)
    on = await under_load(f.with_admission.url, f.keys, n_bronze, n_probes, seed=1)
    await asyncio.sleep(2.0)
    two = await under_load(f.with_admission.url, f.keys, n_bronze, n_probes, seed=4,
                           load_urls=(f.with_admission.url, f.twin.url))  # fmt: skip
    base = pct(idle, 0.99)
    return {
        "idle": {"p50": pct(idle, 0.5), "p99": base, "n": len(idle)},
        "admission_on": _loaded(on),
        "two_routers": _loaded(two),
        "ratio_on": pct(on["ttft"], 0.99) / base,
        "ratio_two_routers": pct(two["ttft"], 0.99) / base,
        "bronze_streams": n_bronze,
        "ttft_ms": {"idle": _ms(idle), "admission_on": _ms(on["ttft"]),
                    "two_routers": _ms(two["ttft"])},
    }  # fmt: skip


def table_two_routers(r: dict[str, Any]) -> str:
    rows = ["| phase | platinum TTFT p50 | p99 | p99 / idle | bronze done/s |",
            "|---|---|---|---|---|",
            f"| idle | {r['idle']['p50'] * 1000:.0f} ms | {r['idle']['p99'] * 1000:.0f} ms | 1.00 | - |"]  # fmt: skip
    for name, key, ratio in (("one router, admission on", "admission_on", "ratio_on"),
                             ("two routers, load split", "two_routers", "ratio_two_routers")):  # fmt: skip
        p = r[key]
        rows.append(f"| {name} | {p['p50'] * 1000:.0f} ms | {p['p99'] * 1000:.0f} ms | "
                    f"{r[ratio]:.2f} | {p['bronze_per_s']:.1f} |")  # fmt: skip
    rows += ["", f"{r['bronze_streams']} concurrent bronze streams in each loaded phase."]
    return "\n".join(rows)


def wait_idle(engines: tuple[str, ...], timeout_s: float = 120.0) -> None:
    """Until no engine runs or queues a request (their own /metrics), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    while any(metric(url, name) for url in engines for name in names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engines still had requests after {timeout_s:g} s")
        time.sleep(0.1)


async def measure(f: Fleet, n_bronze: int, n_probes: int, settle_s: float = 4.0) -> dict[str, Any]:
    """The four phases and the fairness check; `settle_s`: how long each load runs before its
    probes start (and the pause after it), which a faster fleet (`fleet(speed=)`) needs less of."""
    rng = random.Random(7)
    await probes(f.with_admission.url, f.keys["platinum"], 3, rng)  # warm-up
    idle = await probes(f.with_admission.url, f.keys["platinum"], n_probes, rng)
    on = await under_load(f.with_admission.url, f.keys, n_bronze, n_probes, 1, settle_s=settle_s)
    await asyncio.sleep(settle_s / 2)
    off = await under_load(f.without_admission.url, f.keys, n_bronze, 3, 2, settle_s=settle_s)
    await asyncio.sleep(settle_s / 2)
    prio = await under_load(f.priority_only.url, f.keys, n_bronze, n_probes // 3, 3,
                            settle_s=settle_s)  # fmt: skip
    await asyncio.sleep(settle_s / 2)
    # NOTE: the engines finish what the last phase left first: fairness is measured on an idle
    # fleet (a leftover queue on one engine had once held seven small requests behind it)
    await asyncio.to_thread(wait_idle, f.engines)
    fair = await fairness(f.with_admission, f.keys)
    base = pct(idle, 0.99)
    return {
        "idle": {"p50": pct(idle, 0.5), "p99": base, "n": len(idle)},
        "admission_on": _loaded(on),
        "admission_off": _loaded(off),
        "priority_only": _loaded(prio),
        "ratio_on": pct(on["ttft"], 0.99) / base,
        "ratio_off": pct(off["ttft"], 0.99) / base,
        "ratio_priority_only": pct(prio["ttft"], 0.99) / base,
        "fairness": fair,
        "bronze_streams": n_bronze,
        "ttft_ms": {"idle": _ms(idle), "admission_on": _ms(on["ttft"]), "admission_off": _ms(off["ttft"]),
                    "priority_only": _ms(prio["ttft"])},
    }  # fmt: skip


def _loaded(phase: dict[str, Any]) -> dict[str, Any]:
    """A phase under load: platinum TTFT p50/p99 (seconds) and the bronze traffic beside it."""
    ttft = phase["ttft"]
    return {"p50": pct(ttft, 0.5), "p99": pct(ttft, 0.99), "n": len(ttft),
            "bronze_per_s": phase["bronze_per_s"], "bronze_failed": phase["bronze_failed"]}  # fmt: skip


def _ms(xs: list[float]) -> list[float]:
    """Every probe's TTFT, sorted, in ms (the tail is two or three probes: show them)."""
    return sorted(round(x * 1000, 1) for x in xs)


def table(r: dict[str, Any]) -> str:
    rows = [
        "| phase | platinum TTFT p50 | p99 | p99 / idle | bronze done/s |",
        "|---|---|---|---|---|",
    ]
    for name, key, ratio_key in (
        ("idle", "idle", ""),
        ("admission on", "admission_on", "ratio_on"),
        ("admission and engine priority off", "admission_off", "ratio_off"),
        ("engine priority only", "priority_only", "ratio_priority_only"),
    ):
        p = r[key]
        ratio = f"{r[ratio_key]:.2f}" if ratio_key else "1.00"
        rate = f"{p['bronze_per_s']:.1f}" if "bronze_per_s" in p else "-"
        rows.append(
            f"| {name} | {p['p50'] * 1000:.0f} ms | {p['p99'] * 1000:.0f} ms | {ratio} | {rate} |"
        )
    fair = r["fairness"]
    rows.append("")
    rows.append(f"{r['bronze_streams']} concurrent bronze streams. Fairness: two bronze tenants at once, "
                f"200 vs 10 requests, the 10 sent once half the 200 are queued; the small "
                f"tenant's completions ranked {fair['small_ranks']} of the {fair['completed']} "
                f"that completed from then on.")  # fmt: skip
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bronze", type=int, default=500)
    ap.add_argument("--probes", type=int, default=20)
    ap.add_argument(
        "--two-routers",
        action="store_true",
        help="idle, one router, then two routers sharing the load (phases 1, 2, 5)",
    )
    ap.add_argument(
        "--workers", type=int, default=1,
        help="each router's worker processes (results: admission_workers<N> past 1)",
    )  # fmt: skip
    args = ap.parse_args()
    from bench.common import write_result

    if args.two_routers:
        with tempfile.TemporaryDirectory() as tmp, fleet(Path(tmp), twin=True) as f:
            result = asyncio.run(measure_two_routers(f, args.bronze, args.probes))
        cmd = (
            f"python -m bench.admission --two-routers --bronze {args.bronze} --probes {args.probes}"
        )
        write_result("admission_two_routers", cmd, result, table_two_routers(result))
        print(table_two_routers(result))
        return
    with tempfile.TemporaryDirectory() as tmp, fleet(Path(tmp), workers=args.workers) as f:
        result = asyncio.run(measure(f, args.bronze, args.probes))

    cmd = f"python -m bench.admission --bronze {args.bronze} --probes {args.probes}"
    name = "admission"
    if args.workers > 1:
        cmd, name = f"{cmd} --workers {args.workers}", f"admission_workers{args.workers}"
    write_result(name, cmd, result, table(result))
    print(table(result))
    print(json.dumps({k: result[k] for k in ("ratio_on", "ratio_off", "ratio_priority_only")}))


if __name__ == "__main__":
    main()
