"""cgn-operator run: the real kopf operator loop against kmock and a real etcd, the Lease
hand-over between two candidates, the command line and its credentials. (CRDs, rendered
children, status and manifests as pure functions: test_operator.py.)

What is not tested here, because no kube-apiserver runs on these machines: schema
validation by a real API server, server-side apply's field ownership, the garbage
collector deleting children by owner reference, RBAC enforcement (docs/kubernetes.md).
"""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import kopf
import pytest
import yaml

from cgn_control import store
from cgn_control.decide.catalog import parse_model
from cgn_core import keys, pki
from cgn_core.errors import ConfigError
from cgn_core.etcd import EtcdClient
from cgn_core.etcd.local import LocalEtcd
from cgn_core.settings import EtcdSettings
from cgn_ctl import cluster_ops as ctl_ops
from cgn_operator import lease
from cgn_operator.crds import API_VERSION, CLUSTER, MODEL
from cgn_operator.run import start
from cgn_operator.settings import OperatorSettings
from cgn_operator.state import State
from harness.kube import kubeconfig, serve, wait_for

from .conftest import REPO

pytestmark = pytest.mark.slow  # real multi-process runs: not in the fast loop


def test_manifests_command_prints_what_kubectl_takes(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "cgn-operator"
    res = subprocess.run(
        [exe, "manifests", "--image", "reg/cgn:2"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    docs = list(yaml.safe_load_all(res.stdout))
    assert [d["kind"] for d in docs].count("CustomResourceDefinition") == 2
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    assert deploy["spec"]["template"]["spec"]["containers"][0]["image"] == "reg/cgn:2"
    res = subprocess.run(
        [exe, "run", "--kubeconfig", "/nonexistent"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "/nonexistent" in res.stderr
    bad_pem = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
               "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:1",
                                                     "certificate-authority-data": "!!notbase64"}}],
               "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
               "users": [{"name": "u", "user": {"token": "t"}}]}  # fmt: skip
    for text in ("x: [\n", "clusters: 3\n", yaml.safe_dump(bad_pem)):
        bad = tmp_path / "kubeconfig"
        bad.write_text(text)
        res = subprocess.run([exe, "run", "--kubeconfig", bad], capture_output=True, text=True,
                             timeout=60)  # fmt: skip
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
        assert "Traceback" not in res.stderr
        assert "not a usable kubeconfig" in res.stderr or "TLS material" in res.stderr


# ---- the operator loop: kopf against kmock, a real etcd --------------------------------------


class Api:
    def __init__(self, session: aiohttp.ClientSession):
        self.s = session

    @staticmethod
    def path(plural: str, name: str = "", ns: str = "ns1") -> str:
        return f"/apis/{API_VERSION}/namespaces/{ns}/{plural}" + (f"/{name}" if name else "")

    async def create(self, plural: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.s.post(self.path(plural, ns=body["metadata"]["namespace"]), json=body) as r:
            assert r.status < 300, await r.text()
            return dict(await r.json())

    async def patch(self, plural: str, name: str, body: dict[str, Any]) -> None:
        async with self.s.patch(self.path(plural, name), json=body) as r:
            assert r.status < 300, await r.text()

    async def delete(self, plural: str, name: str) -> None:
        async with self.s.delete(self.path(plural, name)) as r:
            assert r.status < 300, await r.text()

    async def get(self, path: str) -> dict[str, Any] | None:
        async with self.s.get(path) as r:
            return None if r.status == 404 else dict(await r.json())


def _model(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "CognitoraModel",
        "metadata": {"name": name, "namespace": "ns1"},
        "spec": spec,
    }


def _cluster(name: str, ns: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "CognitoraCluster",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }


def _cond(body: dict[str, Any] | None, kind: str = "Ready") -> dict[str, Any]:
    for c in ((body or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return dict(c)
    return {}


async def test_operator_loop_against_kmock_and_etcd(tmp_path: Path, etcd_server: LocalEtcd) -> None:
    """Create a cluster and models, see the children and catalog entries appear; change the
    spec and see both follow; an invalid model gets its field path in status and an Event;
    a fallback to a model that comes later is mended by the resync; deleting a model
    deletes its entry, also one whose deletion the operator never saw (the sweep); an entry
    applied by hand is never taken over; no object ever carries a finalizer."""
    settings = EtcdSettings(endpoints=(etcd_server.endpoint,))
    async with serve() as (emu, url), EtcdClient(settings) as etcd, aiohttp.ClientSession(url) as s:
        await etcd.delete(keys.CATALOG, prefix=True)
        await etcd.delete(store.OWNERS, prefix=True)
        os.environ["KUBECONFIG"] = str(kubeconfig(tmp_path / "kc", url))
        api = Api(s)

        async def entry(name: str) -> Any:
            return await etcd.get_json(keys.CATALOG + name)

        async def model(name: str) -> dict[str, Any] | None:
            return await api.get(api.path(MODEL.plural, name))

        stop, ready = asyncio.Event(), asyncio.Event()
        state = State(OperatorSettings(namespace="", standalone=True, resync_s=1.0))
        task = asyncio.create_task(start(state, stop_flag=stop, ready_flag=ready))
        await asyncio.wait_for(ready.wait(), 20)
        try:
            await api.create(
                CLUSTER.plural,
                _cluster(
                    "c1",
                    "ns1",
                    {"etcd": {"endpoints": [etcd_server.endpoint]}, "router": {"replicas": 1}},
                ),
            )
            router = "/apis/apps/v1/namespaces/ns1/deployments/c1-router"
            for child in (
                router,
                "/api/v1/namespaces/ns1/configmaps/c1-config",
                "/apis/apps/v1/namespaces/ns1/daemonsets/c1-agent",
                "/api/v1/namespaces/ns1/services/c1-router",
            ):
                await wait_for(child, lambda: api.get(child))  # noqa: B023

            spec = yaml.safe_load((REPO / "configs/models/smollm2.yaml").read_text())
            spec.pop("name")
            await api.create(MODEL.plural, _model("smollm2", spec))
            doc = await wait_for("the catalog entry", lambda: entry("smollm2"))
            assert doc == parse_model({"name": "smollm2", **spec}).to_json()
            await wait_for("status", lambda: _cond_async(model, "smollm2", "ReplicasNotReady"))

            # spec changes follow: the catalog entry and the router Deployment
            await api.patch(MODEL.plural, "smollm2", {"spec": {"replicas": {"min": 2, "max": 2}}})
            await wait_for(
                "the new replicas",
                lambda: _field(entry, "smollm2", "replicas", {"min": 2, "max": 2}),
            )
            await api.patch(CLUSTER.plural, "c1", {"spec": {"router": {"replicas": 3}}})
            await wait_for("3 routers", lambda: _replicas(api, router, 3))

            # an invalid model: nothing written, the field path in status and in an Event
            bad = _model(
                "broken",
                {
                    "source": "x",
                    "profiles": [{"engine": "cgn_infer", "accelerator": "cpu", "devices": 2}],
                },
            )
            await api.create(MODEL.plural, bad)
            cond = await wait_for(
                "InvalidSpec", lambda: _cond_async(model, "broken", "InvalidSpec")
            )
            assert cond["message"].startswith("spec.profiles[0].devices: a cpu profile takes no")
            assert await entry("broken") is None
            events = await api.get("/api/v1/namespaces/ns1/events")
            assert any(
                e["reason"] == "InvalidSpec" and "profiles[0].devices" in e["message"]
                for e in (events or {}).get("items", [])
            )

            # hostile bodies the schema would have stopped: one line in status, nothing written
            await api.create(MODEL.plural, _model("junk", ["not", "a", "mapping"]))  # type: ignore[arg-type]
            junk = await wait_for("junk", lambda: _cond_async(model, "junk", "InvalidSpec"))
            assert junk["message"] == "spec: expected a mapping (the catalog's model fields)"
            assert await entry("junk") is None

            # a fallback named before its model exists: refused, then mended by the resync
            await api.create(
                MODEL.plural,
                _model(
                    "big",
                    {"source": "x", "fallbacks": ["later"], "profiles": [{"engine": "cgn_infer"}]},
                ),
            )
            await wait_for("refused", lambda: _cond_async(model, "big", "InvalidSpec"))
            await api.create(
                MODEL.plural,
                _model("later", {"source": "x", "profiles": [{"engine": "llama_cpp"}]}),
            )
            await wait_for("big written after later", lambda: entry("big"), timeout_s=10)

            # a model applied by hand is not taken over
            await etcd.put_json(
                keys.CATALOG + "manual",
                {"name": "manual", "source": "x", "profiles": [{"engine": "vllm"}]},
            )
            await api.create(
                MODEL.plural,
                _model("manual", {"source": "y", "profiles": [{"engine": "llama_cpp"}]}),
            )
            conflict = await wait_for("Conflict", lambda: _cond_async(model, "manual", "Conflict"))
            assert "written by hand" in conflict["message"]
            assert (await entry("manual"))["source"] == "x"

            # a cluster with a CA: node certificates for the selected nodes, from that CA
            ca = pki.create_ca()
            ca_pem, ca_key = (base64.b64encode(t.encode()).decode() for t in pki.to_pem(ca))
            async with s.post(
                "/api/v1/namespaces/ns2/secrets",
                json={
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "metadata": {"name": "ca", "namespace": "ns2"},
                    "data": {"ca.pem": ca_pem, "ca.key": ca_key},
                },
            ) as r:
                assert r.status < 300
            for node, gpu in (("gpu-1", "true"), ("cpu-1", "false")):
                async with s.post(
                    "/api/v1/nodes",
                    json={
                        "apiVersion": "v1",
                        "kind": "Node",
                        "metadata": {"name": node, "labels": {"gpu": gpu}},
                    },
                ) as r:
                    assert r.status < 300
            await api.create(
                CLUSTER.plural,
                _cluster(
                    "c2",
                    "ns2",
                    {
                        "etcd": {"endpoints": [etcd_server.endpoint]},
                        "ca": {"secretName": "ca"},
                        "agents": {"nodeSelector": {"gpu": "true"}},
                    },
                ),
            )
            nodes = await wait_for(
                "node certificates", lambda: api.get("/api/v1/namespaces/ns2/secrets/c2-tls-nodes")
            )
            assert {k for k in nodes["data"] if k.endswith(".pem")} == {"ca.pem", "gpu-1.pem"}
            cert = pki.from_pem(
                base64.b64decode(nodes["data"]["gpu-1.pem"]),
                base64.b64decode(nodes["data"]["gpu-1.key"]),
                "gpu-1",
            )
            pki.verify(cert.cert, ca.cert, node="gpu-1")
            c2 = await wait_for(
                "c2's status",
                lambda: _cond_async(
                    lambda n: api.get(api.path(CLUSTER.plural, n, "ns2")), "c2", "EtcdUnavailable"
                ),
            )
            assert "did not answer" in c2["message"]  # its etcd speaks plaintext, not mTLS

            # cgn-ctl shows who manages each model, and refuses what a resource owns
            rows = {r["model"]: r for r in await ctl_ops.models(etcd)}
            assert rows["later"]["managed_by"] == "CognitoraModel ns1/later"
            assert rows["manual"]["managed_by"] is None
            with pytest.raises(store.NotYours, match="managed by CognitoraModel ns1/later"):
                await store.apply_models(
                    etcd,
                    [{"name": "later", "source": "z", "profiles": [{"engine": "vllm"}]}],
                    "m.yaml",
                )
            with pytest.raises(store.NotYours, match="change or delete that resource"):
                await store.delete_model(etcd, "big")

            # deleting a model deletes its entry (the watch event)
            await api.delete(MODEL.plural, "later")
            await api.delete(MODEL.plural, "big")
            await wait_for("big deleted", lambda: _gone(entry, "big"))

            # a deletion the operator never saw (it was down; here: gone from the store with
            # no watch event): the resync's sweep deletes the entry, and only ours
            emu.objects[
                kmock.resource(API_VERSION.split("/")[0], "v1alpha1", MODEL.plural),
                "ns1",
                "smollm2",
            ].delete()
            await wait_for("the sweep", lambda: _gone(entry, "smollm2"), timeout_s=10)
            assert await entry("manual") is not None
            assert not [
                o
                for o in emu.objects.values()
                if not o.deleted and (o.get("metadata") or {}).get("finalizers")
            ]
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)


async def _cond_async(get: Any, name: str, reason: str) -> dict[str, Any] | None:
    cond = _cond(await get(name))
    return cond if cond.get("reason") == reason else None


async def _field(get: Any, name: str, key: str, want: Any) -> bool:
    doc = await get(name)
    return bool(doc) and doc.get(key) == want


async def _replicas(api: Api, path: str, n: int) -> bool:
    doc = await api.get(path)
    return bool(doc) and doc["spec"]["replicas"] == n


async def _gone(get: Any, name: str) -> bool:
    return await get(name) is None


async def test_one_leader_at_a_time_over_a_lease() -> None:
    """Two candidates: the first holds the Lease, the second waits; once the first stops
    renewing, the second takes it after one term and the first, renewing again, finds it lost."""
    from cgn_operator.kube import Kube

    async with serve() as (_, url):
        info = kopf.ConnectionInfo(server=url)
        a, b = Kube(info), Kube(info)
        try:
            first = lease.Lease(a, "ns1", "cgn-operator", "a", ttl_s=1)
            second = lease.Lease(b, "ns1", "cgn-operator", "b", ttl_s=1)
            await asyncio.wait_for(first.campaign(), 5)
            assert not await second.try_take()
            held = (await a.get(first.path))["spec"]
            await asyncio.wait_for(second.campaign(), 10)  # `first` renews no more
            taken = (await b.get(second.path))["spec"]
            assert (taken["holderIdentity"], held["holderIdentity"]) == ("b", "a")
            # NOTE: judged by the Lease's own times (what a candidate compares), not by when
            # this test got to look: on a loaded machine that can be long after the renewal
            term = lease._time(taken["renewTime"]) - lease._time(held["renewTime"])  # type: ignore[operator]
            assert term.total_seconds() > 1.0, (held, taken)
            await asyncio.wait_for(first.keep(), 5)  # returns: lost
        finally:
            await a.close()
            await b.close()


def test_kubeconfig_credentials_become_a_tls_context() -> None:
    """A kubeconfig's embedded CA and client pair (base64 of PEM, as kubectl writes them) load
    into the API client's TLS context; bad data is an error, not a silent plaintext."""
    from cgn_operator.kube import tls_context

    ca = pki.create_ca()
    cert, key = pki.to_pem(pki.issue(ca, "admin", "ctl", usage="client"))
    b64 = lambda t: base64.b64encode(t.encode()).decode()  # noqa: E731
    info = kopf.ConnectionInfo(
        server="https://k:6443",
        ca_data=b64(pki.to_pem(ca)[0]),
        certificate_data=b64(cert),
        private_key_data=b64(key),
    )
    ctx = tls_context(info)
    assert not isinstance(ctx, bool) and ctx.verify_mode.name == "CERT_REQUIRED"
    with pytest.raises(ConfigError, match="do not load as TLS material"):
        tls_context(kopf.ConnectionInfo(server="https://k:6443", ca_data=b64("no certificate")))
