"""What `cgn-operator manifests` prints: the CRDs, RBAC and the operator's Deployment.

Least privilege: a Role in the operator's namespace over exactly the kinds it manages
(its two custom resources and their status, ConfigMaps, Secrets, Services, Deployments,
DaemonSets, StatefulSets; Events to report; the Lease it elects a leader with), and one
read-only ClusterRole for Nodes (which nodes an agent DaemonSet lands on, for their
certificates). With `--namespace ""` (every namespace) the Role becomes a ClusterRole.

Leader election: the Deployment runs one replica (Recreate); more may run, and only the
holder of the Lease `cgn-operator` acts (lease.py).
"""

from __future__ import annotations

from typing import Any

from cgn_operator.crds import CLUSTER, GROUP, MODEL, crds
from cgn_operator.kube import KINDS

NAME = "cgn-operator"
LIVENESS = 8080  # kopf's liveness endpoint


def _rule(groups: list[str], resources: list[str], verbs: list[str]) -> dict[str, Any]:
    return {"apiGroups": groups, "resources": resources, "verbs": verbs}


WRITE = ["get", "list", "watch", "create", "patch", "update"]


def rules() -> list[dict[str, Any]]:
    own = [CLUSTER.plural, MODEL.plural]
    written: dict[str, list[str]] = {}  # API group -> the plurals of the kinds it writes
    for group, plural in KINDS.values():
        written.setdefault(group, []).append(plural)
    return [
        _rule([GROUP], own, ["get", "list", "watch", "patch"]),
        _rule([GROUP], [f"{p}/status" for p in own], ["get", "patch", "update"]),
        *(_rule([group], plurals, WRITE) for group, plurals in written.items()),
        _rule([""], ["events"], ["create"]),
        _rule(["events.k8s.io"], ["events"], ["create"]),
        _rule(["coordination.k8s.io"], ["leases"], ["get", "create", "patch"]),
    ]


def manifests(namespace: str, image: str) -> list[dict[str, Any]]:
    """Everything `kubectl apply -f -` needs to run the operator in `namespace` ("" : it
    watches every namespace and runs in `cognitora`)."""
    home = namespace or "cognitora"
    meta = {"namespace": home, "labels": {"app.kubernetes.io/name": NAME}}
    every = not namespace
    role_kind = "ClusterRole" if every else "Role"
    binding_kind = "ClusterRoleBinding" if every else "RoleBinding"

    def named(name: str, namespaced: bool = True) -> dict[str, Any]:
        return {"name": name, **(meta if namespaced else {"labels": meta["labels"]})}

    subject = [{"kind": "ServiceAccount", "name": NAME, "namespace": home}]
    args = [
        "cgn-operator",
        "run",
        "--namespace",
        namespace,
        "--set",
        f"image={image}",
        "--liveness",
        f"http://0.0.0.0:{LIVENESS}/healthz",
    ]
    selector = {"app.kubernetes.io/name": NAME}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": home}},
        *crds(),
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": named(NAME)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": role_kind,
            "metadata": named(NAME, not every),
            "rules": rules(),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": binding_kind,
            "metadata": named(NAME, not every),
            "subjects": subject,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": NAME},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": named(f"{NAME}-nodes", False),
            "rules": [_rule([""], ["nodes"], ["get", "list", "watch"])],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": named(f"{NAME}-{home}-nodes", False),
            "subjects": subject,
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": f"{NAME}-nodes",
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": named(NAME),
            "spec": {
                "replicas": 1,
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": selector},
                "template": {
                    "metadata": {"labels": selector},
                    "spec": {
                        "serviceAccountName": NAME,
                        "containers": [
                            {
                                "name": "operator",
                                "image": image,
                                "command": args,
                                "livenessProbe": {
                                    "httpGet": {"path": "/healthz", "port": LIVENESS},
                                    "periodSeconds": 30,
                                },
                                "env": [
                                    {
                                        "name": "POD_ID",
                                        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                                    }
                                ],
                                "resources": {
                                    "requests": {"cpu": "50m", "memory": "128Mi"},
                                    "limits": {"memory": "512Mi"},
                                },
                                "securityContext": {
                                    "runAsNonRoot": True,
                                    "runAsUser": 65532,
                                    "allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                },
                                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                            }
                        ],
                        "volumes": [{"name": "tmp", "emptyDir": {"medium": "Memory"}}],
                    },
                },
            },
        },
    ]
