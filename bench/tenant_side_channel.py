"""The prefix-cache timing side channel between tenants (#58), measured through the router.

Tenant A sends a prompt; tenant B then sends the same prompt, and a fresh one of the same
length, and times each one's first token. Where the cache is shared, B's time for A's
prompt is a cache hit and gives A's prompt away; with tenant isolation (the default) it
must be indistinguishable from the fresh prompt's. One run, both setups interleaved pair
by pair on one real cgn-infer engine (SmolLM2, the torch backend) behind a real router
with API keys in a real etcd:

* isolated: keys of tenants `a` and `b`;
* shared: keys of tenants `c` and `d` naming one `kv_share_group` (what sharing does).

Each setup's two samples of B's times are compared with a two-sided Mann-Whitney U test
(normal approximation with the tie correction): isolated should give p > 0.05, shared
p < 0.05. Which of B's two requests goes first alternates pair by pair.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import private_etcd, put_key, until_served, write_result
from harness.procs import cgn_infer, cgn_router, etcd_put

SETUPS = {"isolated": ("a", "b", ""), "shared": ("c", "d", "acme")}


def mann_whitney(x: list[float], y: list[float]) -> tuple[float, float]:
    """(U of `x`, two-sided p) by the normal approximation with the tie correction."""
    n1, n2 = len(x), len(y)
    values = sorted((v, i < n1) for i, v in enumerate([*x, *y]))
    ranks = [0.0] * len(values)
    ties = 0.0
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1][0] == values[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        t = j - i + 1
        ties += t**3 - t
        i = j + 1
    r1 = sum(r for r, (_, first) in zip(ranks, values, strict=True) if first)
    u = r1 - n1 * (n1 + 1) / 2
    n = n1 + n2
    var = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1)))
    if var <= 0:
        return u, 1.0
    z = (u - n1 * n2 / 2) / math.sqrt(var)
    return u, math.erfc(abs(z) / math.sqrt(2))


def ttft(client: httpx.Client, url: str, key: str, prompt: list[int]) -> float:
    """Seconds to the first streamed chunk of a one-token completion of `prompt`."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 1, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    started = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:200]!r}")
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                first = time.perf_counter() - started
                break
        else:
            raise RuntimeError("no chunk")
        for _ in lines:  # the rest of the answer
            pass
    return first


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(7)

    def prompt() -> list[int]:
        return [int(t) for t in rng.integers(100, 40_000, args.prompt_tokens)]

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with private_etcd(tmp) as etcd:
            keys = {
                tenant: put_key(etcd, tenant, kv_share_group=group)
                for victim, asker, group in SETUPS.values()
                for tenant in (victim, asker)
            }
            with cgn_infer(tmp, "--model-name", "smollm2") as engine:
                etcd_put(etcd.endpoint, "/cognitora/endpoints/smollm2/e1",
                         {"url": engine, "engine": "cgn-infer"})  # fmt: skip
                config = {"etcd": {"endpoints": [etcd.endpoint]}, "auth": {"enabled": True},
                          "reconciler": {"enabled": False}}  # fmt: skip
                with cgn_router(tmp, config) as router, httpx.Client(timeout=120) as client:
                    for key in keys.values():
                        until_served(router.url, key, "smollm2")
                    times: dict[str, dict[str, list[float]]] = {
                        s: {"victims_prompt": [], "fresh_prompt": []} for s in SETUPS
                    }
                    for i in range(args.pairs):
                        for setup, (victim, asker, _) in SETUPS.items():
                            secret, fresh = prompt(), prompt()
                            ttft(client, router.url, keys[victim], secret)
                            order = [("victims_prompt", secret), ("fresh_prompt", fresh)]
                            for name, p in order if i % 2 == 0 else order[::-1]:
                                times[setup][name].append(ttft(client, router.url, keys[asker], p))
                        if (i + 1) % 25 == 0:
                            print(f"{i + 1} pairs", file=sys.stderr, flush=True)
    out: dict[str, Any] = {}
    for setup, t in times.items():
        u, p = mann_whitney(t["victims_prompt"], t["fresh_prompt"])
        out[setup] = {
            "victims_prompt_ttft_ms": _summary(t["victims_prompt"]),
            "fresh_prompt_ttft_ms": _summary(t["fresh_prompt"]),
            "mann_whitney_u": u,
            "p_value": p,
            "distinguishable": p < 0.05,
            "samples_ms": {k: [round(v * 1000, 2) for v in vs] for k, vs in t.items()},
        }
    return out


def _summary(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values)
    return {"p10": ms[len(ms) // 10], "p50": statistics.median(ms), "p90": ms[len(ms) * 9 // 10]}


def render(results: dict[str, Any], args: argparse.Namespace) -> str:
    rows = [
        f"{args.pairs} pairs per setup, {args.prompt_tokens}-token prompts (token ids), one "
        "real cgn-infer engine (SmolLM2-135M, torch, 2 threads) behind the router, API keys on.",
        "",
        "| setup | B's TTFT for A's prompt p10 / p50 / p90 ms | fresh prompt p10 / p50 / p90 ms "
        "| Mann-Whitney p | distinguishable (p < 0.05) |",
        "|---|---|---|---:|---|",
    ]
    for setup, r in results.items():
        a, f = r["victims_prompt_ttft_ms"], r["fresh_prompt_ttft_ms"]
        rows.append(
            f"| {setup} | {a['p10']:.1f} / {a['p50']:.1f} / {a['p90']:.1f} "
            f"| {f['p10']:.1f} / {f['p50']:.1f} / {f['p90']:.1f} | {r['p_value']:.3g} "
            f"| {'yes' if r['distinguishable'] else 'no'} |"
        )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pairs", type=int, default=200, help="prompt pairs per setup")
    p.add_argument("--prompt-tokens", type=int, default=256, help="tokens per prompt")
    p.add_argument("--result", default="tenant_side_channel", help="bench/results/ file name")
    args = p.parse_args()
    if not 1 <= args.pairs <= 10_000 or not 32 <= args.prompt_tokens <= 4096:
        p.error("--pairs must be 1-10000 and --prompt-tokens 32-4096")
    results = run(args)
    command = " ".join([".venv/bin/python bench/tenant_side_channel.py", *sys.argv[1:]])
    write_result(args.result, command, results, render(results, args))
    print(render(results, args))


if __name__ == "__main__":
    main()
