"""The hostile inputs of hardening round 3 (#55), against the router before and after, in one run.

    .venv/bin/python bench/hardening.py --base REF [--seconds 4]

Each router (this tree's and, with --base, the one of commit REF, a git
worktree) serves a fake engine (bench/fake_engine.py) from a static config.
While one hostile input is sent, a probe client asks `GET /v1/models` on its
own keep-alive connection every 10 ms: the longest probe is the longest the
router's event loop was held (what every other client waited). Inputs:

* trickled_header: `POST ... X-Big: ` then 4 KiB of the value every 10 ms for
  --seconds (the value never ends): the answer (431 or none), the bytes sent
  before it, and the router's RSS growth.
* empty_arrays_15mb / empty_arrays_8mb: a body whose extra field is a list of
  five (2.7) million empty arrays; its status and the loop's stall.
* malformed_chunked: a chunk size that overflows 64 bits: the answer and how
  long it took (the old router waited out the 60 s body timeout; bounded here
  by --seconds, then "no answer").
* stopped_worker (`--workers 2`): one worker SIGSTOPped; how long until the
  supervisor replaces it, and how many of 16 new requests did not get an answer
  within 2 s in the --seconds after the stop.

Results: bench/results/hardening.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import peak_rss_mib, write_result
from bench.router_overhead import worktree
from cgn_core.etcd.local import free_port
from harness.procs import REPO, Router, cgn_router, http_process


class Probe:
    """`GET /v1/models` every 10 ms on one keep-alive connection, in a thread: the longest."""

    def __init__(self, url: str):
        self.host = url.removeprefix("http://")
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = http.client.HTTPConnection(self.host, timeout=60)
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                conn.request("GET", "/v1/models")
                conn.getresponse().read()
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection(self.host, timeout=60)
            self.longest = max(self.longest, time.perf_counter() - started)
            time.sleep(0.01)
        conn.close()

    def __enter__(self) -> Probe:
        self._thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(70)


def answer_of(sock: socket.socket, within_s: float) -> tuple[int | None, float]:
    """The status of the first answer on `sock` (None: none within `within_s`) and when."""
    started = time.monotonic()
    sock.settimeout(within_s)
    try:
        head = sock.recv(64)
    except OSError:
        return None, time.monotonic() - started
    parts = head.split(b" ")
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
    return status, time.monotonic() - started


def trickled_header(r: Router, seconds: float) -> dict[str, Any]:
    rss = peak_rss_mib(r.proc.pid, "VmRSS")
    host, port = r.url.removeprefix("http://").split(":")
    with Probe(r.url) as probe, socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent, deadline, status = 0, time.monotonic() + seconds, None
        sock.setblocking(False)
        while time.monotonic() < deadline:
            try:
                got = sock.recv(64)
                status = int(got.split(b" ")[1]) if got.startswith(b"HTTP/") else None
                break
            except BlockingIOError:
                pass
            with contextlib.suppress(OSError):  # BlockingIOError too: the router reads no more
                sent += sock.send(b"a" * 4096)
            time.sleep(0.01)
        grown = peak_rss_mib(r.proc.pid, "VmRSS") - rss
    return {"status": status, "bytes_sent": sent, "rss_growth_mib": round(grown, 1),
            "probe_longest_ms": round(probe.longest * 1000, 1)}  # fmt: skip


def empty_arrays(r: Router, count: int) -> dict[str, Any]:
    body = b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "x": ['
    body += b",".join([b"[]"] * count) + b"]}"
    with Probe(r.url) as probe:
        started = time.monotonic()
        resp = httpx.post(r.url + "/v1/chat/completions", content=body, timeout=120)
        took = time.monotonic() - started
    return {"body_mb": round(len(body) / 1e6, 1), "status": resp.status_code,
            "answered_in_s": round(took, 2), "probe_longest_ms": round(probe.longest * 1000, 1)}  # fmt: skip


def malformed_chunked(r: Router, seconds: float) -> dict[str, Any]:
    host, port = r.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFFFFFF\r\nabc")  # fmt: skip
        status, took = answer_of(sock, seconds)
    return {"status": status, "answered_in_s": round(took, 2) if status else f"none in {seconds} s"}


def stopped_worker(r: Router, seconds: float) -> dict[str, Any]:
    doc = httpx.get(r.admin + "/healthz", timeout=10).json()
    victim = doc["workers"][1]
    os.kill(victim["pid"], signal.SIGSTOP)
    stopped = time.monotonic()
    replaced_s: float | None = None
    hung = 0
    try:
        for _ in range(16):
            try:
                httpx.get(r.url + "/v1/models", timeout=2.0)
            except httpx.HTTPError:
                hung += 1
            if replaced_s is None:
                workers = httpx.get(r.admin + "/healthz", timeout=10).json()["workers"]
                if workers[1].get("hangs", 0) > victim.get("hangs", 0):
                    replaced_s = time.monotonic() - stopped
            if time.monotonic() - stopped > seconds:
                break
        while replaced_s is None and time.monotonic() - stopped < seconds:
            workers = httpx.get(r.admin + "/healthz", timeout=10).json()["workers"]
            if workers[1].get("hangs", 0) > victim.get("hangs", 0):
                replaced_s = time.monotonic() - stopped
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):  # replaced: the supervisor killed it
            os.kill(victim["pid"], signal.SIGCONT)
    return {"replaced_after_s": round(replaced_s, 2) if replaced_s else f"not in {seconds} s",
            "requests_without_answer_in_2s": hung}  # fmt: skip


@contextmanager
def routed(tmp: Path, upstream: str, src: Path | None, workers: int) -> Iterator[Router]:
    config = {"discovery": "static", "log": {"level": "warning"}, "workers": workers,
              "endpoints": {"e": {"url": upstream, "model": "fake", "engine": "vllm"}}}  # fmt: skip
    with cgn_router(tmp, config, src=src) as r:
        yield r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", help="also measure the router of this commit (before/after)")
    p.add_argument("--seconds", type=float, default=4.0, help="how long each input is tried")
    args = p.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d, ExitStack() as stack:
        tmp = Path(d)
        trees: dict[str, Path | None] = {"after": None}
        if args.base:
            trees = {f"before ({args.base})": stack.enter_context(worktree(args.base, tmp)),
                     "after": None}  # fmt: skip
        port = free_port()
        fake = [sys.executable, str(REPO / "bench/fake_engine.py"), str(port)]
        upstream = f"http://127.0.0.1:{port}"
        with http_process(fake, upstream + "/health"):
            for label, src in trees.items():
                out: dict[str, Any] = {}
                with routed(tmp, upstream, src, 1) as r:
                    out["trickled_header"] = trickled_header(r, args.seconds)
                    out["empty_arrays_15mb"] = empty_arrays(r, 5_000_000)
                    out["empty_arrays_8mb"] = empty_arrays(r, 2_700_000)
                    out["malformed_chunked"] = malformed_chunked(r, args.seconds)
                with routed(tmp, upstream, src, 2) as r:
                    out["stopped_worker"] = stopped_worker(r, args.seconds)
                print(label, json.dumps(out), file=sys.stderr, flush=True)
                results[label] = out
    command = " ".join([".venv/bin/python bench/hardening.py", *sys.argv[1:]])
    write_result("hardening", command, results, render(results))


def render(r: dict[str, Any]) -> str:
    lines = ["| input | measure | " + " | ".join(r) + " |", "|---|---|" + "---|" * len(r)]
    first = next(iter(r.values()))
    for case, measures in first.items():
        for measure in measures:
            cells = [str(r[label][case].get(measure, "")) for label in r]
            lines.append(f"| {case} | {measure} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "probe_longest_ms: the longest `GET /v1/models` of a client asking every 10 ms meanwhile",
        "(the router's event loop held that long). One worker, except stopped_worker (two).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
