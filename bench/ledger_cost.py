"""What the budgets' ledger adds to a request's CPU (#58: target at most 5 % of the router's).

    .venv/bin/python bench/ledger_cost.py [--seconds 30] [--rate 1000] [--tenants 1000]
                                          [--writers 8]

A request meets the ledger twice (cgn_router/ledger.py): `admit` before its body is read
(a dictionary lookup, and for a tenant with a budget its usage over every writer's record)
and `LedgerObserver.observe` when it ends (its usage charged). Each is timed here in-process
over `--seconds` of `--rate` requests a second of random tenants (`--tenants`, and 100),
each with a budget. Every `publish_s` (1 s, the default, and 5 s) each of `--writers`
other writers, as busy, writes one record per tenant it served in that time (cgn_router/ledger.py `publish`), which this worker parses and
adds up (followers.py); that work and this worker's own writes are timed too and spread
over its requests. With the ledger off a request pays neither. The router's own CPU per request is
read from the last bench/results/router_overhead.json (its median requests/s per router core
against a fake upstream), so the share is a ratio across runs: the ledger's cost is a few
microseconds against hundreds, a margin that no day-to-day machine difference (up to 3x)
closes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from cgn_core.budgets import Budget, UsageEntry, Used, parse_usage
from cgn_router.ledger import Ledger, LedgerObserver
from cgn_router.routing.lifecycle import Ended
from cgn_router.types import Usage

RESULTS = Path(__file__).resolve().parent / "results"


def others(
    ledger: Ledger, tenants: list[str], writers: int, per_second: int, rng: random.Random
) -> tuple[int, int]:
    """One second of every other writer's records, as the router's etcd watch hands them
    over: each writer served `per_second` requests of random tenants and writes one record
    per tenant it served; each is parsed and checked (followers.py), then the tenant's kept
    sum updated. (records, nanoseconds it took)."""
    p = ledger.period
    raws = []
    for w in range(writers):
        for tenant in {rng.choice(tenants) for _ in range(per_second)}:
            used = Used(rng.randrange(1000), rng.randrange(100_000), 0.0)
            doc = UsageEntry(f"other-{w}.w0", tenant, p.day, used)
            raws.append((doc.key, json.dumps(doc.to_json()).encode()))
    t0 = time.perf_counter_ns()
    for key, raw in raws:
        ledger.put_other(parse_usage(json.loads(raw), key))
    return len(raws), time.perf_counter_ns() - t0


def run(
    seconds: int, per_second: int, n_tenants: int, writers: int, publish_s: int = 1
) -> dict[str, float]:
    """`seconds` of traffic; every `publish_s` the other writers' records of what they served
    in that time (a tenant served several times in it is one record)."""
    rng = random.Random(7)
    tenants = [f"tenant-{i}" for i in range(n_tenants)]
    ledger = Ledger("bench.w0")
    ledger.set_budgets({t: Budget(tokens_per_day=10**12) for t in tenants})
    observer = LedgerObserver(ledger, lambda eid: 3.0)
    usage = Usage(prompt_tokens=512, completion_tokens=128, cached_tokens=0)
    admit_ns, end_ns, updates, updates_ns, publish_ns = [], [], 0, 0, 0
    for second in range(seconds):
        if second % publish_s:
            n, took = 0, 0
        else:
            n, took = others(ledger, tenants, writers, per_second * publish_s, rng)
        updates, updates_ns = updates + n, updates_ns + took
        for tenant in (rng.choice(tenants) for _ in range(per_second)):
            ended = Ended("m", "ok", 200, 0.1, usage, "", tenant, "m/r1")
            t0 = time.perf_counter_ns()
            ledger.admit(tenant)
            t1 = time.perf_counter_ns()
            observer.observe(ended)
            t2 = time.perf_counter_ns()
            admit_ns.append(t1 - t0)
            end_ns.append(t2 - t1)
        t0 = time.perf_counter_ns()  # its own records of the second, made ready to write
        docs = [json.dumps(e.to_json()) for e in ledger.pending()]
        publish_ns += time.perf_counter_ns() - t0
        assert docs
    requests = seconds * per_second
    per_request = [a + b for a, b in zip(admit_ns, end_ns, strict=True)]
    return {
        "admit_us_p50": statistics.median(admit_ns) / 1000,
        "end_us_p50": statistics.median(end_ns) / 1000,
        "per_request_us_p99": sorted(per_request)[int(0.99 * len(per_request))] / 1000,
        "others_records_per_s": updates / seconds,
        "others_us_per_record": updates_ns / max(1, updates) / 1000,
        "background_us_per_request": (updates_ns + publish_ns) / requests / 1000,
        # all of it: each request's own, and the others' records and its own writes spread
        "per_request_us_mean": (sum(per_request) + updates_ns + publish_ns) / requests / 1000,
    }


def router_us_per_request() -> tuple[float, str]:
    """The router's CPU per request (µs) from the last router_overhead run: the median of
    this tree's fake-upstream rounds, in requests/s per router core."""
    doc = json.loads((RESULTS / "router_overhead.json").read_text())
    rates = [
        row["c64"]["routed_req_s_per_router_core"]
        for name, row in doc["results"].items()
        if name.startswith("fake_upstream") and "(" not in name
    ]
    median = statistics.median(rates)
    return 1e6 / median, f"{doc['date']}: median {median:.0f} requests/s per router core"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=int, default=30, help="seconds of traffic simulated")
    p.add_argument("--rate", type=int, default=1000, help="requests/s of this worker and of "
                   "each other writer")  # fmt: skip
    p.add_argument("--tenants", type=int, default=1000, help="tenants, each with a budget")
    p.add_argument("--writers", type=int, default=8, help="other router workers")
    args = p.parse_args()
    router_us, source = router_us_per_request()
    rows = []
    setups = [(100, 1), (args.tenants, 1), (args.tenants, 5)]
    for tenants, publish_s in sorted(set(setups)):
        figures = run(args.seconds, args.rate, tenants, args.writers, publish_s)
        share = figures["per_request_us_mean"] / router_us
        figures |= {"tenants": tenants, "publish_s": publish_s, "share": share}
        print(json.dumps(figures))
        rows.append(figures)
    table = [
        "| tenants | publish_s | admit p50 µs | charge p50 µs | others' records/s (µs each) "
        "| background µs per request | per request: all of it, mean / p99 own µs "
        "| router CPU per request µs | share |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {f['tenants']} | {f['publish_s']} | {f['admit_us_p50']:.2f} | {f['end_us_p50']:.2f} "
            f"| {f['others_records_per_s']:.0f} ({f['others_us_per_record']:.1f}) "
            f"| {f['background_us_per_request']:.2f} "
            f"| {f['per_request_us_mean']:.2f} / {f['per_request_us_p99']:.2f} "
            f"| {router_us:.0f} | {f['share']:.1%} |"
            for f in rows
        ),
        "",
        f"{args.seconds} s of {args.rate} requests/s on this worker and on each of "
        f"{args.writers} other writers, random tenants, each with a budget. Router CPU per "
        f"request: bench/results/router_overhead.json ({source}), another run on this "
        "machine type.",
    ]
    command = " ".join([".venv/bin/python bench/ledger_cost.py", *sys.argv[1:]])
    write_result("ledger_cost", command, {"args": vars(args), "rows": rows}, "\n".join(table))


if __name__ == "__main__":
    main()
