"""Routing quality on a real trace: replay Mooncake against sim fleets, four policies, one run.

    .venv/bin/python bench/router_trace.py                    # the committed experiment
    .venv/bin/python bench/router_trace.py --router http://my-router:8080 --model NAME
                                                              # replay on your own fleet

The trace's 512-token block ids become `--blocks-per-id` 16-token blocks of
synthetic token ids (bench/trace.py), prompts are sent as token ids to
/v1/completions (streaming, usage included), arrivals keep their order and
are compressed by `--time-scale`; outputs are scaled by `--output-scale`.

Self-contained mode starts, per fleet size (4 and 8) and policy, a fresh sim
fleet with bounded KV pools and a router (static config, no etcd) and
replays. Policies: round-robin, least-loaded (the load scorer alone),
ours (the default weights, with the saturation guard), and `time` (the
predicted-time scorer alone, opt-in today: #57). Reported per run:
engine-reported prefix hit rate (Σ cached_tokens / Σ prompt_tokens), TTFT
p50/p90/p99, throughput, requests shed (non-200 or broken streams), and the
busiest engine's uncached-prefill tokens relative to the fleet mean. Beside
them, the offline yardstick (bench/trace.py `simulate`, ideal load-aware
affinity over exact LRU caches of the same size).

Fleets of hundreds (`--fleets 200 --virtual`): each fleet's engines are
virtual, hosted by one `cgn-infer serve --backend sim --engines N` process
(each with its own port, scheduler, pool and KV event stream), so the router
follows and routes among all of them on this 2-core machine.

Load sweep (`--sweep`, default 5,6.5): the trace's offered load doubles from
its start to its end, so at any one time scale every policy meets the same
overload at the end, and TTFT p90 mostly measures how late each saturates.
The sweep replays it again on the fleet of 4 at slower time scales, where the
fleet's capacity sits between what ours and round-robin need at the peak:
the TTFT ratios there say how much load each policy carries before it queues.

Results: bench/results/router_trace.{json,md} (or `--result NAME`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from bench.trace import BLOCK, TraceRequest, expand, load, simulate
from cgn_infer.settings import SimSettings
from harness.procs import cgn_infer_engines, cgn_router

TRACE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake/synthetic_trace.jsonl"
POLICIES: dict[str, dict[str, Any]] = {
    "round_robin": {"picker": "round_robin", "scorers": []},
    "least_loaded": {"scorers": [{"type": "load", "weight": 1.0}]},
    "cognitora": {},  # the defaults
    "time": {"scorers": [{"type": "time", "weight": 1.0}]},  # predicted time alone (#57)
}


@dataclass(slots=True)
class Outcome:
    ok: bool
    status: int = 0  # HTTP status (0: no answer)
    endpoint: str = ""
    ttft_s: float = float("nan")
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str = ""
    gaps_s: list[float] = field(default_factory=list)  # between consecutive token chunks
    predicted_ttft_s: float | None = None  # the router's prediction (the time scorer)


async def replay(
    url: str,
    model: str,
    reqs: list[TraceRequest],
    blocks_per_id: int,
    output_scale: float,
    prompt_of: Callable[[int, TraceRequest], Any] | None = None,
) -> tuple[list[Outcome], float]:
    """Send every request at its arrival time; returns the outcomes and the wall time.
    `prompt_of(i, request)`: its prompt (default: token ids from `expand`)."""
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        start = time.monotonic()

        async def one(i: int, req: TraceRequest) -> Outcome:
            body = json.dumps({
                "model": model, "stream": True,
                "prompt": prompt_of(i, req) if prompt_of else expand(req, blocks_per_id, tail=i),
                "max_tokens": max(1, round(req.output_tokens * output_scale)), "ignore_eos": True,
                "stream_options": {"include_usage": True},
            }).encode()  # fmt: skip
            await asyncio.sleep(max(0.0, start + req.at_s - time.monotonic()))
            sent = last = time.monotonic()
            out = Outcome(ok=False)
            try:
                async with session.post(
                    url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
                ) as resp:
                    out.status = resp.status
                    if resp.status != 200:
                        out.error = (await resp.text())[:200]
                        return out
                    out.endpoint = resp.headers.get("x-cognitora-endpoint", "")
                    if (ms := resp.headers.get("x-cognitora-predicted-ttft-ms")) is not None:
                        out.predicted_ttft_s = int(ms) / 1000
                    async for line in resp.content:
                        if not line.startswith(b"data: {"):
                            if line.startswith(b"data: [DONE]"):
                                out.ok = True
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            out.error = str(chunk["error"].get("message"))[:200]
                            return out
                        if chunk.get("choices"):
                            now = time.monotonic()
                            if out.ttft_s != out.ttft_s:  # the first token
                                out.ttft_s = now - sent
                            else:
                                out.gaps_s.append(now - last)
                            last = now
                        if usage := chunk.get("usage"):
                            out.prompt_tokens = usage["prompt_tokens"]
                            out.output_tokens = usage["completion_tokens"]
                            details = usage.get("prompt_tokens_details") or {}
                            out.cached_tokens = details.get("cached_tokens") or 0
            except (aiohttp.ClientError, TimeoutError) as exc:
                out.error = str(exc) or type(exc).__name__
            return out

        outcomes = await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
        return list(outcomes), time.monotonic() - start


def summarize(outcomes: list[Outcome], wall_s: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    ttft = sorted(o.ttft_s for o in ok)
    gaps = sorted(g for o in ok for g in o.gaps_s)

    def pct(p: float, xs: list[float] = ttft) -> float:
        return round(xs[min(len(xs) - 1, int(p * len(xs)))] * 1000, 1) if xs else float("nan")

    uncached: dict[str, int] = {}
    for o in ok:
        uncached[o.endpoint] = uncached.get(o.endpoint, 0) + o.prompt_tokens - o.cached_tokens
    mean = statistics.mean(uncached.values()) if uncached else 0
    prompt = sum(o.prompt_tokens for o in ok)
    return {
        "completed": len(ok),
        "shed": len(outcomes) - len(ok),
        "hit_rate": round(sum(o.cached_tokens for o in ok) / prompt, 4) if prompt else 0.0,
        "ttft_ms": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)},
        "itl_ms": {"p50": pct(0.5, gaps), "p99": pct(0.99, gaps)},
        "throughput_req_s": round(len(ok) / wall_s, 2),
        "output_tok_s": round(sum(o.output_tokens for o in ok) / wall_s, 1),
        "busiest_over_mean": round(max(uncached.values()) / mean, 3) if mean else 0.0,
        "uncached_by_endpoint": dict(sorted(uncached.items())),
        "shed_reasons": sorted({f"{o.status} {o.error}" for o in outcomes if not o.ok})[:5],
        "wall_s": round(wall_s, 1),
    }


def fleet_speed(speed_for_4: float, engines: int) -> float:
    """Sim speed per engine: the fleet's total capacity stays that of 4 engines at `--speed`."""
    return speed_for_4 * 4 / engines


