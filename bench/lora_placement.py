"""Placing LoRA adapters by residency against at random (#60), same fleet, same requests.

    .venv/bin/python bench/lora_placement.py [--requests 1000] [--adapters 50] [--slots 8]

Four cgn-infer sim engines in one process (`--engines 4`), each holding at most
`--slots` adapters (`max_loras`; the least recently used idle one goes), a load
taking `--load-s` seconds (`sim.lora_load_s`, modelled), behind one router whose
catalog names `--adapters` adapters (files written by harness/lora.py). Requests
name an adapter drawn from a Zipf law (exponent `--zipf`) over them, from
`--clients` closed-loop clients, 8 tokens each, streamed. The same seeded sequence
runs twice on fresh engines and a fresh router: `routing.adapter_placement:
residency` (the default: load where none holds it, on a replica with a free slot
or else where the least asked-for adapter is, unloading that one first; route to
holders; widen a hot adapter) and `random` (a random replica, loaded there if it
does not hold it; the engines' LRU evicts). Reported: loads per 1,000 requests
(the router's `cgn_router_adapter_loads_total{result="loaded"}`), TTFT
p50/p90/p99 and requests refused; and, for scale, the loads of the offline
optimum on the same sequence (Belady's rule over all the fleet's slots, one copy
of each adapter: no online policy loads fewer). Results:
bench/results/lora_placement.{json,md}.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from cgn_core.bundled_models import smollm2
from harness.lora import write_adapter
from harness.metrics import metric
from harness.procs import cgn_infer_engines, cgn_router

ENGINES = 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--adapters", type=int, default=50)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--load-s", type=float, default=0.5)
    ap.add_argument("--speed", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    weights = [1 / (i + 1) ** a.zipf for i in range(a.adapters)]
    names = [f"lora{i:02d}" for i in range(a.adapters)]
    asked = rng.choices(names, weights, k=a.requests)
    data: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        files = {n: str(write_adapter(smollm2(), tmp / f"{n}.gguf", rank=4, targets=("attn_q",),
                                      layers=(0,), seed=i)) for i, n in enumerate(names)}  # fmt: skip
        for policy in ("residency", "random"):
            data[policy] = run(a, tmp / policy, files, asked, policy)
            print(policy, data[policy])
    data["offline_optimum_loads"] = belady(asked, ENGINES * a.slots)
    table = "\n".join([
        f"| {a.requests} requests, {a.adapters} adapters (Zipf {a.zipf}), {ENGINES} replicas x "
        f"{a.slots} slots, load {a.load_s} s | loads / 1,000 requests | TTFT p50 | p90 | p99 "
        "| refused |",
        "|---|---:|---:|---:|---:|---:|",
        *(f"| {p} | {d['loads_per_1000']:.0f} | {d['ttft_p50_ms']:.0f} ms | "
          f"{d['ttft_p90_ms']:.0f} ms | {d['ttft_p99_ms']:.0f} ms | {d['refused']} |"
          for p, d in data.items() if p in ("residency", "random")),
        "",
        f"Loads: residency {data['random']['loads'] / max(1, data['residency']['loads']):.1f}x "
        "fewer than random. The offline optimum on this sequence (Belady over all "
        f"{ENGINES * a.slots} slots) loads {data['offline_optimum_loads']} times: "
        f"{data['random']['loads'] / max(1, data['offline_optimum_loads']):.1f}x fewer than "
        "random is the most any placement could reach here.",
    ])  # fmt: skip
    print(table)
    write_result("lora_placement", "python " + " ".join(sys.argv), data, table)


def belady(asked: list[str], slots: int) -> int:
    """Loads of the offline optimum: a miss evicts the adapter asked for again furthest
    in the future (or never)."""
    held: set[str] = set()
    loads = 0
    for i, name in enumerate(asked):
        if name in held:
            continue
        loads += 1
        if len(held) >= slots:
            later = {n: next((j for j in range(i + 1, len(asked)) if asked[j] == n), 1 << 30)
                     for n in held}  # fmt: skip
            held.discard(max(held, key=lambda n: later[n]))
        held.add(name)
    return loads


def run(
    a: argparse.Namespace, tmp: Path, files: dict[str, str], asked: list[str], policy: str
) -> dict[str, Any]:
    tmp.mkdir()
    sim = ("--backend", "sim", "--engines", str(ENGINES), "--speed", str(a.speed),
           "--model-name", "smol", "--set", f"max_loras={a.slots}",
           "--set", f"sim.lora_load_s={a.load_s}", "--set", f"lora_dirs={tmp.parent}")  # fmt: skip
    with cgn_infer_engines(tmp, 1, *sim) as engines:
        endpoints = {f"e{i}": {"url": e.url, "model": "smol"} for i, e in enumerate(engines)}
        config = {
            "models": {"smol": {"adapters": files, "tokenizer": str(smollm2())}},
            "endpoints": endpoints,
            "routing": {"adapter_placement": policy},
        }
        with cgn_router(tmp, config) as router, httpx.Client(timeout=120) as client:
            ttfts: list[float] = []
            refused = 0

            def one(name: str) -> float | None:
                body = {"model": name, "prompt": "Hello there", "max_tokens": 8, "stream": True,
                        "temperature": 0}  # fmt: skip
                start = time.perf_counter()
                with client.stream("POST", router.url + "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        resp.read()
                        return None
                    first = None
                    for line in resp.iter_lines():
                        if first is None and line.startswith("data: ") and '"text"' in line:
                            first = time.perf_counter() - start
                    return first

            started = time.perf_counter()
            with ThreadPoolExecutor(a.clients) as pool:
                for got in pool.map(one, asked):
                    if got is None:
                        refused += 1
                    else:
                        ttfts.append(got)
            wall = time.perf_counter() - started
            loads = metric(router.admin, "cgn_router_adapter_loads_total", model="smol",
                           result="loaded")  # fmt: skip
    q = statistics.quantiles(ttfts, n=100) if len(ttfts) > 1 else [float("nan")] * 99
    return {
        "loads": loads,
        "loads_per_1000": 1000 * loads / len(asked),
        "ttft_p50_ms": 1000 * q[49],
        "ttft_p90_ms": 1000 * q[89],
        "ttft_p99_ms": 1000 * q[98],
        "refused": refused,
        "wall_s": wall,
    }


if __name__ == "__main__":
    main()
