"""A device check for a machine with NVIDIA GPUs (#62): the real vLLM under Cognitora.

    sh scripts/gpu-check.sh --model /models/Qwen2.5-0.5B-Instruct [--timeout 540]

Brings up a one-machine cluster (`cgn-ctl up --insecure`, its own state dir and ports),
declares MODEL (a Hugging Face model directory vLLM loads, or a GGUF file with
`--tokenizer`) on one GPU under vLLM, and checks, in order:

    nvidia-smi       the GPUs and their compute capability, as the driver reports them
    vllm             the package imports, its version
    inventory        the agent saw every GPU, with a class and no health problem
    placement        the reconciler placed the replica on a GPU, and it went Ready
    streamed answer  a chat completion streamed through the router, with an API key
    metrics          the router reads vLLM's /metrics in its vocabulary (running,
                     waiting, KV usage)
    kv events        whether the router follows the replica's KV exactly or estimates it
    drain            `cgn-ctl drain` stops the replica, and nothing is left running

then prints one table and stops everything it started. Exit status 0 when every check
passed, 1 when one failed, 2 when the machine cannot run the check (no GPU, no vLLM).
Under 10 minutes on a machine whose model loads in 5. The pure parts (arguments, the
verdicts, the table) run in the CPU suite: tests/test_gpu_check.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
MODEL = "gpu-check"


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool | None  # None: informational, neither passed nor failed
    detail: str
    seconds: float = 0.0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpu-check.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a HF model directory (or GGUF file)")
    ap.add_argument("--tokenizer", default="", help="for a GGUF model: its HF tokenizer dir")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds for the whole check")
    ap.add_argument("--state-dir", type=Path, default=None, help="default: a temporary one")
    ap.add_argument("--port-base", type=int, default=18080, help="the cluster's first port")
    a = ap.parse_args(argv)
    if not 60 <= a.timeout <= 3600:
        ap.error("--timeout must be in [60, 3600] seconds")
    if not 1024 <= a.port_base <= 65000:
        ap.error("--port-base must be in [1024, 65000]")
    return a


# ---- verdicts (pure: what a command printed -> a Check) ----------------------------------


def gpus(csv: str) -> Check:
    """`nvidia-smi --query-gpu=index,name,compute_cap --format=csv,noheader`'s lines."""
    rows = [[c.strip() for c in line.split(",")] for line in csv.strip().splitlines() if line]
    found = [r for r in rows if len(r) == 3 and r[0].isdigit()]
    if not found:
        return Check("nvidia-smi", False, "no GPU listed")
    listed = "; ".join(f"{i}: {name} (sm {cap})" for i, name, cap in found)
    return Check("nvidia-smi", True, listed)


def inventory(doc: Mapping[str, Any], expected: int) -> Check:
    """The agent's /inventory: every GPU nvidia-smi listed, each with a class, none sick."""
    accels = [a for a in doc.get("accelerators", []) if a.get("accel_class", "cpu") != "cpu"]
    if len(accels) != expected:
        return Check("inventory", False, f"{len(accels)} GPU(s) seen, nvidia-smi lists {expected}")
    sick = [f"{a.get('index')}: {'; '.join(a['health'])}" for a in accels if a.get("health")]
    if sick:
        return Check("inventory", False, "unhealthy: " + ", ".join(sick))
    kinds = sorted({f"{a.get('accel_class')} (sm {a.get('compute_capability') or '?'})"
                    for a in accels})  # fmt: skip
    engines = ", ".join(doc.get("engines", [])) or "none"
    return Check("inventory", True, f"{len(accels)} x {', '.join(kinds)}; engines {engines}")


def placement(replicas: list[Mapping[str, Any]]) -> Check:
    """`cgn-ctl replicas --model gpu-check --json`: one vLLM replica on a GPU, Ready."""
    mine = [r for r in replicas if r.get("engine") == "vllm"]
    if not mine:
        return Check("placement", False, "no vLLM replica placed")
    r = mine[0]
    where = f"{r.get('replica')} on {r.get('node')} devices {r.get('devices')}"
    if r.get("phase") != "Ready":
        return Check("placement", False, f"{where}: {r.get('phase')} {r.get('reason') or ''}")
    return Check("placement", True, where)