def run_fleet(
    engines: int, policy: str, reqs: list[TraceRequest], args: argparse.Namespace, workers: int = 1
) -> dict[str, Any]:
    model = "trace"
    speed = fleet_speed(args.speed, engines)
    sim = ("--backend", "sim", "--speed", str(speed), "--model-name", model,
           "--kv-pool-tokens", str(args.pool_tokens), "--ctx", str(args.ctx),
           "--max-batch", str(args.max_batch))  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        procs, per_proc = (1, ("--engines", str(engines))) if args.virtual else (engines, ())
        with cgn_infer_engines(tmp, procs, *sim, *per_proc) as fleet:
            config = {
                "discovery": "static",
                "auth": {"enabled": False},
                "endpoints": {f"e{i}": {"url": e.url, "model": model} for i, e in enumerate(fleet)},
                "routing": POLICIES[policy],
                "workers": workers,
            }
            with cgn_router(tmp, config) as router:
                outcomes, wall = asyncio.run(
                    replay(router.url, model, reqs, args.blocks_per_id, args.output_scale)
                )
    return summarize(outcomes, wall)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--router", help="replay against this router instead of starting sim fleets")
    p.add_argument("--model", default="trace", help="model name to request (with --router)")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument(
        "--blocks-per-id", type=int, default=4, help="16-token blocks per trace id (32 = unscaled)"
    )
    p.add_argument("--time-scale", type=float, default=8.0, help="arrivals this many times faster")
    p.add_argument("--output-scale", type=float, default=0.125, help="output lengths times this")
    p.add_argument("--fleets", default="4,8", help="fleet sizes (self-contained mode)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument(
        "--speed", type=float, default=20.0,
        help="sim --speed for a fleet of 4 (n engines get speed x 4/n: same total capacity)",
    )  # fmt: skip
    p.add_argument("--pool-tokens", type=int, default=262144, help="each sim engine's KV pool")
    p.add_argument("--ctx", type=int, default=65536)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--result", default="router_trace", help="bench/results/ file name")
    p.add_argument(
        "--workers", default="1",
        help="router worker counts, comma-separated; each past 1 replays every policy again "
             "(results '<policy>_workers<N>')",
    )  # fmt: skip
    p.add_argument(
        "--virtual", action="store_true",
        help="each fleet's sim engines in one process (cgn-infer --engines N): fleets of hundreds",
    )  # fmt: skip
    p.add_argument(
        "--sweep", default="5,6.5",
        help="more time scales, on the fleet of 4 ('' for none); see the load sweep above",
    )  # fmt: skip
    args = p.parse_args()
    reqs = load(args.trace, args.limit, args.time_scale)
    if args.router:
        outcomes, wall = asyncio.run(
            replay(args.router, args.model, reqs, args.blocks_per_id, args.output_scale)
        )
        print(json.dumps(summarize(outcomes, wall), indent=2))
        return
    sim = SimSettings()
    results: dict[str, Any] = {
        "requests": len(reqs), "blocks_per_id": args.blocks_per_id,
        "tokens_per_trace_block": args.blocks_per_id * BLOCK, "time_scale": args.time_scale,
        "output_scale": args.output_scale, "sim_speed": args.speed, "pool_tokens": args.pool_tokens,
        "fleets": {},
    }  # fmt: skip
    for n in map(int, args.fleets.split(",")):
        fleet: dict[str, Any] = {}
        cap = args.pool_tokens // BLOCK
        drain = fleet_speed(args.speed, n) / sim.prefill_s_per_token  # an engine's prefill tok/s
        for name, slack_s in (("yardstick", 1.0), ("affinity_only_upper_bound", 1e9)):
            r = simulate(
                reqs, n, cap, args.blocks_per_id, "ideal", drain, slack_tokens=drain * slack_s
            )
            fleet[name] = {
                "hit_rate": round(r.hit_rate, 4),
                "busiest_over_mean": round(r.busiest_over_mean, 3),
            }
        for policy in args.policies.split(","):
            for w in map(int, args.workers.split(",")):
                name = policy if w == 1 else f"{policy}_workers{w}"
                print(f"fleet of {n}, {name} ...", file=sys.stderr, flush=True)
                fleet[name] = run_fleet(n, policy, reqs, args, w)
                print(json.dumps(fleet[name]), file=sys.stderr, flush=True)
        results["fleets"][str(n)] = fleet
    results["sweep"] = {}
    for scale in [float(x) for x in args.sweep.split(",") if x]:
        swept = load(args.trace, args.limit, scale)
        point: dict[str, Any] = {}
        for policy in args.policies.split(","):
            print(f"sweep: time scale {scale:g}, {policy} ...", file=sys.stderr, flush=True)
            point[policy] = run_fleet(4, policy, swept, args)
            print(json.dumps(point[policy]), file=sys.stderr, flush=True)
        results["sweep"][f"{scale:g}"] = point
    command = " ".join([".venv/bin/python bench/router_trace.py", *sys.argv[1:]])
    write_result(args.result, command, results, render(results))


