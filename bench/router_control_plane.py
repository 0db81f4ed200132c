"""The router's control plane at fleet scale: start-up, etcd events and KV events, one run.

    .venv/bin/python bench/router_control_plane.py [--baseline-src DIR] [--nodes 1000]
        [--per-node 5] [--events 1000] [--engines 1000]

1. Start-up: `--nodes` x `--per-node` endpoints (5,000) over 50 models written to a
   real etcd as agents write them (`endpoints/<node>/<model>/<replica>`), every one
   pointing at one fake engine (bench/fake_engine.py) with a KV event stream in its
   model's namespace. A router with etcd discovery starts: time to ready (listed and
   watching), to all endpoints in its registry, to every endpoint's KV stream open
   (its snapshot applied); RSS then.
2. etcd events at that size: `--events` puts of existing endpoint records (agents
   re-registering), then one new endpoint; router CPU per event and the time until
   the new endpoint is listed. With `--baseline-src` (an older checkout) its router
   runs the same two parts, alternating.
3. KV events: routers following 10 and then `--engines` virtual sim engines (one
   `cgn-infer serve --backend sim --engines N` process, registered in etcd). The
   same load (distinct ~320-token prompts sent straight to the engines, round
   robin, 16 at a time) makes the engines publish KV events; router CPU per event
   applied, its idle CPU (scrapes, heartbeats) over the same time subtracted.

CPU is the router process's user + system time from /proc. Results:
bench/results/router_control_plane.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import peak_rss_mib, write_result
from cgn_core import keys
from cgn_core.etcd import EtcdClient
from cgn_core.etcd.local import LocalEtcd, free_port
from harness.metrics import metric
from harness.poll import until
from harness.procs import REPO, cgn_infer_fleet, cgn_router, etcd_run, http_process

MODELS = 50
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


@contextmanager
def etcd_router(tmp: Path, etcd: str, src: Path) -> Iterator[tuple[str, int, float]]:
    """A cgn-router from source tree `src` following `etcd`; yields (admin URL, pid, seconds
    from start to ready)."""
    config = {"discovery": "etcd", "etcd": {"endpoints": [etcd]}, "log": {"level": "warning"},
              "scrape": {"interval_s": 1.0, "stale_s": 10.0}}  # fmt: skip
    started = time.monotonic()
    with cgn_router(tmp, config, src=src) as router:
        yield router.admin, router.proc.pid, time.monotonic() - started


def endpoint_records(nodes: int, per_node: int, url: str) -> dict[str, dict[str, Any]]:
    out = {}
    for i in range(nodes * per_node):
        node, model = f"node-{i // per_node}", f"model-{i % MODELS}"
        out[f"{keys.ENDPOINTS}{node}/{model}/r{i}"] = {
            "url": url, "engine": "cgn-infer", "role": "both", "node": node, "block_size": 16,
            "kv_events_url": f"{url}/v1/kv/events?ns={model}",
        }  # fmt: skip
    return out


def put_all(etcd: str, records: dict[str, dict[str, Any]]) -> None:
    async def go(c: EtcdClient) -> None:
        for key, value in records.items():
            await c.put_json(key, value)

    etcd_run(etcd, go)


def clear(etcd: str) -> None:
    etcd_run(etcd, lambda c: c.delete(keys.ENDPOINTS, prefix=True))


def registered(admin: str) -> int:
    """How many endpoints the router's registry holds (/readyz: cheap, unlike /endpoints)."""
    return int(httpx.get(admin + "/readyz", timeout=10).json()["endpoints"])  # 503 until synced


def timed(
    what: str, check: Callable[[], Any], timeout_s: float, since: float, poll_s: float = 0.2
) -> float:
    until(what, check, timeout_s, poll_s=poll_s)
    return round(time.monotonic() - since, 2)


def startup_and_watch(tmp: Path, etcd: str, upstream: str, src: Path, args: Any) -> dict[str, Any]:
    records = endpoint_records(args.nodes, args.per_node, upstream)
    n = len(records)
    clear(etcd)
    put_all(etcd, records)
    t0 = time.monotonic()
    with etcd_router(tmp, etcd, src) as (admin, pid, ready_s):
        listed = timed("every endpoint listed", lambda: registered(admin) == n, 300, t0)
        streams = timed(  # polled every 2 s: a 5,000-endpoint /metrics page is not free
            "every KV stream open",
            lambda: metric(admin, "cgn_router_kv_resyncs_total") >= n,
            600,
            t0,
            poll_s=2.0,
        )
        rss = peak_rss_mib(pid, "VmRSS")
        time.sleep(2.0)
        before = cpu_s(pid)
        idle_s = 4.0
        time.sleep(idle_s)
        idle_rate = (cpu_s(pid) - before) / idle_s
        again = dict(list(records.items())[: args.events])  # the same records put again
        new_key = f"{keys.ENDPOINTS}node-new/model-0/sentinel"
        new = {new_key: {**next(iter(records.values())), "node": "node-new"}}
        before, t1 = cpu_s(pid), time.monotonic()
        put_all(etcd, again)
        put_all(etcd, new)
        seen = timed("the new endpoint listed", lambda: registered(admin) == n + 1, 300, t1)
        burned = cpu_s(pid) - before - idle_rate * (time.monotonic() - t1)
    clear(etcd)
    return {
        "endpoints": n, "ready_s": round(ready_s, 2), "all_listed_s": listed,
        "all_streams_s": streams, "rss_mib": round(rss), "idle_cpu_pct": round(idle_rate * 100, 1),
        "events": len(again) + 1, "events_applied_s": seen,
        "cpu_per_event_ms": round(burned * 1000 / (len(again) + 1), 3),
    }  # fmt: skip


