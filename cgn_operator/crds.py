"""The custom resources, cognitora.io/v1alpha1: CognitoraCluster and CognitoraModel.

A CognitoraModel's `spec` is the catalog's model YAML (`cgn-ctl models apply -f`) one to
one: the same fields, checked by the same `cgn_control.decide.catalog.parse_model`. Only the
envelope differs: `metadata.name` is the model's name unless `spec.name` gives one that
Kubernetes cannot (upper case, `_`, `:`), and the model belongs to the namespace's
CognitoraCluster (or the one its `cognitora.io/cluster` label names).

The schemas below are structural (every field typed, no free-form nodes but `env` and
the agents' tolerations) and enforce what a schema can (types, enums, minimums); the
rest (tensor_parallel dividing devices × nodes, fallbacks naming models) is parse_model's
and check_catalog's, and lands in the resource's status with its field path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from cgn_control.decide.adapters import MAX_LOADED
from cgn_control.decide.catalog import ENGINES, KV_CONNECTORS, ROLES, Profile
from cgn_control.decide.scaling import ScalingPolicy
from cgn_core.lora import MAX_RANK
from cgn_core.multinode import LAUNCH_MODES

GROUP = "cognitora.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
CLUSTER_LABEL = f"{GROUP}/cluster"  # on a model: the CognitoraCluster it belongs to


@dataclasses.dataclass(frozen=True, slots=True)
class Kind:
    kind: str
    plural: str
    singular: str
    short: tuple[str, ...]


CLUSTER = Kind("CognitoraCluster", "cognitoraclusters", "cognitoracluster", ("cgncluster",))
MODEL = Kind("CognitoraModel", "cognitoramodels", "cognitoramodel", ("cgnmodel",))


def _s(
    kind: str, description: str = "", extra: Mapping[str, Any] = {}, **more: Any
) -> dict[str, Any]:
    """A schema node of `kind`; `extra` for keys that are not identifiers (x-kubernetes-*)."""
    return {"type": kind, **({"description": description} if description else {}), **extra, **more}


def _obj(props: Mapping[str, Any], description: str = "", **more: Any) -> dict[str, Any]:
    return _s("object", description, properties=dict(props), **more)


_STR = _s("string")
# NOTE: a pool is N replicas or {min, max} (elastic); a structural schema has no int-or-object,
# so the node keeps what it is given and the catalog's parser, which the operator runs on
# every spec, refuses a bad one in the status (InvalidSpec, naming the field)
_POOL = {
    "description": "replicas: N, or {min: N, max: M} for a pool the autoscaler sizes",
    "x-kubernetes-preserve-unknown-fields": True,
}
_STRINGS = _s("array", items=_STR)
_MODEL_NAME = _s("string", pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def _profile() -> dict[str, Any]:
    props: dict[str, Any] = {
        "engine": _s("string", "the engine that runs this profile", enum=list(ENGINES)),
        "accelerator": _s("string", "an accelerator class (h100-80g, m2-ultra-192g) or cpu"),
        "devices": _s("integer", "accelerators per node for one replica (0 on cpu)", minimum=0),
        "nodes": _s("integer", "nodes one replica spans", minimum=1),
        "tensor_parallel": _s("integer", minimum=1),
        "source": _s("string", "overrides the model's source for this engine"),
        "ctx": _s("integer", minimum=1),
        "threads": _s("integer", minimum=1),
        "dtype": _STR,
        "gpu_memory_utilization": _s("number", exclusiveMinimum=True, minimum=0, maximum=1),
        "kv_connector": _s("string", enum=list(KV_CONNECTORS)),
        "backend": _STR,
        "launcher": _STR,
        "url": _STR,
        "extra_args": _STRINGS,
        "env": _s("object", additionalProperties=_STR),
        "role": _s("string", "the pool of a disaggregated model it may serve", enum=list(ROLES)),
        "quantization": _s("string", "vllm / sglang --quantization (fp8 needs sm 8.9+)"),
        "launch_mode": _s("string", "vllm across nodes: ray or mp", enum=list(LAUNCH_MODES)),
        "rendezvous_timeout_s": _s(
            "number", "how long ranks 1.. wait for rank 0", exclusiveMinimum=True, minimum=0
        ),
    }
    missing = {f.name for f in dataclasses.fields(Profile)} ^ set(props)
    assert not missing, f"the CRD's profile schema and catalog.Profile differ: {missing}"
    return _obj(props, required=["engine"])


_SLO_FIELDS = ("ttft_p90_ms", "itl_p90_ms")


def _scaling() -> dict[str, Any]:
    """The catalog's `scaling:` block (ScalingPolicy of cgn_control/decide/scaling.py, less
    the SLO)."""
    kinds = {"enabled": "boolean", "max_step_up": "integer"}
    props = {
        f.name: _s(kinds.get(f.name, "number"), minimum=0) if f.name != "enabled" else _s("boolean")
        for f in dataclasses.fields(ScalingPolicy)
        if f.name not in _SLO_FIELDS
    }
    return _obj(props, "the autoscaler's policy; ranges are checked as by cgn-ctl models apply")


def model_spec_schema() -> dict[str, Any]:
    return _obj(
        {
            "name": _s(
                "string",
                "the model's name in the catalog and the API (default: metadata.name)",
                pattern=_MODEL_NAME["pattern"],
            ),
            "source": _s("string", "GGUF path, bundled model name or engine model id"),
            "tokenizer": _s("string", "for routing; default: source when it is a GGUF"),
            "role": _s("string", enum=list(ROLES)),
            "replicas": _obj({"min": _s("integer", minimum=0), "max": _s("integer", minimum=1)}),
            "pools": _obj(
                {role: _POOL for role in ("prefill", "decode")},
                "replicas per role of a disaggregated model (instead of replicas)",
            ),
            "scaling": _scaling(),
            "slo": _obj(
                {k: _s("number", exclusiveMinimum=True, minimum=0) for k in _SLO_FIELDS},
                "the autoscaler scales up while the router's p90 over a minute is worse",
            ),
            "migration_limit": _s(
                "integer",
                "continuations of a stream whose engine fails (default: the router's; 0: off)",
                minimum=0,
                maximum=16,
            ),
            "migrate_across_engines": _s(
                "boolean", "a stream may continue on a replica of another engine kind"
            ),
            "adapters": _s(
                "object",
                "LoRA adapters by the name a request uses in model",
                additionalProperties=_obj(
                    {
                        "source": _s("string", "an absolute path to a GGUF LoRA file"),
                        "rank": _s("integer", minimum=1, maximum=MAX_RANK),
                        "pin": _s("boolean", "loaded on every replica"),
                    },
                    required=["source"],
                ),
            ),
            "max_adapters": _s(
                "integer", "adapters loaded at once per replica", minimum=1, maximum=MAX_LOADED
            ),
            "aliases": _s("array", items=_MODEL_NAME),
            "fallbacks": _s("array", items=_MODEL_NAME),
            "profiles": _s(
                "array",
                "in priority order: the first that fits is used",
                items=_profile(),
                minItems=1,
            ),
        },
        "the catalog's model spec (cgn-ctl models apply), field for field",
        required=["profiles"],
    )


def _conditions() -> dict[str, Any]:
    return _s(
        "array",
        items=_obj(
            {
                "type": _STR,
                "status": _s("string", enum=["True", "False", "Unknown"]),
                "reason": _STR,
                "message": _STR,
                "lastTransitionTime": _s("string", format="date-time"),
                "observedGeneration": _s("integer"),
            },
            required=["type", "status"],
        ),
        extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


def model_status_schema() -> dict[str, Any]:
    return _obj(
        {
            "model": _s("string", "the name in the catalog"),
            "desiredReplicas": _s("integer"),
            "placedReplicas": _s("integer"),
            "readyReplicas": _s("integer"),
            "catalog": _s("string", "Written, or why the model is not in the catalog"),
            "observedGeneration": _s("integer"),
            "conditions": _conditions(),
        }
    )


def cluster_spec_schema() -> dict[str, Any]:
    return _obj(
        {
            "image": _s("string", "the image every component runs (default: the operator's)"),
            "etcd": _obj(
                {
                    "endpoints": _s("array", "an external etcd; empty: run one here", items=_STR),
                    "tlsSecret": _s("string", "Secret with ca.pem, cert.pem, key.pem for it"),
                    "replicas": _s("integer", "members of the embedded etcd", enum=[1, 3, 5]),
                    "storage": _s("string", "the embedded members' volume size (e.g. 1Gi)"),
                    "image": _s("string", "the embedded etcd's image"),
                },
            ),
            "router": _obj(
                {
                    "replicas": _s("integer", minimum=1),
                    "port": _s("integer", minimum=1, maximum=65535),
                    "serviceType": _s("string", enum=["ClusterIP", "NodePort", "LoadBalancer"]),
                },
            ),
            "agents": _obj(
                {
                    "nodeSelector": _s("object", additionalProperties=_STR),
                    "tolerations": _s(
                        "array",
                        items=_s("object", extra={"x-kubernetes-preserve-unknown-fields": True}),
                    ),
                    "modelDirs": _s(
                        "array", "host directories mounted read-only for models", items=_STR
                    ),
                },
            ),
            "kvcached": _obj({"enabled": _s("boolean")}),
            "metrics": _obj({"enabled": _s("boolean")}),
            "ca": _obj(
                {"secretName": _s("string", "Secret with ca.pem and ca.key; none: no mTLS")},
            ),
            "gateway": _obj(
                {
                    "mode": _s(
                        "string",
                        "proxy: the router carries the requests; epp: your gateway does, the "
                        "router picks the pod (an InferencePool and its endpoint picker)",
                        enum=["proxy", "epp"],
                    ),
                    "poolName": _s("string", "the InferencePool's name (default: the cluster's)"),
                    "targetPort": _s("integer", "the pool's port", minimum=1, maximum=65535),
                    "failureMode": _s("string", enum=["FailClose", "FailOpen"]),
                },
            ),
        },
        "one Cognitora cluster: etcd, routers, agents on the selected nodes",
    )


def cluster_status_schema() -> dict[str, Any]:
    return _obj(
        {
            "routers": _s("string", "ready/desired"),
            "agents": _s("string", "ready/desired"),
            "nodes": _s("integer", "nodes registered in etcd"),
            "models": _s("integer", "models in the catalog"),
            "etcd": _s("string", "the endpoints the cluster uses"),
            "observedGeneration": _s("integer"),
            "conditions": _conditions(),
        }
    )


def _column(name: str, path: str, kind: str = "string", **more: Any) -> dict[str, Any]:
    return {"name": name, "type": kind, "jsonPath": path, **more}


def _crd(
    kind: Kind, spec: dict[str, Any], status: dict[str, Any], columns: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{kind.plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind.kind,
                "plural": kind.plural,
                "singular": kind.singular,
                "shortNames": list(kind.short),
                "categories": ["cognitora"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        *columns,
                        _column("Age", ".metadata.creationTimestamp", "date"),
                    ],
                    "schema": {
                        "openAPIV3Schema": _obj(
                            {
                                "apiVersion": _STR,
                                "kind": _STR,
                                "metadata": _s("object"),
                                "spec": spec,
                                "status": status,
                            },
                            required=["spec"],
                        )
                    },
                }
            ],
        },
    }


def crds() -> list[dict[str, Any]]:
    ready = '.status.conditions[?(@.type=="Ready")].status'
    return [
        _crd(
            CLUSTER,
            cluster_spec_schema(),
            cluster_status_schema(),
            [
                _column("Ready", ready),
                _column("Routers", ".status.routers"),
                _column("Agents", ".status.agents"),
                _column("Nodes", ".status.nodes", "integer"),
                _column("Models", ".status.models", "integer"),
            ],
        ),
        _crd(
            MODEL,
            model_spec_schema(),
            model_status_schema(),
            [
                _column("Model", ".status.model"),
                _column("Ready", ".status.readyReplicas", "integer"),
                _column("Desired", ".status.desiredReplicas", "integer"),
                _column("Catalog", ".status.catalog", priority=1),
                _column("Status", ready),
            ],
        ),
    ]


def model_doc(metadata: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any]:
    """The catalog document of a CognitoraModel: its spec, named by metadata.name unless the
    spec names it."""
    return {"name": metadata.get("name"), **spec}
