"""What the router adds: latency at concurrency 1, throughput at 64, direct vs routed, one run.

    .venv/bin/python bench/router_overhead.py [--requests 2000] [--seconds 8] [--base REF]
                                              [--rounds N]

Upstreams: a fake engine that answers at once (bench/fake_engine.py), and a
real cgn-infer sim engine (--speed 1000, one output token). The router runs
pinned to CPU 0 (static config: four endpoint entries for the one upstream,
so every request is scored and picked among four); upstream and load
generator share CPU 1, so the router's throughput is measured on one core.

* c=1: sequential requests on one keep-alive connection, alternating direct
  and routed; added latency = routed minus direct, at p50 and p99.
* c=64: `wrk -c64` (Debian package `wrk`) for `--seconds`, direct and routed;
  the router's CPU time over the run gives requests/s per router core.

With `--base REF` the router of that commit (a git worktree) is measured too,
against the same upstreams in the same run, one router after the other:
before and after a change, side by side. With `--rounds N` (N > 1) the fake
upstream's scenario runs N times, the routers alternating, and the table
gives each router's median and range of requests/s per router core (what a
shared 2-core machine varies by between minutes, ±15 %, is then visible).

Results: bench/results/router_overhead.{json,md}.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from cgn_core.bundled_models import smollm2
from cgn_core.etcd.local import free_port
from cgn_core.readiness import wait_ready_file
from harness.procs import BIN, REPO, http_process, stop

BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
ROUTER_CPU, CLIENT_CPU = "0", "1"


def pinned(cpu: str, argv: list[str]) -> list[str]:
    can_pin = shutil.which("taskset") is not None and (os.cpu_count() or 1) > 1
    return ["taskset", "-c", cpu, *argv] if can_pin else argv


@contextmanager
def router(
    tmp: Path, upstream: str, model: str, engine: str, src: Path | None = None
) -> Iterator[tuple[str, int]]:
    """This tree's router, or with `src` the one of that checkout."""
    cfg = tmp / "router.yaml"
    cfg.write_text(yaml.safe_dump({
        "discovery": "static", "auth": {"enabled": False}, "log": {"level": "warning"},
        # four registry entries for the one upstream: every request is a real choice
        "endpoints": {f"e{i}": {"url": upstream, "model": model, "engine": engine} for i in range(4)},
    }))  # fmt: skip
    ready = tmp / "router.ready"
    exe, env = [str(BIN / "cgn-router")], None
    if src is not None:  # NOTE: -P: modules from the checkout, not from the current folder
        exe = [sys.executable, "-P", "-c", "import sys; from cgn_router.cli import main; "
               "sys.argv[0] = 'cgn-router'; main()"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(src)}
    argv = pinned(ROUTER_CPU, [*exe, "serve", "--port", "0", "--admin-port", "0",
                               "--config", str(cfg), "--ready-file", str(ready)])  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        port = wait_ready_file(ready, timeout_s=60, proc=proc)["ports"]["http"]
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        stop(proc)
        ready.unlink(missing_ok=True)


