"""A mixed fleet of real engines: a Mooncake trace through a real router to cgn-infer,
llama.cpp and mlx_lm serving SmolLM2 on this machine, round-robin against ours, one run.

    .venv/bin/python bench/mixed_fleet.py                 # the committed experiment

`cgn-ctl up --engines cgn_infer,llama_cpp,mlx_lm` starts the fleet (etcd,
three agents each offering one engine, one replica each); a router of the
policy (auth off, the same etcd) replays a window of the trace
(bench/router_trace.py's replay, streamed /v1/completions with usage).

Prompts are text, since mlx_lm takes no token ids: each 512-token trace
block id becomes `--words` words drawn from SmolLM2's one-token words,
seeded by (run, id, position), so equal ids in equal positions are equal
text and each policy's run meets cold caches (its own words). Outputs are
the trace's times `--output-scale`, arrivals `--time-scale` times faster.

Each policy gets a fresh fleet (cold caches, no work left from another run).
Before the first run, each engine's capacity is measured alone (requests of the
trace's mean shape, one at a time, straight to the engine: requests/s);
each run reports every engine's share of requests and of uncached prompt
tokens beside its share of that capacity. Hit rate is what the engines
report (cached_tokens / prompt_tokens); mlx_lm counts tokens from its
prompt cache, llama.cpp from its slot's cache.

`NAME@fast` runs policy NAME with mlx_lm's node cordoned (the router routes
nothing there): the two fast engines alone, #57's yardstick for what adding a
slow replica may cost. `time_held` is `time` with the model's TTFT SLO at
`--slo-ms`: a request whose best prediction misses it waits at the router for a
replica that meets it (cgn_router/hold.py).

Results: bench/results/mixed_fleet.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from bench.router_trace import POLICIES, TRACE, replay, summarize
from bench.trace import TraceRequest, load
from cgn_core import bundled_models
from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.tokenizer import GGUFTokenizer
from harness.mixed_fleet import BIN, ENGINES, endpoint_records, engine_of_node, mixed_fleet
from harness.poll import router_endpoints, until
from harness.procs import cgn_router


def one_token_words() -> list[str]:
    """Words SmolLM2's vocabulary holds whole with their leading space (one token each)."""
    with GGUFFile(bundled_models.smollm2()) as g:
        pieces = GGUFTokenizer(g).pieces
    return sorted(
        p[1:] for p in pieces if p.startswith("Ġ") and p[1:].isalpha() and 3 <= len(p) <= 9
    )


def text_of(req: TraceRequest, i: int, words: list[str], per_id: int, run: int) -> str:
    parts = []
    for pos, h in enumerate(req.hash_ids):
        rng = random.Random(f"{run}:{h}:{pos}")
        parts.append(" ".join(rng.choice(words) for _ in range(per_id)))
    return "\n".join(parts) + f"\nRequest {i}."


def capacity(rec: dict[str, Any], prompts: list[str], max_tokens: int) -> dict[str, float]:
    """Requests/s of one engine alone, one request at a time (after one to warm it)."""
    auth = {"Authorization": f"Bearer {rec['api_token']}"}
    body = {"model": "smollm2", "max_tokens": max_tokens, "ignore_eos": True}
    with httpx.Client(timeout=300, headers=auth) as c:
        c.post(rec["url"] + "/v1/completions", json=body | {"prompt": "Warm up."})
        t0 = time.monotonic()
        for p in prompts:
            r = c.post(rec["url"] + "/v1/completions", json=body | {"prompt": p})
            r.raise_for_status()
        wall = time.monotonic() - t0
    return {"req_s": round(len(prompts) / wall, 3), "s_per_req": round(wall / len(prompts), 2)}


