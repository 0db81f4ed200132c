"""Autoscaled against static fleets on a trace whose rate rises and falls, one run.

    .venv/bin/python bench/autoscale_trace.py [--seconds 150] [--min 1] [--max 4]
        [--peak-rps 12] [--base-rps 1.5] [--slo-ms 2000]

A real cluster on this machine: etcd, two agents, a router leading the
reconciler (and the autoscaler). The model is SmolLM2's shapes on the sim
backend (`--speed 4`, 4 requests at a time per replica, a 10 s cold start:
`--sim-load-s`). Requests are the shared Mooncake trace's rows in order
(prompt from their block ids, 16 tokens an id and at most 96 ids, at most 32
output tokens),
re-timed to a rate that stays at `--base-rps`, ramps to `--peak-rps` and
back: low for the first fifth of `--seconds`, up over the second, at the
peak for the third, down over the fourth, low for the last. The same
arrivals three ways, one after the other: static at `--max` replicas, static
at `--min`, and autoscaled between them. Per way: the share of requests
whose time to first token is within `--slo-ms` (SLO attainment), replicas x
seconds used (placed, sampled each half second from the reconciler's
view), goodput (requests within the SLO) per replica-second, requests
failed, and the autoscaler's direction changes (with its stabilization
window). The timeline (arrival rate and replicas placed, three ways) is
drawn to a PNG beside the results.

Results: bench/results/autoscale_trace.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import struct
import sys
import tempfile
import time
import zlib
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools

from bench.common import write_result
from bench.trace import expand, load
from cgn_core import keys
from cgn_core.etcd.local import LocalEtcd
from harness.procs import BIN, REPO, cgn_agent, cgn_router, etcd_run

TRACE = REPO.parent / "shared" / "traces" / "mooncake" / "synthetic_trace.jsonl"
SCALING = {"warmup_s": 2, "up_cooldown_s": 4, "down_cooldown_s": 10, "stabilization_s": 20}
PROFILE = ('{engine: cgn_infer, backend: sim, threads: 1, extra_args: [--speed, "4", '
           '--max-batch, "4", --kv-pool-tokens, "16384", --sim-load-s, "10"]}')  # fmt: skip


def rate(t: float, seconds: float, base: float, peak: float) -> float:
    """Arrivals per second at `t`: base, ramp up, peak, ramp down, base (fifths)."""
    f = t / seconds
    if f < 0.2 or f >= 0.8:
        return base
    if f < 0.4:
        return base + (peak - base) * (f - 0.2) / 0.2
    if f < 0.6:
        return peak
    return peak - (peak - base) * (f - 0.6) / 0.2


def arrivals(seconds: float, base: float, peak: float) -> list[float]:
    """Arrival times whose rate follows `rate` (deterministic: evenly spaced in its integral)."""
    out, acc, t, dt = [], 0.0, 0.0, 0.01
    while t < seconds:
        acc += rate(t, seconds, base, peak) * dt
        while acc >= 1.0:
            acc -= 1.0
            out.append(t)
        t += dt
    return out


def model_yaml(name: str, lo: int, hi: int) -> str:
    scaling = ", ".join(f"{k}: {v}" for k, v in SCALING.items())
    return (f"name: {name}\nsource: smollm2\nreplicas: {{min: {lo}, max: {hi}}}\n"
            f"scaling: {{{scaling}}}\nprofiles:\n  - {PROFILE}\n")  # fmt: skip


async def one(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], out: dict[str, Any]
) -> None:
    start = time.monotonic()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                out["status"] = f"http {resp.status_code}"
                return
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and "ttft_s" not in out:
                    out["ttft_s"] = time.monotonic() - start
                if line.startswith("data: [DONE]"):
                    out["status"] = "ok"
            out.setdefault("status", "cut")
    except httpx.HTTPError as exc:
        out["status"] = type(exc).__name__


async def replay(url: str, name: str, times: list[float], prompts: list[list[int]],
                 outputs: list[int], placed: Any) -> tuple[list[dict[str, Any]], list[tuple[float, int]]]:  # fmt: skip
    """Send each request at its time; sample the placed replicas every half second."""
    results: list[dict[str, Any]] = [{} for _ in times]
    timeline: list[tuple[float, int]] = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        start = time.monotonic()
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                timeline.append((time.monotonic() - start, await placed()))
                await asyncio.sleep(0.5)

        sampler = asyncio.create_task(sample())
        tasks = []
        for i, at in enumerate(times):
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            body = {"model": name, "prompt": prompts[i], "max_tokens": outputs[i],
                    "stream": True, "ignore_eos": True}  # fmt: skip
            tasks.append(asyncio.create_task(one(client, url, body, results[i])))
        await asyncio.gather(*tasks)
        done.set()
        await sampler
    return results, timeline


def summarize(results: list[dict[str, Any]], timeline: list[tuple[float, int]], slo_s: float,
              window_s: float) -> dict[str, Any]:  # fmt: skip
    ok = [r for r in results if r.get("status") == "ok"]
    within = sum(r["ttft_s"] <= slo_s for r in ok)
    replica_s = sum(0.5 * n for _, n in timeline)
    counts = [n for _, n in timeline]
    turns = [(timeline[i][0], counts[i] > counts[i - 1]) for i in range(1, len(counts))
             if counts[i] != counts[i - 1]]  # fmt: skip
    directions = [turns[i] for i in range(len(turns)) if i == 0 or turns[i][1] != turns[i - 1][1]]
    flips_within_window = sum(
        1 for a, b in itertools.pairwise(directions) if b[0] - a[0] < window_s
    )
    ttfts = sorted(r["ttft_s"] for r in ok)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "failures": sorted({r.get("status", "none") for r in results if r.get("status") != "ok"}),
        "slo_attainment": within / len(results) if results else 0.0,
        "ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else None,
        "ttft_p90_s": ttfts[int(0.9 * len(ttfts))] if ttfts else None,
        "replica_seconds": replica_s,
        "goodput_per_replica_s": within / replica_s if replica_s else 0.0,
        "direction_changes": len(directions),
        "direction_changes_within_window": flips_within_window,
        "timeline": timeline,
    }


def run_way(etcd: LocalEtcd, router_url: str, router_admin: str, ctl: Any, name: str, lo: int, hi: int,
            args: argparse.Namespace, times: list[float], prompts: list[list[int]],
            outputs: list[int], tmp: Path) -> dict[str, Any]:  # fmt: skip
    spec = tmp / f"{name}.yaml"
    spec.write_text(model_yaml(name, lo, hi))
    ctl("models", "apply", "-f", str(spec))

    async def placed() -> int:
        async def count(c: Any) -> int:
            kvs, _ = await c.get_prefix(keys.PLACEMENTS)
            return sum(1 for kv in kvs if json.loads(kv.value).get("model") == name)

        return await asyncio.to_thread(etcd_run, etcd.endpoint, count)

    def ready() -> int:
        with httpx.Client(timeout=10) as c:
            endpoints = c.get(router_admin + "/endpoints").json()["endpoints"]
        return sum(e["model"] == name for e in endpoints)

    deadline = time.monotonic() + 180
    while not ready():  # at least one replica routable before the clock starts
        assert time.monotonic() < deadline, f"{name}: no replica became ready"
        time.sleep(0.5)
    if lo > 1:  # a static fleet starts whole
        while asyncio.run(placed()) < lo or not _all_ready(etcd, name, lo):
            assert time.monotonic() < deadline, f"{name}: {lo} replicas never became ready"
            time.sleep(0.5)
    print(f"{name}: replaying {len(times)} requests over {args.seconds} s", file=sys.stderr)
    results, timeline = asyncio.run(replay(router_url, name, times, prompts, outputs, placed))
    ctl("models", "delete", name)
    out = summarize(results, timeline, args.slo_ms / 1e3, SCALING["stabilization_s"])
    out |= {"min": lo, "max": hi}
    print(name, {k: v for k, v in out.items() if k != "timeline"}, file=sys.stderr)
    return out


def _all_ready(etcd: LocalEtcd, name: str, n: int) -> bool:
    async def count(c: Any) -> int:
        kvs, _ = await c.get_prefix(keys.REPLICAS)
        docs = [json.loads(kv.value) for kv in kvs]
        return sum(d.get("model") == name and d.get("phase") == "Ready" for d in docs)

    return etcd_run(etcd.endpoint, count) >= n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=150)
    ap.add_argument("--min", type=int, default=1)
    ap.add_argument("--max", type=int, default=4)
    ap.add_argument("--base-rps", type=float, default=1.5)
    ap.add_argument("--peak-rps", type=float, default=12.0)
    ap.add_argument("--slo-ms", type=float, default=2000.0)
    args = ap.parse_args()
    times = arrivals(args.seconds, args.base_rps, args.peak_rps)
    rows = load(TRACE, limit=len(times))
    # NOTE: 16 tokens a block id, at most 96 ids: every prompt and its answer fit the sim
    # model's 2,048-token context (a longer one is a 400 in any fleet, not a scaling loss)
    prompts = [expand(dataclasses.replace(r, hash_ids=r.hash_ids[:96]), 1, i)
               for i, r in enumerate(rows)]  # fmt: skip
    outputs = [min(32, r.output_tokens) for r in rows]
    import subprocess

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d, ExitStack() as stack:
        tmp = Path(d)
        etcd = LocalEtcd(tmp / "etcd")
        etcd.start()
        stack.callback(etcd.stop)

        def ctl(*a: str) -> None:
            res = subprocess.run([str(BIN / "cgn-ctl"), *a, "--etcd", etcd.endpoint],
                                 capture_output=True, text=True, timeout=120)  # fmt: skip
            assert res.returncode == 0, res.stderr

        for node in ("n1", "n2"):
            stack.enter_context(cgn_agent(tmp / node, etcd.endpoint, "--set", "lease_ttl_s=3",
                                          "--set", "engines.stop_on_exit=true", node=node))  # fmt: skip
        config = {"etcd": {"endpoints": [etcd.endpoint]}, "scrape": {"interval_s": 0.5},
                  "reconciler": {"interval_s": 0.5, "lease_ttl_s": 3},
                  "admission": {"enabled": False}, "log": {"level": "warning"}}  # fmt: skip
        (tmp / "router").mkdir()
        router = stack.enter_context(cgn_router(tmp / "router", config))
        ways = {"static at max": (args.max, args.max), "static at min": (args.min, args.min),
                "autoscaled": (args.min, args.max)}  # fmt: skip
        for label, (lo, hi) in ways.items():
            name = "m-" + label.split()[-1]
            results[label] = run_way(etcd, router.url, router.admin, ctl, name, lo, hi, args,
                                     times, prompts, outputs, tmp)  # fmt: skip
    rate_line = [(t, rate(t, args.seconds, args.base_rps, args.peak_rps)) for t in
                 np.arange(0, args.seconds, 0.5)]  # fmt: skip
    png = REPO / "bench" / "results" / "autoscale_trace.png"
    draw(png, {k: v["timeline"] for k, v in results.items()}, rate_line, args.seconds, args.max)
    command = " ".join([".venv/bin/python bench/autoscale_trace.py", *sys.argv[1:]])
    for r in results.values():
        r["timeline"] = [(round(t, 1), n) for t, n in r["timeline"]]
    write_result("autoscale_trace", command, {"args": vars(args), "ways": results},
                 render(results, args))  # fmt: skip
    print(render(results, args))


def render(r: dict[str, Any], args: argparse.Namespace) -> str:
    rows = [f"| way | SLO attainment (TTFT ≤ {args.slo_ms:g} ms) | TTFT p50 / p90 s | replica-seconds | "
            "goodput per replica-second | failed | direction changes (within a window) |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for label, w in r.items():
        rows.append(
            f"| {label} ({w['min']}–{w['max']}) | {w['slo_attainment']:.1%} | "
            f"{w['ttft_p50_s']:.2f} / {w['ttft_p90_s']:.2f} | {w['replica_seconds']:.0f} | "
            f"{w['goodput_per_replica_s']:.3f} | {w['failed']} | "
            f"{w['direction_changes']} ({w['direction_changes_within_window']}) |"
        )
    auto, top = r.get("autoscaled"), r.get("static at max")
    if auto and top:
        rows += ["", f"Autoscaled used {auto['replica_seconds'] / top['replica_seconds']:.0%} of "
                 f"static-max's replica-seconds at {auto['slo_attainment']:.1%} SLO attainment "
                 f"against its {top['slo_attainment']:.1%}."]  # fmt: skip
    rows += ["", f"{r[next(iter(r))]['requests']} requests over {args.seconds:g} s "
             f"({args.base_rps:g} → {args.peak_rps:g} → {args.base_rps:g} req/s); sim engines "
             "(speed 4, 4 at a time, 10 s cold start) under two real agents, a real router and "
             "etcd; scaling " + json.dumps(SCALING) + ". Timeline: autoscale_trace.png (replicas "
             "placed over time; red static at max, blue static at min, green autoscaled, grey "
             "the arrival rate scaled to the plot)."]  # fmt: skip
    return "\n".join(rows)


def draw(path: Path, lines: dict[str, list[tuple[float, int]]], rate_line: list[tuple[float, float]],
         seconds: float, top: int) -> None:  # fmt: skip
    """A plain PNG: replicas placed over time per way (and the arrival rate, scaled), drawn
    with numpy and zlib (no plotting library in this environment)."""
    w, h, pad = 900, 320, 30
    img = np.full((h, w, 3), 255, np.uint8)
    colors = {"static at max": (200, 60, 60), "static at min": (60, 60, 200),
              "autoscaled": (30, 150, 60), "rate": (150, 150, 150)}  # fmt: skip
    peak = max(v for _, v in rate_line) or 1

    def xy(t: float, v: float, vmax: float) -> tuple[int, int]:
        x = pad + int((w - 2 * pad) * t / seconds)
        y = h - pad - int((h - 2 * pad) * v / vmax)
        return min(max(x, 0), w - 1), min(max(y, 0), h - 1)

    def polyline(points: list[tuple[int, int]], color: tuple[int, int, int]) -> None:
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            n = max(abs(x1 - x0), abs(y1 - y0), 1)
            for i in range(n + 1):
                x, y = x0 + (x1 - x0) * i // n, y0 + (y1 - y0) * i // n
                img[max(0, y - 1) : y + 2, max(0, x - 1) : x + 2] = color

    img[h - pad, pad : w - pad] = 0  # axes
    img[pad : h - pad, pad] = 0
    for n in range(1, top + 1):  # a faint line per replica count
        img[xy(0, n, top + 0.5)[1], pad : w - pad] = 225
    polyline([xy(t, v, peak * (top + 0.5) / top) for t, v in rate_line], colors["rate"])
    for label, points in lines.items():  # steps: a count holds until the next sample
        pts = []
        for t, n in points:
            if pts:
                pts.append((*xy(t, pts[-1][2], top + 0.5), pts[-1][2]))
            pts.append((*xy(t, n, top + 0.5), n))
        polyline([(x, y) for x, y, _ in pts], colors[label])
    for i, color in enumerate(colors.values()):  # legend swatches, top left
        img[8 + 12 * i : 16 + 12 * i, pad + 10 : pad + 30] = color
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    path.write_bytes(png)


if __name__ == "__main__":
    main()
