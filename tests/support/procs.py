"""Start and stop real server processes for tests: port 0, readiness, SIGTERM, only our pids."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from cgn_core.bundled_models import smollm2
from cgn_core.etcd.local import free_port
from cgn_core.process import stop_group
from cgn_core.readiness import wait_ready_file

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


stop = stop_group  # SIGTERM our process group, SIGKILL after a grace period


def wait_http_ok(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy within {timeout_s}s")
        time.sleep(0.1)


@contextmanager
def cgn_infer(tmp: Path, *args: str, model: Path | None = None) -> Iterator[str]:
    """A real `cgn-infer serve` on a free port; yields its base URL."""
    with cgn_infer_fleet(tmp, 1, *args, model=model) as urls:
        yield urls[0]


@contextmanager
def cgn_infer_fleet(
    tmp: Path, n: int, *args: str, model: Path | None = None
) -> Iterator[list[str]]:
    """`n` real `cgn-infer serve` processes started together; yields their base URLs."""
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    with ExitStack() as stack:
        for _ in range(n):
            ready = tmp / f"infer-{time.monotonic_ns()}.ready"
            log = stack.enter_context((tmp / f"{ready.name}.log").open("wb"))
            argv = [str(BIN / "cgn-infer"), "serve", "--model", str(model or smollm2()),
                    "--port", "0", "--threads", "2", "--ready-file", str(ready), *args]  # fmt: skip
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            stack.callback(stop, proc)
            procs.append((proc, ready))
        urls = []
        for proc, ready in procs:
            port = wait_ready_file(ready, timeout_s=180, proc=proc)["ports"]["http"]
            urls.append(f"http://127.0.0.1:{port}")
        yield urls


@contextmanager
def llamacpp(model: Path, *, parallel: int = 1, ctx: int = 4096, threads: int = 2) -> Iterator[str]:
    """llama.cpp's server (xllamacpp) on a free port; yields its base URL once /health is 200."""
    port = free_port()
    argv = [sys.executable, str(REPO / "tests/support/llamacpp_server.py"), str(model), str(port),
            str(threads), str(parallel), str(ctx)]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", proc, timeout_s=180)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def post(url: str, body: dict[str, object], timeout_s: float = 120) -> dict[str, object]:
    """POST JSON, return JSON (reference-engine calls in tests and benchmarks)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        doc: dict[str, object] = json.load(resp)
        return doc
