"""Routing cost against fleet size: 4, 100 and 1,000 endpoints of one model, one run.

    .venv/bin/python bench/router_fleet.py [--baseline-src DIR] [--seconds 6] [--requests 600]

Static configs whose endpoints all point at one fake engine (bench/fake_engine.py),
as in issue #27's table: every request is routed among all of a model's
endpoints, the upstream costs the same whatever the fleet. Sizes: 4, 100 and
1,000 endpoints of one model, and 1,000 spread over 50 models (20 each).
Requests carry a ~2,000-token shared system prompt (a long agent or RAG
preamble: 113 blocks to match on every endpoint that holds it) and a user
question that differs per request, hashed with SmolLM2's tokenizer. The
endpoints are cgn-infer engines with the router's defaults: each publishes a
KV event stream (the fake engine's holds no block) and is scraped on the
router's schedule (`scrape.interval_s` 1 s, or `--scrape-interval`).

* c=1: sequential requests, alternating direct and routed; added = routed - direct.
* c=64: `wrk -t1 -c64` for `--seconds`.
* With `--baseline-src DIR` (a checkout of an older commit), that router runs
  the same configs, alternating with this one, size by size.
* routing cost in-process (no HTTP, no machine noise): the registry's views,
  the pipeline and a lease for one request whose 113 blocks every endpoint
  holds, per fleet size, for each tree.
* index memory: the RSS of a process holding a `PrefixIndex` of 1,000
  endpoints x 16,384 blocks, distinct blocks (the worst case) and with 90 % of
  each endpoint's blocks shared with others; and the time of one `match_all`.

Results: bench/results/router_fleet.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from bench.router_vs_smg import BODY, SYSTEM, pct, sequential, wrk
from cgn_core.etcd.local import free_port
from harness.procs import REPO, cgn_router, http_process

LONG = {**BODY, "messages": [{"role": "system", "content": SYSTEM * 15}, BODY["messages"][1]]}
SIZES = {"4": (4, 1), "100": (100, 1), "1000": (1000, 1), "1000 over 50 models": (1000, 50)}


@contextmanager
def router(
    tmp: Path, upstream: str, size: int, models: int, src: Path, scrape_s: float = 1.0
) -> Iterator[str]:
    """A cgn-router from source tree `src` routing model `fake` (and others) to `upstream`."""
    names = ["fake", *(f"other{i}" for i in range(1, models))]
    endpoints = {f"e{i}": {"url": upstream, "model": names[i % models],
                           "kv_events_url": f"{upstream}/v1/kv/events?ns={names[i % models]}"}
                 for i in range(size)}  # fmt: skip
    config = {"discovery": "static", "log": {"level": "warning"}, "endpoints": endpoints,
              "models": {"fake": {"tokenizer": "smollm2"}},
              "scrape": {"interval_s": scrape_s, "stale_s": max(5.0, 3 * scrape_s)}}  # fmt: skip
    with cgn_router(tmp, config, src=src) as r:
        yield r.url


def measure(
    tmp: Path, upstream: str, size: int, models: int, src: Path, args: Any
) -> dict[str, float]:
    with router(tmp, upstream, size, models, src, args.scrape_interval) as url:
        c1 = sequential({"direct": upstream, "routed": url}, "unused", args.requests, [LONG])
        c64 = wrk(url, "unused", args.seconds, tmp, [LONG])
    return {"added_c1_p50_ms": round(pct(c1["routed"], 0.5) - pct(c1["direct"], 0.5), 3),
            "added_c1_p99_ms": round(pct(c1["routed"], 0.99) - pct(c1["direct"], 0.99), 3),
            "c64_req_s": round(c64["req_s"]), "c64_p99_ms": round(c64["p99_ms"], 1)}  # fmt: skip


INDEX_PROBE = """
import json, random, sys, time
from cgn_router.routing.kv_index import PrefixIndex
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
shared = float(sys.argv[1])
before = rss()
idx = PrefixIndex(300, 65536, 5)
rng = random.Random(0)
common = [rng.randbytes(32) for _ in range(16384)]
for e in range(1000):
    own = [rng.randbytes(32) for _ in range(16384 - int(16384 * shared))]
    blocks = common[: int(16384 * shared)] + own
    idx.snapshot(f"m/e{e}", 1, blocks)
after = rss()
prompt = common[:64] if shared else blocks[:64]
t = time.perf_counter()
for _ in range(1000):
    got = idx.match_all(prompt, 0.0)
walk_us = (time.perf_counter() - t) * 1000
print(json.dumps({"rss_mib": round(after - before), "pairs": 1000 * 16384,
       "bytes_per_pair": round((after - before) * 2**20 / (1000 * 16384), 1),
       "match_all_us": round(walk_us, 1), "endpoints_matched": len(got)}))
"""


ROUTE_PROBE = """
import json, random, sys, time
from cgn_router.routing.kv_index import PrefixIndex
from cgn_router.routing.chain import RoutingChain
from cgn_router.registry import Registry
from cgn_router.sessions import Sessions
from cgn_router.settings import BreakerSettings, RoutingSettings
from cgn_router.types import Endpoint, EndpointId, RequestInfo
try:  # this tree: past SHORT_LIST endpoints a short list of SHORT_PICKS each
    from cgn_router.service import SHORT_LIST, SHORT_PICKS