def kv_event_cost(tmp: Path, etcd: str, engines: int, requests: int) -> dict[str, Any]:
    model = "sim"
    sim = ("--backend", "sim", "--speed", "50", "--kv-pool-tokens", "4096", "--model-name", model,
           "--engines", str(engines))  # fmt: skip
    clear(etcd)
    with cgn_infer_fleet(tmp, 1, *sim) as urls:
        put_all(etcd, {f"{keys.ENDPOINTS}node-{i // 5}/{model}/r{i}": {
            "url": u, "engine": "cgn-infer", "node": f"node-{i // 5}", "block_size": 16}
            for i, u in enumerate(urls)})  # fmt: skip
        with etcd_router(tmp, etcd, REPO) as (admin, pid, _):
            until("every KV stream open",
                  lambda: metric(admin, "cgn_router_kv_resyncs_total") >= engines, 300, 0.2)  # fmt: skip
            time.sleep(2.0)
            before, idle_s = cpu_s(pid), 4.0
            time.sleep(idle_s)
            idle_rate = (cpu_s(pid) - before) / idle_s
            events0 = metric(admin, "cgn_router_kv_events_total")
            before, t1 = cpu_s(pid), time.monotonic()
            asyncio.run(load(urls, model, requests))
            time.sleep(1.0)  # the last events in flight
            elapsed = time.monotonic() - t1
            burned = cpu_s(pid) - before - idle_rate * elapsed  # before rendering /metrics again
            events = metric(admin, "cgn_router_kv_events_total") - events0
    clear(etcd)
    return {"engines": engines, "events": int(events), "seconds": round(elapsed, 1),
            "idle_cpu_pct": round(idle_rate * 100, 1),
            "cpu_per_event_us": round(burned * 1e6 / max(events, 1), 1),
            "cpu_per_request_ms": round(burned * 1e3 / requests, 3)}  # fmt: skip


async def load(urls: list[str], model: str, n: int) -> None:
    sem = asyncio.Semaphore(16)
    async with aiohttp.ClientSession() as s:

        async def one(i: int) -> None:
            prompt = " ".join(f"q{i}w{j}" for j in range(160))
            body = {"model": model, "prompt": prompt, "max_tokens": 4}
            async with sem, s.post(urls[i % len(urls)] + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()

        await asyncio.gather(*(one(i) for i in range(n)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--baseline-src", type=Path, help="an older checkout to compare against")
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--per-node", type=int, default=5)
    p.add_argument("--events", type=int, default=1000)
    p.add_argument("--engines", type=int, default=1000, help="0: skip part 3")
    p.add_argument("--requests", type=int, default=400)
    args = p.parse_args()
    trees = {**({"baseline": args.baseline_src} if args.baseline_src else {}), "this": REPO}
    results: dict[str, Any] = {"startup": {}, "kv_events": []}
    with tempfile.TemporaryDirectory() as d, ExitStack() as stack:
        tmp = Path(d)
        server = LocalEtcd(tmp / "etcd")
        server.start()
        stack.callback(server.stop)
        port = free_port()
        fake = [sys.executable, str(REPO / "bench/fake_engine.py"), str(port)]
        stack.enter_context(http_process(fake, f"http://127.0.0.1:{port}/health", tmp / "fake.log"))
        for name, src in trees.items():
            got = startup_and_watch(tmp, server.endpoint, f"http://127.0.0.1:{port}", src, args)
            results["startup"][name] = got
            print(name, got, flush=True)
        for n in (10, args.engines) if args.engines else ():
            got = kv_event_cost(tmp, server.endpoint, n, args.requests)
            results["kv_events"].append(got)
            print(got, flush=True)
    command = "python bench/router_control_plane.py " + " ".join(sys.argv[1:])
    write_result("router_control_plane", command.strip(), results, table(results, args))


def table(r: dict[str, Any], args: Any) -> str:
    rows = ["| router | endpoints | ready s | all listed s | all KV streams s | RSS MiB | "
            "idle CPU % | CPU per etcd event ms | events applied in s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, s in r["startup"].items():
        rows.append(f"| {name} | {s['endpoints']} | {s['ready_s']} | {s['all_listed_s']} | "
                    f"{s['all_streams_s']} | {s['rss_mib']} | {s['idle_cpu_pct']} | "
                    f"{s['cpu_per_event_ms']} | {s['events_applied_s']} ({s['events']} events) |")  # fmt: skip
    rows += ["", f"{args.nodes} nodes x {args.per_node} endpoints over {MODELS} models in etcd, "
             "all pointing at one fake engine with a KV stream each; scrape.interval_s 1 "
             "(capped at scrape.max_per_s 100).", "",
             "| engines followed | KV events | seconds | router idle CPU % | router CPU per KV event µs "
             "| per request's events ms |",
             "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for k in r["kv_events"]:
        rows.append(f"| {k['engines']} | {k['events']} | {k['seconds']} | {k['idle_cpu_pct']} | "
                    f"{k['cpu_per_event_us']} | {k['cpu_per_request_ms']} |")  # fmt: skip
    rows += ["", f"{args.requests} requests straight to the engines (not through the router), "
             "16 at a time; the router only follows their KV streams and scrapes them."]  # fmt: skip
    return "\n".join(rows)


if __name__ == "__main__":
    main()