def render(r: dict[str, Any]) -> str:
    lines = [
        f"{r['requests']} requests; each 512-token trace block = {r['tokens_per_trace_block']} tokens "
        f"(length scale {r['tokens_per_trace_block'] / 512:g}), arrivals {r['time_scale']:g}x faster, "
        f"outputs x{r['output_scale']:g}; sim engines at --speed {r['sim_speed']:g} x 4/n with "
        f"{r['pool_tokens']}-token KV pools.",
        "",
    ]
    for n, fleet in r["fleets"].items():
        lines += [
            f"### {n} engines",
            "",
            "| policy | hit rate | TTFT p50 ms | p90 ms | p99 ms | req/s | out tok/s | shed | busiest/mean |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, s in fleet.items():
            if "ttft_ms" not in s:
                continue
            t = s["ttft_ms"]
            lines.append(
                f"| {name} | {s['hit_rate']:.3f} | {t['p50']} | {t['p90']} | {t['p99']} | "
                f"{s['throughput_req_s']} | {s['output_tok_s']} | {s['shed']} | {s['busiest_over_mean']} |"
            )
        y, u = fleet["yardstick"], fleet["affinity_only_upper_bound"]
        lines += [
            "",
            f"Offline yardstick (ideal load-aware affinity, exact LRU caches): hit rate "
            f"{y['hit_rate']:.3f}, busiest/mean {y['busiest_over_mean']}; affinity without a load "
            f"bound: {u['hit_rate']:.3f}, busiest/mean {u['busiest_over_mean']}.",
            "",
        ]
        if "cognitora" in fleet and "round_robin" in fleet and "least_loaded" in fleet:
            c, rr, ll = fleet["cognitora"], fleet["round_robin"], fleet["least_loaded"]
            lines.append(
                f"Ours vs round-robin: hit rate x{c['hit_rate'] / max(rr['hit_rate'], 1e-9):.1f}, "
                f"TTFT p90 x{rr['ttft_ms']['p90'] / c['ttft_ms']['p90']:.1f} better; vs least-loaded: "
                f"TTFT p90 x{ll['ttft_ms']['p90'] / c['ttft_ms']['p90']:.1f} better; hit rate = "
                f"{c['hit_rate'] / max(y['hit_rate'], 1e-9):.0%} of the yardstick's."
            )
            lines.append("")
    if r.get("sweep"):
        lines += [
            "### Load sweep, 4 engines",
            "",
            "| arrivals | policy | hit rate | TTFT p50 ms | p90 ms | p99 ms | req/s | shed | "
            "p90: round-robin / this | least-loaded / this |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for scale, point in sorted(r["sweep"].items(), key=lambda kv: float(kv[0])):
            for name, s in point.items():
                t = s["ttft_ms"]
                vs = {k: point[k]["ttft_ms"]["p90"] / t["p90"] if k in point else float("nan")
                      for k in ("round_robin", "least_loaded")}  # fmt: skip
                lines.append(
                    f"| {scale}x | {name} | {s['hit_rate']:.3f} | {t['p50']} | {t['p90']} | "
                    f"{t['p99']} | {s['throughput_req_s']} | {s['shed']} | "
                    f"{vs['round_robin']:.1f} | {vs['least_loaded']:.1f} |"
                )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
