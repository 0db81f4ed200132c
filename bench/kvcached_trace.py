"""Mooncake replay with small engine pools: with and without cgn-kvcached on every node, one run.

    .venv/bin/python bench/kvcached_trace.py [--limit N] [--pool-tokens 65536]

The fleet of bench/router_trace.py (4 sim engines behind a router, the
default policy) with KV pools a quarter of that bench's (`--pool-tokens`,
default 65,536 tokens each), replayed twice: engines alone, then with a
`cgn-kvcached` per node (`--engines-per-node`, default 2: two nodes; RAM
tier only, `--store-blocks` blocks) that its engines offer finished blocks
to and restore prompts from, and the router following each store's KV
events (`stores:` in its static config), so it weighs blocks in a node's
store. The store and the engines' offers and restores use real CPU (the sim
engines' compute does not): on a 2-core machine `--time-scale` must leave
the CPU some headroom, or the comparison measures CPU contention. Reported per run: prefix hit rate
counting every tier (Σ cached_tokens / Σ prompt_tokens: the engine counts
restored tokens as cached), TTFT p50/p90/p99, throughput, shed.

The sim engine charges a restore the time its modelled blocks (SmolLM2's
46,080 bytes per token) take at the configured restore bandwidth, scaled by
its `--speed` like its compute (bench/results/kvcached_ttft.md measured
restores on this CPU at ~600 MB/s from RAM against a ~240 token/s prefill).

Results: bench/results/kvcached_trace.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
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
from harness.procs import cgn_infer_engines, cgn_kvcached, cgn_router

MODEL = "trace"


def run(reqs: list[Any], args: argparse.Namespace, with_store: bool) -> dict[str, Any]:
    engines, per_node = 4, args.engines_per_node
    nodes = engines // per_node
    sim = ["--backend", "sim", "--speed", str(fleet_speed(args.speed, engines)),
           "--model-name", MODEL, "--kv-pool-tokens", str(args.pool_tokens), "--ctx",
           str(args.ctx), "--max-batch", str(args.max_batch)]  # fmt: skip
    with tempfile.TemporaryDirectory() as d, ExitStack() as stack:
        tmp = Path(d)
        stores = []
        if with_store:
            ram = max(1 << 20, args.store_blocks * 128)  # a sim block is 128 bytes
            stores = [stack.enter_context(cgn_kvcached(tmp, ram_bytes=ram)) for _ in range(nodes)]
        fleet = []
        for i in range(engines):  # engine i on node i // per_node, with that node's store
            extra = list(stores[i // per_node].engine_args) if with_store else []
            fleet += stack.enter_context(cgn_infer_engines(tmp, 1, *sim, *extra))
        config: dict[str, Any] = {
            "discovery": "static",
            "auth": {"enabled": False},
            "endpoints": {
                f"e{i}": {"url": e.url, "model": MODEL, "node": f"n{i}"}
                for i, e in enumerate(fleet)
            },
        }
        if with_store:
            config["stores"] = {f"n{i}": {"events_url": s.admin + "/v1/kv/events"}
                                for i, s in enumerate(stores)}  # fmt: skip
        router = stack.enter_context(cgn_router(tmp, config))
        outcomes, wall = asyncio.run(
            replay(router.url, MODEL, reqs, args.blocks_per_id, args.output_scale)
        )
        counters = {name: sum(metric(e.url, f"cgn_infer_{name}_total") for e in fleet)
                    for name in COUNTERS}  # fmt: skip
    return summarize(outcomes, wall) | {"engine_counters": counters}


COUNTERS = ("prefill_tokens_computed", "kv_restored_tokens", "kv_restore_skipped",
            "kv_restore_failures", "kv_offloaded_blocks", "kv_offload_dropped")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--blocks-per-id", type=int, default=4)
    p.add_argument("--time-scales", default="3,5", help="arrivals this many times faster, each")
    p.add_argument("--output-scale", type=float, default=0.125)
    p.add_argument("--speed", type=float, default=20.0)
    p.add_argument("--pool-tokens", type=int, default=65536, help="each engine's KV pool")
    p.add_argument("--store-blocks", type=int, default=1 << 16, help="each node store's RAM tier")
    p.add_argument("--engines-per-node", type=int, default=2, choices=(1, 2, 4))
    p.add_argument("--ctx", type=int, default=65536)
    p.add_argument("--max-batch", type=int, default=16)
    args = p.parse_args()
    results: dict[str, Any] = {"pool_tokens": args.pool_tokens, "store_blocks": args.store_blocks,
                               "engines_per_node": args.engines_per_node, "scales": {}}  # fmt: skip
    for scale in [float(x) for x in args.time_scales.split(",")]:
        reqs = load(args.trace, args.limit, scale)
        results["requests"] = len(reqs)
        runs = results["scales"][f"{scale:g}"] = {}
        for name, with_store in (("engines alone", False), ("with cgn-kvcached", True)):
            print(f"{scale:g}x, {name} ...", file=sys.stderr, flush=True)
            runs[name] = run(reqs, args, with_store)
            print(runs[name], file=sys.stderr, flush=True)
    command = " ".join([".venv/bin/python bench/kvcached_trace.py", *sys.argv[1:]])
    write_result("kvcached_trace", command, results, render(results))
    print(render(results))


def render(r: dict[str, Any]) -> str:
    lines = [f"{r['requests']} Mooncake requests on 4 sim engines, {r['engines_per_node']} per "
             f"node, with {r['pool_tokens']}-token pools (a quarter of bench/router_trace.py's); "
             f"one store per node of {r['store_blocks']} blocks (RAM).", "",
             "| arrivals | run | hit rate (all tiers) | TTFT p50 ms | p90 ms | p99 ms | req/s | shed |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for scale, runs in r["scales"].items():
        for name, s in runs.items():
            t = s["ttft_ms"]
            lines.append(f"| {scale}x | {name} | {s['hit_rate']:.3f} | {t['p50']} | {t['p90']} | "
                         f"{t['p99']} | {s['throughput_req_s']} | {s['shed']} |")  # fmt: skip
    lines += ["", "| arrivals | run | " + " | ".join(COUNTERS) + " |",
              "|---|---|" + "---:|" * len(COUNTERS)]  # fmt: skip
    for scale, runs in r["scales"].items():
        for name, s in runs.items():
            c = s["engine_counters"]
            lines.append(
                f"| {scale}x | {name} | " + " | ".join(f"{c[k]:.0f}" for k in COUNTERS) + " |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
