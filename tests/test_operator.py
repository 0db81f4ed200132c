"""cgn-operator as pure functions (CRDs, rendered children, status, the Lease, RBAC) and
kubectl's client-side dry run of every manifest. (The operator loop: test_operator_loop.py.)

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
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from cgn_control.decide.catalog import CatalogError, parse_model
from cgn_control.decide.cluster import Snapshot
from cgn_core import pki
from cgn_operator import children, lease, manifests, status
from cgn_operator.crds import API_VERSION, CLUSTER, MODEL, crds, model_doc
from cgn_operator.models import cluster_of
from harness.kube import kubeconfig, serve

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
        blocks = re.findall(r"```yaml\n(.*?)```", doc.read_text(), re.S)
        for model in (m for block in blocks for m in yaml.safe_load_all(block)):
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


# The Gateway API Inference Extension's objects, as its published Go types define them
# (api/v1 InferencePool; apix/v1alpha2 InferenceObjective as of GIE v1.0): our reading,
# written as JSON Schema here (its CRDs are not vendored).
_NAME = {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 253}
POOL_SPEC = {
    "type": "object", "additionalProperties": False,
    "required": ["selector", "targetPorts", "endpointPickerRef"],
    "properties": {
        "selector": {"type": "object", "additionalProperties": False, "required": ["matchLabels"],
                     "properties": {"matchLabels": {"type": "object", "minProperties": 1,
                                                    "additionalProperties": {"type": "string"}}}},
        "targetPorts": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
            "type": "object", "additionalProperties": False, "required": ["number"],
            "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}},
        "endpointPickerRef": {"type": "object", "additionalProperties": False, "required": ["name"],
                              "properties": {
            "group": {"type": "string"}, "kind": {"enum": ["Service"]}, "name": _NAME,
            "portNumber": {"type": "integer", "minimum": 1, "maximum": 65535},
            "failureMode": {"enum": ["FailOpen", "FailClose"]}}},
    },
}  # fmt: skip
OBJECTIVE_SPEC = {
    "type": "object", "additionalProperties": False, "required": ["poolRef"],
    "properties": {
        "priority": {"type": "integer"},
        "poolRef": {"type": "object", "required": ["name"], "properties": {"name": _NAME}},
    },
}  # fmt: skip


def test_an_epp_cluster_points_an_inference_pool_at_the_routers_picker(tmp_path: Path) -> None:
    """#61: `spec.gateway.mode: epp` renders the picker's Service, an InferencePool over
    the agents' pods with the router as its endpoint picker, one InferenceObjective per
    admission band; the router's config turns the picker on and maps the objectives to
    bands, and loads as the router's settings. Proxy mode renders none of them."""
    from cgn_core.settings import load_settings
    from cgn_operator import gateway
    from cgn_router.settings import RouterSettings

    spec = {**CLUSTER_BODY["spec"], "gateway": {"mode": "epp", "poolName": "llm",
                                                "failureMode": "FailOpen"}}  # fmt: skip
    jsonschema.Draft4Validator(_spec_schema("CognitoraCluster")).validate(spec)
    c = children.cluster_from({**CLUSTER_BODY, "spec": spec}, "img:1")
    objs = {(o["kind"], o["metadata"]["name"]): o for o in gateway.objects(c)}
    assert set(objs) == {("Service", "main-epp"), ("InferencePool", "llm"),
                         *(("InferenceObjective", f"llm-{b}") for b in ("platinum", "gold", "bronze"))}  # fmt: skip
    pool = objs[("InferencePool", "llm")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    jsonschema.Draft4Validator(POOL_SPEC).validate(pool["spec"])
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service", "name": "main-epp", "portNumber": 9002, "failureMode": "FailOpen"}  # fmt: skip
    by = {(o["kind"], o["metadata"]["name"]): o for o in children.children(c)}
    agent_labels = by[("DaemonSet", "main-agent")]["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"] == agent_labels  # the engines' pods
    for band, priority in (("platinum", 2), ("gold", 1), ("bronze", 0)):
        objective = objs[("InferenceObjective", f"llm-{band}")]
        jsonschema.Draft4Validator(OBJECTIVE_SPEC).validate(objective["spec"])
        assert objective["spec"] == {"priority": priority, "poolRef": {"name": "llm"}}
    service = objs[("Service", "main-epp")]["spec"]
    router = by[("Deployment", "main-router")]["spec"]["template"]["spec"]["containers"][0]
    assert {p["name"] for p in router["ports"]} >= {"epp", "epp-health"}
    assert (
        service["selector"] == by[("Deployment", "main-router")]["spec"]["selector"]["matchLabels"]
    )
    assert {p["targetPort"] for p in service["ports"]} == {"epp", "epp-health"}
    config = tmp_path / "router.yaml"
    config.write_text(by[("ConfigMap", "main-config")]["data"]["router.yaml"])
    settings = load_settings(RouterSettings, "router", yaml_path=config)
    assert settings.epp.enabled and settings.epp.host == "0.0.0.0" and settings.workers == 1
    assert settings.epp.objectives == {"llm-platinum": "platinum", "llm-gold": "gold",
                                       "llm-bronze": "bronze"}  # fmt: skip
    assert gateway.objects(children.cluster_from(CLUSTER_BODY, "img:1")) == []
    with pytest.raises(children.SpecError, match=r"spec\.gateway\.poolName"):
        children.cluster_from({**CLUSTER_BODY, "spec": {"gateway": {"poolName": "Bad_Name"}}}, "i")


def test_cluster_spec_errors_name_the_field() -> None:
    bad = {**CLUSTER_BODY, "spec": {"etcd": {"endpoints": ["e:2379"], "replicas": 3}}}
    with pytest.raises(children.SpecError, match=r"^spec.etcd: replicas and storage"):
        children.cluster_from(bad, "img")
    bad = {**CLUSTER_BODY, "spec": {"etcd": {"tlsSecret": "s"}}}
    with pytest.raises(children.SpecError, match=r"^spec.etcd.tlsSecret"):
        children.cluster_from(bad, "img")


@pytest.mark.parametrize(
    "spec",
    [
        {"router": {"replicas": "many"}},
        {"router": ["replicas"]},
        {"agents": {"nodeSelector": ["gpu"]}},
        ["not", "a", "mapping"],
    ],
)
def test_a_cluster_body_of_the_wrong_shape_is_a_spec_error(spec: Any) -> None:
    """What an API server without the CRD's schema lets through is a SpecError (the cluster's
    status), never a TypeError that would end a reconcile pass."""
    with pytest.raises(children.SpecError, match=r"^spec: not of the CognitoraCluster schema"):
        children.cluster_from({**CLUSTER_BODY, "spec": spec}, "img")


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
    return Snapshot.of(
        models={"m": spec}, nodes={"n1": {}}, placements=placements, statuses=statuses
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


def test_desired_replicas_is_the_autoscalers_target_and_ready_is_measured_against_min() -> None:
    """min 2, max 3: the leader's record says 3 (and a record past max is held to it);
    two Ready replicas are Ready and not Degraded while the third comes up."""
    base = _snap(["Ready", "Ready"])
    for written, shown, message in ((3, 3, "2/3 ready, 2 placed (min 2)"),
                                    (9, 3, "2/3 ready, 2 placed (min 2)"),
                                    (None, 2, "2/2 ready, 2 placed")):  # fmt: skip
        record = {"m": {"model": "m", "desired": written}} if written else {}
        snap = Snapshot.of(base.models, {}, {k: p.to_json() for k, p in base.placements.items()},
                           {k: s.to_json() for k, s in base.statuses.items()}, scaling=record)  # fmt: skip
        st = status.model_status(snap.models["m"], None, snap, "m")
        conds = {c["type"]: c for c in st["conditions"]}
        assert st["desiredReplicas"] == shown
        assert (conds["Ready"]["status"], conds["Degraded"]["status"]) == ("True", "False")
        assert conds["Ready"]["message"] == message


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
        "inferencepools",
        "inferenceobjectives",
        "events",
        "leases",
    }


def _every_manifest() -> list[dict[str, Any]]:
    from cgn_operator import gateway

    c = children.cluster_from(CLUSTER_BODY, "img:1")
    epp = children.cluster_from(
        {**CLUSTER_BODY, "spec": {**CLUSTER_BODY["spec"], "gateway": {"mode": "epp"}}}, "img"
    )
    tls = children.cluster_from({**CLUSTER_BODY, "spec": {"ca": {"secretName": "ca"}}}, "img")
    return [
        *manifests.manifests("cognitora", "img:1"),
        *children.children(c),
        *children.children(tls),
        *children.children(epp),
        *(o for o in gateway.objects(epp) if o["kind"] == "Service"),  # GIE's kinds: above
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


def test_a_model_resource_has_every_field_of_the_catalogs_model() -> None:
    from cgn_control.decide.catalog import MODEL_FIELDS
    from cgn_operator import crds

    assert set(crds.model_spec_schema()["properties"]) == MODEL_FIELDS
    spec = parse_model(crds.model_doc({"name": "m"}, {
        "source": "smollm2", "profiles": [{"engine": "cgn_infer"}], "max_adapters": 2,
        "adapters": {"sql": {"source": "/models/sql.gguf", "rank": 8, "pin": True}}}))  # fmt: skip
    assert spec.adapters["sql"].pin and spec.max_adapters == 2


def test_a_model_resource_carries_the_autoscalers_policy() -> None:
    """CognitoraModel's spec has the catalog's scaling: and slo: blocks, field for field, and
    they reach the catalog entry through the same parser."""
    import dataclasses

    from cgn_control.decide.scaling import ScalingPolicy
    from cgn_operator import crds

    props = crds.model_spec_schema()["properties"]
    policy = {f.name for f in dataclasses.fields(ScalingPolicy)}
    assert set(props["scaling"]["properties"]) | set(props["slo"]["properties"]) == policy
    spec = parse_model(crds.model_doc({"name": "m"}, {
        "source": "smollm2", "replicas": {"min": 1, "max": 4},
        "scaling": {"stabilization_s": 30}, "slo": {"ttft_p90_ms": 500},
        "profiles": [{"engine": "cgn_infer"}]}))  # fmt: skip
    assert (spec.pools["both"].max, spec.scaling.stabilization_s, spec.scaling.ttft_p90_ms) == (
        4,
        30,
        500,
    )