def shares(outcomes: list[Any]) -> dict[str, dict[str, float]]:
    ok = [o for o in outcomes if o.ok]
    answered: dict[str, list[Any]] = {e: [] for e in ENGINES}
    for o in ok:  # endpoint ids are <model>/<node>.<replica>
        answered[engine_of_node(o.endpoint.split("/", 1)[-1].rsplit(".", 1)[0])].append(o)
    out: dict[str, dict[str, float]] = {}
    uncached_total = sum(o.prompt_tokens - o.cached_tokens for o in ok) or 1
    for engine, mine in answered.items():
        out[engine] = {
            "requests": round(len(mine) / max(len(ok), 1), 3),
            "uncached_tokens": round(
                sum(o.prompt_tokens - o.cached_tokens for o in mine) / uncached_total, 3
            ),
            "hit_rate": round(
                sum(o.cached_tokens for o in mine) / max(sum(o.prompt_tokens for o in mine), 1), 3
            ),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--start", type=int, default=3920, help="the trace's row to start at")
    p.add_argument("--limit", type=int, default=60, help="how many requests")
    p.add_argument("--time-scale", type=float, default=0.2, help="arrivals this many times faster")
    p.add_argument("--output-scale", type=float, default=0.05)
    p.add_argument("--words", type=int, default=4, help="words per 512-token trace block")
    p.add_argument(
        "--policies",
        default="round_robin,cognitora",
        help="routing policies (bench/router_trace.py's; time_held: time with --slo-ms), "
        "comma-separated; NAME@fast: NAME "
        "with mlx_lm's node cordoned, the two fast engines alone",
    )
    p.add_argument("--slo-ms", type=float, default=2000.0, help="time_held's TTFT SLO")
    args = p.parse_args()
    window = load(args.trace, args.start + args.limit, args.time_scale)[args.start :]
    reqs = [replace(r, at_s=r.at_s - window[0].at_s) for r in window]
    words = one_token_words()
    results: dict[str, Any] = {
        "requests": len(reqs), "start": args.start, "words_per_block": args.words,
        "time_scale": args.time_scale, "output_scale": args.output_scale, "runs": {},
    }  # fmt: skip
    mean = statistics.mean(len(r.hash_ids) for r in reqs)
    shape = [r for r in reqs if abs(len(r.hash_ids) - mean) <= mean / 2][:2] or reqs[:2]
    out_tokens = max(1, round(statistics.mean(r.output_tokens for r in reqs) * args.output_scale))
    for run, policy in enumerate(args.policies.split(",")):
        with tempfile.TemporaryDirectory() as d, mixed_fleet(Path(d) / "up") as up:
            etcd = up["etcd"]
            recs = endpoint_records(etcd)
            if run == 0:  # each engine alone, before any traffic
                cap = {}
                for e in ENGINES:
                    prompts = [
                        text_of(r, i, words, args.words, run=-1) for i, r in enumerate(shape)
                    ]
                    print(f"capacity of {e} ...", file=sys.stderr, flush=True)
                    cap[e] = capacity(recs[e], prompts, out_tokens)
                total = sum(c["req_s"] for c in cap.values())
                for e in ENGINES:
                    cap[e]["share"] = round(cap[e]["req_s"] / total, 3)
                results["capacity"] = cap
            name, _, only = policy.partition("@")
            if only == "fast":  # the router routes nothing to a cordoned node's engine
                subprocess.run([str(BIN / "cgn-ctl"), "cordon", recs["mlx_lm"]["node"],
                                "--etcd", etcd, "--reason", "bench: the fast pair alone"],
                               check=True, capture_output=True, timeout=60)  # fmt: skip
            config: dict[str, Any] = {"etcd": {"endpoints": [etcd]},
                                      "routing": POLICIES[name.removesuffix("_held")]}  # fmt: skip
            if name.endswith("_held"):
                config["models"] = {"smollm2": {"ttft_slo_ms": args.slo_ms}}
                config["routing"] = {**config["routing"], "hold_for_slo": True}
            print(f"{policy} ...", file=sys.stderr, flush=True)
            with cgn_router(Path(d), config) as router:
                until("the router sees the three engines",
                      lambda: len(router_endpoints(router.admin)) == len(ENGINES), 30)  # fmt: skip
                outcomes, wall = asyncio.run(
                    replay(router.url, "smollm2", reqs, 1, args.output_scale,
                           prompt_of=lambda i, r, run=run: text_of(r, i, words, args.words, run))
                )  # fmt: skip
            s = summarize(outcomes, wall)
            s["shares"] = shares(outcomes)
            results["runs"][policy] = s
            print(json.dumps(s), file=sys.stderr, flush=True)
    command = " ".join([".venv/bin/python bench/mixed_fleet.py", *sys.argv[1:]])
    write_result("mixed_fleet", command, results, render(results))


def render(r: dict[str, Any]) -> str:
    lines = [
        f"{r['requests']} Mooncake requests (rows {r['start']} on: the trace's start shares "
        f"almost no prefix), each 512-token block as {r['words_per_block']} "
        f"one-token words, arrivals {r['time_scale']:g}x faster, outputs x{r['output_scale']:g}; "
        "SmolLM2 on cgn-infer, llama.cpp (xllamacpp) and mlx_lm (MLX's CPU backend), one "
        "replica each, one thread each, on the same 2 cores.",
        "",
        "| policy | hit rate | TTFT p50 ms | p90 ms | req/s | shed |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, s in r["runs"].items():
        t = s["ttft_ms"]
        lines.append(
            f"| {name} | {s['hit_rate']:.3f} | {t['p50']} | {t['p90']} | "
            f"{s['throughput_req_s']} | {s['shed']} |"
        )
    lines += ["", "Each engine: measured capacity alone, and its share of the requests each run's "
              "engines answered (a request the router retried elsewhere counts where it was "
              "answered).", "",
              "| engine | capacity req/s | capacity share | " +
              " | ".join(f"{n}: requests / uncached tokens / hit rate" for n in r["runs"]) + " |",
              "|---|---:|---:|" + "---:|" * len(r["runs"])]  # fmt: skip
    for e in ENGINES:
        c = r["capacity"][e]
        cells = [
            f"{s['shares'][e]['requests']:.2f} / {s['shares'][e]['uncached_tokens']:.2f} / "
            f"{s['shares'][e]['hit_rate']:.2f}"
            for s in r["runs"].values()
        ]
        lines.append(f"| {e} | {c['req_s']} | {c['share']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
