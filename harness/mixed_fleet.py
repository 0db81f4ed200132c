"""A mixed fleet on this machine for tests and benchmarks: `cgn-ctl up --engines
cgn_infer,llama_cpp,mlx_lm` from the development venv (etcd, router, one agent per engine,
cgn-metrics, SmolLM2 on each engine), on free ports, stopped with `cgn-ctl down`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cgn_core import keys
from harness.procs import etcd_run

ENGINES = ("cgn_infer", "llama_cpp", "mlx_lm")  # in profile order
BIN = Path(sys.executable).parent


def engine_of_node(node: str) -> str:
    """The engine a node of this fleet offers (up names them <host>-<engine>)."""
    return next(e for e in ENGINES if node.endswith("-" + e.replace("_", "-")))


def _ctl(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    return subprocess.run(
        [str(BIN / "cgn-ctl"), *args], env=env, capture_output=True, text=True, timeout=timeout_s
    )


@contextmanager
def mixed_fleet(state: Path, timeout_s: float = 600) -> Iterator[dict[str, Any]]:
    """The fleet, up (engines on one thread each, no KV store); yields up's record (url, key,
    model, etcd, nodes, dashboard, ...) with `state`; `cgn-ctl down` after, whatever happened."""
    ports = ["--port", "0", "--admin-port", "0", "--agent-port", "0", "--metrics-port", "0"]
    try:
        # NOTE: --insecure: tests and the bench read etcd and the engines directly; the TLS
        # path of `up` is tests/test_install.py's and tests/test_up_join.py's
        up = _ctl("up", "--engines", ",".join(ENGINES), "--state-dir", str(state), *ports,
                  "--etcd-port", "0", "--kv-ram-gib", "0", "--threads", "1", "--insecure",
                  timeout_s=timeout_s)  # fmt: skip
        if up.returncode:
            raise RuntimeError(f"cgn-ctl up failed: {up.stderr[-3000:]}")
        yield json.loads((state / "up.json").read_text()) | {"state": state}
    finally:
        _ctl("down", "--state-dir", str(state), timeout_s=120)


def endpoint_records(etcd: str) -> dict[str, dict[str, Any]]:
    """Each engine's endpoint record as its agent published it (url, api_token, ...), with
    the node it runs on."""

    async def read(c: Any) -> dict[str, dict[str, Any]]:
        kvs, _ = await c.get_prefix(keys.ENDPOINTS)
        out = {}
        for kv in kvs:
            node = kv.key.split("/")[-3]
            out[engine_of_node(node)] = json.loads(kv.value) | {"node": node}
        return out

    return etcd_run(etcd, read)
