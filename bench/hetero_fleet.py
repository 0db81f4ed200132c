"""Unequal replicas (#57): does adding a slow replica to a busy fleet help or hurt, per policy?

    .venv/bin/python bench/hetero_fleet.py                # the committed experiment

Two fast sim engines (`--speed`), alone and then beside 1 or 3 slow ones at 1/4 and 1/10
of their speed, replay one window of the Mooncake trace (bench/router_trace.py's replay)
at about the fast pair's capacity. Per fleet and per policy:

* `round_robin`: every replica in turn;
* `queue` (today's default chain: prefix, load, KV usage, affinity): scores a replica by its
  queue relative to the others', so a slow replica with a short queue looks as good;
* `time`: the `time` scorer alone, each replica's speed learned from its answers
  (cgn_router/routing/speed.py), the least predicted time to first token wins;
* `time_held`: the same, the model with a TTFT SLO of `--slo-ms`: a request whose best
  prediction misses it waits at the router for a replica that meets it (cgn_router/hold.py;
  its prediction error then counts the wait, which the prediction after it does not).

Reported: TTFT p50/p90/p99, the streams moved before their first token (the time
scorer's: cgn_router_errors_total{cause="moved"}), each replica's share of the requests beside its share of the
fleet's capacity (its sim speed over the sum), and for `time` the prediction error
|predicted − actual| / actual (p50, p90) from each answer's x-cognitora-predicted-ttft-ms.
"Warm": the requests after the window's first quarter (before, the router knows nothing
of any replica: the first requests are ties, and one that lands on a slow replica waits).
Each run gets fresh engines (cold caches, nothing learned). One run; the machine's noise
between runs is about ±10 %.

Results: bench/results/hetero_fleet.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from bench.router_trace import TRACE, Outcome, replay, summarize
from bench.trace import load
from harness.metrics import metric
from harness.procs import cgn_infer_engines, cgn_router

POLICIES: dict[str, dict[str, Any]] = {
    "round_robin": {"picker": "round_robin", "scorers": []},
    "queue": {},  # the default chain
    "time": {"scorers": [{"type": "time", "weight": 1.0}]},
    "time_held": {"scorers": [{"type": "time", "weight": 1.0}]},  # and the model's SLO
}


def fleets(slow_counts: list[int], ratios: list[float]) -> list[tuple[int, float]]:
    """(slow replicas, how many times slower): the fast pair alone first."""
    return [(0, 1.0), *((k, r) for r in ratios for k in slow_counts if k)]


def prediction_error(outcomes: list[Outcome]) -> dict[str, float] | None:
    errors = sorted(
        abs(o.predicted_ttft_s - o.ttft_s) / o.ttft_s
        for o in outcomes
        if o.ok and o.predicted_ttft_s is not None and o.ttft_s > 0
    )
    if not errors:
        return None
    return {
        "p50": round(errors[len(errors) // 2], 3),
        "p90": round(errors[min(len(errors) - 1, int(0.9 * len(errors)))], 3),
        "answers": len(errors),
    }


def run(slow: int, ratio: float, policy: str, args: argparse.Namespace) -> dict[str, Any]:
    model = "hetero"
    sim = ("--backend", "sim", "--model-name", model, "--max-batch", str(args.max_batch),
           "--kv-pool-tokens", str(args.pool_tokens), "--ctx", "65536")  # fmt: skip
    reqs = load(args.trace, args.limit, args.time_scale)
    with tempfile.TemporaryDirectory() as d, ExitStack() as stack:
        tmp = Path(d)
        fast = stack.enter_context(
            cgn_infer_engines(tmp, 1, *sim, "--speed", str(args.speed), "--engines", "2")
        )
        urls = {f"fast{i}": e.url for i, e in enumerate(fast)}
        speeds = {name: args.speed for name in urls}
        if slow:
            slow_speed = args.speed / ratio
            engines = stack.enter_context(
                cgn_infer_engines(tmp, 1, *sim, "--speed", str(slow_speed), "--engines", str(slow))
            )
            for i, e in enumerate(engines):
                urls[f"slow{i}"], speeds[f"slow{i}"] = e.url, slow_speed
        config = {
            "discovery": "static",
            "auth": {"enabled": False},
            "endpoints": {n: {"url": u, "model": model} for n, u in urls.items()},
            "routing": POLICIES[policy],
        }
        if policy == "time_held":
            config["models"] = {model: {"ttft_slo_ms": args.slo_ms}}
            config["routing"] = {**POLICIES[policy], "hold_for_slo": True}
        with cgn_router(tmp, config) as router:
            outcomes, wall = asyncio.run(
                replay(router.url, model, reqs, args.blocks_per_id, args.output_scale)
            )
            moved = metric(router.admin, "cgn_router_errors_total", cause="moved")
            held = metric(router.admin, "cgn_router_held_seconds_count")
    out = summarize(outcomes, wall)
    out["moved"], out["held"] = int(moved), int(held)
    start = reqs[0].at_s + (reqs[-1].at_s - reqs[0].at_s) / 4
    warm = [o for o, r in zip(outcomes, reqs, strict=True) if r.at_s >= start]
    out["warm"] = {
        "ttft_ms": summarize(warm, wall)["ttft_ms"],
        "prediction_error": prediction_error(warm),
    }
    total = sum(speeds.values())
    served = [o.endpoint.split("/")[-1] for o in outcomes if o.ok]
    out["share"] = {
        n: {"requests": round(served.count(n) / max(1, len(served)), 3),
            "capacity": round(s / total, 3)}
        for n, s in speeds.items()
    }  # fmt: skip
    out["prediction_error"] = prediction_error(outcomes)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--limit", type=int, default=240, help="the trace's first N requests")
    p.add_argument("--time-scale", type=float, default=2.0, help="arrivals this many times faster")
    p.add_argument("--output-scale", type=float, default=0.125, help="output lengths times this")
    p.add_argument("--blocks-per-id", type=int, default=4, help="16-token blocks per trace id")
    p.add_argument("--speed", type=float, default=10.0, help="the fast engines' sim --speed")
    p.add_argument("--slow", default="1,3", help="slow replicas beside the fast pair")
    p.add_argument("--ratios", default="4,10", help="how many times slower they are")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--pool-tokens", type=int, default=262144)
    p.add_argument("--slo-ms", type=float, default=1000.0, help="time_held's TTFT SLO")
    args = p.parse_args()
    results: dict[str, Any] = {"runs": {}}
    counts = [int(x) for x in args.slow.split(",")]
    for slow, ratio in fleets(counts, [float(x) for x in args.ratios.split(",")]):
        fleet = "2 fast" if not slow else f"2 fast + {slow} at 1/{ratio:g}"
        results["runs"][fleet] = {}
        for policy in args.policies.split(","):
            print(f"{fleet}, {policy} ...", file=sys.stderr, flush=True)
            r = run(slow, ratio, policy, args)
            print(json.dumps(r), file=sys.stderr, flush=True)
            results["runs"][fleet][policy] = r
    results["setup"] = {k: v for k, v in vars(args).items() if k != "trace"}
    command = " ".join([".venv/bin/python bench/hetero_fleet.py", *sys.argv[1:]])
    write_result("hetero_fleet", command, results, render(results))


def render(r: dict[str, Any]) -> str:
    s = r["setup"]
    lines = [
        f"The trace's first {s['limit']} requests, arrivals {s['time_scale']:g}x faster, outputs "
        f"x{s['output_scale']:g}; fast sim engines at --speed {s['speed']:g}.",
        "",
        "| fleet | policy | TTFT p50 ms | p90 ms | p99 ms | warm p90 / p99 ms | done | moved | held | "
        "slow replicas' share: requests / capacity | prediction error p50 / p90: all, warm |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for fleet, runs in r["runs"].items():
        for policy, x in runs.items():
            t = x["ttft_ms"]
            slow = [v for n, v in x["share"].items() if n.startswith("slow")]
            share = (
                f"{sum(v['requests'] for v in slow):.3f} / {sum(v['capacity'] for v in slow):.3f}"
                if slow
                else "-"
            )
            errors = [x["prediction_error"], x["warm"]["prediction_error"]]
            err = ", ".join(f"{e['p50']:.2f} / {e['p90']:.2f}" for e in errors if e) or "-"
            w = x["warm"]["ttft_ms"]
            lines.append(
                f"| {fleet} | {policy} | {t['p50']} | {t['p90']} | {t['p99']} | "
                f"{w['p90']} / {w['p99']} | {x['completed']} | {x['moved']} | {x.get('held', 0)} | "
                f"{share} | {err} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
