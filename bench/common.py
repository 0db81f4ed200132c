"""Shared helpers for benchmarks: engines as real processes, timing over HTTP, result files."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from cgn_core import keys
from cgn_core.apikeys import create
from cgn_core.etcd.local import LocalEtcd, free_port
from harness.procs import REPO, etcd_put, stop, wait_http_ok

RESULTS = REPO / "bench" / "results"


def peak_rss_mib(pid: int, field: str = "VmHWM") -> float:
    """VmHWM (peak resident set) of a live process, MiB; `field="VmRSS"`: the current one."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


@contextmanager
def engine(
    kind: str,
    model: Path,
    threads: int,
    *extra: str,
    parallel: int = 1,
    ctx: int = 4096,
    env: dict[str, str] | None = None,
) -> Iterator[dict[str, Any]]:
    """Start `cgn-infer` or llama.cpp (xllamacpp) on a free port; yields url, pid, load_s.
    llama.cpp gets `ctx` tokens per parallel slot, and cgn-infer a KV pool of the same token
    capacity unless `extra` sets one. `env` is added to this process's environment."""
    port = free_port()
    if kind == "llama.cpp":
        argv = [sys.executable, "-m", "cgn_agent.launchers.xllamacpp_server", "--model", str(model),
                "--port", str(port), "--threads", str(threads), "--parallel", str(parallel),
                "--ctx", str(ctx)]  # fmt: skip
    else:
        argv = [str(Path(sys.executable).parent / "cgn-infer"), "serve", "--model", str(model),
                "--port", str(port), "--threads", str(threads), "--ctx", str(ctx), *extra]  # fmt: skip
        if "--kv-pool-tokens" not in extra:
            argv += ["--kv-pool-tokens", str(ctx * parallel)]
    start = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(url + "/health", proc, timeout_s=300)
        yield {"url": url, "pid": proc.pid, "load_s": time.monotonic() - start}
    finally:
        stop(proc)


@contextmanager
def private_etcd(tmp: Path) -> Iterator[LocalEtcd]:
    """An etcd of the benchmark's own under `tmp`, stopped after."""
    etcd = LocalEtcd(tmp / "etcd")
    etcd.start()
    try:
        yield etcd
    finally:
        etcd.stop()


def put_key(etcd: LocalEtcd, tenant: str, band: str = "gold", **fields: Any) -> str:
    """A new API key of `tenant` stored in `etcd` (`fields`: `apikeys.create`'s, such as
    `kv_share_group` or `weight`); the key itself, for the client."""
    key, record = create(tenant, band, **fields)
    etcd_put(etcd.endpoint, keys.API_KEYS + record.id, record.to_json())
    return key


def until_served(url: str, key: str, model: str, timeout_s: float = 30.0) -> None:
    """Wait until the router at `url` serves `key` a one-token answer of `model` (the key
    and the endpoint reach it through etcd's watch, each worker on its own)."""
    body = {"model": model, "prompt": "hi", "max_tokens": 1}
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.post(url + "/v1/completions", json=body, timeout=30,
                       headers={"Authorization": f"Bearer {key}"})  # fmt: skip
        if r.status_code == 200:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"not served within {timeout_s:g} s: {r.status_code} {r.text[:200]}")
        time.sleep(0.2)


def model_id(url: str) -> str:
    return str(httpx.get(url + "/v1/models").json()["data"][0]["id"])


def stream_completion(
    client: httpx.Client, url: str, body: dict[str, Any]
) -> tuple[float, list[float]]:
    """POST a streaming completion; returns (time to first token, arrival time of each token)."""
    start = time.perf_counter()
    stamps: list[float] = []
    with client.stream(
        "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=600
    ) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                doc = json.loads(line[6:])
                if doc.get("choices") and doc["choices"][0].get("text"):
                    stamps.append(time.perf_counter() - start)
    return (stamps[0] if stamps else float("nan")), stamps


def write_result(name: str, command: str, data: dict[str, Any], table: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": _machine()}
    (RESULTS / f"{name}.json").write_text(json.dumps({**meta, "results": data}, indent=1) + "\n")
    (RESULTS / f"{name}.md").write_text(
        f"# {name}\n\nCommand: `{command}`  \nDate: {meta['date']}  \nMachine: {meta['machine']}\n\n{table}\n"
    )


def _machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, Python {platform.python_version()}"