except ImportError:  # before issue #27
    SHORT_LIST = SHORT_PICKS = None
size, models = int(sys.argv[1]), int(sys.argv[2])
reg = Registry(BreakerSettings(), PrefixIndex(300, 65536, 5), Sessions(600), 5.0)
names = ["fake", *(f"other{i}" for i in range(1, models))]
reg.replace_source("static", [Endpoint(EndpointId(f"{names[i % models]}/e{i}"), names[i % models],
                                       "http://x") for i in range(size)])
pipeline, rng = RoutingChain.from_settings(RoutingSettings()), random.Random(0)
req = RequestInfo("fake", "both", tuple(bytes([i % 256, i // 256]) * 16 for i in range(113)), 1822)
now = time.monotonic()
for e in reg.by_model["fake"]:  # every endpoint of the model holds the prompt (assumed)
    reg.index.routed(e, req.blocks, now, exact=True)
def once():
    big = SHORT_LIST is not None and len(reg.by_model["fake"]) > SHORT_LIST
    views = reg.views(req, now, frozenset(), SHORT_PICKS) if big else reg.views(req, now)
    lease = reg.begin(pipeline.route(req, views, rng).view, req, now)
    lease.end("ok", now)
once()
t = time.perf_counter()
n = 0
while time.perf_counter() - t < 2.0:
    once()
    n += 1
print(json.dumps({"route_us": round((time.perf_counter() - t) / n * 1e6, 1)}))
"""


def route_cost(src: Path, size: int, models: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(src)}
    res = subprocess.run([sys.executable, "-P", "-c", ROUTE_PROBE, str(size), str(models)], env=env,
                         capture_output=True, text=True, check=True, timeout=600)  # fmt: skip
    return float(json.loads(res.stdout.strip().splitlines()[-1])["route_us"])


def index_memory(src: Path) -> dict[str, Any]:
    out = {}
    for label, shared in (("distinct blocks", 0.0), ("90 % shared", 0.9)):
        env = {**os.environ, "PYTHONPATH": str(src)}
        res = subprocess.run([sys.executable, "-P", "-c", INDEX_PROBE, str(shared)], env=env,
                             capture_output=True, text=True, check=True, timeout=1800)  # fmt: skip
        out[label] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--baseline-src", type=Path, help="an older checkout to compare against")
    p.add_argument("--seconds", type=int, default=6)
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument(
        "--scrape-interval", type=float, default=1.0, help="the routers' scrape.interval_s"
    )
    args = p.parse_args()
    trees = {"this": REPO, **({"baseline": args.baseline_src} if args.baseline_src else {})}
    results: dict[str, Any] = {name: {} for name in trees}
    with tempfile.TemporaryDirectory() as d, ExitStack() as stack:
        tmp = Path(d)
        port = free_port()
        fake = [sys.executable, str(REPO / "bench/fake_engine.py"), str(port)]
        stack.enter_context(http_process(fake, f"http://127.0.0.1:{port}/health", tmp / "fake.log"))
        upstream = f"http://127.0.0.1:{port}"
        for label, (size, models) in SIZES.items():
            for name, src in trees.items():
                got = measure(tmp, upstream, size, models, src, args)
                got["route_us"] = route_cost(src, size, models)
                results[name][label] = got
                print(f"{name} {label}: {json.dumps(got)}", file=sys.stderr, flush=True)
    if not args.skip_memory:
        results["index_memory"] = index_memory(REPO)
    command = " ".join([".venv/bin/python bench/router_fleet.py", *sys.argv[1:]])
    write_result("router_fleet", command, results, render(results))


def render(r: dict[str, Any]) -> str:
    lines = ["| router | endpoints | routing cost in-process µs | added c=1 p50 / p99 ms | c=64 req/s | "
             "c=64 p99 ms | req/s vs 4 |", "|---|---|---:|---|---:|---:|---:|"]  # fmt: skip
    for name in ("baseline", "this"):
        if name not in r:
            continue
        base = r[name]["4"]["c64_req_s"]
        for label, m in r[name].items():
            lines.append(f"| {name} | {label} | {m['route_us']} | {m['added_c1_p50_ms']} / {m['added_c1_p99_ms']} | "
                         f"{m['c64_req_s']} | {m['c64_p99_ms']} | {m['c64_req_s'] / base:.2f} |")  # fmt: skip
    if "index_memory" in r:
        lines += ["", "Index of 1,000 endpoints x 16,384 blocks (one process, RSS growth):", "",
                  "| blocks | RSS MiB | bytes per (endpoint, block) | match_all of 64 blocks |",
                  "|---|---:|---:|---:|"]  # fmt: skip
        for label, m in r["index_memory"].items():
            lines.append(f"| {label} | {m['rss_mib']} | {m['bytes_per_pair']} | "
                         f"{m['match_all_us']} µs ({m['endpoints_matched']} endpoints matched) |")  # fmt: skip
    lines += [
        "",
        "All endpoints point at one fake engine, each with its own KV event stream; the routers "
        "scrape each every `scrape.interval_s` (1 s unless the command says otherwise); "
        "nothing pinned.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
