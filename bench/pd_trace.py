"""Prefill/decode disaggregation on a sim fleet under the Mooncake trace: aggregated
vs disaggregated pools of the same total size, one run.

    .venv/bin/python bench/pd_trace.py      # 8 engines: 8 x both vs 2 prefill + 6 decode

The replay is bench/router_trace.py's (token-id prompts, arrivals compressed
by `--time-scale`, streamed, usage included) through one router with the
default routing; the disaggregated fleet splits prompts whose uncached part
is at least the router's `pd.min_uncached_tokens` (512), and runs shorter ones
on the decode pool alone. The sim models a transfer's time from the modelled
engine's KV bytes over `transfer.mb_per_s` (default 1,000 MB/s), and each
step's time from its prefill tokens, decoding rows and their context, so a
prefill in the same step slows every decode row of an aggregated engine.

Reported per layout: decode ITL p50/p99 over every streamed answer, TTFT
p50/p90, requests shed, prefix hit rate, and for the disaggregated layout the
router's decisions and fallbacks. Results: bench/results/pd_trace.{json,md}.
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
from bench.router_trace import TRACE, fleet_speed, replay, summarize
from bench.trace import load
from harness.metrics import metric
from harness.procs import cgn_infer_engines, cgn_router

MODEL = "trace"
REASONS = ("split", "short_prompt", "prefill_busy", "no_prefill_pool")


def run(pools: dict[str, int], reqs: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    """Replay on a fleet of sim engines per pool (role -> engines), one process per pool."""
    total = sum(pools.values())
    sim = ("--backend", "sim", "--speed", str(fleet_speed(args.speed, total)), "--model-name",
           MODEL, "--kv-pool-tokens", str(args.pool_tokens), "--ctx", str(args.ctx),
           "--max-batch", str(args.max_batch))  # fmt: skip
    with tempfile.TemporaryDirectory() as d, ExitStack() as stack:
        tmp = Path(d)
        endpoints = {}
        for role, n in pools.items():
            fleet = stack.enter_context(
                cgn_infer_engines(tmp, 1, *sim, "--engines", str(n), "--role", role)
            )
            for i, e in enumerate(fleet):
                endpoints[f"{role}{i}"] = {"url": e.url, "model": MODEL, "role": role}
        config = {"discovery": "static", "auth": {"enabled": False}, "endpoints": endpoints}
        with cgn_router(tmp, config) as router:
            outcomes, wall = asyncio.run(
                replay(router.url, MODEL, reqs, args.blocks_per_id, args.output_scale)
            )
            out = summarize(outcomes, wall)
            out["pd_decisions"] = {
                r: metric(router.admin, "cgn_router_pd_decisions_total", reason=r) for r in REASONS
            }
            out["pd_fallbacks"] = metric(router.admin, "cgn_router_pd_fallbacks_total")
    out.pop("uncached_by_endpoint")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--limit", type=int, default=2000, help="the first N requests")
    p.add_argument("--engines", type=int, default=8, help="engines in each layout")
    p.add_argument("--prefill", type=int, default=2, help="of them, prefill engines")
    p.add_argument("--blocks-per-id", type=int, default=4)
    p.add_argument("--time-scale", type=float, default=8.0)
    p.add_argument("--output-scale", type=float, default=0.125)
    p.add_argument("--speed", type=float, default=20.0, help="as bench/router_trace.py's")
    p.add_argument("--pool-tokens", type=int, default=262144)
    p.add_argument("--ctx", type=int, default=65536)
    p.add_argument("--max-batch", type=int, default=16)
    args = p.parse_args()
    reqs = load(args.trace, args.limit, args.time_scale)
    layouts = {
        "aggregated": {"both": args.engines},
        "disaggregated": {"prefill": args.prefill, "decode": args.engines - args.prefill},
    }
    results: dict[str, Any] = {"requests": len(reqs), "engines": args.engines,
                               "prefill_engines": args.prefill, "time_scale": args.time_scale,
                               "sim_speed": args.speed, "layouts": {}}  # fmt: skip
    for name, pools in layouts.items():
        print(f"{name} ...", file=sys.stderr, flush=True)
        results["layouts"][name] = run(pools, reqs, args)
        print(json.dumps(results["layouts"][name]), file=sys.stderr, flush=True)
    command = "python bench/pd_trace.py " + " ".join(sys.argv[1:])
    write_result("pd_trace", command.strip(), results, table(results))


def table(r: dict[str, Any]) -> str:
    rows = ["| layout | ITL p50 ms | ITL p99 ms | TTFT p50 ms | TTFT p90 ms | shed | hit rate | "
            "splits | fallbacks |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, x in r["layouts"].items():
        rows.append(f"| {name} | {x['itl_ms']['p50']} | {x['itl_ms']['p99']} | "
                    f"{x['ttft_ms']['p50']} | {x['ttft_ms']['p90']} | {x['shed']} | "
                    f"{x['hit_rate']} | {x['pd_decisions']['split']:.0f} | "
                    f"{x['pd_fallbacks']:.0f} |")  # fmt: skip
    agg, dis = r["layouts"]["aggregated"], r["layouts"]["disaggregated"]
    rows += ["", f"{r['requests']} Mooncake requests at time scale {r['time_scale']:g}; "
             f"{r['engines']} sim engines each (disaggregated: {r['prefill_engines']} prefill + "
             f"{r['engines'] - r['prefill_engines']} decode), sim --speed {r['sim_speed']:g} x 4/"
             f"{r['engines']}.", "",
             f"Decode ITL p99, aggregated / disaggregated: "
             f"{agg['itl_ms']['p99'] / dis['itl_ms']['p99']:.2f}x; TTFT p90: "
             f"{dis['ttft_ms']['p90'] / agg['ttft_ms']['p90']:.2f}x the aggregated."]  # fmt: skip
    return "\n".join(rows)


if __name__ == "__main__":
    main()
