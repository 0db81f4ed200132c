"""What TLS by default costs the newcomer (#65): `cgn-ctl up` (TLS: a CA, certificates, etcd
with client certificates and RBAC, mutual TLS) against `cgn-ctl up --insecure` on the same
machine, alternated, each from an empty state dir to a served completion; then the time from
`cgn-ctl up --join` on a second host (a network namespace) to its node Ready.

    .venv/bin/python -m bench.up_tls [--rounds 3]

Needs root (the namespace) for the join figure; the rest runs anywhere. The install itself
is the same for both modes and is not timed here (tests/test_install.py prints it).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import write_result
from harness import netns

CTL = str(Path(sys.executable).parent / "cgn-ctl")
PORTS = ["--port", "0", "--admin-port", "0", "--agent-port", "0", "--etcd-port", "0",
         "--metrics-port", "0", "--threads", "1"]  # fmt: skip


def ctl(state: Path, *args: str, ns: str = "") -> subprocess.CompletedProcess[str]:
    prefix = ["ip", "netns", "exec", ns] if ns else []
    env = {**os.environ, "CGN_CTL_STATE_DIR": str(state)}
    return subprocess.run([*prefix, CTL, *args], capture_output=True, text=True, timeout=600,
                          env=env)  # fmt: skip


def timed_up(state: Path, *extra: str) -> float:
    """Seconds from `cgn-ctl up` to its return (a completion served), then `down`."""
    started = time.monotonic()
    res = ctl(state, "up", *PORTS, *extra)
    took = time.monotonic() - started
    ctl(state, "down")
    if res.returncode:
        raise SystemExit(f"up {' '.join(extra)} failed: {res.stderr[-2000:]}")
    return took


def join_seconds(tmp: Path) -> float | None:
    """Seconds from `up --join` on host B to B's node Ready; None without namespaces."""
    try:
        with netns.other_host() as (ns, _there, here):
            a, b = tmp / "join-a", tmp / "join-b"
            try:
                up = ctl(a, "up", "--listen", here, *PORTS)
                if up.returncode:
                    raise SystemExit(f"up --listen failed: {up.stderr[-2000:]}")
                [line] = [x for x in up.stdout.splitlines() if x.startswith("cgn-ctl up --join")]
                started = time.monotonic()
                joined = ctl(b, *line.split()[1:], "--node-id", "bench-b", "--threads", "1", ns=ns)
                if joined.returncode:
                    raise SystemExit(f"up --join failed: {joined.stderr[-2000:]}")
                while time.monotonic() - started < 120:
                    shown = json.loads(ctl(a, "nodes", "--json").stdout)
                    if any(n["node"] == "bench-b" and n["state"] == "ready" for n in shown):
                        return time.monotonic() - started
                    time.sleep(0.1)
                raise SystemExit("the joined node was not Ready within 120 s")
            finally:
                ctl(b, "down", ns=ns)
                ctl(a, "down")
    except netns.NetnsUnavailable as exc:
        print(f"no join figure: {exc}", file=sys.stderr)
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="up runs per mode (alternated)")
    args = ap.parse_args()
    command = shlex.join(["python", "-m", "bench.up_tls", *sys.argv[1:]])
    runs: dict[str, list[float]] = {"tls": [], "insecure": []}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for i in range(args.rounds):
            for mode, extra in (("tls", ()), ("insecure", ("--insecure",))):
                runs[mode].append(timed_up(tmp / f"{mode}-{i}", *extra))
                print(f"round {i} {mode}: {runs[mode][-1]:.1f}s", file=sys.stderr)
        join_s = join_seconds(tmp)
    tls, plain = statistics.median(runs["tls"]), statistics.median(runs["insecure"])
    table = [
        "| | median s | runs (s) |",
        "|---|---|---|",
        f"| `cgn-ctl up` (TLS) | {tls:.1f} | {', '.join(f'{x:.1f}' for x in runs['tls'])} |",
        f"| `cgn-ctl up --insecure` | {plain:.1f} | "
        f"{', '.join(f'{x:.1f}' for x in runs['insecure'])} |",
        "",
        f"TLS / insecure: **{tls / plain:.2f}×** (target ≤ 1.3×).",
        "",
        f"`up --join` to the node Ready on a second host: **{join_s:.1f} s** (target ≤ 30 s)."
        if join_s is not None
        else "`up --join`: not measured (no network namespaces here).",
    ]
    data = {"runs": runs, "ratio": tls / plain, "join_s": join_s}
    write_result("up_tls", command, data, "\n".join(table))
    print("\n".join(table))


if __name__ == "__main__":
    main()