def latency_pair(direct: str, routed: str, body: bytes, n: int) -> dict[str, float]:
    """Alternate sequential requests on two keep-alive connections; ms percentiles."""
    conns = {k: http.client.HTTPConnection(u.removeprefix("http://"), timeout=30) for k, u in
             (("direct", direct), ("routed", routed))}  # fmt: skip
    times: dict[str, list[float]] = {"direct": [], "routed": []}
    headers = {"Content-Type": "application/json"}
    for i in range(n + 50):
        for key, conn in conns.items():
            t = time.perf_counter()
            conn.request("POST", "/v1/chat/completions", body, headers)
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200, resp.status
            if i >= 50:  # warm-up
                times[key].append((time.perf_counter() - t) * 1000)
    out = {}
    for key, ts in times.items():
        ts.sort()
        out[f"{key}_p50_ms"] = round(ts[len(ts) // 2], 3)
        out[f"{key}_p99_ms"] = round(ts[int(len(ts) * 0.99)], 3)
    out["added_p50_ms"] = round(out["routed_p50_ms"] - out["direct_p50_ms"], 3)
    out["added_p99_ms"] = round(out["routed_p99_ms"] - out["direct_p99_ms"], 3)
    return out


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wrk(url: str, body: bytes, seconds: int, conns: int, tmp: Path) -> float:
    script = tmp / "post.lua"
    script.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = {json.dumps(body.decode())}\n"
    )
    argv = pinned(CLIENT_CPU, ["wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "-s", str(script),
                               url + "/v1/chat/completions"])  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    if re.search(r"Non-2xx or 3xx responses: (\d+)", out):
        raise RuntimeError(f"wrk saw errors:\n{out}")
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    assert m, out
    return float(m.group(1))


def throughput(
    direct: str, routed: str, router_pid: int, body: bytes, seconds: int, tmp: Path
) -> dict[str, float]:
    d = wrk(direct, body, seconds, 64, tmp)
    cpu0, t0 = cpu_seconds(router_pid), time.monotonic()
    r = wrk(routed, body, seconds, 64, tmp)
    cores = (cpu_seconds(router_pid) - cpu0) / (time.monotonic() - t0)
    return {"direct_req_s": round(d), "routed_req_s": round(r), "router_cores_used": round(cores, 2),
            "routed_req_s_per_router_core": round(r / max(cores, 1e-9))}  # fmt: skip


def scenario(
    name: str,
    upstream: str,
    model: str,
    engine: str,
    args: argparse.Namespace,
    tmp: Path,
    src: Path | None = None,
) -> dict[str, Any]:
    body = json.dumps({**BODY, "model": model}).encode()
    with router(tmp, upstream, model, engine, src) as (url, pid):
        result: dict[str, Any] = {"c1": latency_pair(upstream, url, body, args.requests)}
        if shutil.which("wrk"):
            result["c64"] = throughput(upstream, url, pid, body, args.seconds, tmp)
        else:
            result["c64"] = "skipped: install wrk (apt install wrk)"
    print(name, json.dumps(result), file=sys.stderr, flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=2000, help="sequential requests per side at c=1")
    p.add_argument("--seconds", type=int, default=8, help="wrk duration per side at c=64")
    p.add_argument("--base", help="also measure the router of this commit (before/after)")
    p.add_argument("--rounds", type=int, default=1, help="fake-upstream rounds, alternating")
    args = p.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d, ExitStack() as stack:
        tmp = Path(d)
        trees: dict[str, Path | None] = {"": None}
        if args.base:
            trees = {f" ({args.base})": stack.enter_context(worktree(args.base, tmp)), "": None}
        port = free_port()
        fake = pinned(CLIENT_CPU, [sys.executable, str(REPO / "bench/fake_engine.py"), str(port)])
        with http_process(fake, f"http://127.0.0.1:{port}/health"):
            for round_ in range(args.rounds):
                for label, src in trees.items():
                    key = "fake_upstream" + label + (f" #{round_ + 1}" if args.rounds > 1 else "")
                    results[key] = scenario(
                        "fake" + label, f"http://127.0.0.1:{port}", "fake", "vllm", args, tmp, src
                    )
        port = free_port()
        sim = pinned(CLIENT_CPU, [str(BIN / "cgn-infer"), "serve", "--model", str(smollm2()), "--backend", "sim",
                                  "--speed", "1000", "--port", str(port), "--model-name", "sim",
                                  "--max-batch", "64"])  # fmt: skip
        with http_process(sim, f"http://127.0.0.1:{port}/health"):
            for label, src in trees.items():
                results["sim_engine" + label] = scenario(
                    "sim" + label, f"http://127.0.0.1:{port}", "sim", "cgn-infer", args, tmp, src
                )
    command = " ".join([".venv/bin/python bench/router_overhead.py", *sys.argv[1:]])
    write_result("router_overhead", command, results, render(results))


@contextmanager
def worktree(ref: str, tmp: Path) -> Iterator[Path]:
    path = tmp / "base"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), ref],
                   check=True, capture_output=True)  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
                       check=False, capture_output=True)  # fmt: skip


def render(r: dict[str, Any]) -> str:
    lines = [
        "| upstream | c=1 direct p50 / p99 ms | routed p50 / p99 ms | added p50 / p99 ms | "
        "c=64 direct req/s | routed req/s | router cores | req/s per router core |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for name, s in r.items():
        c1, c64 = s["c1"], s["c64"]
        tail = (f"{c64['direct_req_s']} | {c64['routed_req_s']} | {c64['router_cores_used']} | "
                f"{c64['routed_req_s_per_router_core']}") if isinstance(c64, dict) else f"{c64} | | |"  # fmt: skip
        lines.append(
            f"| {name} | {c1['direct_p50_ms']} / {c1['direct_p99_ms']} | {c1['routed_p50_ms']} / "
            f"{c1['routed_p99_ms']} | {c1['added_p50_ms']} / {c1['added_p99_ms']} | {tail} |"
        )
    rounds: dict[str, list[int]] = {}
    for name, s in r.items():
        if " #" in name and isinstance(s["c64"], dict):
            rounds.setdefault(name.split(" #")[0], []).append(
                s["c64"]["routed_req_s_per_router_core"]
            )
    if rounds:
        lines += ["", "| router | rounds | req/s per router core: median | min | max |",
                  "|---|---:|---:|---:|---:|"]  # fmt: skip
        paired = list(rounds.values())
        for name, rates in rounds.items():
            ordered = sorted(rates)
            lines.append(f"| {name} | {len(rates)} | {ordered[len(rates) // 2]} | {ordered[0]} | "
                         f"{ordered[-1]} |")  # fmt: skip
        if len(paired) == 2:  # --base: each round's routers ran back to back
            ratios = sorted(round(b / a, 2) for a, b in zip(*paired, strict=True))
            lines += ["", f"This tree / the base, round by round (sorted): {ratios}; median "
                          f"{ratios[len(ratios) // 2]}."]  # fmt: skip
    lines += [
        "",
        "Router pinned to CPU 0; upstream and load generator (wrk, or the c=1 client) on CPU 1.",
        "The sim engine answers a one-token request through its full HTTP, tokenizer and scheduler path.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
