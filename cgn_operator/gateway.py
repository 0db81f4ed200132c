"""A CognitoraCluster behind the user's own gateway (`spec.gateway.mode: epp`, issue #61):
the Gateway API Inference Extension's objects that point the gateway at the router's
endpoint picker (docs/gateway.md).

    <cluster>-epp          Service: the routers' ext_proc (9002) and gRPC health (9003)
    <poolName>             InferencePool (inference.networking.k8s.io/v1): the agents' pods,
                           which run the engines, picked by <cluster>-epp
    <poolName>-<band>      InferenceObjective (inference.networking.x-k8s.io/v1alpha2) per
                           admission band: a request naming one is admitted in that band

The HTTPRoute stays the user's: it sends the paths it chooses to the pool. Pure: the
objects only (clusters.py applies them with the others). The picker reads the pool's
endpoints from etcd (the agents' records), not from the pool's selector, so it needs no
RBAC of its own; the selector names the agents' pods so that a gateway that checks a
pick against the pool (the subset hint) finds the picked pod in it.
"""

from __future__ import annotations

from typing import Any

from cgn_operator.children import BANDS, EPP_HEALTH, EPP_PORT, Cluster, _meta, _obj, labels

POOL_API = "inference.networking.k8s.io/v1"
OBJECTIVE_API = "inference.networking.x-k8s.io/v1alpha2"


def objects(c: Cluster) -> list[dict[str, Any]]:
    """The picker's Service, the InferencePool and its InferenceObjectives; [] in proxy mode."""
    g = c.gateway
    if not g.epp:
        return []
    picker = f"{c.name}-epp"
    service = _obj("v1", "Service", _meta(c, picker, "gateway"), spec={
        "selector": labels(c, "router"),
        "ports": [
            {"name": "grpc-epp", "port": EPP_PORT, "targetPort": "epp", "appProtocol": "http2"},
            {"name": "grpc-health", "port": EPP_HEALTH, "targetPort": "epp-health",
             "appProtocol": "http2"},
        ],
    })  # fmt: skip
    pool = _obj(POOL_API, "InferencePool", _meta(c, g.pool, "gateway"), spec={
        "selector": {"matchLabels": labels(c, "agent")},
        "targetPorts": [{"number": g.target_port}],
        "endpointPickerRef": {
            "kind": "Service", "name": picker, "portNumber": EPP_PORT,
            "failureMode": g.failure_mode,
        },
    })  # fmt: skip
    objectives = [
        _obj(
            OBJECTIVE_API,
            "InferenceObjective",
            _meta(c, f"{g.pool}-{band}", "gateway"),
            spec={"priority": priority, "poolRef": {"name": g.pool}},
        )
        for band, priority in BANDS.items()
    ]
    return [service, pool, *objectives]