def streamed(events: list[str]) -> Check:
    """The `data:` lines of a streamed chat completion."""
    text = []
    for line in events:
        if line == "[DONE]":
            continue
        try:
            chunk = json.loads(line)
        except ValueError:
            return Check("streamed answer", False, f"not JSON: {line[:80]!r}")
        for choice in chunk.get("choices") or []:
            text.append((choice.get("delta") or {}).get("content") or "")
    if not events or events[-1] != "[DONE]":
        return Check("streamed answer", False, "the stream did not end with [DONE]")
    said = "".join(text)
    if not said:
        return Check("streamed answer", False, "no text in the stream")
    return Check("streamed answer", True, f"{len(events) - 1} chunks: {said[:40]!r}")


def metrics(endpoint: Mapping[str, Any]) -> Check:
    """The router's /endpoints entry for the replica: its load read from vLLM's metrics."""
    load = endpoint.get("load")
    if endpoint.get("scrape_error") or not isinstance(load, Mapping):
        return Check("metrics", False, endpoint.get("scrape_error") or "no load figures")
    figures = ", ".join(f"{k} {load.get(k)}" for k in ("running", "waiting", "kv_usage"))
    return Check("metrics", True, f"{endpoint.get('engine')}: {figures}")


def kv_events(endpoint: Mapping[str, Any]) -> Check:
    """Informational: exact (KV events followed) or approximate (the router's own estimate)."""
    tracking = endpoint.get("kv_tracking", "?")
    blocks = endpoint.get("kv_blocks") or {}
    return Check("kv events", None, f"{tracking}: {blocks.get('exact', 0)} exact, "
                 f"{blocks.get('assumed', 0)} assumed blocks")  # fmt: skip


def drained(replicas: list[Mapping[str, Any]], engines_left: int) -> Check:
    if replicas:
        return Check("drain", False, f"still placed: {[r.get('replica') for r in replicas]}")
    if engines_left:
        return Check("drain", False, f"{engines_left} vLLM process(es) left running")
    return Check("drain", True, "the replica stopped; no vLLM process left")


def model_doc(source: str, tokenizer: str, accel: str) -> dict[str, Any]:
    """The catalog entry the check declares: MODEL on one GPU of class `accel` under vLLM."""
    doc: dict[str, Any] = {
        "name": MODEL,
        "source": source,
        "replicas": {"min": 1},
        "profiles": [{"engine": "vllm", "accelerator": accel, "devices": 1, "ctx": 2048}],
    }
    if tokenizer:
        doc["tokenizer"] = tokenizer
    return doc


def table(checks: Sequence[Check]) -> str:
    mark = {True: "ok", False: "FAIL", None: "info"}
    width = max(len(c.name) for c in checks) if checks else 5
    rows = [f"{'check':<{width}}  result  seconds  detail"]
    rows += [f"{c.name:<{width}}  {mark[c.ok]:<6}  {c.seconds:7.1f}  {c.detail}" for c in checks]
    return "\n".join(rows)


def verdict(checks: Sequence[Check]) -> int:
    return 1 if any(c.ok is False for c in checks) else 0


# ---- the run (needs the GPU machine) ------------------------------------------------------


def _run(argv: list[str], timeout: float, env: Mapping[str, str] | None = None) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])}: exit {out.returncode}: {out.stderr[-300:]}")
    return out.stdout


def _get(url: str, key: str = "") -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def _until(what: str, probe: Callable[[], Any], deadline: float) -> Any:
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within the time left: {what}")
        time.sleep(2)


