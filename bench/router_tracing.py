"""What tracing costs the router: off, on at 1 % and on at 100 %, in one run.

    .venv/bin/python bench/router_tracing.py [--rounds 3] [--seconds 8] [--requests 1000]

Three routers (one worker each) on the setup of bench/router_vs_smg.py (four
fake engines, etcd, an API key, SmolLM2's tokenizer, admission), differing only
in `tracing`: off; on with `sample_ratio` 0.01; on with 1.0. The two traced
ones export to an OTLP/gRPC receiver in a process of its own
(harness/otlp.py), so collecting costs their CPU, not the routers'. Per
round, in alternating order: c=1 latency over one keep-alive connection
(added = router - the engine alone), then `wrk` at c=64 for `--seconds`:
requests/s, p99, and the router's CPU time per request from /proc.

Results: bench/results/router_tracing.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from bench.router_vs_smg import BODY, gateways, measured_wrk, pct, sequential

RECEIVER = """
import sys, time
from harness.otlp import receiver
with receiver() as rx:
    print(rx.url, flush=True)
    while True:
        time.sleep(5)
        with rx.lock:
            rx.spans.clear()  # counted by the routers; kept here only to be dropped
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=int, default=8, help="wrk duration per router per round")
    p.add_argument("--requests", type=int, default=1000, help="sequential requests per router")
    args = p.parse_args()
    repo = Path(__file__).resolve().parents[1]
    rx = subprocess.Popen([sys.executable, "-c", RECEIVER], cwd=repo, stdout=subprocess.PIPE,
                          text=True)  # fmt: skip
    assert rx.stdout is not None
    url = rx.stdout.readline().strip()
    assert url.startswith("http://"), url
    traced = {"enabled": True, "endpoint": url}
    variants = {
        "off": {"workers": 1},
        "on_1pct": {"workers": 1, "tracing": {**traced, "sample_ratio": 0.01}},
        "on_100pct": {"workers": 1, "tracing": {**traced, "sample_ratio": 1.0}},
    }
    rounds: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory() as d, gateways(Path(d), [1], variants) as g:
            names = list(variants)
            for r in range(args.rounds):
                targets = {k: g[k] for k in ("direct", *names)}
                c1 = sequential(targets, g["key"], args.requests, [BODY])
                order = names if r % 2 == 0 else names[::-1]
                c64 = {k: measured_wrk(g["pids"][k], g[k], g["key"], args.seconds, Path(d), [BODY])
                       for k in order}  # fmt: skip
                one = {k: {"added_c1_p50_ms": pct(c1[k], 0.5) - pct(c1["direct"], 0.5),
                           "added_c1_p99_ms": pct(c1[k], 0.99) - pct(c1["direct"], 0.99),
                           "c64_req_s": c64[k]["req_s"], "c64_p99_ms": c64[k]["p99_ms"],
                           "cpu_us_per_req": c64[k]["cpu_us_per_req"]}
                       for k in names}  # fmt: skip
                print(f"round {r + 1}: {json.dumps(one)}", file=sys.stderr, flush=True)
                rounds.append(one)
            time.sleep(2)  # the last spans go out before the routers stop
    finally:
        rx.kill()
    mean = {k: {m: round(statistics.fmean(r[k][m] for r in rounds), 3) for m in rounds[0][k]}
            for k in rounds[0]}  # fmt: skip
    results = {"rounds": rounds, "mean": mean}
    command = " ".join([".venv/bin/python bench/router_tracing.py", *sys.argv[1:]])
    write_result("router_tracing", command, results, render(results))


def render(r: dict[str, Any]) -> str:
    m = r["mean"]
    off = m["off"]
    lines = [
        f"Mean of {len(r['rounds'])} alternating rounds; one worker per router; 2 cores shared "
        "by the fake engines, the routers, the receiver and wrk.",
        "",
        "| tracing | added c=1 p50 / p99 ms | c=64 req/s | c=64 p99 ms | CPU µs/req | "
        "req/s vs off | CPU vs off |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, label in (("off", "off"), ("on_1pct", "on, 1 %"), ("on_100pct", "on, 100 %")):
        g = m[name]
        lines.append(
            f"| {label} | {g['added_c1_p50_ms']:.3f} / {g['added_c1_p99_ms']:.3f} | "
            f"{g['c64_req_s']:.0f} | {g['c64_p99_ms']:.1f} | {g['cpu_us_per_req']:.0f} | "
            f"{g['c64_req_s'] / off['c64_req_s']:.2f}x | "
            f"{g['cpu_us_per_req'] / off['cpu_us_per_req']:.2f}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
