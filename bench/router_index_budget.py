"""The router's KV index under its memory budget: RSS with 1,000 engines' full pools.

    .venv/bin/python bench/router_index_budget.py [--budgets 256,512,0] [--endpoints 1000]

One process per budget (0: none) builds a `PrefixIndex` the way the router
does (three quarters of `routing.index_budget_mb` for the engines' blocks) and
feeds it a snapshot of 16,384 distinct blocks from each of `--endpoints`
engines, the worst case (nothing shared). Reported: the process's RSS growth,
the index's own estimate, the blocks it forgot to stay within the budget, the
time to take the snapshots, and whether the last engine's newest blocks still
match (the ones a request would find).

Results: bench/results/router_index_budget.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result

PROBE = """
import json, random, sys, time
from cgn_router.routing.kv_index import UNLIMITED, PrefixIndex
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
budget_mb, endpoints = int(sys.argv[1]), int(sys.argv[2])
before = rss()
idx = PrefixIndex(300, 65536, 5, (budget_mb << 20) * 3 // 4 if budget_mb else UNLIMITED)
rng = random.Random(0)
t = time.perf_counter()
for e in range(endpoints):
    blocks = [rng.randbytes(32) for _ in range(16384)]
    idx.snapshot(f"m/e{e}", 1, blocks)
took = time.perf_counter() - t
print(json.dumps({"rss_mib": round(rss() - before), "estimate_mib": round(idx.bytes_used() / 2**20),
       "forgotten": idx.forgotten, "snapshots_s": round(took, 1),
       "newest_matched": idx.match(f"m/e{endpoints - 1}", blocks[-64:], 0.0)}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--budgets", default="256,512,0", help="index_budget_mb values (0: none)")
    p.add_argument("--endpoints", type=int, default=1000)
    args = p.parse_args()
    repo = Path(__file__).resolve().parents[1]
    runs: dict[str, Any] = {}
    for mb in map(int, args.budgets.split(",")):
        env = {**os.environ, "PYTHONPATH": str(repo)}
        res = subprocess.run([sys.executable, "-P", "-c", PROBE, str(mb), str(args.endpoints)],
                             env=env, capture_output=True, text=True, check=True, timeout=3600)  # fmt: skip
        runs[str(mb)] = json.loads(res.stdout.strip().splitlines()[-1])
        print(mb, runs[str(mb)], file=sys.stderr, flush=True)
    results = {"endpoints": args.endpoints, "blocks_per_endpoint": 16384, "runs": runs}
    command = " ".join([".venv/bin/python bench/router_index_budget.py", *sys.argv[1:]])
    write_result("router_index_budget", command, results, render(results))


def render(r: dict[str, Any]) -> str:
    lines = [
        f"{r['endpoints']} engines x {r['blocks_per_endpoint']:,} distinct blocks each, one "
        "snapshot per engine, one process per budget.",
        "",
        "| routing.index_budget_mb | engines' share | RSS growth MiB | index estimate MiB | "
        "blocks forgotten | snapshots s | last engine's newest 64 blocks matched |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mb, run in r["runs"].items():
        share = f"{int(mb) * 3 // 4}" if mb != "0" else "—"
        lines.append(
            f"| {mb if mb != '0' else 'none'} | {share} | {run['rss_mib']} | {run['estimate_mib']} "
            f"| {run['forgotten']:,} | {run['snapshots_s']} | {run['newest_matched']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
