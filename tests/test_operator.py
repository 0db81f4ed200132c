"""cgn-operator: CRDs, rendered children, status, the Lease, RBAC (pure), kubectl's client-side
dry run of every manifest, and the real kopf operator loop against kmock and a real etcd.

What is not tested here, because no kube-apiserver runs on these machines: schema
validation and pruning by a real API server, server-side apply's field ownership, the
garbage collector deleting children by owner reference, RBAC enforcement, and the
manifests on a real cluster (docs/kubernetes.md lists the same).
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import kmock
import kopf
import pytest
import yaml

from cgn_control import store
from cgn_control.catalog import CatalogError, parse_model
from cgn_control.cluster import Snapshot
from cgn_core import keys, pki
from cgn_core.errors import ConfigError
from cgn_core.etcd import EtcdClient
from cgn_core.etcd.local import LocalEtcd
from cgn_core.settings import EtcdSettings
from cgn_ctl import ops as ctl_ops
from cgn_operator import children, lease, manifests, status
from cgn_operator.crds import API_VERSION, CLUSTER, MODEL, crds, model_doc
from cgn_operator.handlers import State, cluster_of, start
from cgn_operator.settings import OperatorSettings
from harness.kube import kubeconfig, serve, wait_for

from .conftest import REPO

NOW = dt.datetime(2026, 12, 2, tzinfo=dt.UTC)  # for pure time arithmetic (the Lease)


def _now() -> dt.datetime:  # certificates are issued as of the real clock
    return dt.datetime.now(dt.UTC)


# Recorded shape of a CognitoraCluster as the API server returns it (uid, generation, ...).
CLUSTER_BODY: dict[str, Any] = {
    "apiVersion": API_VERSION,
    "kind": "CognitoraCluster",
    "metadata": {
        "name": "main",
        "namespace": "cognitora",
        "generation": 3,
        "uid": "7b0a3c3e-1d2f-4b6a-9e0c-5f1e2d3c4b5a",
        "creationTimestamp": "2026-12-01T10:00:00Z",
        "resourceVersion": "81234",
    },
    "spec": yaml.safe_load((REPO / "configs/kubernetes/cluster.yaml").read_text())["spec"],
}


def _schema_nodes(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for key, child in (node.get("properties") or {}).items():
        out += _schema_nodes(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        out += _schema_nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _schema_nodes(node["additionalProperties"], f"{path}{{}}")
    return out


def _spec_schema(kind: str) -> dict[str, Any]:
    crd = next(c for c in crds() if c["spec"]["names"]["kind"] == kind)
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


# ---- CRDs ------------------------------------------------------------------------------------


def test_crd_schemas_are_structural() -> None:
    """Kubernetes' structural-schema rules: every node typed (or explicitly free-form), no
    properties beside additionalProperties, nothing but name/generateName under metadata,
    status a subresource, printer columns on real paths."""
    for crd in crds():
        version = crd["spec"]["versions"][0]
        root = version["schema"]["openAPIV3Schema"]
        assert root["properties"]["metadata"] == {"type": "object"}
        assert version["subresources"] == {"status": {}}
        for path, node in _schema_nodes(root):
            free = node.get("x-kubernetes-preserve-unknown-fields") is True
            assert "type" in node or free, f"{crd['metadata']['name']}{path}: untyped"
            assert not ("properties" in node and "additionalProperties" in node), path
            assert not {"$ref", "definitions", "dependencies", "id"} & set(node), path
            if node.get("type") == "array":
                assert isinstance(node.get("items"), dict), f"{path}: array without items"
        props = root["properties"]
        for col in version["additionalPrinterColumns"]:
            head = re.match(r"\.(\w+)(?:\.(\w+))?", col["jsonPath"])
            assert head and head[1] in (*props, "metadata"), col


def test_a_catalog_model_moves_with_only_the_envelope_changed() -> None:
    catalog = yaml.safe_load((REPO / "configs/models/smollm2.yaml").read_text())
    resource = yaml.safe_load((REPO / "configs/kubernetes/model-smollm2.yaml").read_text())
    assert {k: v for k, v in catalog.items() if k != "name"} == resource["spec"]
    assert resource["metadata"]["name"] == catalog["name"]
    assert parse_model(model_doc(resource["metadata"], resource["spec"])) == parse_model(catalog)
    jsonschema.Draft4Validator(_spec_schema("CognitoraModel")).validate(resource["spec"])


def test_every_model_in_the_docs_fits_the_crd_schema() -> None:
    """The YAML models in docs/ are valid catalog entries; their specs pass the CRD schema."""
    validator = jsonschema.Draft4Validator(_spec_schema("CognitoraModel"))
    found = 0
    for doc in sorted((REPO / "docs").glob("*.md")):
        for block in re.findall(r"```yaml\n(.*?)```", doc.read_text(), re.S):
            model = yaml.safe_load(block)
            if not isinstance(model, dict) or "profiles" not in model or "name" not in model:
                continue
            parse_model(model)
            validator.validate({k: v for k, v in model.items() if k != "name"})
            found += 1
    assert found >= 2


@pytest.mark.parametrize(
    ("spec", "keyword"),
    [
        ({"profiles": [{"engine": "tgi"}]}, "enum"),
        ({"profiles": []}, "minItems"),
        ({"profiles": [{"engine": "vllm", "devices": -1}]}, "minimum"),
        ({"replicas": {"min": "1"}, "profiles": [{"engine": "vllm"}]}, "type"),
        ({"source": "x"}, "required"),
    ],
)
def test_the_crd_schema_refuses_what_the_catalog_refuses(
    spec: dict[str, Any], keyword: str
) -> None:
    errors = list(jsonschema.Draft4Validator(_spec_schema("CognitoraModel")).iter_errors(spec))
    assert [e.validator for e in errors] == [keyword]
    with pytest.raises(CatalogError):
        parse_model({"name": "m", **spec})


def test_cluster_example_fits_its_schema() -> None:
    jsonschema.Draft4Validator(_spec_schema("CognitoraCluster")).validate(CLUSTER_BODY["spec"])


# ---- children (pure) -------------------------------------------------------------------------


def test_a_cluster_renders_its_children_with_owner_references() -> None:
    c = children.cluster_from(CLUSTER_BODY, "img:1")
    objs = children.children(c)
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert names == {
        ("ConfigMap", "main-config"),
        ("Service", "main-etcd"),
        ("StatefulSet", "main-etcd"),
        ("Deployment", "main-router"),
        ("Service", "main-router"),
        ("DaemonSet", "main-agent"),
        ("Deployment", "main-metrics"),
        ("Service", "main-metrics"),
    }
    for o in objs:
        (ref,) = o["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": API_VERSION,
            "kind": "CognitoraCluster",
            "name": "main",
            "uid": CLUSTER_BODY["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert o["metadata"]["namespace"] == "cognitora"
        assert "finalizers" not in o["metadata"]
    by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    assert by[("Deployment", "main-router")]["spec"]["replicas"] == 2
    agent = by[("DaemonSet", "main-agent")]["spec"]["template"]["spec"]
    assert agent["nodeSelector"] == {"cognitora.io/node": "true"}
    assert {"name": "CGN_AGENT_NODE_ID", "value": "$(NODE)"} in agent["containers"][0]["env"]
    configs = {k: yaml.safe_load(v) for k, v in by[("ConfigMap", "main-config")]["data"].items()}
    etcd = ["main-etcd-0.main-etcd.cognitora.svc:2379"]
    assert configs["router.yaml"]["etcd"]["endpoints"] == etcd
    assert configs["agent.yaml"]["kvcached"] == {"mode": "run"}
    assert configs["agent.yaml"]["model_dirs"] == ["/models"]
    # an external etcd: no StatefulSet, its endpoints everywhere; a spec change lands in place
    ext = {
        **CLUSTER_BODY,
        "spec": {
            **CLUSTER_BODY["spec"],
            "etcd": {"endpoints": ["e:2379"]},
            "router": {"replicas": 3},
            "metrics": {"enabled": False},
        },
    }
    objs = children.children(children.cluster_from(ext, "img:1"))
    assert not [o for o in objs if o["kind"] == "StatefulSet"]
    assert next(o for o in objs if o["kind"] == "Deployment")["spec"]["replicas"] == 3


def test_cluster_spec_errors_name_the_field() -> None:
    bad = {**CLUSTER_BODY, "spec": {"etcd": {"endpoints": ["e:2379"], "replicas": 3}}}
    with pytest.raises(children.SpecError, match=r"^spec.etcd: replicas and storage"):
        children.cluster_from(bad, "img")
    bad = {**CLUSTER_BODY, "spec": {"etcd": {"tlsSecret": "s"}}}
    with pytest.raises(children.SpecError, match=r"^spec.etcd.tlsSecret"):
        children.cluster_from(bad, "img")


def test_node_certificates_come_from_the_cluster_ca_and_are_not_reissued() -> None:
    ca = pki.create_ca()
    c = children.cluster_from({**CLUSTER_BODY, "spec": {"ca": {"secretName": "ca"}}}, "img")
    first = children.secrets(c, ca, ["gpu-1", "gpu-2"], {}, _now())
    by = {s["metadata"]["name"]: s["data"] for s in first}
    assert set(by) == {"main-tls-router", "main-tls-nodes", "main-tls-etcd"}
    nodes = by["main-tls-nodes"]
    for node in ("gpu-1", "gpu-2"):
        pair = pki.from_pem(
            base64.b64decode(nodes[f"{node}.pem"]), base64.b64decode(nodes[f"{node}.key"]), node
        )
        pki.verify(pair.cert, ca.cert, usage="client", node=node)
    # again, with a third node: the two pairs are kept byte for byte, the third issued
    again = children.secrets(c, ca, ["gpu-1", "gpu-2", "gpu-3"], by, _now())
    nodes2 = next(s["data"] for s in again if s["metadata"]["name"] == "main-tls-nodes")
    assert nodes2["gpu-1.pem"] == nodes["gpu-1.pem"] and "gpu-3.pem" in nodes2
    # a new CA reissues everything
    other = children.secrets(c, pki.create_ca(), ["gpu-1"], by, _now())
    assert (
        next(s for s in other if s["metadata"]["name"] == "main-tls-nodes")["data"]["gpu-1.pem"]
        != nodes["gpu-1.pem"]
    )
    cfg = yaml.safe_load(children.config_map(c)["data"]["agent.yaml"])
    assert cfg["etcd"]["tls"] == {"ca_file": "/etc/cognitora/tls/ca.pem"}  # its pair: by node


def test_a_model_belongs_to_the_namespace_cluster_or_its_label() -> None:
    one = {"cognitora": [CLUSTER_BODY]}
    model = {"metadata": {"name": "m", "namespace": "cognitora"}}
    assert cluster_of(model, one, "img").name == "main"
    with pytest.raises(children.SpecError, match="has none"):
        cluster_of({"metadata": {"name": "m", "namespace": "elsewhere"}}, one, "img")
    labelled = {
        "metadata": {
            "name": "m",
            "namespace": "cognitora",
            "labels": {"cognitora.io/cluster": "other"},
        }
    }
    with pytest.raises(children.SpecError, match="no CognitoraCluster 'other'"):
        cluster_of(labelled, one, "img")


# ---- status (pure) ---------------------------------------------------------------------------


def _snap(phases: list[str]) -> Snapshot:
    spec = parse_model(
        {
            "name": "m",
            "source": "smollm2",
            "replicas": {"min": 2, "max": 3},
            "profiles": [{"engine": "cgn_infer"}],
        }
    )
    placements = {("n1", f"r{i}"): {"model": "m"} for i in range(len(phases))}
    statuses = {
        ("n1", f"r{i}"): {"phase": p, "reason": "oom" if p == "Failed" else ""}
        for i, p in enumerate(phases)
    }
    return Snapshot(
        models={"m": spec}, nodes={"n1": {}}, placements=placements, statuses=statuses, cordons={}
    )


@pytest.mark.parametrize(
    ("phases", "ready", "degraded", "reason"),
    [
        ([], "False", "False", "AsDesired"),  # coming up, not degraded
        (["Ready"], "False", "True", "BelowDesired"),
        (["Ready", "Ready"], "True", "False", "AsDesired"),
        (["Ready", "Ready", "Failed"], "True", "True", "ReplicasFailed"),
    ],
)
def test_model_status_from_etcd(phases: list[str], ready: str, degraded: str, reason: str) -> None:
    snap = _snap(phases)
    st = status.model_status(snap.models["m"], None, snap, "m")
    conds = {c["type"]: c for c in st["conditions"]}
    assert (conds["Ready"]["status"], conds["Degraded"]["status"]) == (ready, degraded)
    assert conds["Degraded"]["reason"] == reason
    assert st["readyReplicas"] == phases.count("Ready") and st["desiredReplicas"] == 2


@pytest.mark.parametrize(
    ("router", "agents", "snap", "problem", "ready", "degraded"),
    [
        ({"readyReplicas": 2}, {"numberReady": 3, "desiredNumberScheduled": 3}, True, None,
         ("True", "Serving"), "False"),
        ({"readyReplicas": 1}, {"numberReady": 2, "desiredNumberScheduled": 3}, True, None,
         ("True", "Serving"), "True"),
        ({}, {}, True, None, ("False", "NoRouterReady"), "True"),
        ({"readyReplicas": 2}, {}, False, None, ("False", "EtcdUnavailable"), "False"),
        (None, None, False, ("ApplyFailed", "PATCH ...: 403"), ("False", "ApplyFailed"), "False"),
    ],
)  # fmt: skip
def test_cluster_status_from_children_and_etcd(
    router: Any, agents: Any, snap: bool, problem: Any, ready: tuple[str, str], degraded: str
) -> None:
    st = status.cluster_status(router, agents, 2, _snap([]) if snap else None, "e:2379", problem)
    conds = {c["type"]: c for c in st["conditions"]}
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ready
    assert conds["Degraded"]["status"] == degraded


def test_condition_times_move_only_on_a_change() -> None:
    first = status.merge_conditions([], [status.condition("Ready", False, "x")], "t1", 1)
    same = status.merge_conditions(first, [status.condition("Ready", False, "y")], "t2", 2)
    flipped = status.merge_conditions(same, [status.condition("Ready", True, "z")], "t3", 2)
    assert [c["lastTransitionTime"] for c in (*first, *same, *flipped)] == ["t1", "t1", "t3"]


@pytest.mark.parametrize(
    ("spec", "free"),
    [
        ({}, True),
        ({"holderIdentity": "me"}, True),
        (
            {
                "holderIdentity": "other",
                "renewTime": "2026-12-01T23:59:55.000000Z",
                "leaseDurationSeconds": 15,
            },
            False,
        ),
        (
            {
                "holderIdentity": "other",
                "renewTime": "2026-12-01T23:59:00.000000Z",
                "leaseDurationSeconds": 15,
            },
            True,
        ),
        ({"holderIdentity": "other", "renewTime": "garbage", "leaseDurationSeconds": 15}, True),
    ],
)
def test_lease_is_free_when_unheld_ours_or_expired(spec: dict[str, Any], free: bool) -> None:
    assert lease.free_for(spec, "me", NOW) is free


# ---- manifests -------------------------------------------------------------------------------


def test_rbac_is_least_privilege() -> None:
    docs = manifests.manifests("cognitora", "img:1")
    roles = [d for d in docs if d["kind"] in ("Role", "ClusterRole")]
    for role in roles:
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
            assert "delete" not in rule["verbs"], rule  # children go by garbage collection
    cluster_wide = [r for r in roles if r["kind"] == "ClusterRole"]
    assert [r["rules"] for r in cluster_wide] == [
        [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]
    ]
    (role,) = [r for r in roles if r["kind"] == "Role"]
    kinds = {res for rule in role["rules"] for res in rule["resources"]}
    assert kinds == {
        CLUSTER.plural,
        MODEL.plural,
        f"{CLUSTER.plural}/status",
        f"{MODEL.plural}/status",
        "configmaps",
        "secrets",
        "services",
        "deployments",
        "daemonsets",
        "statefulsets",
        "events",
        "leases",
    }


def _every_manifest() -> list[dict[str, Any]]:
    c = children.cluster_from(CLUSTER_BODY, "img:1")
    tls = children.cluster_from({**CLUSTER_BODY, "spec": {"ca": {"secretName": "ca"}}}, "img")
    return [
        *manifests.manifests("cognitora", "img:1"),
        *children.children(c),
        *children.children(tls),
        *children.secrets(tls, pki.create_ca(), ["n1"], {}, _now()),
        yaml.safe_load((REPO / "configs/kubernetes/cluster.yaml").read_text()),
        yaml.safe_load((REPO / "configs/kubernetes/model-smollm2.yaml").read_text()),
    ]


async def test_kubectl_accepts_every_manifest(tmp_path: Path) -> None:
    """`kubectl apply --dry-run=client --validate=false`: every document maps to a kind the
    API serves and decodes into Kubernetes' own Go types (a wrong field type fails)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (CI installs Debian's kubernetes-client)")
    path = tmp_path / "all.yaml"
    path.write_text(yaml.safe_dump_all(_every_manifest()))
    async with serve() as (_, url):
        env = {**os.environ, "KUBECONFIG": str(kubeconfig(tmp_path / "kc", url))}
        proc = await asyncio.create_subprocess_exec(
            kubectl,
            "apply",
            "--dry-run=client",
            "--validate=false",
            "-f",
            str(path),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert out.decode().count("(dry run)") == len(_every_manifest())


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
    for text in ("x: [\n", "clusters: 3\n"):
        bad = tmp_path / "kubeconfig"
        bad.write_text(text)
        res = subprocess.run([exe, "run", "--kubeconfig", bad], capture_output=True, text=True,
                             timeout=60)  # fmt: skip
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
        assert "not a usable kubeconfig" in res.stderr and "Traceback" not in res.stderr


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
            t0 = asyncio.get_running_loop().time()
            await asyncio.wait_for(second.campaign(), 10)  # `first` renews no more
            assert asyncio.get_running_loop().time() - t0 >= 0.9
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