def main(argv: Sequence[str]) -> int:
    a = parse_args(argv)
    if shutil.which("nvidia-smi") is None:
        print("gpu-check: no nvidia-smi on this machine: it needs an NVIDIA GPU", file=sys.stderr)
        return 2
    deadline = time.monotonic() + a.timeout
    state = a.state_dir or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    ctl = str(BIN / "cgn-ctl")
    env = {**os.environ, "CGN_CTL_STATE_DIR": str(state)}
    checks: list[Check] = []

    def step(name: str, fn: Callable[[], Check]) -> bool:
        started = time.monotonic()
        try:
            got = fn()
        except (RuntimeError, TimeoutError, OSError, ValueError, KeyError) as exc:
            got = Check(name, False, f"{type(exc).__name__}: {exc}"[:300])
        checks.append(Check(got.name, got.ok, got.detail, time.monotonic() - started))
        return got.ok is not False

    smi = _run(["nvidia-smi", "--query-gpu=index,name,compute_cap", "--format=csv,noheader"], 30)
    if not step("nvidia-smi", lambda: gpus(smi)):
        print(table(checks))
        return 2
    expected = len([x for x in smi.splitlines() if x.strip()])
    version = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    said = version.stdout.strip() or version.stderr[-200:]
    if not step("vllm", lambda: Check("vllm", version.returncode == 0, said)):
        print(table(checks))
        return 2
    p = a.port_base
    # plaintext, on its own ports; the control plane's own replica is the bundled model
    up = [ctl, "up", "--insecure", "--state-dir", str(state), "--port", str(p),
          "--admin-port", str(p + 1), "--agent-port", str(p + 2), "--etcd-port", str(p + 3),
          "--metrics-port", str(p + 4)]  # fmt: skip
    try:
        _run(up, max(60.0, deadline - time.monotonic()), env)
        record = json.loads((state / "up.json").read_text())
        router, admin, key = record["url"], record["router_admin"], record["key"]
        found = _get(record["agent_admin"] + "/inventory")
        step("inventory", lambda: inventory(found, expected))
        accel = next(a["accel_class"] for a in found["accelerators"] if a["accel_class"] != "cpu")
        spec = state / "model.yaml"
        spec.write_text(json.dumps(model_doc(a.model, a.tokenizer, accel)))
        _run([ctl, "models", "apply", "-f", str(spec)], 60, env)

        def listed() -> list[Any]:
            return list(json.loads(_run([ctl, "replicas", "--model", MODEL, "--json"], 60, env)))

        def ready() -> list[Any] | None:
            rows = listed()
            return rows if rows and rows[0].get("phase") in ("Ready", "Failed") else None

        step("placement", lambda: placement(_until("the replica Ready", ready, deadline)))
        step("streamed answer", lambda: streamed(_stream(router, key)))
        eps = [e for e in _get(admin + "/endpoints")["endpoints"] if e["model"] == MODEL]
        step("metrics", lambda: metrics(eps[0]) if eps else Check("metrics", False, "no endpoint"))
        if eps:
            step("kv events", lambda: kv_events(eps[0]))
        _run([ctl, "drain", record["node"], "--grace", "30"], 180, env)
        _until("the replica gone", lambda: not listed(), deadline)
        step("drain", lambda: drained(listed(), _vllm_left()))
    except (RuntimeError, TimeoutError, OSError, ValueError, KeyError) as exc:
        checks.append(Check("cluster", False, f"{type(exc).__name__}: {exc}"[:300]))
    finally:
        subprocess.run([ctl, "down", "--state-dir", str(state)], capture_output=True, timeout=120)
    print(table(checks))
    return verdict(checks)


def _stream(router: str, key: str) -> list[str]:
    ask = [{"role": "user", "content": "Say hello."}]
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": 16, "messages": ask})
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    req = urllib.request.Request(router + "/v1/chat/completions", body.encode(), headers)
    with urllib.request.urlopen(req, timeout=120) as resp:
        lines = [raw.decode().strip() for raw in resp]
    return [line[6:] for line in lines if line.startswith("data: ")]


def _vllm_left() -> int:
    out = subprocess.run(["pgrep", "-f", "vllm serve"], capture_output=True, text=True)
    return len(out.stdout.split())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
